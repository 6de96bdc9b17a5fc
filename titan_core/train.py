"""``python -m titan_core.train`` (for ``torchrun -m``): the same options as ``titan run``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from titan_core.cli import RUN_DESCRIPTION, add_run_arguments, report_error
from titan_core.errors import TitanError


def resolve_config(args: argparse.Namespace):
    """Registry -> recipe -> validated config with the command line's overrides."""
    from titan_core._registry import get_registry
    from titan_core.config import validate
    from titan_core.recipes import call_recipe, find_recipe

    if args.module and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a user's module is found
    registry = get_registry(set(args.disable_plugin))
    config = call_recipe(find_recipe(registry, args.recipe, args.module))
    if args.comm_backend:
        config.comm.backend = args.comm_backend
    if args.dump_folder:
        config.job.dump_folder = args.dump_folder
    # run_train.sh limits pure-fake runs to one step unless the recipe set debug.max_steps.
    max_steps = os.environ.get("TITAN_DEFAULT_MAX_STEPS")
    if max_steps and config.debug.max_steps is None:
        if not max_steps.isdigit() or int(max_steps) < 1:
            raise_usage(f"TITAN_DEFAULT_MAX_STEPS={max_steps!r}: expected a positive integer")
        config.debug.max_steps = int(max_steps)
    return registry, validate(config, source=args.recipe)


def raise_usage(message: str) -> None:
    from titan_core.errors import UsageError

    raise UsageError(message)


def run_from_args(args: argparse.Namespace) -> int:
    registry, config = resolve_config(args)
    if args.print_config:
        from titan_core.config import render

        print(render(config, args.print_config))
        return 0
    # Validate the comm backend name before importing torch for a clearer, faster error.
    registry.get("comm_backends", config.comm.backend, what="comm backend")
    if args.all_pp_ranks:
        from titan_core.memory_sweep import run_all_pp_ranks

        return run_all_pp_ranks(config, registry, args)
    from titan_core.log import setup_logging

    setup_logging()
    from titan_core.trainer import train

    train(config, registry)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_core.train", description=RUN_DESCRIPTION)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except TitanError as exc:
        return report_error(exc)


if __name__ == "__main__":
    sys.exit(main())
