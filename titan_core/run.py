"""``titan run``: resolve the recipe into a validated config, then train (or run a run option).

``python -m titan_core.train`` (the torchrun entry) is the same command. Torch is imported only
once a run really trains, so ``--print-config`` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from titan_core.errors import PluginError, UsageError

DESCRIPTION = """\
Train with a recipe. Training behaviour (model, steps, batch, parallel degrees, ...) is set in
the recipe, a Python function returning titan's config; these options only select and launch it.
Environment: TITAN_DISABLE_PLUGINS=a,b keeps plugins from being imported; under torchrun,
RANK/WORLD_SIZE/LOCAL_RANK come from the launcher; plugin comm backends read their own
variables (see docs/debugging.md)."""


def configure(parser: argparse.ArgumentParser) -> None:
    """The operational options of ``titan run`` (the plugins' flags: :func:`add_run_options`)."""
    parser.add_argument(
        "--recipe",
        "--config",
        dest="recipe",
        action=_Once,
        metavar="NAME",
        required=True,
        help="recipe to run (titan recipes list); --config is an alias",
    )
    parser.add_argument(
        "--module",
        action=_Once,
        metavar="MOD",
        help="import MOD (e.g. my_project.recipes) and look the recipe up among its functions",
    )
    parser.add_argument(
        "--print-config",
        action=_Once,
        nargs="?",
        const="toml",
        choices=("toml", "json"),
        metavar="{toml,json}",
        help="print the resolved config (TOML by default) and exit without building anything",
    )
    parser.add_argument(
        "--comm-backend",
        action=_Once,
        metavar="BACKEND",
        help="override comm.backend: default, or one a plugin provides (titan plugins list)",
    )
    parser.add_argument(
        "--dump-folder",
        action=_Once,
        metavar="DIR",
        help="override job.dump_folder (where logs, metrics and reports go)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the outputs (checkpoints included) of another run in the dump folder first; "
        "without it such a folder is refused, unless this run resumes it (docs/getting_started.md)",
    )


def add_run_options(
    parser: argparse.ArgumentParser,
    run_options: list[Any],
    provider: Callable[[Any], str],
    conflicts: Mapping[str, tuple[list[Any], str]] | None = None,
) -> None:
    """The plugins' flags. A flag of ``titan run``'s own is left out with a warning naming the
    plugin; a flag two plugins share fails, naming both, when it is given (neither would know
    the other's action ran instead). ``conflicts``: the run-option names two plugins provide,
    each with every provider's record and the registry's error naming both distributions
    (:meth:`~titan_core._registry.Registry.conflicting_records`): the flags of those records
    fail with that error when given, as a command of one name does, instead of being dropped."""
    by_flag: dict[str, list[Any]] = {}
    for option in run_options:
        by_flag.setdefault(option.flag, []).append(option)
    refused: dict[str, list[str]] = {}  # flag -> the name conflicts it belongs to
    for records, message in (conflicts or {}).values():
        for record in records:
            messages = refused.setdefault(record.flag, [])
            if message not in messages:  # two providers of one name may share the flag
                messages.append(message)
    for flag in dict.fromkeys([*by_flag, *refused]):
        options = by_flag.get(flag, [])
        try:
            if flag in refused:
                message = "; ".join(refused[flag])
                if options:  # an option of another name has the flag too: it cannot run either
                    owners = " and ".join(f"run option {o.name!r} of {provider(o)}" for o in options)
                    message += f"; {flag} is also the flag of {owners}"
                parser.add_argument(
                    flag, action=_Refused, nargs=0, message=message, help="(refused: provided twice)"
                )
            elif len(options) > 1:
                owners = " and ".join(f"run option {o.name!r} of {provider(o)}" for o in options)
                message = f"{flag} is provided twice: by {owners}; uninstall or disable one of them"
                parser.add_argument(
                    flag, action=_Refused, nargs=0, message=message, help="(refused: provided twice)"
                )
            else:
                option = options[0]
                parser.add_argument(
                    flag, action="store_true", dest=f"run_option_{option.name}", help=option.help
                )
        except argparse.ArgumentError:  # the flag is titan run's own
            for option in options:
                print(
                    f"titan: warning: run option {option.name!r} of {provider(option)} has flag {flag}, "
                    "which is titan run's own; it is left out: the plugin should rename the flag",
                    file=sys.stderr,
                )
            for message in refused.get(flag, []):
                print(
                    f"titan: warning: {message}; its flag {flag} is titan run's own and is left out",
                    file=sys.stderr,
                )


class _Once(argparse.Action):
    """Store the option's value; the option given again with another value is an error naming both.

    argparse keeps the last value, so a wrapper's flag and the user's (``--module a`` from
    ``MODULE=a``, then ``--module b``) ran what one of them asked for without a word. The same
    value twice is one choice."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier != values:
            names = "/".join(self.option_strings)
            raise UsageError(
                f"{names} given twice, as {earlier!r} and as {values!r}: argparse would take the last "
                "one without a word; give it once (a wrapper such as run_train.sh may add it: MODULE, "
                "CONFIG, COMM_BACKEND)"
            )
        setattr(namespace, self.dest, values)


class _Refused(argparse.Action):
    """A flag that cannot be used; giving it ends the parse with its message."""

    def __init__(self, *args: Any, message: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message = message

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        parser.error(self.message)


def resolve_config(args: argparse.Namespace, registry: Any) -> Any:
    """Recipe -> config with the command line's overrides, validated once."""
    from titan_core.config import validate
    from titan_core.recipes import call_recipe, find_recipe

    if args.module and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a user's module is found
    config = call_recipe(find_recipe(registry, args.recipe, args.module))
    if args.comm_backend is not None:
        if not args.comm_backend.strip():  # `--comm-backend "$MODE"` with MODE unset: not "default"
            raise UsageError(
                "--comm-backend: got an empty name; give the comm backend to use (default, fake, "
                "real_pp_fake_spmd or a plugin's: titan plugins list), or leave the option out"
            )
        config.comm.backend = args.comm_backend
    apply_backend_settings(config, registry)
    if args.dump_folder is not None:
        if not args.dump_folder.strip():  # an unset shell variable: not "use the recipe's folder"
            raise UsageError("--dump-folder: got an empty path; give the folder for this run's outputs")
        if args.dump_folder.startswith("~"):  # bash leaves `--dump-folder=~/x` and "~/x" as they are
            raise UsageError(
                f"--dump-folder {args.dump_folder!r}: the shell did not expand '~' (it does not after "
                f"'=' or in quotes); write --dump-folder {args.dump_folder} (a space, no quotes) or "
                "the full path"
            )
        config.job.dump_folder = args.dump_folder
    # run_train.sh limits simulated runs to one step unless the recipe set debug.max_steps.
    max_steps = os.environ.get("TITAN_DEFAULT_MAX_STEPS")
    if max_steps and config.debug.max_steps is None:
        if not max_steps.isdigit() or int(max_steps) < 1:
            raise UsageError(f"TITAN_DEFAULT_MAX_STEPS={max_steps!r}: expected a positive integer")
        config.debug.max_steps = int(max_steps)
    return validate(config, source=args.recipe)


def check_names(config: Any, registry: Any) -> None:
    """The plugins' names this config selects exist (cheap: no torch, nothing built)."""
    spec = registry.get("models", config.model.name, what="model.name")
    try:
        spec.flavor(config.model.flavor, config.model.overrides)
    except LookupError as exc:
        field = "model.overrides" if config.model.flavor in spec.flavors else "model.flavor"
        raise UsageError(f"{field}: {exc}") from None
    registry.get("comm_backends", config.comm.backend, what="comm.backend")
    refuse_unread_env(registry, config.comm.backend, os.environ)
    registry.get("datasets", config.data.dataset, what="data.dataset")
    if config.validation.dataset is not None:
        registry.get("datasets", config.validation.dataset, what="validation.dataset")


def check_model_alone(config: Any, registry: Any) -> tuple[Any, Any, Any]:
    """The model's own checks of its arguments (``ModelSpec.validate``, and against the tokenizer
    and ``training.seq_len``) under no parallelism: what ``--print-config`` can refuse without
    knowing the launch (a layout's checks need its world size, which the run's process has).
    Returns the model spec, the tokenizer and the model's arguments."""
    from titan_core.errors import call_plugin
    from titan_core.layout import check_model
    from titan_core.parallel_dims import ParallelDims

    alone = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    return check_model(config, registry, alone, call_plugin)


def parameter_counts(config: Any, registry: Any, spec: Any, model_args: Any) -> str:
    """``model moe/deepseek_v3_671b: 671.03B parameters, 37.55B active per token``: the config's
    model with its overrides, counted analytically as ``titan models list`` counts its flavors
    (nothing built, no torch)."""
    from titan_core.cli import human
    from titan_core.errors import call_plugin

    label = registry.label("models", config.model.name)
    total = model_figure(lambda: label, "num_params", call_plugin, spec.num_params, model_args, True)
    text = f"model {config.model.name}/{config.model.flavor}: {human(total)} parameters"
    if spec.num_active_params is not None:
        active_fn = spec.num_active_params
        active = model_figure(lambda: label, "num_active_params", call_plugin, active_fn, model_args)
        text += f", {human(active)} active per token"
    return text


def model_figure(
    label: Callable[[], str], field: str, call: Callable[..., Any], fn: Callable[..., Any], *args: Any
) -> float:
    """``ModelSpec.<field>(*args)``, a model plugin's analytic count (``num_params``,
    ``num_active_params``, ``flops_per_token``), called through ``call`` (an exception is one
    error naming the model) and checked: a string or NaN went on into the memory threshold of
    the initialisation and into MFU, and failed there far from the plugin."""
    import math
    import numbers

    value = call(lambda: f"{label()} failed in {field}", fn, *args)
    whole = field != "flops_per_token"
    ok = isinstance(value, numbers.Integral if whole else numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value >= 0):
        wanted = "a parameter count, an int >= 0" if whole else "FLOPs per token, a finite number >= 0"
        raise PluginError(
            f"{label()} returned {type(value).__name__} {value!r} from {field}; it must return {wanted}"
        )
    return value


def check_served(config: Any, registry: Any) -> None:
    """Every core field a plugin implements (``Callback.serves``) that ``config`` sets is served
    by a loaded plugin's callback: one with no such plugin would be ignored without a word (the
    trainer, and ``run_train.sh`` before torchrun through :func:`preflight`). Cheap: no torch."""
    from titan_core.config import plugin_served

    served = {path for r in registry.every("callbacks").values() for path in r.serves}  # conflicts fail
    # A comm backend's settings (the fake ones turn the memory report on) are not the user's
    # to leave at their defaults: without the serving plugin those runs go on as before.
    backend_sets = registry.get("comm_backends", config.comm.backend, what="comm.backend").sets
    for path, value in plugin_served(config).items():
        if path not in served and path in backend_sets:  # the run goes on, but not as documented
            print(
                f"titan: warning: comm backend {config.comm.backend!r} sets {path} = {value!r}, but no "
                "loaded plugin implements it (a callback listing it in Callback.serves), so this run "
                "goes without it; install or enable that plugin (titan's own: docs/architecture.md)",
                file=sys.stderr,
            )
        if path not in served and path not in backend_sets:
            raise UsageError(
                f"{path} = {value!r}: no loaded plugin implements it (a callback listing it in "
                "Callback.serves); install or enable that plugin (titan's own: docs/architecture.md) "
                f"or leave {path} at its default"
            )


def apply_backend_settings(config: Any, registry: Any) -> None:
    """Set the config values the selected comm backend always runs with (``CommBackend.sets``)."""
    backend = registry.get("comm_backends", config.comm.backend, what="comm.backend")
    for path, value in backend.sets.items():
        section_name, _, name = path.partition(".")
        section = config.sections().get(section_name)
        if section is None or name not in attrs.fields_dict(type(section)):
            owner = registry.provider("comm_backends", backend.name)
            raise PluginError(
                f"comm backend {backend.name!r} sets {path!r}, which is not a config field; plugin "
                f"{owner.name!r} ({owner.origin}) must be fixed or disabled"
            )
        setattr(section, name, value)


def check_launch(config: Any, registry: Any, processes: int) -> None:
    """The launch checks of the records this config selects, for a run of ``processes`` processes
    (``run_train.sh`` before torchrun starts them; each process before its comm backend starts):
    a refusal is one error before any process group exists, not a collective left waiting. The
    comm backend's comes first: it says how the run must be launched at all."""
    backend = registry.get("comm_backends", config.comm.backend, what="comm.backend")
    if backend.launch_check is not None:
        backend.launch_check(config, processes)
    c = config.checkpoint
    if c.enable or c.create_seed_checkpoint:
        checkpointer = registry.get("checkpointers", c.backend, what="checkpoint.backend")
        if checkpointer.launch_check is not None:
            checkpointer.launch_check(config, processes)


def preflight(argv: list[str], processes: int) -> int:
    """``run_train.sh``'s checks before torchrun starts ``processes`` processes, in one process:
    what each of them would refuse before building anything, refused once (one error line, its
    exit status) instead of as torchrun's traceback after a worker failed, or not at all on the
    screen when only a rank that ``LOG_RANK`` hides failed.

    The recipe resolves and validates, the names it selects exist, the comm backend's and
    plugins' launch checks pass, the parallel degrees fit, and what the trainer checks of the
    layout before building anything (:func:`titan_core.layout.check_layout`) passes: the global
    batch against the DP degree, the model's arguments under the degrees (``ModelSpec.validate``),
    a strategy for every degree and each applied strategy's own check (``Strategy.check``), every
    plugin-implemented field it sets has its plugin loaded (:func:`check_served`); and the dump
    folder may take this run.
    """
    from titan_core._registry import get_registry
    from titan_core.cli import build_parser, check_environment, parse_args, report_error
    from titan_core.errors import TitanError, call_plugin

    registry = get_registry()
    try:
        check_environment(registry)
        args = parse_args(build_parser(registry), ["run", *argv])
        config = resolve_config(args, registry)
        check_names(config, registry)
        check_launch(config, registry, processes)
        from titan_core.layout import check_layout
        from titan_core.parallel_dims import ParallelDims
        from titan_core.run_folder import RunFolder, plugin_outputs, run_dp

        # The trainer's checks of the layout, from the same function; a plugin that raises is
        # named as the trainer names it, with where it raised instead of a traceback file (this
        # check writes nothing).
        parallel_dims = ParallelDims.from_config(config.parallelism, processes)
        # Warnings are left to the run's log (each worker logs them where LOG_RANK shows it).
        check_layout(config, registry, parallel_dims, call_plugin, warn=lambda _message: None)
        # Reads run.json and decides as the run's first process will, writes nothing: with
        # --overwrite, whether it may remove the earlier outputs (the first process removes them).
        RunFolder(
            config,
            dp=run_dp(config, registry, parallel_dims),
            overwrite=args.overwrite,
            is_writer=False,
            outputs=plugin_outputs(registry),
            registry=registry,
        )
    except TitanError as exc:
        return report_error(exc)
    return 0


def launched_processes(env: Mapping[str, str]) -> int:
    """How many processes the launcher started (torchrun's ``WORLD_SIZE``; 1 without one)."""
    raw = env.get("WORLD_SIZE", "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"environment variable WORLD_SIZE={raw!r} is not a positive integer")
    return int(raw)


def process_rank(env: Mapping[str, str]) -> int:
    """This process's rank among those the launcher started (torchrun's ``RANK``; 0 without one).
    Not the logical rank when a backend simulates peers: the first process (0) is the one that
    exists in every launch, so it alone prepares the dump folder."""
    raw = env.get("RANK", "").strip() or "0"
    if not raw.isdigit():
        raise UsageError(f"environment variable RANK={raw!r} is not a non-negative integer")
    return int(raw)


def refuse_unread_env(registry: Any, backend: str, env: Mapping[str, str]) -> None:
    """One error when a variable that other comm backends declare (``CommBackend.env_vars``) is
    set for a run whose backend ``backend`` would not read it. Blank counts as unset: run_train.sh
    exports its variables empty."""
    backends = registry.records("comm_backends")
    chosen = backends.get(backend.lower())
    own = set(chosen.env_vars) if chosen is not None else set()
    readers: dict[str, list[str]] = {}
    for other in backends.values():
        for name in other.env_vars:
            if name not in own:
                readers.setdefault(name, []).append(other.name)
    for name, names in readers.items():
        raw = env.get(name, "")
        if raw.strip():
            which = ", ".join(repr(n) for n in names)
            raise UsageError(
                f"{name}={raw!r} is set, but comm backend {backend!r} does not read it (only {which} "
                f"{'does' if len(names) == 1 else 'do'}), so this run would ignore it. Select that "
                f"backend (--comm-backend {names[0]}, COMM_BACKEND={names[0]} with run_train.sh), "
                f"or unset {name}; see docs/debugging.md"
            )


def run(args: argparse.Namespace, registry: Any) -> int:
    from titan_core.errors import TitanError
    from titan_core.stop_signals import SigtermStop, stopped_by_sigterm

    try:
        return _run(args, registry)
    except TitanError as exc:
        record_for_torchrun(exc)
        raise
    except SigtermStop as exc:
        # Not written for torchrun's report: when torchrun ends the survivors of a rank that
        # failed, that rank's line is the cause to show, not theirs.
        said = (
            str(exc) or "before the run was built: nothing was trained or saved; run the same command again"
        )
        raise stopped_by_sigterm(said) from None


def record_for_torchrun(exc: BaseException) -> None:
    """Write titan's error line into torchrun's error file (``TORCHELASTIC_ERROR_FILE``), which
    its ``ChildFailedError`` report shows under the failed rank: with ``LOG_RANK=0``
    (``run_train.sh``'s default) the output of rank 1 is hidden, and when rank 1 alone failed
    (its data unreadable, a callback raising there), torchrun ended rank 0 before it said
    anything, and the report gave rank 1's exit code and no reason. Best effort."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"titan: error: {exc}"
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:  # the report then lacks the line; the rank's own output still has it
        pass


def _run(args: argparse.Namespace, registry: Any) -> int:
    config = resolve_config(args, registry)
    # Names first: --print-config of a recipe naming an unknown model or flavor is an error too.
    check_names(config, registry)
    warn_failed_plugins(registry)
    if args.print_config:
        spec, _, model_args = check_model_alone(config, registry)
        counts = parameter_counts(config, registry, spec, model_args)
        from titan_core.config import render

        text = render(config, args.print_config)
        if args.print_config == "toml":  # a comment: the output still loads as the config
            print(f"# {counts}")
        else:  # JSON has no comments: the count goes beside it
            print(f"titan: {counts}", file=sys.stderr)
        print(text)
        return 0
    for option in registry.records("run_options").values():
        if getattr(args, f"run_option_{option.name}", False):
            from titan_core._registry import CORE_MODULE
            from titan_core.cli import exit_status

            # A plugin's code ending the process, as a plugin command's run: an exception is one
            # error naming the option and its plugin, and the return value an exit status.
            core = registry.provider("run_options", option.name).module == CORE_MODULE
            label = registry.label("run_options", option.name)
            return exit_status(label, option.run, config, registry, args, plugin=not core)
    from titan_core.log import setup_logging

    setup_logging()
    from titan_core.trainer import train

    try:
        train(config, registry, overwrite=getattr(args, "overwrite", False))
    except Exception as exc:
        failure = wrapped_titan_error(exc) or peer_failure(exc, config) or out_of_memory(exc, config)
        if failure is None:
            raise
        raise failure from None
    return 0


def warn_failed_plugins(registry: Any) -> None:
    """One stderr line per plugin that failed to load: nothing it provides is used, so a name it
    gives may have come from another plugin (its recipe, its model) without a word."""
    for info in registry.plugins.values():
        if info.status == "failed":
            first = next((line for line in (info.error or "").splitlines() if line.strip()), "")
            print(
                f"titan: warning: plugin {info.name!r} ({info.origin}) failed to load, so this run uses "
                f"nothing it provides; a name it gives may come from another plugin ({first}; titan "
                "plugins list shows it)",
                file=sys.stderr,
            )


def wrapped_titan_error(exc: BaseException) -> Exception | None:
    """The titan error that torch wrapped in one of its own, else ``None``: a pipeline stage,
    for one, re-raises whatever its forward raised as ``RuntimeError('... failed to run
    forward')``, so a plugin's clear error would reach the user as torch's traceback."""
    from titan_core.errors import TitanError

    seen: set[int] = {id(exc)}
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TitanError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return None


def out_of_memory(exc: BaseException, config: Any) -> Exception | None:
    """One titan error for an allocator's out-of-memory error (CUDA or CPU), else ``None``.

    The allocator's error may be the cause of the exception that left the training loop: a
    pipeline stage re-raises what its forward raised as ``RuntimeError('[Stage 1] failed to run
    forward: ...') from e``, which ended a pipeline-parallel run in a traceback. The line names
    the ``_exit`` snapshot the profiler wrote (its note on ``exc``), and claims none it did not."""
    from titan_core.errors import OOM_RANK_NOTE, OOM_SNAPSHOT_NOTE, TitanError, out_of_memory_cause

    oom = out_of_memory_cause(exc)
    if oom is None:
        return None
    first = next((line.strip() for line in str(oom).splitlines() if line.strip()), "")
    notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str)]

    def noted(tag: str) -> str | None:
        return next((n.removeprefix(tag) for n in notes if n.startswith(tag)), None)

    # The memory plugins note the rank the process stands for (under the fake backends a logical
    # rank that RANK does not give) and the _exit snapshot once the profiler wrote it.
    rank = noted(OOM_RANK_NOTE) or os.environ.get("RANK", "0")
    path = noted(OOM_SNAPSHOT_NOTE)
    if path is not None:
        snapshot = f"memory snapshot: {path}"
    elif getattr(getattr(config, "profiler", None), "enable_memory_snapshot", False):
        # Snapshots are taken inside the training loop: none before it, none a full disk refused.
        snapshot = (
            "no memory snapshot was written for it (out of memory before the training loop, or the "
            "snapshot could not be written: a warning above says why)"
        )
    else:
        snapshot = (
            "for a memory snapshot of the step that ran out, set profiler.enable_memory_snapshot = "
            "True (docs/profiling.md)"
        )
    return TitanError(
        f"out of memory on rank {rank} ({first[:200]}); lower training.local_batch_size or "
        "training.seq_len, turn on activation_checkpoint.mode, or shard more (parallelism.*); "
        f"{snapshot}"
    )


#: Exception names torch raises when a collective with a peer fails (2.11-2.14).
_PEER_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
#: Fragments of the messages of RuntimeErrors gloo and NCCL raise for a dead or stalled peer.
_PEER_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "Broken pipe",
)


#: gloo's message for a send or receive that timed out (its TCP transport's unbound buffer).
_GLOO_POINT_TO_POINT = re.compile(r"Timed out waiting \d+ms for (send|recv) operation")


def peer_failure(exc: BaseException, config: Any) -> Exception | None:
    """One titan error for a collective that failed because a peer died or stalled, else ``None``."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not (world.isdigit() and int(world) > 1):
        return None
    text = str(exc)
    if type(exc).__name__ not in _PEER_ERRORS and not any(t in text for t in _PEER_TEXT):
        return None
    from titan_core.errors import TitanError

    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    rank = os.environ.get("RANK", "?")
    phase = next(
        (
            n.removeprefix("titan-phase: ")
            for n in getattr(exc, "__notes__", ())
            if n.startswith("titan-phase: ")
        ),
        None,
    )
    where = f" in {phase}" if phase else ""
    timeout = f"comm.train_timeout_seconds={config.comm.train_timeout_seconds}"
    if _GLOO_POINT_TO_POINT.search(first):
        # torch shortens gloo's collectives after step 1 but not its sends and receives (the
        # pipeline's): they keep the timeout the group was created with.
        timeout = (
            f"comm.init_timeout_seconds={config.comm.init_timeout_seconds} (gloo's pipeline sends and "
            "receives keep the timeout their group started with: torch cannot shorten it to "
            "comm.train_timeout_seconds)"
        )
    tag = "titan-peer-cause: "
    cause = next((n.removeprefix(tag) for n in getattr(exc, "__notes__", ()) if n.startswith(tag)), None)
    if cause is not None:  # the peer posted why it failed (Trainer._tell_peers): say it here
        return TitanError(
            f"rank {rank}: a collective with its peers failed{where}: {cause}; comm_traces/ holds "
            "the flight recorder's dumps where the backend writes them"
        )
    return TitanError(
        f"rank {rank}: a collective with its peers failed{where}: a peer died, or stalled past "
        f"{timeout} ({first[:300]}); the "
        "first rank to fail names the cause in its own log; comm_traces/ holds the flight "
        "recorder's dumps where the backend writes them"
    )
