"""``titan run``: resolve the recipe into a validated config, then train (or run a run option).

``python -m titan_core.train`` (the torchrun entry) is the same command. Torch is imported only
once a run really trains, so ``--print-config`` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from titan_core.errors import UsageError

DESCRIPTION = """\
Train with a recipe. Training behaviour (model, steps, batch, parallel degrees, ...) is set in
the recipe, a Python function returning titan's config; these options only select and launch it.
Environment: TITAN_DISABLE_PLUGINS=a,b keeps plugins from being imported; under torchrun,
RANK/WORLD_SIZE/LOCAL_RANK come from the launcher; plugin comm backends read their own
variables (see docs/debugging.md)."""


def configure(parser: argparse.ArgumentParser, run_options: list[Any] = ()) -> None:  # type: ignore[assignment]
    """The operational options of ``titan run``, plus the flags plugins add (``RunOption``)."""
    parser.add_argument(
        "--recipe",
        "--config",
        dest="recipe",
        metavar="NAME",
        required=True,
        help="recipe to run (titan recipes list); --config is an alias",
    )
    parser.add_argument(
        "--module",
        metavar="MOD",
        help="import MOD (e.g. my_project.recipes) and look the recipe up among its functions",
    )
    parser.add_argument(
        "--print-config",
        nargs="?",
        const="toml",
        choices=("toml", "json"),
        metavar="{toml,json}",
        help="print the resolved config (TOML by default) and exit without building anything",
    )
    parser.add_argument(
        "--comm-backend",
        metavar="BACKEND",
        help="override comm.backend: default, or one a plugin provides (titan plugins list)",
    )
    parser.add_argument(
        "--dump-folder",
        metavar="DIR",
        help="override job.dump_folder (where logs, metrics and reports go)",
    )
    for option in run_options:
        parser.add_argument(
            option.flag, action="store_true", dest=f"run_option_{option.name}", help=option.help
        )


def resolve_config(args: argparse.Namespace, registry: Any) -> Any:
    """Recipe -> config with the command line's overrides, validated once."""
    from titan_core.config import validate
    from titan_core.recipes import call_recipe, find_recipe

    if args.module and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a user's module is found
    config = call_recipe(find_recipe(registry, args.recipe, args.module))
    if args.comm_backend:
        config.comm.backend = args.comm_backend
    if args.dump_folder:
        config.job.dump_folder = args.dump_folder
    # run_train.sh limits simulated runs to one step unless the recipe set debug.max_steps.
    max_steps = os.environ.get("TITAN_DEFAULT_MAX_STEPS")
    if max_steps and config.debug.max_steps is None:
        if not max_steps.isdigit() or int(max_steps) < 1:
            raise UsageError(f"TITAN_DEFAULT_MAX_STEPS={max_steps!r}: expected a positive integer")
        config.debug.max_steps = int(max_steps)
    return validate(config, source=args.recipe)


def run(args: argparse.Namespace, registry: Any) -> int:
    config = resolve_config(args, registry)
    if args.print_config:
        from titan_core.config import render

        print(render(config, args.print_config))
        return 0
    # Validate the comm backend name before importing torch for a clearer, faster error.
    registry.get("comm_backends", config.comm.backend, what="comm backend")
    for option in registry.records("run_options").values():
        if getattr(args, f"run_option_{option.name}", False):
            return option.run(config, registry, args)
    from titan_core.log import setup_logging

    setup_logging()
    from titan_core.trainer import train

    train(config, registry)
    return 0
