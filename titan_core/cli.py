"""The ``titan`` command: argument parsing only; the work happens in the modules it calls.

Every subcommand is a :class:`~titan_core.records.Command` record: the core's own (``run``,
``plugins``, ``models``, ``recipes``) come from titan's built-in plugin, others from plugins
through ``titan_commands``, so ``titan --help`` lists them all. ``titan --help``, ``titan plugins
list`` and ``titan recipes list`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import keyword
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from titan_core.errors import TitanError

DISABLE_HELP = "do not import plugin NAME (repeatable; also TITAN_DISABLE_PLUGINS=a,b)"


def _early_disabled(argv: Sequence[str]) -> set[str]:
    """``--disable-plugin`` values, read before the registry (which builds the parser) loads."""
    found: set[str] = set()
    for i, arg in enumerate(argv):
        if arg == "--disable-plugin" and i + 1 < len(argv):
            found.add(argv[i + 1])
        elif arg.startswith("--disable-plugin="):
            found.add(arg.split("=", 1)[1])
    return found


def _refuse_disabled_core(registry: Any) -> None:
    """The core's own plugin (``titan_core._builtin``: the run, plugins, models and recipes
    commands, the default comm backend, the datasets) cannot be disabled: without it ``titan``
    would lose its own commands and answer with argparse's "invalid choice"."""
    from titan_core._registry import CORE_MODULE, DISABLE_ENV
    from titan_core.errors import UsageError

    for name in sorted(registry.disabled):
        info = registry.plugins.get(name)
        if info is not None and info.module == CORE_MODULE:
            raise UsageError(
                f"plugin {name!r} is titan's core (its own commands, comm backend and datasets) and "
                f"cannot be disabled; remove it from --disable-plugin / {DISABLE_ENV}"
            )


def _check_torch_distributed_debug() -> None:
    """``TORCH_DISTRIBUTED_DEBUG`` set to anything but OFF/INFO/DETAIL (any case) makes ``import
    torch`` raise a ValueError, wherever titan first imports it (a strategy, the trainer)."""
    from titan_core.errors import UsageError

    name = "TORCH_DISTRIBUTED_DEBUG"
    value = os.environ.get(name)
    if value is not None and value.upper() not in ("OFF", "INFO", "DETAIL"):
        raise UsageError(
            f"{name}={value!r}: torch accepts only OFF, INFO or DETAIL (any case); set one of "
            "them or unset it"
        )


def _check_log_format() -> None:
    """``TITAN_LOG_FORMAT`` is ``json``, ``console`` or unset: another value would be ignored."""
    from titan_core.errors import UsageError
    from titan_core.log import LOG_FORMAT_ENV, LOG_FORMATS

    value = os.environ.get(LOG_FORMAT_ENV, "")
    if value.strip().lower() not in ("", *LOG_FORMATS):
        raise UsageError(
            f"{LOG_FORMAT_ENV}={value!r}: expected one of {', '.join(LOG_FORMATS)} (or unset: JSON "
            "lines when stdout is not a terminal, console lines when it is)"
        )


def check_environment(registry: Any) -> None:
    """What every ``titan`` process refuses before its command runs (``titan`` and
    ``run_train.sh``'s check before torchrun alike): a disabled core, an unknown log format, a
    ``TORCH_DISTRIBUTED_DEBUG`` that ``import torch`` would fail on."""
    _refuse_disabled_core(registry)
    _refuse_unknown_disabled(registry)
    _check_log_format()
    _check_torch_distributed_debug()


def _imported_names(source: str) -> set[str]:
    """The names a module's imports bind (``import a.b`` binds ``a``)."""
    import ast

    return {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def _refuse_unknown_disabled(registry: Any) -> None:
    """A name in ``TITAN_DISABLE_PLUGINS`` that no plugin has: a typo disables nothing, as
    ``--disable-plugin`` of an unknown name is refused too."""
    from titan_core._registry import DISABLE_ENV, disabled_from_env
    from titan_core.errors import UsageError

    unknown = sorted(disabled_from_env() - set(registry.plugins))
    if unknown:
        known = ", ".join(sorted(registry.plugins)) or "(none)"
        raise UsageError(
            f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV, '')!r}: no plugin named {', '.join(unknown)}; "
            f"plugins: {known}"
        )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with torchtitan-style field overrides (``--training.lr 3e-4``)
    one :class:`UsageError` saying where settings live; other unknown arguments get argparse's
    own error (exit 2)."""
    from titan_core.errors import UsageError

    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    overrides = [a.split("=", 1)[0] for a in extra if a.startswith("--") and "." in a.split("=", 1)[0]]
    if overrides:
        raise UsageError(
            f"{', '.join(overrides)}: titan takes no config field overrides on the command line; "
            "training settings live in the recipe (a Python function returning the config): "
            "`titan recipes copy NAME my_recipe.py` writes one with every field in view, to edit "
            "and run with `titan run --module my_recipe --recipe NAME` (docs/config.md)"
        )
    return parser.parse_args(argv)  # exits with argparse's error for the unknown arguments


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` gives: its first word that is neither an option nor an option's value."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--disable-plugin":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (``--comm-b``): run_train.sh and other wrappers read the arguments
    by their full names, and would see another run than the one titan starts. A class rather
    than a flag, because ``add_subparsers`` makes its parsers of the parent's class: a plugin
    command's own subcommands (``titan memory compare``) refuse them too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def build_parser(registry: Any) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="titan",
        description="titan: pre-train language models with plugins for models and parallelism.",
    )
    parser.add_argument("--version", action="store_true", help="print titan's version and exit")
    parser.add_argument("--disable-plugin", action="append", default=[], metavar="NAME", help=DISABLE_HELP)
    commands = registry.records("commands")
    conflicts = registry.conflicts("commands")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join([*commands, *conflicts]) + "}")
    for name in conflicts:  # listed, and refused when given (_main), naming both plugins
        sub.add_parser(name, help="(refused: provided by two plugins)", add_help=False)
    for name, command in commands.items():
        child = sub.add_parser(name, help=command.help, description=command.description or command.help)
        child.add_argument(
            "--disable-plugin", action="append", default=argparse.SUPPRESS, metavar="NAME", help=DISABLE_HELP
        )
        configure_failure = None
        try:
            command.configure(child)
        except (Exception, SystemExit) as exc:  # a broken plugin command must not take the whole CLI down
            from titan_core.errors import describe

            # Said at once (`titan --help` still works), and again when the command is run: it
            # would run with the arguments its configure never added.
            configure_failure = f"failed to set up its arguments (configure): {describe(exc)}"
            print(f"titan: warning: {_command_label(registry, name)} {configure_failure}", file=sys.stderr)
        child.set_defaults(_command=command, _parser=child, _configure_failure=configure_failure)
    return parser


def _command_label(registry: Any, name: str) -> str:
    """``command 'hello' of plugin 'greeter' (titan-greeter 1.0)``: how errors name a command."""
    provider = registry.provider("commands", name)
    return f"command {name!r} of plugin {provider.name!r} ({provider.origin})"


def run_command_record(command: Any, args: argparse.Namespace, registry: Any) -> int:
    """``command.run(args)`` as the process's exit status.

    A plugin's command (``titan_commands``) is the plugin's code: an exception other than a
    :class:`TitanError` is one :class:`PluginError` naming the command, its plugin and
    distribution and the line that raised (``call_plugin``), not a traceback. titan's own
    commands raise theirs as they are: an unexpected one is titan's bug, and its traceback is
    what a report needs. ``run`` returns an exit status (an int from 0 to 255) or ``None``
    (success); anything else is refused, naming it: a string went to ``sys.exit`` (printed
    bare, exit 1) and ``256`` exited 0, the status being taken modulo 256.
    """
    from titan_core._registry import CORE_MODULE
    from titan_core.errors import PluginError

    label = _command_label(registry, command.name)
    if getattr(args, "_configure_failure", None):
        raise PluginError(f"{label} {args._configure_failure}; update the plugin or tell its author")
    core = registry.provider("commands", command.name).module == CORE_MODULE
    return exit_status(label, command.run, args, plugin=not core)


def exit_status(label: str, run: Callable[..., Any], *args: Any, plugin: bool = True) -> int:
    """``run(*args)``, a plugin's entry point that ends the process (a command's ``run``, a
    ``titan run`` option's), as the exit status; ``label`` names it and its plugin in errors.

    A plugin's exception other than a :class:`TitanError` is one :class:`PluginError` naming
    ``label`` and the line that raised (``call_plugin``), not a traceback (``plugin=False``,
    titan's own code: raised as it is, its traceback being what a report needs). ``run`` returns
    an int from 0 to 255 or ``None`` (success); anything else is refused, naming it."""
    from titan_core.errors import PluginError, call_plugin

    if not plugin:
        code = run(*args)
    else:
        # BrokenPipeError: the reader of the output went away (`titan hello | head`), not the
        # plugin's failure; _guarded_main ends quietly.
        passes = lambda exc: isinstance(exc, BrokenPipeError)
        code = call_plugin(lambda: f"{label} failed", run, *args, passes=passes)
    if code is None:
        return 0
    if type(code) is not int or not 0 <= code <= 255:  # bool is an int: True/False read as 1/0
        raise PluginError(
            f"{label} returned {code!r} ({type(code).__name__}) from run; it must return an exit "
            "status (an int from 0 to 255, 0 for success) or None (success): print a result, and "
            "raise titan_core.errors.TitanError(message) for a failure"
        )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The ``titan`` program (``argv=None``: read ``sys.argv`` and end the process) or, given
    ``argv``, the same command run in-process, returning its exit code."""
    if argv is None:
        exit_process(_guarded_main(sys.argv[1:]))
    return _guarded_main(list(argv))


def exit_process(code: int) -> None:
    """End the program with ``code``; one of several launched ranks skips interpreter teardown.

    Once a distributed run has ended (outputs closed, process groups destroyed), a gloo worker
    thread can still be releasing the tensors of the last collective; if that happens while the
    interpreter finalizes, the release cannot take the GIL and the process aborts
    ("terminate called without an active exception", exit -6) after a run that succeeded.
    Nothing is left to do at that point, so a rank flushes its output and leaves at once.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and "torch.distributed" in sys.modules:
        import logging

        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def _guarded_main(argv: list[str]) -> int:
    from titan_core.stop_signals import SigtermStop, sigterm_stops_the_command, stopped_by_sigterm

    try:
        with sigterm_stops_the_command():
            return _main(argv)
    except SigtermStop as exc:  # a command that knows what the stop leaves says it (titan run)
        command = " ".join(word for word in ("titan", _command_name(argv)) if word)
        said = str(exc) or f"before `{command}` finished; run it again"
        return report_error(stopped_by_sigterm(said))
    except BrokenPipeError:
        # `titan ... | head`: the reader went away; end quietly (no traceback at exit either).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as exc:  # the trainer's says after which step it stopped
        where = f" {exc}" if str(exc) else ""
        print(f"titan: interrupted (Ctrl-C){where}", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    from titan_core._registry import get_registry

    try:
        disabled = _early_disabled(argv)
        registry = get_registry(disabled)
        unknown = sorted(disabled - set(registry.plugins))
        if unknown:
            from titan_core.errors import UsageError

            known = ", ".join(sorted(registry.plugins)) or "(none)"
            raise UsageError(
                f"--disable-plugin {', '.join(unknown)}: no plugin of that name; plugins: {known}"
            )
        check_environment(registry)
        parser = build_parser(registry)
        given = _command_name(argv)
        conflicts = registry.conflicts("commands")
        if given in conflicts:
            from titan_core.errors import PluginError

            raise PluginError(conflicts[given])
    except TitanError as exc:
        return report_error(exc)
    try:
        args = parse_args(parser, argv)
    except TitanError as exc:
        return report_error(exc)
    if args.version:
        from importlib.metadata import version

        print(f"titan-core {version('titan-core')}")
        return 0
    command = getattr(args, "_command", None)
    if command is None:
        parser.print_help()
        return 2
    from titan_core.stop_signals import sigterm_waits_for_the_error_line

    with sigterm_waits_for_the_error_line():
        try:
            return run_command_record(command, args, registry)
        except TitanError as exc:
            return report_error(exc)


def report_error(exc: TitanError) -> int:
    """One ``titan: error:`` line on stderr (every rank prints its own under torchrun).

    When the logs are JSON (``TITAN_LOG_FORMAT=json``, or stdout not a terminal), the error is
    also one JSON record in the log stream, with the rank, so log collectors see it.
    """
    import contextlib

    # A reader that went away (`titan run ... 2>&1 | head`) must not turn the error's exit status
    # into the 0 of a quietly ended pipe (_guarded_main's BrokenPipeError).
    with contextlib.suppress(BrokenPipeError):
        print(f"titan: error: {exc}", file=sys.stderr)
    from titan_core.log import json_logs

    if json_logs():
        record: dict[str, Any] = {"event": "error", "level": "error", "message": str(exc)}
        record["exit_code"] = exc.exit_code
        if os.environ.get("RANK", "").isdigit():
            record["rank"] = int(os.environ["RANK"])
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps(record), flush=True)
    return exc.exit_code


# -- the core's own commands ------------------------------------------------------------------------


def configure_run(parser: argparse.ArgumentParser) -> None:
    from titan_core._registry import get_registry
    from titan_core.run import DESCRIPTION, add_run_options, configure

    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    registry = get_registry()

    def provider(option: Any) -> str:
        info = registry.provider("run_options", option.name)
        return f"plugin {info.name!r} ({info.origin})"

    configure(parser)
    add_run_options(
        parser,
        list(registry.records("run_options").values()),
        provider,
        registry.conflicting_records("run_options", "run option"),
    )


def run_command(args: argparse.Namespace) -> int:
    from titan_core._registry import get_registry
    from titan_core.run import run

    return run(args, get_registry())


def _list_only(dest: str, help: str) -> Callable[[argparse.ArgumentParser], None]:
    """``configure`` of a group command whose one subcommand is ``list [--json]``."""

    def configure(parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest=dest, metavar="{list}")
        listing = sub.add_parser("list", help=help)
        listing.add_argument("--json", action="store_true", help="machine-readable output")

    return configure


configure_plugins = _list_only("plugins_command", "list plugins, their hooks, import time and status")
configure_models = _list_only("models_command", "models, flavors and parameter counts (total and active)")


#: A plugin import this slow is named by ``titan plugins list`` (titan's own take milliseconds).
SLOW_IMPORT_SECONDS = 0.5


def plugins_command(args: argparse.Namespace) -> int:
    if args.plugins_command != "list":
        args._parser.print_help()
        return 0
    from titan_core._registry import get_registry

    registry = get_registry()
    registry.gather_all()
    plugins = sorted(registry.plugins.values(), key=lambda p: p.name)
    if args.json:
        import attrs

        print(json.dumps([attrs.asdict(p) for p in plugins], indent=2))
        return 0
    rows = [("NAME", "VERSION", "DISTRIBUTION", "STATUS", "IMPORT", "HOOKS", "PROVIDES")]
    for p in plugins:
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(p.provides.items()))
        hooks = ", ".join(h.removeprefix("titan_") for h in p.hooks)
        took = f"{p.import_seconds * 1000:.0f}ms" + (" torch!" if p.imported_torch else "")
        rows.append((p.name, p.version, p.distribution, p.status, took, hooks or "-", provides or "-"))
    print_table(rows)
    for p in plugins:
        if p.error:
            print(f"\n{p.name}: {p.status}: {p.error}")
        if p.imported_torch:
            print(
                f"\n{p.name}: imported torch at module level ({p.import_seconds:.2f}s); import it "
                "inside hook bodies so `titan --help` stays fast (docs/plugins.md)"
            )
        elif p.import_seconds >= SLOW_IMPORT_SECONDS:
            print(
                f"\n{p.name}: its import took {p.import_seconds:.2f}s, which every titan command pays "
                "(`titan --help` too); move heavy imports and work into hook bodies (docs/plugins.md)"
            )
        for conflict in p.conflicts:
            print(f"\n{p.name}: conflict: {conflict} is provided by another plugin too; runs using it fail")
    return 0


def configure_recipes(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipes_command", metavar="{list,show,copy}")
    listing = sub.add_parser("list", help="list recipes from plugins (or --module)")
    listing.add_argument("--module", metavar="MOD", help="list the recipes of module MOD")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    show = sub.add_parser("show", help="where a recipe comes from (plugin, function, file) and its docstring")
    show.add_argument("name", metavar="NAME", help="recipe name (titan recipes list)")
    show.add_argument("--module", metavar="MOD", help="look NAME up in module MOD instead of plugins")
    copy = sub.add_parser(
        "copy",
        help="write a recipe module starting from recipe NAME, every field in view, to edit and run",
        description="Write FILE (a .py module) with one recipe function that builds the same config as "
        "NAME: the fields NAME changed are assignments, the others are listed with their defaults. "
        "Run it with `titan run --module <FILE's module> --recipe <function>`.",
    )
    copy.add_argument(
        "name",
        metavar="NAME",
        help="recipe to start from (titan recipes list), or a run's job.dump_folder or config file "
        "(config.toml, --print-config output): a recipe of exactly the config that run ran",
    )
    copy.add_argument("file", metavar="FILE", help="the module to write, e.g. my_recipes.py")
    copy.add_argument("--module", metavar="MOD", help="look NAME up in module MOD instead of plugins")
    copy.add_argument(
        "--function",
        metavar="FN",
        help="name of the new recipe function (default: NAME, or the recipe a config file records)",
    )
    copy.add_argument("--force", action="store_true", help="replace FILE if it exists")


def recipes_command(args: argparse.Namespace) -> int:
    if args.recipes_command == "show":
        return _recipes_show(args)
    if args.recipes_command == "copy":
        return _recipes_copy(args)
    if args.recipes_command != "list":
        args._parser.print_help()
        return 0
    if args.module:
        from titan_core.recipes import import_module, module_recipes

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `titan run --module` does
        from titan_core._registry import get_registry

        module = import_module(args.module)
        recipes = {r.name: (r, args.module) for r in module_recipes(module).values()}
        # `titan run --module` runs any public function there, imported ones too: list those that
        # are a plugin's recipes (`from titan_plugins_llama3.recipes import llama3_debugmodel`).
        registry = get_registry()
        for record in registry.records("recipes").values():
            if getattr(module, record.name, None) is record.fn and record.name not in recipes:
                plugin = registry.provider("recipes", record.name).name
                recipes[record.name] = (record, f"{args.module} (imported from plugin {plugin})")
        conflicts: dict[str, tuple[str, str]] = {}
    else:
        from titan_core._registry import get_registry

        registry = get_registry()
        recipes = {
            r.name: (r, registry.provider("recipes", r.name).name)
            for r in registry.records("recipes").values()
        }
        conflicts = _conflicts(registry, "recipes", "recipe")
        _warn_failed(registry, "recipes")
    if args.json:
        rows = [
            {"name": n, "source": s, "description": r.description, "error": None}
            for n, (r, s) in sorted(recipes.items())
        ]
        rows += [
            {"name": n, "source": who, "description": "", "error": message}
            for n, (who, message) in sorted(conflicts.items())
        ]
        print(json.dumps(rows, indent=2))
        return _report_conflicts(conflicts)
    table = [("RECIPE", "FROM", "DESCRIPTION")]
    table += [(n, s, r.description) for n, (r, s) in sorted(recipes.items())]
    unusable = "(not usable: see the error below)"
    table += [(n, f"conflict: {who}", unusable) for n, (who, _) in conflicts.items()]
    print_table(table)
    return _report_conflicts(conflicts)


def _conflicts(registry: Any, kind: str, what: str) -> dict[str, tuple[str, str]]:
    """Names of ``kind`` two plugins provide: ``name -> (their plugins, the error naming both
    distributions)``. The list commands show them (a row and the error) and exit 1: left out, a
    name ``titan run`` refuses looked uninstalled, with nothing said but by ``titan plugins list``."""
    return {
        name: (", ".join(p.name for p in registry.providers(kind, name)), message)
        for name, message in sorted(registry.conflicts(kind, what).items())
    }


def _report_conflicts(conflicts: dict[str, tuple[str, str]]) -> int:
    """One ``titan: error:`` line per conflict (stderr: ``--json`` output stays JSON); the exit status."""
    for _, message in conflicts.values():
        print(f"titan: error: {message}", file=sys.stderr)
    return 1 if conflicts else 0


def _warn_failed(registry: Any, kind: str) -> None:
    """One stderr line per plugin that failed to load: what it provides is missing from the list."""
    for info in registry.plugins.values():
        if info.status == "failed":
            first = next((line for line in (info.error or "").splitlines() if line.strip()), "")
            print(
                f"titan: warning: plugin {info.name!r} ({info.origin}) failed to load, so none of its "
                f"{kind} are listed: {first} (titan plugins list shows it)",
                file=sys.stderr,
            )


def _user_module_path() -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `titan run --module` does


def _recipes_show(args: argparse.Namespace) -> int:
    from titan_core._registry import get_registry
    from titan_core.recipes import describe_recipe

    if args.module:
        _user_module_path()
    info = describe_recipe(get_registry(), args.name, args.module)
    doc = info.pop("doc")
    print_table([(f"{key}:", value) for key, value in info.items()])
    print()
    print(doc)
    return 0


def _recipes_copy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from titan_core._registry import get_registry
    from titan_core.errors import UsageError
    from titan_core.recipes import config_file_recipe, config_source, find_recipe, recipe_module_source

    path = Path(args.file)
    config_path = None if args.module else config_source(args.name, get_registry())
    # From a config file, the recipe's name is the one the run recorded (config.toml's `recipe`).
    from_file = config_file_recipe(config_path, args.function) if config_path is not None else None
    function = from_file.name if from_file is not None else args.function or args.name
    if path.suffix != ".py" or not path.stem.isidentifier():
        raise UsageError(f"FILE {args.file!r}: give a Python module file name, e.g. my_recipes.py")
    if keyword.iskeyword(path.stem):
        raise UsageError(
            f"FILE {args.file!r}: {path.stem!r} is a Python keyword, not importable; choose another name"
        )
    if path.stem in sys.stdlib_module_names:
        raise UsageError(
            f"FILE {args.file!r}: {path.stem!r} would hide a standard-library module; choose another name"
        )
    installed = importlib.util.find_spec(path.stem)  # top-level name: finds, imports nothing
    if installed is not None and (
        installed.origin is None or Path(installed.origin).resolve() != path.resolve()
    ):
        raise UsageError(
            f"FILE {args.file!r}: {path.stem!r} would hide the installed module of that name "
            f"({installed.origin or 'a package'}), for this folder's runs too; choose another name"
        )
    if not function.isidentifier() or keyword.iskeyword(function):
        raise UsageError(f"--function {function!r}: not a Python function name; pass --function NAME")
    if path.exists() and not args.force:
        raise UsageError(f"FILE {args.file!r} exists; choose another file or pass --force to replace it")
    if args.module:
        _user_module_path()
    registry = get_registry()
    if from_file is not None:
        recipe, origin = from_file, f"run config {config_path}"
    else:
        recipe = find_recipe(registry, args.name, args.module)
        if args.module:
            origin = f"module {args.module}"
        else:
            origin = f"plugin {registry.provider('recipes', args.name).name}"
    folder = path.resolve().parent
    run = f"titan run --module {path.stem} --recipe {function}"
    if folder != Path.cwd().resolve():
        run = f"PYTHONPATH={folder} {run}"
    source = recipe_module_source(recipe, origin, function, run)
    if function in _imported_names(source):  # the function would replace what it calls
        raise UsageError(
            f"--function {function!r}: the module imports a name {function!r} that the recipe uses; "
            "choose another function name"
        )
    try:
        path.write_text(source)
    except OSError as exc:
        raise UsageError(f"FILE {args.file!r}: cannot write it ({exc.strerror})") from None
    print(f"wrote {path} (recipe {function}, from {config_path or args.name}); run it with:\n  {run}")
    return 0


def models_command(args: argparse.Namespace) -> int:
    """Every flavor with its analytic parameter count (no model is built, torch is not imported).

    A count that raises marks its row (naming the plugin and the error) and the exit status 1;
    the other models are still listed.
    """
    if args.models_command != "list":
        args._parser.print_help()
        return 0
    from titan_core._registry import get_registry
    from titan_core.errors import PluginError, describe
    from titan_core.run import model_figure

    def _call(what: Any, fn: Any, *args: Any) -> Any:  # raises as it is: the row names it
        return fn(*args)

    registry = get_registry()
    rows = []
    for spec in sorted(registry.records("models").values(), key=lambda s: s.name):
        provider = registry.provider("models", spec.name)
        for flavor, flavor_args in spec.flavors.items():
            row: dict[str, Any] = {"model": spec.name, "flavor": flavor, "params": None}
            row.update(active_params=None, plugin=provider.name, error=None)
            label = lambda: f"plugin {provider.name!r} ({provider.origin})"  # noqa: B023 (called at once)
            try:
                row["params"] = model_figure(label, "num_params", _call, spec.num_params, flavor_args, True)
                active = spec.num_active_params
                row["active_params"] = (
                    model_figure(label, "num_active_params", _call, active, flavor_args)
                    if active
                    else row["params"]
                )
            except PluginError as exc:  # no count: a string, NaN (model_figure's message)
                row["error"] = str(exc)
            except Exception as exc:  # one plugin's bad count must not hide the other models
                counted = "num_params" if row["params"] is None else "num_active_params"
                row["error"] = (
                    f"{counted} failed in plugin {provider.name!r} ({provider.origin}): {describe(exc)}"
                )
            rows.append(row)
    conflicts = _conflicts(registry, "models", "model")
    _warn_failed(registry, "models")
    for name, (who, message) in conflicts.items():  # one row: each plugin has its own flavors
        rows.append({"model": name, "flavor": None, "params": None, "active_params": None})
        rows[-1].update(plugin=who, error=message)
    code = 1 if any(r["error"] for r in rows) else 0
    if args.json:
        print(json.dumps(rows, indent=2))
        _report_conflicts(conflicts)
        return code
    table = [("MODEL", "FLAVOR", "PARAMS", "ACTIVE", "PLUGIN")]
    for r in rows:
        if r["model"] in conflicts:
            who = conflicts[r["model"]][0]
            table.append((r["model"], "-", "-", "-", f"conflict: {who} (not usable: see the error below)"))
            continue
        params, active = (human(r[k]) if r[k] is not None else "failed" for k in ("params", "active_params"))
        table.append((r["model"], r["flavor"], params, active, r["error"] or r["plugin"]))
    print_table(table)
    _report_conflicts(conflicts)
    return code


def human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last column is left ragged."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())


if __name__ == "__main__":
    main()
