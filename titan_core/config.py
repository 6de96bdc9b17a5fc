"""titan's configuration: attrs classes, one per section, with each field's doc beside it.

A recipe is a plain function returning a :class:`TrainerConfig`. The field paths below
(``training.steps``, ``parallelism.dp_shard`` ...) are part of titan's interface.
:func:`validate` checks a config that a recipe built and returns every problem with its dotted
path; :func:`to_dict` / :func:`from_dict` convert to and from plain data through cattrs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import attrs
from attrs import define, field

from titan_core.errors import UsageError

# ---------------------------------------------------------------------------------------------
# Sections. Field docs are the ``#:`` comment above each field; ``titan run --help`` and
# docs/config.md point here.
# ---------------------------------------------------------------------------------------------


@define
class Job:
    #: Folder for everything a run writes: logs, TensorBoard, memory reports, checkpoints.
    dump_folder: str = "./outputs"
    #: Free text shown in the first log line.
    description: str = ""


@define
class Model:
    #: Model family, as registered by a model plugin (``titan plugins list``).
    name: str = "llama3"
    #: Flavor of the family (``debugmodel``, ``8B``, ...).
    flavor: str = "debugmodel"
    #: Changes to the flavor's arguments, e.g. ``{"n_layers": 8}`` for a shallower 8B.
    overrides: dict[str, int | float | bool | str] = field(factory=dict)


@define
class Data:
    #: Dataset name as registered by a plugin: ``bundled`` (generated offline text),
    #: ``text`` (local ``.txt``/``.jsonl`` files given by ``data.path``).
    dataset: str = "bundled"
    #: File or folder for datasets that read local files (``.jsonl`` with a ``text`` field,
    #: or ``.txt``); ``None`` for the bundled corpus.
    path: str | None = None
    #: Hugging Face ``tokenizer.json``; ``None`` uses the tokenizer shipped with titan.
    tokenizer_path: str | None = None
    #: Number of documents of the bundled corpus (ignored by other datasets).
    bundled_documents: int = 4000
    #: Sequences each data-parallel rank shuffles among; 0 keeps the packing order, so runs
    #: with different DP degrees see the same global batches (for loss comparisons).
    shuffle_buffer: int = 256


@define
class Training:
    #: Number of optimizer steps.
    steps: int = 10
    #: Sequences per step on each data-parallel rank.
    local_batch_size: int = 8
    #: Tokens per sequence.
    seq_len: int = 2048
    #: Peak learning rate of AdamW.
    lr: float = 8e-4
    #: Linear warm-up steps before the peak learning rate.
    warmup_steps: int = 2
    #: Fraction of steps (after warm-up) spent decaying linearly towards ``min_lr_factor * lr``.
    decay_ratio: float = 0.8
    #: Learning rate at the end of decay, as a fraction of ``lr``.
    min_lr_factor: float = 0.1
    #: AdamW weight decay.
    weight_decay: float = 0.1
    #: AdamW beta1.
    beta1: float = 0.9
    #: AdamW beta2.
    beta2: float = 0.95
    #: AdamW epsilon.
    eps: float = 1e-8
    #: Gradient clipping max norm (total 2-norm over all parameters); <= 0 disables clipping.
    max_norm: float = 1.0
    #: Compute dtype: ``float32``, or ``bfloat16`` (autocast on one device, FSDP mixed
    #: precision otherwise; parameters and optimizer state stay float32).
    dtype: str = "float32"
    #: Device type: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
    device: str = "auto"


@define
class Parallelism:
    #: Replicated data-parallel degree (HSDP's replicate dimension).
    dp_replicate: int = 1
    #: Sharded data-parallel (FSDP) degree; -1 takes whatever the other degrees leave.
    dp_shard: int = -1
    #: Tensor-parallel degree (with sequence parallel).
    tp: int = 1
    #: Context-parallel degree.
    cp: int = 1
    #: Pipeline-parallel degree.
    pp: int = 1
    #: Expert-parallel degree (borrowed from the dp_shard x cp ranks).
    ep: int = 1
    #: Pipeline schedule: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``...
    pp_schedule: str = "1F1B"
    #: Microbatches per step for pipeline parallel; ``None`` uses the number of stages.
    pp_microbatches: int | None = None
    #: Pipeline stages per PP rank for interleaved/looped schedules; ``None`` picks by schedule.
    pp_stages_per_rank: int | None = None
    #: Keep the loss sharded over the vocabulary under TP (loss parallel).
    loss_parallel: bool = True


@define
class Comm:
    #: Communication backend plugin: ``default``, ``fake`` or ``real_pp_fake_spmd``.
    backend: str = "default"
    #: Timeout of process-group initialisation and the first step, in seconds.
    init_timeout_seconds: int = 300
    #: Timeout of collectives after the first step, in seconds.
    train_timeout_seconds: int = 100
    #: Flight-recorder entries kept per rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``); 0 disables it.
    trace_buf_size: int = 20000


@define
class Profiler:
    #: Profiler plugin used when profiling or memory snapshots are enabled.
    backend: str = "torch"
    #: Record torch.profiler traces every ``profile_freq`` steps.
    enable_profiling: bool = False
    #: Folder (under ``job.dump_folder``) for profiler traces.
    save_traces_folder: str = "profile_traces"
    #: Steps between profiler traces.
    profile_freq: int = 10
    #: Record CUDA memory snapshots.
    enable_memory_snapshot: bool = False
    #: Folder (under ``job.dump_folder``) for memory snapshots.
    save_memory_snapshot_folder: str = "memory_snapshot"
    #: Steps between memory snapshots; ``None`` uses ``profile_freq``.
    memory_snapshot_freq: int | None = None


@define
class Metrics:
    #: Log a line (and TensorBoard scalars) every ``log_freq`` steps.
    log_freq: int = 10
    #: Write TensorBoard scalars under ``job.dump_folder/save_tb_folder``.
    enable_tensorboard: bool = False
    #: Folder (under ``job.dump_folder``) for TensorBoard event files.
    save_tb_folder: str = "tb"
    #: Peak dense bf16 TFLOP/s of one device for MFU; ``None`` looks the device up.
    peak_tflops: float | None = None


@define
class Checkpoint:
    #: Save (and resume from) checkpoints.
    enable: bool = False
    #: Checkpointer plugin.
    backend: str = "dcp"
    #: Folder (under ``job.dump_folder``) for checkpoints.
    folder: str = "checkpoint"
    #: Steps between checkpoints (the last step is always saved).
    interval: int = 500
    #: Load checkpoints but never save one (for debugging with a seed checkpoint).
    load_only: bool = False
    #: Write a seed checkpoint of the freshly initialised model and exit (needs all degrees 1).
    create_seed_checkpoint: bool = False
    #: Initial weights loaded after initialisation, whatever the parallel layout: a DCP checkpoint
    #: folder (e.g. a seed ``.../checkpoint/step-0``) or a ``.pt`` file holding a full (unsharded)
    #: model state dict, e.g. written by a one-process run.
    initial_load_path: str | None = None


@define
class ActivationCheckpoint:
    #: ``none``, ``full`` (recompute every block) or ``selective`` (see ``selective_ac_option``).
    mode: str = "none"
    #: Under ``selective``: ``op`` recomputes cheap operators of every block but keeps the outputs
    #: of attention, every other matmul and collectives (reduce-scatter, all-to-all); an integer
    #: ``N`` (``"2"``) recomputes every N-th block whole.
    selective_ac_option: str = "op"
    #: Stash and restore the RNG state for recomputation (deterministic against no AC).
    preserve_rng_state: bool = False
    #: Determinism check of recomputation (``default`` or ``none``), as torch.utils.checkpoint.
    determinism_check: str = "default"
    #: Capture debug information about recomputation (slower).
    debug: bool = False


@define
class Compile:
    #: ``torch.compile`` each transformer block.
    enable: bool = False


@define
class Debug:
    #: Seed of model initialisation and data order; ``None`` picks 0.
    seed: int | None = None
    #: Use deterministic algorithms (slower; bit-for-bit reproducible on one configuration).
    deterministic: bool = False
    #: Warn instead of failing on non-deterministic ops (exploration only, not validation).
    deterministic_warn_only: bool = False
    #: Stop after this many steps regardless of ``training.steps`` (``run_train.sh`` sets 1 in
    #: pure fake mode); ``None`` runs all steps.
    max_steps: int | None = None
    #: Record memory after init, after the first optimizer step, during steady-state
    #: forward/backward and after the optimizer step, and write
    #: ``memory_report_rank{rank}.json`` under ``job.dump_folder``; always on with the fake
    #: comm backends (docs/debugging.md).
    memory_report: bool = False


@define
class TrainerConfig:
    """The whole configuration of a run; what every recipe returns."""

    job: Job = field(factory=Job)
    model: Model = field(factory=Model)
    data: Data = field(factory=Data)
    training: Training = field(factory=Training)
    parallelism: Parallelism = field(factory=Parallelism)
    comm: Comm = field(factory=Comm)
    profiler: Profiler = field(factory=Profiler)
    metrics: Metrics = field(factory=Metrics)
    checkpoint: Checkpoint = field(factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(factory=ActivationCheckpoint)
    compile: Compile = field(factory=Compile)
    debug: Debug = field(factory=Debug)
    #: Name of the recipe that produced this config (filled in by the CLI).
    recipe: str = ""


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class ConfigError(UsageError):
    """A config failed validation; ``problems`` holds one ``path: message`` line per problem."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        head = f"invalid config from recipe {source!r}" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


_TYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool"}


def _check_type(value: Any, annotation: Any) -> str | None:
    """Return 'expected X' when ``value`` does not match a field annotation, else None."""
    allowed: list[type] = []
    optional = False
    for part in str(annotation).replace(" ", "").split("|"):
        if part == "None":
            optional = True
        elif part in ("int", "float", "str", "bool"):
            allowed.append({"int": int, "float": float, "str": str, "bool": bool}[part])
    if value is None:
        return None if optional else f"expected {_names(allowed)}, got None"
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return None
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if t is str and isinstance(value, str):
            return None
    expected = _names(allowed) + (" or None" if optional else "")
    return f"expected {expected}, got {type(value).__name__} {value!r}"


def _check_table(path: str, value: Any, annotation: str) -> list[str]:
    """Problems of a ``dict[str, <scalars>]`` field, one per bad key or value."""
    if not isinstance(value, dict):
        return [f"{path}: expected a table (dict), got {type(value).__name__}"]
    value_annotation = annotation[len("dict[str,") : -1]
    problems = []
    for key, item in value.items():
        if not isinstance(key, str):
            problems.append(f"{path}: expected str keys, got {key!r}")
        elif (err := _check_type(item, value_annotation)) is not None:
            problems.append(f"{path}.{key}: {err}")
    return problems


def _names(types: list[type]) -> str:
    return " or ".join(_TYPE_NAMES[t] for t in types)


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """Yield ``(dotted path, annotation, value)`` for every leaf field of a config section."""
    for a in attrs.fields(type(obj)):
        value = getattr(obj, a.name)
        path = f"{prefix}{a.name}"
        annotation = _annotation(a.type)
        if annotation in _SECTIONS:
            if type(value).__name__ == annotation and attrs.has(type(value)):
                yield from _walk(value, path + ".")
            else:
                yield path, annotation, value
        else:
            yield path, annotation, value


def _annotation(annotation: Any) -> str:
    """A field's annotation as source text ("int | None", "Training"), resolved or not."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)  # e.g. types.UnionType renders as "int | None"


_SECTIONS = {_annotation(a.type) for a in attrs.fields(TrainerConfig) if a.name != "recipe"}

_CHOICES: dict[str, tuple[str, ...]] = {
    "training.dtype": ("float32", "bfloat16"),
    "training.device": ("auto", "cpu", "cuda"),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "activation_checkpoint.determinism_check": ("default", "none"),
}

_POSITIVE = (
    "training.steps",
    "training.local_batch_size",
    "training.seq_len",
    "parallelism.dp_replicate",
    "parallelism.tp",
    "parallelism.cp",
    "parallelism.pp",
    "parallelism.ep",
    "parallelism.pp_microbatches",
    "parallelism.pp_stages_per_rank",
    "metrics.log_freq",
    "profiler.profile_freq",
    "profiler.memory_snapshot_freq",
    "checkpoint.interval",
    "comm.init_timeout_seconds",
    "comm.train_timeout_seconds",
    "debug.max_steps",
    "data.bundled_documents",
)


def validate(config: Any, source: str = "") -> TrainerConfig:
    """Check a recipe's result; raise :class:`ConfigError` listing every problem by path."""
    if not isinstance(config, TrainerConfig):
        raise ConfigError([f"<recipe>: expected a TrainerConfig, got {type(config).__name__}"], source)
    problems: list[str] = []
    for path, annotation, value in _walk(config):
        if annotation in _SECTIONS:
            problems.append(f"{path}: expected a {annotation} section, got {type(value).__name__}")
            continue
        if annotation.startswith("dict["):
            problems += _check_table(path, value, annotation)
            continue
        if (err := _check_type(value, annotation)) is not None:
            problems.append(f"{path}: {err}")
            continue
        if path in _CHOICES and value not in _CHOICES[path]:
            problems.append(f"{path}: expected one of {', '.join(_CHOICES[path])}, got {value!r}")
        if path in _POSITIVE and value is not None and value < 1:
            problems.append(f"{path}: expected a positive integer, got {value!r}")
    if not problems:
        p = config.parallelism
        if p.dp_shard == 0 or p.dp_shard < -1:
            problems.append(f"parallelism.dp_shard: expected -1 or a positive integer, got {p.dp_shard}")
        if config.training.lr <= 0:
            problems.append(f"training.lr: expected a positive float, got {config.training.lr}")
        option = config.activation_checkpoint.selective_ac_option
        if option != "op" and not (option.isdigit() and int(option) > 0):
            problems.append(
                "activation_checkpoint.selective_ac_option: expected 'op' or a positive integer "
                f"such as '2', got {option!r}"
            )
        if config.training.warmup_steps < 0:
            problems.append(f"training.warmup_steps: expected >= 0, got {config.training.warmup_steps}")
        if not 0 <= config.training.decay_ratio <= 1:
            problems.append(
                f"training.decay_ratio: expected a value in [0, 1], got {config.training.decay_ratio}"
            )
    if problems:
        raise ConfigError(problems, source)
    return config


# ---------------------------------------------------------------------------------------------
# Conversion (cattrs) and printing
# ---------------------------------------------------------------------------------------------


def _converter() -> Any:
    import cattrs

    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    def scalar(value: Any, _: Any) -> Any:
        if not isinstance(value, (int, float, bool, str)):
            raise TypeError(f"expected int, float, bool or str, got {type(value).__name__}")
        return value

    converter.register_structure_hook(int | float | bool | str, scalar)
    return converter


def to_dict(config: TrainerConfig) -> dict[str, Any]:
    return _converter().unstructure(config)


def from_dict(data: dict[str, Any]) -> TrainerConfig:
    """Structure plain data into a config; errors are rendered as ``path: message`` lines."""
    import cattrs

    try:
        config = _converter().structure(data, TrainerConfig)
    except cattrs.BaseValidationError as exc:
        problems = [_render_cattrs(m) for m in cattrs.transform_error(exc, path="")]
        raise ConfigError(problems) from None
    return validate(config)


def _render_cattrs(message: str) -> str:
    # cattrs renders "invalid value for type, expected int @ .training.steps".
    text, _, path = message.rpartition(" @ ")
    return f"{path.lstrip('.$') or '<root>'}: {text}"


def render(config: TrainerConfig, fmt: Literal["toml", "json"] = "toml") -> str:
    data = to_dict(config)
    if fmt == "json":
        return json.dumps(data, indent=2)
    return _to_toml(data)


def _to_toml(data: dict[str, Any]) -> str:
    top = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    lines = [*top, ""] if top else []
    for section, values in data.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))
