"""titan's configuration: attrs classes, one per section, with each field's doc and checks beside it.

A recipe is a plain function returning a :class:`TrainerConfig`. The field paths below
(``training.steps``, ``parallelism.dp_shard`` ...) are part of titan's interface. Plugins add
their own sections through the ``titan_config_sections`` hook (``config.profiler``,
``config.activation_checkpoint`` ...): a section is a class made with :func:`section`.

Validation happens where a value is set: every field is checked against its annotation
(``int``, ``float``, ``bool``, ``str``, ``None`` unions, ``typing.Literal`` choices, ``dict[str,
...]`` tables) and its validators when the section is built and whenever a recipe assigns it, so a
bad value fails on the recipe's own line with the field's dotted path. :func:`validate` then runs
the checks that span several fields, once, after the recipe returns. :func:`to_dict` /
:func:`from_dict` convert to and from plain data through cattrs.

This module does not use ``from __future__ import annotations``: the core sections' validators
read the real annotation objects (a plugin's section may use it: :func:`section`).
"""

import copy
import functools
import inspect
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import attrs
from attrs import field

from titan_core.errors import PluginError, UsageError, call_plugin, problems_returned

# ---------------------------------------------------------------------------------------------
# Errors and validators
# ---------------------------------------------------------------------------------------------


class ConfigError(UsageError):
    """A config failed validation; ``problems`` holds one ``path: message`` line per problem."""

    def __init__(self, problems: list[str], source: str = "", where: str = "") -> None:
        self.problems = problems
        self.source = source
        head = f"invalid config from recipe {source!r}" if source else "invalid config"
        if where:
            head += f" ({where})"
        if len(problems) == 1:
            super().__init__(f"{head}: {problems[0]}")
        else:
            super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


def positive(_inst: Any, _attr: Any, value: Any) -> None:
    """Validator: a positive number (``None`` passes when the annotation allows it)."""
    if value is not None and not value > 0:
        raise ValueError(f"expected a positive {_kind(value)}, got {value!r}")


def non_negative(_inst: Any, _attr: Any, value: Any) -> None:
    """Validator: zero or more."""
    if value is not None and not value >= 0:
        kind = _kind(value)
        raise ValueError(f"expected {'an' if kind == 'integer' else 'a'} {kind} >= 0, got {value!r}")


def finite(_inst: Any, _attr: Any, value: Any) -> None:
    """Validator: not NaN or infinite."""
    if value is not None and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")


#: The smallest normal float32 (``torch.finfo(torch.float32).tiny``): AdamW's state is float32.
_FLOAT32_TINY = 1.1754943508222875e-38


def _adamw_eps(_inst: Any, _attr: Any, value: float) -> None:
    """Validator of ``training.eps``: a value float32 holds. AdamW divides by ``sqrt(v) + eps``
    in float32, where a smaller eps is 0 (a subnormal one is 0 where denormals flush); a
    parameter whose gradient is 0 so far (the embedding of a token no batch held yet) then
    becomes 0 / 0 = NaN, and the run stopped as a divergence blamed on the LR or the data."""
    if value < _FLOAT32_TINY:
        raise ValueError(
            f"{value:g} is below float32's smallest normal number ({_FLOAT32_TINY:.3g}): AdamW adds "
            "it to float32 state, where it is 0, and a parameter whose gradient is 0 would become "
            "0 / 0 = NaN; use 1e-08 (the default) or another value of at least 1.2e-38"
        )


def _max_norm(_inst: Any, _attr: Any, value: float) -> None:
    """Validator of ``training.max_norm``: finite, and saying how to turn clipping off (torch's
    idiom ``max_norm=inf`` is titan's ``<= 0``: config.toml and run.json record finite values)."""
    if not math.isfinite(value):
        off = "; 0 (or any value <= 0) turns gradient clipping off" if value == math.inf else ""
        raise ValueError(f"expected a finite number, got {value!r}{off}")


def _subfolder(_inst: Any, _attr: Any, value: str) -> None:
    """Validator: a folder of its own under the dump folder, not the dump folder itself."""
    if os.path.normpath(value or ".") == ".":
        raise ValueError(
            f"{value!r} names job.dump_folder itself, where the run's logs are; name a folder of its own "
            "in it (the default: 'checkpoint')"
        )


#: The longest timeout ``datetime.timedelta`` (what torch's process groups take) holds, in whole
#: days: about 2.7 million years.
_MAX_TIMEOUT_SECONDS = 999_999_999 * 86_400


def _timeout(_inst: Any, attr: Any, value: int) -> None:
    """Validator of a comm timeout: one torch can take. A larger one failed at process-group
    start with ``OverflowError: days=...`` blamed on the comm backend plugin (exit 1)."""
    if value > _MAX_TIMEOUT_SECONDS:
        raise ValueError(
            f"{value} seconds is beyond the longest timeout torch takes ({_MAX_TIMEOUT_SECONDS}, "
            "datetime.timedelta's limit of 999999999 days); for no practical limit use e.g. "
            f"{86_400 * 365} (a year)"
        )


#: What a name field names, and what leaving an optional one unset (``None``) means, for the
#: error of a blank one.
_NAME_OF = {
    "model.name": ("a model name", ""),
    "model.flavor": ("a flavor", ""),
    "data.dataset": ("a dataset name", ""),
    "validation.dataset": ("a dataset name", "to validate on data.dataset"),
    "comm.backend": ("a comm backend name", ""),
    "checkpoint.backend": ("a checkpointer name", ""),
    "parallelism.pp_schedule": ("a pipeline schedule name", ""),
}


def record_name(inst: Any, attr: Any, value: str | None) -> None:
    """Validator of a field naming a plugin's record (a model, dataset, backend...): not blank.

    A blank name is what an unset variable gives (``os.environ.get("DATASET", "")``): it was
    ``unknown model ''`` naming no field, or, for an optional one (``validation.dataset``), read
    as unset: validation ran on ``data.dataset`` without a word."""
    if value is None or value.strip():
        return
    path = _path(inst, attr.name)
    what, unset = _NAME_OF.get(path, ("a name", ""))
    if type(None) in typing.get_args(attr.type):
        fix = f"give {what}, or leave it unset (None)" + (f" {unset}" if unset else "")
    else:
        fix = f"give {what} (the default: {attr.default!r})"
    raise ValueError(f"{value!r} is empty (what an unset variable gives); {fix}")


#: What leaving a core path field unset (``None``) means, for the error of a blank one.
_UNSET_MEANS = {
    "data.path": "for a dataset that reads no files (the bundled corpus)",
    "data.tokenizer_path": "to use titan's bundled tokenizer",
    "validation.path": "to validate on data.path",
    "checkpoint.initial_load_path": "to train from the freshly initialised weights",
}


def local_path(inst: Any, attr: Any, value: str | None) -> None:
    """Validator of a path field: not blank, and not starting with ``~``.

    A blank value is what an unset variable gives (``os.environ.get("INIT", "")`` in a recipe,
    ``--dump-folder "$OUT"``): read as unset, the run trained from scratch (or
    on the default data, with the bundled tokenizer) without a word; read as a path, it was the
    current folder. ``None`` is how a field is left unset. The shell expands ``~`` to the home
    folder; Python's file functions do not, so ``"~/runs/a"`` was a folder named ``~`` in the
    current folder (a run written where no one looks) or a file said not to exist."""
    if value is not None and not value.strip():
        unset = _UNSET_MEANS.get(_path(inst, attr.name)) if attr is not None else None
        if attr is not None and type(None) in typing.get_args(attr.type):
            fix = "give a path, or leave it unset (None)" + (f" {unset}" if unset else "")
        else:
            default = getattr(attr, "default", None)
            fix = f"give a path (the default: {default!r})" if isinstance(default, str) else "give a path"
        raise ValueError(
            f"{value!r} is empty (what an unset variable gives, as os.environ.get(NAME, '') in a "
            f"recipe does); {fix}"
        )
    if value is not None and "\x00" in value:
        # No file name holds one: the run built its model, then failed with "ValueError:
        # embedded null byte" where the path was first used (a traceback naming no field).
        raise ValueError(f"{value!r} holds a NUL character ('\\x00'), which no path can hold; remove it")
    if value is not None and value.startswith("~"):
        raise ValueError(
            f"{value!r} starts with '~', which only a shell expands to a home folder: titan would "
            f"use a folder named {value.split('/', 1)[0]!r} in the current folder; write "
            f"os.path.expanduser({value!r}) in the recipe, or the full path"
        )


def in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable:
    """Validator: ``lo <= value <= hi`` (``lo_open``/``hi_open`` exclude the ends)."""
    text = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value is None:
            return
        low_ok = value > lo if lo_open else value >= lo
        high_ok = value < hi if hi_open else value <= hi
        if not (low_ok and high_ok):
            raise ValueError(f"expected a value in {text}, got {value!r}")

    return check


def _kind(value: Any) -> str:
    return "integer" if isinstance(value, int) else "number"


#: Section class -> its name in TrainerConfig (core sections and plugin sections).
_SECTION_NAMES: dict[type, str] = {}


def _path(inst: Any, name: str) -> str:
    section_name = _SECTION_NAMES.get(type(inst), type(inst).__name__.lower())
    return f"{section_name}.{name}" if section_name else name


def _type_error(value: Any, annotation: Any) -> str | None:
    """'expected X, got Y' when ``value`` does not match ``annotation``, else ``None``."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return None
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices and type(value) in {type(c) for c in choices}:
            return None
        return f"expected one of {', '.join(map(str, choices))}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = [_type_error(value, o) for o in options if o is not type(None)]
        if any(e is None for e in errors):
            return None
        literals = [o for o in options if typing.get_origin(o) is Literal]
        if literals and len(errors) == 1:
            return errors[0] + (" or None" if type(None) in options else "")
        names = " or ".join(_type_name(o) for o in options)
        return f"expected {names}, got {_describe(value)}"
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            return f"expected a table (dict), got {type(value).__name__}"
        for k, v in value.items():
            if (err := _type_error(k, key_type)) is not None:
                return f"key {k!r}: {err}"
            if (err := _type_error(v, value_type)) is not None:
                return f".{k}: {err}"  # rendered as the path of the entry
        return None
    if origin in (list, tuple) or annotation in (list, tuple):
        return _sequence_error(value, annotation)
    if annotation is type(None):
        return None if value is None else f"expected None, got {_describe(value)}"
    if annotation is bool:
        return None if isinstance(value, bool) else f"expected bool, got {_describe(value)}"
    if annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"expected int, got {_describe(value)}"
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected float, got {_describe(value)}"
    if isinstance(annotation, type):
        if isinstance(value, annotation):
            return None
        what = f"a {annotation.__name__} section" if attrs.has(annotation) else annotation.__name__
        return f"expected {what}, got {_describe(value)}"
    return None


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _magnitude_error(value: Any, annotation: Any) -> str | None:
    """An integer of the right type that no field can hold: beyond a signed 64-bit integer for an
    ``int`` field (TOML's integers, so config.toml would record what other TOML readers refuse;
    torch's int64 could not hold it either), or beyond float range for a ``float`` one (``10**400``
    is an int to Python and no float: the validators' comparisons raised OverflowError, which
    named no field)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    if int in options:
        if _INT64_MIN <= value <= _INT64_MAX:
            return None
        return (
            f"expected an integer config.toml can hold (a signed 64-bit integer, {_INT64_MIN} to "
            f"{_INT64_MAX}), got one of {_digits(value)} digits"
        )
    if float in options:
        try:
            float(value)
        except OverflowError:
            return f"expected a number within float range, got an integer of {_digits(value)} digits"
    return None


def _digits(value: int) -> int:
    """The decimal digits of ``value``; estimated past Python's limit on converting an int to
    text (4300 digits), where ``str`` raises ValueError."""
    try:
        return len(str(abs(value)))
    except ValueError:
        return int(abs(value).bit_length() * math.log10(2)) + 1


def _sequence_error(value: Any, annotation: Any) -> str | None:
    """A list or tuple field: a list or tuple (TOML has only arrays), each item checked."""
    if not isinstance(value, (list, tuple)):
        return f"expected a list, got {_describe(value)}"
    args = typing.get_args(annotation)
    if not args:
        return None
    if typing.get_origin(annotation) is tuple and args[-1] is not Ellipsis:
        if len(value) != len(args):
            return f"expected {len(args)} items, got {len(value)}: {value!r}"
        items = list(zip(args, value, strict=True))
    else:
        items = [(args[0], v) for v in value]
    for i, (item_type, item) in enumerate(items):
        if (err := _type_error(item, item_type)) is not None:
            return f"[{i}]: {err}"
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a section class whose module used ``from __future__ import
    annotations`` (attrs then holds strings): resolved once, when a value is first checked."""
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:
        raise UsageError(
            f"config section class {cls.__module__}.{cls.__qualname__}: its field annotations do not "
            f"resolve ({type(exc).__name__}: {exc}); use names the module defines or imports"
        ) from None


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    return getattr(annotation, "__name__", str(annotation))


def _describe(value: Any) -> str:
    return "None" if value is None else f"{type(value).__name__} {value!r}"


@attrs.frozen
class _Checked:
    """The validator :func:`section` puts on every field: the annotation, then the field's own.

    Errors become :class:`ConfigError` with the field's dotted path (``training.lr: ...``).
    """

    annotation: Any
    validators: tuple[Callable, ...]

    def __call__(self, inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        annotation = self.annotation
        if isinstance(annotation, str):  # ``from __future__ import annotations`` in the section's module
            annotation = _hints(type(inst)).get(attribute.name, Any)
        err = _type_error(value, annotation)
        if err is None:
            err = _magnitude_error(value, annotation)
        if err is None:
            try:
                for validator in self.validators:
                    validator(inst, attribute, value)
            except (ValueError, TypeError) as exc:
                err = str(exc)
        if err is not None:
            sep = "" if err.startswith((".", "[")) else ": "
            raise ConfigError([f"{_path(inst, attribute.name)}{sep}{err}"])


def _add_checks(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    checked = []
    for a in fields:
        own = a.validator
        validators = () if own is None else (own,)
        changes: dict[str, Any] = {"validator": _Checked(a.type, validators)}
        if isinstance(a.default, (list, dict, set)):
            # ``layers: list[int] = [0]`` would be one list shared by every config: a recipe's
            # ``append`` would change the default of every later one. A copy per instance instead.
            changes["default"] = attrs.Factory(functools.partial(copy.deepcopy, a.default))
        checked.append(a.evolve(**changes))
    return checked


def section(cls: type) -> type:
    """Make ``cls`` a config section: an attrs class whose fields are checked when set.

    Every field needs a default; annotate it with types (``int``, ``float | None``,
    ``Literal["a", "b"]``, ``list[str]``) and add validators beside it (:func:`positive`,
    :func:`in_range`...). String annotations (``from __future__ import annotations``) are resolved
    when a value is first checked. A ``#:`` comment above a field is its documentation (``titan
    recipes copy`` writes it beside the field, docs/config.md lists it).
    """
    return attrs.define(cls, field_transformer=_add_checks)


def field_docs(cls: type) -> dict[str, str]:
    """The ``#:`` comments above each field of a section class, by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in source.split("\n")[1:]:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
        elif re.match(r"^[a-z_0-9]+\s*:", text):
            docs[text.split(":")[0].strip()] = " ".join(pending)
            pending = []
        elif text.startswith(("def ", "@")):
            break
    return docs


# ---------------------------------------------------------------------------------------------
# Core sections. Field docs are the ``#:`` comment above each field; docs/config.md shows them.
# ---------------------------------------------------------------------------------------------


#: Field metadata of a core field that a plugin implements (a callback lists it in
#: ``Callback.serves``): setting it with no such plugin loaded is an error, not a no-op.
PLUGIN_SERVED = "titan_plugin_served"


#: Field metadata of a core field that only the strategy handling one parallel dimension reads
#: (``Strategy.handles``; the value is that dimension): changed from its default on a launch where
#: no applied strategy handles it, it cannot take effect, and the run warns
#: (:func:`titan_core.layout.unapplied_settings`).
APPLIED_BY = "titan_applied_by"


def strategy_settings(config: "TrainerConfig") -> dict[str, tuple[Any, str]]:
    """The core fields only a strategy reads (metadata :data:`APPLIED_BY`) that ``config`` sets to
    other than their defaults: dotted path -> (value, the parallel dimension of that strategy)."""
    found = {}
    for name, cls in CORE_SECTIONS.items():
        for a in attrs.fields(cls):
            dim = a.metadata.get(APPLIED_BY)
            value = getattr(getattr(config, name), a.name)
            if dim is not None and value != a.default:
                found[f"{name}.{a.name}"] = (value, dim)
    return found


@section
class Job:
    #: Folder for everything a run writes: logs, TensorBoard, memory reports, checkpoints.
    dump_folder: str = field(default="./outputs", validator=local_path)
    #: Free text shown in the first log line.
    description: str = ""


@section
class Model:
    #: Model family, as registered by a model plugin (``titan plugins list``).
    name: str = field(default="llama3", validator=record_name)
    #: Flavor of the family (``debugmodel``, ``8B``, ...).
    flavor: str = field(default="debugmodel", validator=record_name)
    #: Changes to the flavor's arguments, e.g. ``{"n_layers": 8}`` for a shallower 8B.
    overrides: dict[str, int | float | bool | str] = field(factory=dict)


@section
class Data:
    #: Dataset name as registered by a plugin: ``bundled`` (generated offline text),
    #: ``text`` (local ``.txt``/``.jsonl`` files given by ``data.path``).
    dataset: str = field(default="bundled", validator=record_name)
    #: File or folder for datasets that read local files (``.jsonl`` with a ``text`` field,
    #: or ``.txt``); ``None`` for the bundled corpus (which refuses a path: it reads no files).
    path: str | None = field(default=None, validator=local_path)
    #: Hugging Face ``tokenizer.json``; ``None`` uses the tokenizer shipped with titan.
    tokenizer_path: str | None = field(default=None, validator=local_path)
    #: Number of documents of the bundled corpus (ignored by other datasets).
    bundled_documents: int = field(default=4000, validator=positive)
    #: Sequences each data-parallel rank shuffles among; 0 keeps the packing order, so runs
    #: with different DP degrees see the same global batches (for loss comparisons).
    shuffle_buffer: int = field(default=256, validator=non_negative)
    #: Batches prepared ahead on a background thread (tokenized, packed and, on CUDA, pinned
    #: for an asynchronous copy), so the step never waits for the data; 0 prepares each batch
    #: inside the step.
    prefetch: int = field(default=2, validator=non_negative)


@section
class Training:
    #: Number of optimizer steps.
    steps: int = field(default=10, validator=positive)
    #: Sequences per forward/backward on each data-parallel rank (one microbatch).
    local_batch_size: int = field(default=8, validator=positive)
    #: Sequences per optimizer step over all data-parallel ranks; ``None`` is
    #: ``local_batch_size`` x the data-parallel degree. A multiple of that: the trainer then
    #: accumulates gradients over ``global_batch_size / (local_batch_size x DP degree)``
    #: microbatches per step (losses scaled so gradients are those of the whole batch's mean;
    #: FSDP reduces gradients on the last microbatch only).
    global_batch_size: int | None = field(default=None, validator=positive)
    #: Tokens per sequence.
    seq_len: int = field(default=2048, validator=positive)
    #: Peak learning rate of AdamW.
    lr: float = field(default=8e-4, validator=[finite, positive])
    #: Linear warm-up steps before the peak learning rate.
    warmup_steps: int = field(default=2, validator=non_negative)
    #: Fraction of steps (after warm-up) spent decaying linearly towards ``min_lr_factor * lr``,
    #: rounded, and at least one step when it is above 0 (the last step is at the floor).
    decay_ratio: float = field(default=0.8, validator=in_range(0, 1))
    #: Learning rate at the end of decay, as a fraction of ``lr``; the schedule stays there
    #: after ``steps`` (a resumed run with more steps never goes below it).
    min_lr_factor: float = field(default=0.1, validator=in_range(0, 1))
    #: AdamW weight decay, on every parameter unless the model's ``ModelSpec.param_groups``
    #: says otherwise; the Llama 3 and MoE models define none, so norms and embeddings decay too
    #: (torchtitan's convention; Megatron-LM exempts norms and biases). ``lr x weight_decay``
    #: must stay below 1 (each step multiplies the weights by ``1 - lr x weight_decay``).
    weight_decay: float = field(default=0.1, validator=[finite, non_negative])
    #: AdamW beta1, in [0, 1).
    beta1: float = field(default=0.9, validator=in_range(0, 1, hi_open=True))
    #: AdamW beta2, in [0, 1).
    beta2: float = field(default=0.95, validator=in_range(0, 1, hi_open=True))
    #: AdamW epsilon, at least 1.2e-38 (float32's smallest normal number: a smaller one is 0 in
    #: AdamW's float32 state, and a parameter whose gradient is 0 would become NaN).
    eps: float = field(default=1e-8, validator=[finite, positive, _adamw_eps])
    #: Gradient clipping: the total 2-norm over all parameters of the step's gradient (after
    #: accumulation) is scaled down to at most this; the logs show the norm before clipping.
    #: <= 0 disables clipping (``inf`` is refused: set 0).
    max_norm: float = field(default=1.0, validator=_max_norm)
    #: Compute dtype: ``float32``, or ``bfloat16`` (FSDP2 mixed precision on CUDA, one GPU
    #: included unless ``single_device_mixed_precision``; autocast on CPU; parameters and
    #: optimizer state stay float32).
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: bf16 on one CUDA process: ``fsdp`` (FSDP2 on a 1-GPU mesh: bf16 parameters for compute,
    #: fp32 master weights and gradients) or ``autocast`` (autocast over fp32 weights, cast at
    #: each use; no unsharded bf16 copies, so less memory). Several processes always use FSDP2.
    single_device_mixed_precision: Literal["fsdp", "autocast"] = "fsdp"
    #: Device type: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
    device: Literal["auto", "cpu", "cuda"] = "auto"


def _dp_shard(_inst: Any, _attr: Any, value: int) -> None:
    if value == 0 or value < -1:
        raise ValueError(f"expected -1 or a positive integer, got {value}")


@section
class Parallelism:
    #: Replicated data-parallel degree (HSDP's replicate dimension).
    dp_replicate: int = field(default=1, validator=positive)
    #: Sharded data-parallel (FSDP) degree; -1 takes whatever the other degrees leave.
    dp_shard: int = field(default=-1, validator=_dp_shard)
    #: Tensor-parallel degree (with sequence parallel).
    tp: int = field(default=1, validator=positive)
    #: Context-parallel degree.
    cp: int = field(default=1, validator=positive)
    #: Pipeline-parallel degree.
    pp: int = field(default=1, validator=positive)
    #: Expert-parallel degree (borrowed from the dp_shard x cp ranks).
    ep: int = field(default=1, validator=positive)
    #: Pipeline schedule: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``...
    pp_schedule: str = field(default="1F1B", validator=record_name)
    #: Microbatches per step for pipeline parallel; ``None`` uses the number of stages. Only
    #: with ``pp > 1`` (refused otherwise).
    pp_microbatches: int | None = field(default=None, validator=positive)
    #: Pipeline stages per PP rank for interleaved/looped schedules; ``None`` picks by schedule.
    #: Only with ``pp > 1`` (refused otherwise).
    pp_stages_per_rank: int | None = field(default=None, validator=positive)
    #: Keep the loss sharded over the vocabulary under TP (loss parallel); changed without TP,
    #: the run warns that it has no effect.
    loss_parallel: bool = field(default=True, metadata={APPLIED_BY: "tp"})
    #: When FSDP frees a block's gathered parameters after its forward: ``default`` frees them
    #: unless pipeline parallel (whose microbatches would gather the same parameters again),
    #: ``always`` or ``never`` (keep them until the block's backward: one gather less per step,
    #: the memory of every block's gathered parameters at the peak). The last block is kept in
    #: every mode: backward starts with it. Changed on a launch without FSDP (one CPU process),
    #: the run warns that it has no effect.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = field(
        default="default", metadata={APPLIED_BY: "dp_shard"}
    )


@section
class Validation:
    #: Compute a validation loss every ``freq`` steps and after the last step; it is logged
    #: (``validation`` lines) and written as TensorBoard ``validation/loss`` and
    #: ``validation/perplexity``.
    enable: bool = False
    #: Dataset of the validation data (``bundled``, ``text`` or a plugin's); ``None`` uses
    #: ``data.dataset``. Validation that reads the training dataset at the training path reads
    #: its held-out documents instead (the bundled corpus has them: same grammar, other draws);
    #: a dataset without them (``text``) is read as it is, with a warning: give held-out data
    #: with ``validation.path`` (or ``validation.dataset``).
    dataset: str | None = field(default=None, validator=record_name)
    #: File or folder for datasets that read local files (with ``validation.dataset`` or
    #: ``data.dataset`` ``text``); ``None`` uses ``data.path``.
    path: str | None = field(default=None, validator=local_path)
    #: Steps between validations (the last step always validates).
    freq: int = field(default=100, validator=positive)
    #: Global batches per validation (``training.global_batch_size`` sequences, read in the
    #: training step's microbatches), so the validation set does not change with the split of
    #: the batch; every validation reads the same batches, so values are comparable across steps.
    steps: int = field(default=10, validator=positive)


@section
class Comm:
    #: Communication backend plugin: ``default``, ``fake`` or ``real_pp_fake_spmd``.
    backend: str = field(default="default", validator=record_name)
    #: Timeout of process-group initialisation and the first step, in seconds (at most
    #: 999999999 days, ``datetime.timedelta``'s limit, which torch takes).
    init_timeout_seconds: int = field(default=300, validator=[positive, _timeout])
    #: Timeout of collectives after the first step, in seconds (at most 999999999 days).
    train_timeout_seconds: int = field(default=100, validator=[positive, _timeout])
    #: Flight-recorder entries kept per rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``); 0 disables it.
    trace_buf_size: int = field(default=20000, validator=non_negative)


@section
class Metrics:
    #: Log a line (and TensorBoard scalars) every ``log_freq`` steps.
    log_freq: int = field(default=10, validator=positive)
    #: Write TensorBoard scalars into ``save_tb_folder`` (a subfolder per dump folder there when
    #: it is outside ``job.dump_folder``).
    enable_tensorboard: bool = False
    #: Folder (under ``job.dump_folder``) for TensorBoard event files; one outside it (an absolute
    #: path), which runs of several dump folders may share, gets a subfolder per dump folder.
    save_tb_folder: str = field(default="tb", validator=local_path)
    #: Peak dense bf16 TFLOP/s of one device for MFU; ``None`` looks the device up.
    peak_tflops: float | None = field(default=None, validator=[finite, positive])


@section
class Checkpoint:
    #: Save (and resume from) checkpoints.
    enable: bool = False
    #: Checkpointer plugin.
    backend: str = field(default="dcp", validator=record_name)
    #: Folder (under ``job.dump_folder``) for checkpoints.
    folder: str = field(default="checkpoint", validator=[_subfolder, local_path])
    #: Steps between checkpoints (the last step is always saved).
    interval: int = field(default=500, validator=positive)
    #: Load checkpoints but never save one (for debugging with a seed checkpoint).
    load_only: bool = False
    #: Checkpoints kept: after each save the oldest beyond the newest ``keep_latest_k`` are
    #: removed (a seed checkpoint, ``step-0``, never is); 0 keeps every one. 10, as torchtitan,
    #: so a long run does not fill its disk.
    keep_latest_k: int = field(default=10, validator=non_negative)
    #: Resume from this step's checkpoint instead of the newest (0: the seed checkpoint); ``None``
    #: takes the newest that loads. One that cannot be loaded is an error, not a fallback; with
    #: newer checkpoints in the folder it needs ``load_only`` (this run's saves would mix with them).
    load_step: int | None = field(default=None, validator=non_negative)
    #: Write a seed checkpoint of the freshly initialised model and exit (needs all degrees 1).
    create_seed_checkpoint: bool = False
    #: Initial weights loaded after initialisation, whatever the parallel layout: a DCP checkpoint
    #: folder (e.g. a seed ``.../checkpoint/step-0``), a ``.pt`` file holding a full (unsharded)
    #: model state dict, or a Hugging Face model folder (config.json + safetensors).
    initial_load_path: str | None = field(default=None, validator=local_path)


@section
class Debug:
    #: Seed of model initialisation and data order; ``None`` picks 0 (a signed 64-bit integer,
    #: as config.toml can hold it).
    seed: int | None = None
    #: Use deterministic algorithms (slower; bit-for-bit reproducible on one configuration).
    deterministic: bool = False
    #: With ``deterministic``: warn instead of failing on non-deterministic ops (exploration only;
    #: such a run is unfit for numerical validation and ``titan compare`` refuses it).
    deterministic_warn_only: bool = False
    #: Stop after this many steps regardless of ``training.steps`` (``run_train.sh`` sets 1 in
    #: pure fake mode); ``None`` runs all steps.
    max_steps: int | None = field(default=None, validator=positive)
    #: Initialise like one process (a full model copy on the host, then this rank's shards) when
    #: the fp32 model is at most this many GiB, or whenever the mesh is on the CPU: the result
    #: then equals the one-process initialisation for any layout (docs/parallelism.md).
    init_full_model_max_gib: float = field(default=8.0, validator=[finite, non_negative])
    #: Record memory after init, after the first optimizer step, during steady-state
    #: forward/backward and after the optimizer step, and write
    #: ``memory_report_rank{rank}.json`` under ``job.dump_folder``; always on with the fake
    #: comm backends (docs/debugging.md). A plugin's callback implements it (``Callback.serves``;
    #: titan's: titan-plugins-memory): a run that sets it with no such callback loaded is refused.
    memory_report: bool = field(default=False, metadata={PLUGIN_SERVED: True})
    #: With a comm backend that simulates every peer: run steps on PyTorch fake tensors (shapes,
    #: dtypes and storage sizes propagate; nothing is computed, initialised or loaded; batches
    #: are zeros; loss and gradient norm log as NaN). ``auto``: on the CPU when the model allows
    #: it (docs/debugging.md); ``on`` errors where it cannot; ``off`` computes.
    fake_tensors: Literal["auto", "on", "off"] = "auto"


def _served() -> list[tuple[str, attrs.Attribute]]:
    """``(section name, attribute)`` of each core field a plugin implements (:data:`PLUGIN_SERVED`)."""
    return [
        (name, a)
        for name, cls in CORE_SECTIONS.items()
        for a in attrs.fields(cls)
        if a.metadata.get(PLUGIN_SERVED)
    ]


def served_fields() -> list[str]:
    """The dotted paths of the core fields a plugin implements (metadata :data:`PLUGIN_SERVED`)."""
    return [f"{name}.{a.name}" for name, a in _served()]


def plugin_served(config: "TrainerConfig") -> dict[str, Any]:
    """The core fields a plugin implements (metadata :data:`PLUGIN_SERVED`) that ``config`` sets
    to other than their defaults, by dotted path."""
    found = {}
    for name, a in _served():
        value = getattr(getattr(config, name), a.name)
        if value != a.default:
            found[f"{name}.{a.name}"] = value
    return found


#: The core's sections, in the order they print.
CORE_SECTIONS: dict[str, type] = {
    "job": Job,
    "model": Model,
    "data": Data,
    "training": Training,
    "parallelism": Parallelism,
    "validation": Validation,
    "comm": Comm,
    "metrics": Metrics,
    "checkpoint": Checkpoint,
    "debug": Debug,
}
_SECTION_NAMES.update({cls: name for name, cls in CORE_SECTIONS.items()})


def plugin_sections() -> dict[str, type]:
    """Sections added by plugins (``titan_config_sections``), by name, from the loaded registry."""
    from titan_core._registry import get_registry

    return get_registry().config_sections()


def register_section_name(name: str, cls: type) -> None:
    """Called by the registry so that errors in a plugin section carry its dotted path (the
    registry has refused core names and classes not made with :func:`section` already). Nested
    attrs classes of its fields get theirs too (``mini.inner.kind``, not ``inner.kind``)."""
    _SECTION_NAMES[cls] = name
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # the section's own checks name unresolvable annotations
        return
    for attribute in attrs.fields(cls):
        nested = hints.get(attribute.name)
        if isinstance(nested, type) and attrs.has(nested) and nested not in _SECTION_NAMES:
            register_section_name(f"{name}.{attribute.name}", nested)


_CORE_FIELDS = (*CORE_SECTIONS, "recipe")


@attrs.define(slots=False, on_setattr=attrs.setters.NO_OP)
class TrainerConfig:
    """The whole configuration of a run; what every recipe returns.

    Plugin sections are attributes too (``config.profiler.profile_freq``): they are created with
    their defaults on first access and printed with the core's.
    """

    job: Job = field(factory=Job)
    model: Model = field(factory=Model)
    data: Data = field(factory=Data)
    training: Training = field(factory=Training)
    parallelism: Parallelism = field(factory=Parallelism)
    validation: Validation = field(factory=Validation)
    comm: Comm = field(factory=Comm)
    metrics: Metrics = field(factory=Metrics)
    checkpoint: Checkpoint = field(factory=Checkpoint)
    debug: Debug = field(factory=Debug)
    #: Name of the recipe that produced this config (filled in by the CLI).
    recipe: str = ""

    def __getattr__(self, name: str) -> Any:  # only for names that are not core fields
        if name.startswith("_"):
            raise AttributeError(name)
        extra = self.__dict__.setdefault("_sections", {})
        if name not in extra:
            cls = plugin_sections().get(name)
            if cls is None:
                raise AttributeError(_unknown_section(name), name=name, obj=self)
            extra[name] = cls()
        return extra[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CORE_FIELDS:
            annotation = str if name == "recipe" else CORE_SECTIONS[name]
            if (err := _type_error(value, annotation)) is not None:
                raise ConfigError([f"{name}: {err}"])
            object.__setattr__(self, name, value)
            return
        cls = plugin_sections().get(name)
        if cls is None:
            raise AttributeError(_unknown_section(name), name=name, obj=self)
        if (err := _type_error(value, cls)) is not None:
            raise ConfigError([f"{name}: {err}"])
        self.__dict__.setdefault("_sections", {})[name] = value

    def sections(self) -> dict[str, Any]:
        """Every section, core then plugin, by name (plugin sections created with defaults)."""
        found = {name: getattr(self, name) for name in CORE_SECTIONS}
        found.update({name: getattr(self, name) for name in sorted(plugin_sections())})
        return found


def _unknown_section(name: str) -> str:
    from titan_core._registry import get_registry

    withheld = get_registry().unavailable("config_sections", name)
    if withheld is not None:  # the section exists, but its plugin failed: say which and why
        return f"{name}: {withheld}"
    known = ", ".join([*CORE_SECTIONS, *sorted(plugin_sections())])
    registry = get_registry()
    disabled = sorted(p.name for p in registry.plugins.values() if p.status == "disabled")
    hint = "is the plugin that adds it installed?"
    if disabled:  # a disabled plugin is never imported, so its sections are unknown
        hint += f" Disabled plugins, whose sections are not known: {', '.join(disabled)}"
    return f"{name}: no config section of that name; sections: {known} ({hint})"


# ---------------------------------------------------------------------------------------------
# Checks across fields, run once after the recipe
# ---------------------------------------------------------------------------------------------


def validate(config: Any, source: str = "") -> TrainerConfig:
    """Check what spans several fields; raise :class:`ConfigError` listing every problem by path.

    Single fields were checked when they were set.
    """
    if not isinstance(config, TrainerConfig):
        raise ConfigError([f"<recipe>: expected a TrainerConfig, got {type(config).__name__}"], source)
    problems: list[str] = []
    for values in config.sections().values():
        # Fields were checked when set; a list changed in place (``append``) was not.
        try:
            attrs.validate(values)
        except ConfigError as exc:
            problems += exc.problems
    d = config.debug
    if d.deterministic_warn_only and not d.deterministic:
        problems.append(
            "debug.deterministic_warn_only: has no effect without debug.deterministic = True; "
            "set both, or neither"
        )
    for name, values in config.sections().items():
        problems += _not_utf8(attrs.asdict(values, recurse=False), name)
    c = config.checkpoint
    if c.load_only and not c.enable:
        problems.append(
            "checkpoint.load_only: has no effect with checkpoint.enable = False (no checkpoint is "
            "read or written); set checkpoint.enable = True to resume without saving, or leave "
            "load_only False (initial weights come from checkpoint.initial_load_path either way)"
        )
    if c.load_step is not None and not c.enable:
        problems.append(
            f"checkpoint.load_step: has no effect with checkpoint.enable = False (no checkpoint is "
            f"read); set checkpoint.enable = True to resume from step {c.load_step}, or leave "
            "load_step None"
        )
    problems += _checkpoint_folder_problems(config)
    t = config.training
    problems += optimizer_problems(t)
    if t.global_batch_size is not None and t.global_batch_size % t.local_batch_size:
        problems.append(
            f"training.global_batch_size: {t.global_batch_size} is not a multiple of "
            f"training.local_batch_size={t.local_batch_size}; set it to local_batch_size x DP degree "
            "x the number of microbatches to accumulate, or None"
        )
    p = config.parallelism
    if p.pp == 1:  # only pipeline parallel reads them: a run would go on as if they applied
        problems += [
            f"parallelism.{name}: {getattr(p, name)!r} does nothing with parallelism.pp = 1 (only "
            "pipeline parallel reads it); set parallelism.pp > 1, or leave it None"
            for name in ("pp_microbatches", "pp_stages_per_rank")
            if getattr(p, name) is not None
        ]
    from titan_core._registry import get_registry

    for record, label in get_registry().config_checks():
        problems += _plugin_check(record, label, config)
    if problems:
        raise ConfigError(problems, source)
    return config


def _checkpoint_folder_problems(config: Any) -> list[str]:
    """``checkpoint.folder`` resolving to ``job.dump_folder`` itself, or to a folder holding it, in
    any spelling (an absolute path, ``../out``, a trailing ``/.``; the field's own check sees only
    ``''`` and ``'.'``). Compared as resolved paths: the run failed later with its own lock on the
    dump folder taken for "another run" using the checkpoint folder; one holding the dump folder
    would get the run's logs mixed with the checkpointer's steps."""
    c = config.checkpoint
    dump, folder = config.job.dump_folder, c.folder
    if not (c.enable or c.create_seed_checkpoint) or not dump or not folder:  # unused, or refused
        return []
    root = os.path.realpath(dump)
    path = os.path.realpath(os.path.join(dump, folder))
    if path == root:
        where = "is the dump folder itself"
    elif os.path.commonpath([root, path]) == path:
        where = "holds the dump folder"
    else:
        return []
    return [
        f"checkpoint.folder: {folder!r} {where} (job.dump_folder {dump!r} is {root!r}, the "
        f"checkpoint folder {path!r}); "
        "checkpoints need a folder of their own: a name inside the dump folder (the default: "
        "'checkpoint') or a path outside it"
    ]


def _not_utf8(value: Any, where: str) -> list[str]:
    """A ``where: ...`` line for each string that UTF-8 cannot encode (a path of undecodable
    bytes, which ``os.fsdecode`` turns into surrogates, or a lone surrogate): config.toml, and
    the logs, are UTF-8, so the run could not record what it ran."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return [
                f"{where}: {value!r} is not valid UTF-8 (a path of undecodable bytes, or a lone "
                "surrogate); titan records its config as UTF-8 TOML: rename the file or folder, "
                "or give the text in UTF-8"
            ]
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _not_utf8(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _not_utf8(v, f"{where}[{i}]")]
    return []


#: The largest float32 (``torch.finfo(torch.float32).max``): parameters and AdamW's state are
#: float32, and torch converts the optimizer's Python scalars to their dtype.
_FLOAT32_MAX = 3.4028234663852886e38


def optimizer_problems(t: Training) -> list[str]:
    """Settings AdamW cannot run with, each a ``training.x: ...`` line (:func:`validate`, and the
    trainer for a caller that skipped it). A finite ``training.lr`` can still be too large:
    AdamW's step size, ``lr / (1 - beta1 ** step)``, at most ``lr / (1 - beta1)`` on the first
    step, is converted to float32, and beyond float32's range that conversion raises inside
    torch's optimizer step. A smaller lr that only makes the loss diverge is the trainer's
    non-finite-loss error (``Diverged``) instead."""
    step_size = t.lr / (1 - t.beta1)
    if step_size <= _FLOAT32_MAX:
        # Decoupled weight decay multiplies every parameter by 1 - lr x weight_decay each step:
        # at 0 or below the weights were zeroed (or flipped) at the peak LR and the run went on
        # at the loss of uniform predictions, exit 0. (Only when the LR fits: an LR too large is
        # the one problem to name.)
        shrink = t.lr * t.weight_decay
        if shrink < 1:
            return []
        return [
            f"training.weight_decay: {t.weight_decay:g} x training.lr {t.lr:g} = {shrink:g} is >= 1: "
            "AdamW multiplies every parameter by 1 - lr x weight_decay each step, so the weights "
            "would be zeroed or flip sign at the peak LR; lower training.weight_decay below "
            f"{1 / t.lr:.3g} (1 / training.lr; usually 0.01 to 0.1)"
        ]
    return [
        f"training.lr: {t.lr:g} is too large: AdamW's step size lr / (1 - training.beta1) = "
        f"{step_size:.3g} is beyond float32's range ({_FLOAT32_MAX:.3g}), so the first optimizer "
        f"step would fail; lower training.lr to at most {_FLOAT32_MAX * (1 - t.beta1):.3g} (peak learning "
        "rates are usually 1e-4 to 1e-2)"
    ]


def _plugin_check(record: Any, label: str, config: TrainerConfig) -> list[str]:
    """A plugin section's ``check``: its problems, or one :class:`PluginError` naming it when it
    raises or returns something other than a list of strings.

    Every config holds every section, so a broken check would stop every run of the installation,
    also those that never touch the plugin: while the section is at its defaults the breakage is
    a warning naming the plugin and the run goes on; a run that sets the section's fields needs
    them checked, and stops.
    """
    try:
        found = call_plugin(
            lambda: f"the check of {label} failed",
            record.check,
            config,
            message=lambda what, exc: f"{what}: {type(exc).__name__}: {exc}",
        )
        return problems_returned(found, f"the check of {label} returned")
    except PluginError as exc:
        if getattr(config, record.name) != record.cls():
            raise
        from titan_core.log import get_logger

        get_logger("titan.config").warning(
            f"{exc}; the section is at its defaults, so this run goes on (fix or uninstall the plugin "
            "before setting its fields)"
        )
        return []


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
    # Strict scalars: cattrs' own hooks call int()/str()/float(), so "10" became 10, 10.5 became
    # 10 and 3 became "3" without a word, where a recipe setting the same values is refused.
    for kind in (int, float, bool, str):
        converter.register_structure_hook(kind, _strict(kind))
    return converter


def _strict(kind: type) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:  # True is an int to Python, not to TOML
            ok = False
        elif kind is float:
            ok = isinstance(value, (int, float))
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise TypeError(f"expected {_TYPE_WORDS[kind]}, got {type(value).__name__} {value!r}")
        if kind is float:
            try:
                return float(value)
            except OverflowError:  # an integer beyond float range (10**400)
                raise TypeError(
                    f"expected a number within float range, got an integer of {len(str(value))} digits"
                ) from None
        return value

    return structure


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _cattrs_message(exc: BaseException, type_: Any) -> str:
    """How one structuring failure reads: a section's own validation error keeps its dotted
    paths (marked for :func:`from_dict`), titan's type errors their text, cattrs' the rest."""
    from cattrs.errors import ForbiddenExtraKeysError
    from cattrs.v import format_exception

    cls = getattr(exc, "cl", None)
    if isinstance(exc, ForbiddenExtraKeysError) and cls is not None and attrs.has(cls):  # as in a recipe
        known = ", ".join(a.name for a in attrs.fields(cls))
        section = _SECTION_NAMES.get(cls, cls.__name__)
        return _OWN + "\n".join(
            f"{section}.{key}: no such field; {section} has {known}" for key in sorted(exc.extra_fields)
        )
    if isinstance(exc, ConfigError):
        return _OWN + "\n".join(exc.problems)
    if isinstance(exc, TypeError) and str(exc).startswith("expected "):
        return str(exc)
    if " not in literal " in str(exc):  # cattrs' CattrsError (a ValueError in older cattrs)
        choices = ", ".join(repr(c) for c in getattr(type_, "__args__", ()))
        return f"expected one of {choices}, got {str(exc).split(' not in literal ')[0]!r}"
    return format_exception(exc, type_)


#: Marks a message that is already ``path: message`` lines (a section's own ConfigError).
_OWN = "\x00"


def to_dict(config: TrainerConfig) -> dict[str, Any]:
    converter = _converter()
    data: dict[str, Any] = {name: converter.unstructure(s) for name, s in config.sections().items()}
    data["recipe"] = config.recipe
    return data


def from_dict(data: dict[str, Any]) -> TrainerConfig:
    """Structure plain data into a config; errors are rendered as ``path: message`` lines."""
    import cattrs

    extra = plugin_sections()
    unknown = sorted(set(data) - {*_CORE_FIELDS, *extra})
    if unknown:
        raise ConfigError([_unknown_section(name) for name in unknown])
    converter = _converter()
    config = TrainerConfig()
    try:
        for name, value in data.items():
            if name == "recipe":
                config.recipe = value
                continue
            cls = CORE_SECTIONS.get(name) or extra[name]
            if problems := _shape_problems(name, cls, value):
                raise ConfigError(problems)
            try:
                setattr(config, name, converter.structure(value, cls))
            except cattrs.BaseValidationError as exc:
                messages = cattrs.transform_error(exc, path="", format_exception=_cattrs_message)
                problems = [p for m in messages for p in _render_cattrs(name, m)]
                raise ConfigError(problems) from None
    except ConfigError:
        raise
    return validate(config)


def _shape_problems(section_name: str, cls: type, value: Any) -> list[str]:
    """What cattrs would take in without a word: a section that is no table, a string where a
    list goes (structured as its characters), a value outside a ``Literal`` (quoted vaguely)."""
    if not isinstance(value, dict):
        return [f"{section_name}: expected a table of its fields, got {type(value).__name__} {value!r}"]
    attrs.resolve_types(cls)
    problems = []
    for a in attrs.fields(cls):
        if a.name not in value or value[a.name] is None:
            continue
        given, kind = value[a.name], a.type
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)
        origin, where = typing.get_origin(kind) or kind, f"{section_name}.{a.name}"
        if origin in (list, tuple) and not isinstance(given, (list, tuple)):
            problems.append(f"{where}: expected a list, got {type(given).__name__} {given!r}")
        elif origin is dict and not isinstance(given, dict):
            problems.append(f"{where}: expected a table, got {type(given).__name__} {given!r}")
        elif origin is Literal and given not in typing.get_args(kind):
            choices = ", ".join(repr(c) for c in typing.get_args(kind))
            problems.append(f"{where}: expected one of {choices}, got {given!r}")
    return problems


def _render_cattrs(section_name: str, message: str) -> list[str]:
    # cattrs renders "invalid value for type, expected int @ .steps".
    text, _, path = message.rpartition(" @ ")
    if text.startswith(_OWN):  # the section's validation: its lines carry their paths
        return text.removeprefix(_OWN).split("\n")
    return [f"{section_name}{path.replace('$', '')}: {text}"]


def render(config: TrainerConfig, fmt: Literal["toml", "json"] = "toml") -> str:
    data = to_dict(config)
    if fmt == "json":
        return json.dumps(data, indent=2)
    return _to_toml(data, config.sections())


def _to_toml(data: dict[str, Any], sections: dict[str, Any] | None = None) -> str:
    top = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    lines = [*top, ""] if top else []
    for section_name, values in data.items():
        if isinstance(values, dict):
            lines += _toml_table(section_name, values, (sections or {}).get(section_name))
    return "\n".join(lines)


def _toml_table(name: str, values: dict[str, Any], section_value: Any) -> list[str]:
    """``[name]`` and its keys, then a ``[name.field]`` table per nested section class. A nested
    section is a table of its own, not an inline one, so that its ``None`` fields are left out as
    the section's are: TOML has no null, and inside ``{ ... }`` a None was the string "None"."""
    lines, nested = [f"[{name}]"], []
    for key, value in values.items():
        child = getattr(section_value, key, None)
        if isinstance(value, dict) and attrs.has(type(child)):
            nested.append((f"{name}.{key}", value, child))
        elif value is None:
            lines.append(f"# {key} = (unset)")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append("")
    for table in nested:
        lines += _toml_table(*table)
    return lines


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes of quote, backslash and control characters are TOML's
    too, but not its surrogate pairs for characters beyond U+FFFF (invalid TOML): those are
    written as themselves, and DEL, which TOML must see escaped, as ``\u007f``."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_string(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    # As the plain number: a subclass's repr is no TOML (numpy's ``np.float64(0.001)``, an
    # IntEnum's ``<Steps.SHORT: 7>``), and a recipe computing its LR with numpy gets one.
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return _toml_string(str(value))


__all__ = [
    "CORE_SECTIONS",
    "ConfigError",
    "TrainerConfig",
    "field",
    "field_docs",
    "finite",
    "from_dict",
    "in_range",
    "local_path",
    "non_negative",
    "positive",
    "render",
    "section",
    "to_dict",
    "validate",
]
