"""The run's layout, checked before anything is built: the model, its arguments and the
strategies a config asks for under its parallel degrees.

The trainer calls :func:`check_layout` before the mesh and the model, ``run_train.sh`` before
torchrun starts any process (:func:`titan_core.run.preflight`), so both refuse a layout with the
same error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from titan_core._registry import Registry
from titan_core.config import TrainerConfig
from titan_core.data.loader import load_tokenizer
from titan_core.errors import UsageError
from titan_core.parallel_dims import ParallelDims
from titan_core.parallelize import check_strategies
from titan_core.run import check_served

__all__ = [
    "Layout",
    "check_data_paths",
    "check_layout",
    "check_model",
    "microbatches_per_step",
    "model_arg",
    "resolve_model",
    "unapplied_settings",
]

_ABSENT = object()


def model_arg(args: Any, name: str, default: Any = None) -> Any:
    """The model argument ``name`` of ``args`` (a dict, attrs or dataclass instance, or any object
    with attributes), or ``default`` when it has no such argument. The trainer reads
    ``vocab_size``, ``max_seq_len`` and ``bos_id`` through this (docs/plugins.md)."""
    if isinstance(args, Mapping):
        return args.get(name, default)
    return getattr(args, name, default)


def microbatches_per_step(training: Any, parallel_dims: ParallelDims) -> int:
    """Microbatches accumulated per optimizer step: ``training.global_batch_size`` over
    ``training.local_batch_size`` x the DP degree (one without a global batch size); a global
    batch that is no multiple of that is one :class:`UsageError` naming the fields."""
    t = training
    dp = parallel_dims.dp
    per_microbatch = t.local_batch_size * dp
    wanted = t.global_batch_size or per_microbatch
    if wanted % per_microbatch:
        raise UsageError(
            f"training.global_batch_size={wanted} is not a multiple of training.local_batch_size "
            f"x DP degree = {t.local_batch_size} x {dp} = {per_microbatch}; set it to a multiple "
            "of that (or None for one microbatch per step)"
        )
    return wanted // per_microbatch


@attrs.frozen
class Layout:
    """What :func:`check_layout` found: the model and the strategies this run uses."""

    spec: Any
    tokenizer: Any
    model_args: Any
    #: The strategies this run applies, in order.
    strategies: list[Any]
    #: Microbatches accumulated per optimizer step (:func:`microbatches_per_step`).
    accumulation: int


def _log_warning(message: str) -> None:
    from titan_core.log import get_logger

    get_logger("titan.layout").warning(message)


def check_layout(
    config: TrainerConfig,
    registry: Registry,
    parallel_dims: ParallelDims,
    call: Callable[..., Any] = lambda what, fn, *args: fn(*args),
    warn: Callable[[str], None] = _log_warning,
) -> Layout:
    """Everything a run of ``parallel_dims`` asks of its config, its model and its strategies that
    shows before anything is built, checked in one place: the global batch against the DP degree
    (:func:`microbatches_per_step`), the model's arguments (:func:`resolve_model`, the model's
    ``validate``), the strategies (:func:`~titan_core.parallelize.check_strategies`: a strategy
    for every degree, each one's ``check``) and the core fields plugins serve
    (:func:`~titan_core.run.check_served`). ``call(what, fn, *args)`` runs plugin code, an
    exception becoming one :class:`PluginError` starting with ``what()``
    (:func:`~titan_core.errors.call_plugin`). The trainer calls it before the mesh and the model,
    ``run_train.sh`` before torchrun starts any process (:func:`titan_core.run.preflight`), so
    the two refuse a layout with the same error. A setting that only a strategy this launch does
    not apply reads is one ``warn`` line (:func:`unapplied_settings`; the run's log by default)."""
    accumulation = microbatches_per_step(config.training, parallel_dims)
    spec, tokenizer, model_args = check_model(config, registry, parallel_dims, call)
    strategies = check_strategies(registry, config, parallel_dims, spec, model_args, call)
    check_served(config, registry)
    check_data_paths(config, registry)
    for message in unapplied_settings(config, strategies, parallel_dims):
        warn(message)
    return Layout(spec, tokenizer, model_args, strategies, accumulation)


def unapplied_settings(
    config: TrainerConfig, strategies: list[Any], parallel_dims: ParallelDims
) -> list[str]:
    """One line per core setting that only the strategy handling one parallel dimension reads
    (:data:`~titan_core.config.APPLIED_BY`: ``fsdp_reshard_after_forward`` FSDP's, ``dp_shard``;
    ``loss_parallel`` TP's, ``tp``), changed from its default while no strategy this run applies
    handles that dimension: it cannot take effect, and was ignored without a word.

    A warning, not an error (as settings the config alone shows to do nothing are, e.g.
    ``pp_microbatches`` with ``pp = 1``): whether a strategy applies depends on the launch (the
    number of processes, the device), and one recipe serves several (a one-process smoke test of
    a recipe written for 8 GPUs)."""
    from titan_core.config import strategy_settings

    handled = {dim for strategy in strategies for dim in strategy.handles}
    degrees = ", ".join(
        f"{d}={getattr(parallel_dims, d)}" for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    )
    return [
        f"{path} = {value!r} has no effect in this run: only the strategy handling {dim} reads it, "
        f"and none applies to this launch ({degrees}, world size {parallel_dims.world_size}); it "
        f"takes effect where that strategy applies (e.g. {dim} > 1), or leave it at its default"
        for path, (value, dim) in strategy_settings(config).items()
        if dim not in handled
    ]


def model_arguments(spec: Any, config: TrainerConfig, tokenizer: Any) -> Any:
    """The model's arguments for ``config.model``, the BOS id filled in from ``tokenizer`` when
    the model asks for it (``bos_id`` present and ``None``); a bad flavor or override is one
    error naming its field. Training and ``titan export`` build the same arguments."""
    m = config.model
    try:
        model_args = spec.flavor(m.flavor, m.overrides)
        if model_arg(model_args, "bos_id", _ABSENT) is None and tokenizer is not None:
            model_args = spec.flavor(m.flavor, {**m.overrides, "bos_id": tokenizer.bos_id})
    except LookupError as exc:
        field = "model.overrides" if m.flavor in spec.flavors else "model.flavor"
        raise UsageError(f"{field}: {exc}") from None
    return model_args


def resolve_model(
    config: TrainerConfig,
    registry: Registry,
    parallel_dims: ParallelDims,
    call: Callable[..., Any] = lambda fn, *args: fn(*args),
) -> tuple[Any, Any, Any]:
    """The model spec, the tokenizer and the model's arguments (the BOS id filled in from the
    tokenizer when the model asks for it), checked by the model itself (``ModelSpec.validate``,
    through ``call``) and against the tokenizer and ``training.seq_len``. Builds nothing: the
    trainer and run_train.sh's check before torchrun (:func:`titan_core.run.preflight`) share it."""
    spec = registry.get("models", config.model.name, what="model.name")
    tokenizer = load_tokenizer(config.data.tokenizer_path)
    model_args = model_arguments(spec, config, tokenizer)
    bos = model_arg(model_args, "bos_id", _ABSENT)
    if bos not in (_ABSENT, None) and tokenizer.bos_id is not None and bos != tokenizer.bos_id:
        # The document mask starts a document at the model's bos_id; the loader frames each one
        # with the tokenizer's: another id split documents at an ordinary token, never at a BOS.
        raise UsageError(
            f"model.overrides.bos_id={bos} is not the tokenizer's BOS id {tokenizer.bos_id} "
            "(data.tokenizer_path): leave bos_id unset (titan fills it in from the tokenizer), or set it to "
            f"{tokenizer.bos_id}"
        )
    if spec.validate is not None:
        call(spec.validate, model_args, parallel_dims)
    name = f"{config.model.name}/{config.model.flavor}"
    max_seq_len = model_arg(model_args, "max_seq_len")
    if max_seq_len is not None and config.training.seq_len > max_seq_len:
        raise UsageError(
            f"training.seq_len={config.training.seq_len} exceeds the model's max_seq_len={max_seq_len} "
            f'({name}); lower seq_len or set model.overrides = {{"max_seq_len": ...}}'
        )
    vocab = model_arg(model_args, "vocab_size")
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model {name} has a vocabulary of "
            f"{vocab}; use a flavor with a larger vocabulary or a smaller tokenizer (data.tokenizer_path)"
        )
    return spec, tokenizer, model_args


def check_model(
    config: TrainerConfig,
    registry: Registry,
    parallel_dims: ParallelDims,
    call: Callable[..., Any] = lambda what, fn, *args: fn(*args),
) -> tuple[Any, Any, Any]:
    """:func:`resolve_model`, the model's ``validate`` run through ``call(what, fn, *args)``
    (:func:`check_layout`), so a plugin that raises is named as the model's."""
    label = registry.label("models", config.model.name)
    return resolve_model(
        config,
        registry,
        parallel_dims,
        lambda fn, *args: call(lambda: f"{label} failed to validate its arguments", fn, *args),
    )


def check_data_paths(config: TrainerConfig, registry: Registry) -> None:
    """Refuse a ``data.path`` or ``validation.path`` that its dataset would not read
    (``Dataset.reads_path``): the run would train, or validate, on other text than the files
    named, without a word."""
    d, v = config.data, config.validation
    sources = [("data", d.dataset, d.path)]
    if v.enable:
        sources.append(("validation", v.dataset or d.dataset, v.path))
    for section_name, name, path in sources:
        if path is None:
            continue
        dataset = registry.get("datasets", name, what=f"{section_name}.dataset")
        if not dataset.reads_path:
            what = f" ({dataset.description})" if dataset.description else ""
            raise UsageError(
                f"{section_name}.path = {path!r} is not read: {section_name}.dataset {name!r}{what} "
                f"reads no files; to read them set {section_name}.dataset = 'text' (.jsonl/.txt), or "
                f"leave {section_name}.path unset"
            )
