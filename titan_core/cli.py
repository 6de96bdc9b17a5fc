"""The ``titan`` command: argument parsing only; the work happens in the modules it calls.

``titan --help``, ``titan plugins list`` and ``titan recipes list`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from titan_core.errors import TitanError

RUN_DESCRIPTION = """\
Train with a recipe. Training behaviour (model, steps, batch, parallel degrees, ...) is set in
the recipe, a Python function returning titan's config; these options only select and launch it.
Environment: TITAN_DISABLE_PLUGINS=a,b keeps plugins from being imported; under torchrun,
RANK/WORLD_SIZE/LOCAL_RANK come from the launcher; the fake comm backend reads NGPU and
FAKE_PP_RANK (see docs/debugging.md)."""


def add_run_arguments(parser: argparse.ArgumentParser, *, standalone: bool = True) -> None:
    """The operational options of ``titan run`` (also ``python -m titan_core.train``).

    ``standalone=False`` when the parser is ``titan``'s subcommand: then ``--disable-plugin``
    given before ``run`` is kept rather than reset.
    """
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
        help="override comm.backend: default, fake or real_pp_fake_spmd (titan plugins list)",
    )
    parser.add_argument(
        "--all-pp-ranks",
        action="store_true",
        help="with --comm-backend fake: run every pipeline coordinate in turn and compare memory",
    )
    parser.add_argument(
        "--dump-folder",
        metavar="DIR",
        help="override job.dump_folder (where logs, metrics and reports go)",
    )
    parser.add_argument(
        "--disable-plugin",
        action="append",
        default=[] if standalone else argparse.SUPPRESS,
        metavar="NAME",
        help="do not import plugin NAME (repeatable; also TITAN_DISABLE_PLUGINS=a,b)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan",
        description="titan: pre-train language models with plugins for models and parallelism.",
    )
    parser.add_argument("--version", action="store_true", help="print titan's version and exit")
    parser.add_argument(
        "--disable-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="do not import plugin NAME (repeatable; also TITAN_DISABLE_PLUGINS=a,b)",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,plugins,models,recipes}")

    run = sub.add_parser("run", help="train with a recipe", description=RUN_DESCRIPTION)
    add_run_arguments(run, standalone=False)

    plugins = sub.add_parser("plugins", help="inspect installed plugins")
    plugins_sub = plugins.add_subparsers(dest="plugins_command", metavar="{list}")
    plugins_list = plugins_sub.add_parser("list", help="list plugins, their hooks and status")
    plugins_list.add_argument("--json", action="store_true", help="machine-readable output")

    models = sub.add_parser("models", help="inspect model families and flavors")
    models_sub = models.add_subparsers(dest="models_command", metavar="{list}")
    models_list = models_sub.add_parser("list", help="models, flavors and parameter counts")
    models_list.add_argument("--json", action="store_true", help="machine-readable output")

    recipes = sub.add_parser("recipes", help="inspect recipes")
    recipes_sub = recipes.add_subparsers(dest="recipes_command", metavar="{list}")
    recipes_list = recipes_sub.add_parser("list", help="list recipes from plugins (or --module)")
    recipes_list.add_argument("--module", metavar="MOD", help="list the recipes of module MOD")
    recipes_list.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(f"titan-core {version('titan-core')}")
        return 0
    try:
        if args.command == "run":
            from titan_core.train import run_from_args

            return run_from_args(args)
        if args.command == "plugins" and args.plugins_command == "list":
            return _plugins_list(args)
        if args.command == "recipes" and args.recipes_command == "list":
            return _recipes_list(args)
        if args.command == "models" and args.models_command == "list":
            return _models_list(args)
    except TitanError as exc:
        return report_error(exc)
    parser.print_help()
    return 2 if args.command is None else 0


def report_error(exc: TitanError) -> int:
    print(f"titan: error: {exc}", file=sys.stderr)
    return exc.exit_code


def _registry(args: argparse.Namespace):
    from titan_core._registry import get_registry

    return get_registry(set(args.disable_plugin))


def _plugins_list(args: argparse.Namespace) -> int:
    registry = _registry(args)
    registry.gather_all()
    plugins = sorted(registry.plugins.values(), key=lambda p: p.name)
    if args.json:
        import attrs

        print(json.dumps([attrs.asdict(p) for p in plugins], indent=2))
        return 0
    rows = [("NAME", "VERSION", "DISTRIBUTION", "STATUS", "HOOKS", "PROVIDES")]
    for p in plugins:
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(p.provides.items()))
        hooks = ", ".join(h.removeprefix("titan_") for h in p.hooks)
        rows.append((p.name, p.version, p.distribution, p.status, hooks or "-", provides or "-"))
    _print_table(rows)
    for p in plugins:
        if p.error:
            print(f"\n{p.name}: {p.status}: {p.error}")
    return 0


def _recipes_list(args: argparse.Namespace) -> int:
    if args.module:
        from titan_core.recipes import import_module, module_recipes

        recipes = {r.name: (r, args.module) for r in module_recipes(import_module(args.module)).values()}
    else:
        registry = _registry(args)
        recipes = {
            r.name: (r, registry.provider("recipes", r.name).name)
            for r in registry.records("recipes").values()
        }
    if args.json:
        print(
            json.dumps(
                [
                    {"name": n, "source": s, "description": r.description}
                    for n, (r, s) in sorted(recipes.items())
                ],
                indent=2,
            )
        )
        return 0
    rows = [("RECIPE", "FROM", "DESCRIPTION")]
    rows += [(n, s, r.description) for n, (r, s) in sorted(recipes.items())]
    _print_table(rows)
    return 0


def _models_list(args: argparse.Namespace) -> int:
    """Every flavor with its analytic parameter count (no model is built, torch is not imported)."""
    registry = _registry(args)
    rows = []
    for spec in sorted(registry.records("models").values(), key=lambda s: s.name):
        provider = registry.provider("models", spec.name)
        for flavor, flavor_args in spec.flavors.items():
            rows.append(
                {
                    "model": spec.name,
                    "flavor": flavor,
                    "params": spec.num_params(flavor_args, True),
                    "plugin": provider.name,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("MODEL", "FLAVOR", "PARAMS", "PLUGIN")]
    table += [(r["model"], r["flavor"], _human(r["params"]), r["plugin"]) for r in rows]
    _print_table(table)
    return 0


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())


if __name__ == "__main__":
    sys.exit(main())
