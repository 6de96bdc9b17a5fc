"""Typed records that plugins return from titan's hooks.

Each hook (see :mod:`titan_core.hookspecs`) returns a list of one of these records. A record
carries a ``name`` users select it by and the callables that build the thing it stands for.
The records never import torch: what they build is created only when a run asks for it, so
listing plugins stays fast.

The registry (:mod:`titan_core._registry`) gathers every hook's records from all plugins when it
loads and normalises their names; a name provided twice fails the runs that use it, naming both
distributions, and a plugin with one bad hook result offers none of its records.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import argparse

    from torch import nn

    from titan_core.config import Data, TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.topology import Topology


def _callable(what: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{what}: expected a function, got {type(value).__name__} {value!r}")


def _function(what: str) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: the field holds a callable (a record's wrong value fails the plugin where
    it makes the record, not every run where the core first calls it)."""
    return lambda _i, _a, v: _callable(what, v)


def _optional(what: str) -> Callable[[Any, Any, Any], None]:
    return lambda _i, _a, v: v is None or _callable(what, v)


def _text(what: str) -> Callable[[Any], str]:
    """An attrs converter of a description: ``None`` is ``""`` (``Recipe(name, fn, fn.__doc__)``
    of a function without a docstring; the tables of ``titan recipes list`` failed on it with a
    TypeError), any other non-string a TypeError naming the field, where the plugin makes it."""

    def convert(value: Any) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise TypeError(f"{what}: expected a string, got {type(value).__name__} {value!r}")
        return value

    return convert


def _names(what: str, noun: str) -> Callable[[Any], tuple[str, ...]]:
    """An attrs converter to a tuple of names; a bare string (``("norm")`` lacks its comma) would
    become its letters, each a name nobody meant."""

    def convert(value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise TypeError(f"{what}: expected a tuple of {noun}, got {value!r} (a 1-tuple is ('name',))")
        if not all(isinstance(v, str) for v in value):
            raise TypeError(f"{what}: expected a tuple of {noun}, got {value!r}")
        return tuple(value)

    return convert


def _flavors(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"ModelSpec.flavors: expected a mapping of flavor names to model arguments "
            f"({{'debug': {{...}}}}), got {type(value).__name__} {value!r}"
        )
    # ``config.model.flavor`` is a string: a flavor under another key could never be chosen
    # (and ``titan models list`` ended in a TypeError for every plugin's models).
    bad = [k for k in value if not isinstance(k, str) or not k.strip()]
    if bad:
        raise TypeError(
            f"ModelSpec.flavors: flavor names must be non-empty strings (config.model.flavor "
            f"selects one), got {', '.join(map(repr, bad))}"
        )


@attrs.frozen
class ModelSpec:
    """A model family: its flavors and what the trainer and strategies need from it.

    The built module follows titan's decoder protocol (``docs/plugins.md``): ``init_weights()``
    initialises every parameter and buffer in place, ``forward(tokens) -> logits``, and the
    transformer blocks live in ``model.layers`` (an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...)
    so that FSDP, activation checkpointing and pipeline splitting can find them.
    """

    name: str
    #: flavor name -> model arguments (any object; usually a frozen attrs/dataclass instance).
    flavors: Mapping[str, Any] = attrs.field(validator=lambda _i, _a, v: _flavors(v))
    #: ``build(args) -> nn.Module``; called under ``torch.device("meta")``.
    build: Callable[[Any], nn.Module] = attrs.field(validator=_function("ModelSpec.build"))
    #: ``num_params(args, include_embedding) -> int`` computed analytically (no model built).
    num_params: Callable[[Any, bool], int] = attrs.field(validator=_function("ModelSpec.num_params"))
    #: ``flops_per_token(args, seq_len) -> float`` for MFU (6N + attention, torchtitan's formula).
    flops_per_token: Callable[[Any, int], float] = attrs.field(
        validator=_function("ModelSpec.flops_per_token")
    )
    #: ``tp_plan(model, tp_mesh, loss_parallel) -> None`` applies the DTensor TP/SP plan in
    #: place; ``None`` when the model does not support tensor parallelism.
    tp_plan: Callable[..., None] | None = attrs.field(default=None, validator=_optional("ModelSpec.tp_plan"))
    description: str = attrs.field(default="", converter=_text("ModelSpec.description"))
    #: ``validate(args, parallel_dims) -> None`` raises :class:`~titan_core.errors.UsageError`
    #: when this model cannot run under the layout (e.g. a TP degree that does not divide the
    #: vocabulary); called after the config is checked and before anything is built.
    validate: Callable[[Any, ParallelDims], None] | None = attrs.field(
        default=None, validator=_optional("ModelSpec.validate")
    )
    #: ``param_groups(model, optimizer_config) -> list[dict]``: optimizer parameter groups (torch's
    #: ``[{"params": [...], "weight_decay": 0.0}, ...]``) for this rank's model part, each trainable
    #: parameter in exactly one (the trainer refuses others); ``None``: one group with
    #: ``training.weight_decay`` for every parameter.
    param_groups: Callable[[nn.Module, Any], list[dict[str, Any]]] | None = attrs.field(
        default=None, validator=_optional("ModelSpec.param_groups")
    )
    #: ``num_active_params(args) -> int``: parameters one token uses (mixture-of-experts models);
    #: ``None``: every parameter is active.
    num_active_params: Callable[[Any], int] | None = attrs.field(
        default=None, validator=_optional("ModelSpec.num_active_params")
    )
    #: Converts state dicts to and from Hugging Face ``transformers`` names (import/export);
    #: ``None`` when the model has no Hugging Face counterpart.
    state_dict_adapter: StateDictAdapter | None = None
    #: Whether a step can run on fake tensors (shapes only; ``debug.fake_tensors``): ``False``
    #: when shapes depend on values, e.g. how many tokens the router sends to each expert.
    runs_on_fake_tensors: bool = True
    #: Top-level modules (attribute names) that only the first pipeline stage holds, run before
    #: the blocks: the token embedding, a learned position table. Later stages set them to
    #: ``None``. Pipeline parallelism refuses a top-level module with parameters that is neither
    #: ``layers`` nor named here or in ``last_stage_modules``: every stage would hold a copy.
    first_stage_modules: tuple[str, ...] = attrs.field(
        default=("tok_embeddings",), converter=_names("ModelSpec.first_stage_modules", "module names")
    )
    #: Top-level modules only the last pipeline stage holds, run after the blocks.
    last_stage_modules: tuple[str, ...] = attrs.field(
        default=("norm", "output"), converter=_names("ModelSpec.last_stage_modules", "module names")
    )
    #: Parts of module names (as ``named_modules`` gives them) that low-precision strategies
    #: (float8) leave in the training dtype, whatever their own settings: layers whose outputs
    #: decide discrete choices, such as an MoE router's gate (``"router.gate"``), where float8
    #: rounding would change which experts a token goes to.
    high_precision_modules: tuple[str, ...] = attrs.field(
        default=(), converter=_names("ModelSpec.high_precision_modules", "module names")
    )
    #: Model arguments that change how the model computes, not what its weights mean or what it
    #: computes: one matmul for three (``fuse_qkv``), a kernel choice, the longest sequence it
    #: accepts (``max_seq_len``, a buffer's length). A resume and ``titan export`` compare the
    #: checkpoint's model with this run's and refuse another one (its weights would be read as
    #: this model's); a difference in these alone is the same model.
    compute_only_args: tuple[str, ...] = attrs.field(
        default=(), converter=_names("ModelSpec.compute_only_args", "argument names")
    )
    #: ``resolve_args(args) -> args``: the arguments as the model reads them, every value it
    #: derives from others filled in (``n_kv_heads=None`` is ``n_heads``; a window of ``None``
    #: is the whole context), as the same kind of object (attrs, dataclass, dict) or a mapping
    #: of argument names to values. A resume and ``titan export`` compare the resolved
    #: arguments, so two spellings of one model are the same model; ``None``: the arguments are
    #: compared as written. It must not raise on arguments a flavor accepts.
    resolve_args: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=_optional("ModelSpec.resolve_args")
    )

    def flavor(self, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """The flavor's arguments with ``overrides`` applied (attrs, dataclass or dict args)."""
        try:
            args = self.flavors[flavor]
        except KeyError:
            known = ", ".join(sorted(self.flavors))
            raise LookupError(
                f"model {self.name!r} has no flavor {flavor!r}; known flavors: {known}"
            ) from None
        if not overrides:
            return args
        if isinstance(args, dict):
            fields = set(args)
        elif attrs.has(type(args)):
            fields = {a.name for a in attrs.fields(type(args))}
        elif dataclasses.is_dataclass(args):
            fields = {f.name for f in dataclasses.fields(args)}
        else:
            raise LookupError(f"model {self.name!r} flavor arguments cannot be overridden")
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise LookupError(
                f"{self.name} arguments have no field {', '.join(map(repr, unknown))}; "
                f"fields: {', '.join(sorted(fields))}"
            )
        current = args if isinstance(args, dict) else {f: getattr(args, f) for f in fields}
        declared = _declared_types(args)
        for key, value in overrides.items():
            # The field's declared type decides (a flavor may fill a float field with an int
            # literal); without one, the flavor's own value's type.
            hint = declared.get(key)
            fits = _fits(hint, value) if hint is not None else None
            if fits is None:
                old = current[key]
                hint = type(old)
                numeric = isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool)
                fits = old is None or type(value) is type(old) or numeric
            if not fits:
                raise LookupError(f"{self.name} argument {key!r} expects {_describe(hint)}, got {value!r}")
        if isinstance(args, dict):
            return {**args, **overrides}
        if attrs.has(type(args)):
            return attrs.evolve(args, **overrides)
        return dataclasses.replace(args, **overrides)


def _declared_types(args: Any) -> dict[str, Any]:
    """Field name -> type annotation of attrs or dataclass arguments ({} when unresolvable)."""
    if isinstance(args, dict):
        return {}
    try:
        return typing.get_type_hints(type(args))
    except Exception:  # annotations naming what their module does not import
        return {}


def _fits(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` is of type ``hint``; ``None`` for a type this check does not know."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        answers = [_fits(h, value) for h in typing.get_args(hint)]
        return True if True in answers else (None if None in answers else False)
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # an int is a float value here, as in Python's numeric tower
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return None


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


@attrs.frozen
class StateDictAdapter:
    """How a model's state dict maps onto its Hugging Face ``transformers`` counterpart.

    The four callables work on plain ``{name: tensor}`` dicts of full (unsharded) tensors;
    ``titan export --to hf`` and ``checkpoint.initial_load_path`` pointing at a Hugging Face
    folder use them.
    """

    #: ``to_hf(state_dict, args) -> state_dict`` with Hugging Face names (and q/k permutation).
    to_hf: Callable[[dict[str, Any], Any], dict[str, Any]]
    #: ``from_hf(state_dict, args) -> state_dict`` with titan names.
    from_hf: Callable[[dict[str, Any], Any], dict[str, Any]]
    #: ``hf_config(args) -> dict``: the ``config.json`` of the exported model.
    hf_config: Callable[[Any], dict[str, Any]]
    #: ``args_from_hf(config_json) -> args``: model arguments equal to a Hugging Face config.
    args_from_hf: Callable[[dict[str, Any]], Any] | None = None
    #: ``for_run(folder_args, run_args) -> args``: the folder's arguments as a run may load them,
    #: where it may load less than the folder holds (DeepSeek's multi-token-prediction modules:
    #: a run with fewer loads the main model, ``from_hf`` dropping the rest). ``None``: they
    #: must equal the run's.
    for_run: Callable[[Any, Any], Any] | None = None


@attrs.frozen
class Recipe:
    """A named function that returns a fully populated :class:`~titan_core.config.TrainerConfig`."""

    name: str
    fn: Callable[[], TrainerConfig] = attrs.field(validator=_function("Recipe.fn"))
    description: str = attrs.field(default="", converter=_text("Recipe.description"))


@attrs.frozen
class Strategy:
    """A parallelism or model transformation applied to each model part before training.

    Strategies run in ascending ``order`` (``titan_core.parallelize.ORDER`` names the slots):
    pipeline splitting happens first and produces model parts; the others transform each part.
    """

    name: str
    order: int = attrs.field(validator=lambda _i, _a, v: _an_int("Strategy.order", v))
    #: ``applies(config, parallel_dims) -> bool``: whether this run needs the strategy.
    applies: Callable[[TrainerConfig, ParallelDims], bool] = attrs.field(
        validator=lambda _i, _a, v: _callable("Strategy.applies", v)
    )
    #: ``apply(parts, ctx) -> parts``: takes this rank's model parts (a list of ``nn.Module``)
    #: and a :class:`~titan_core.parallelize.ParallelContext`, returns the parts to train; it may
    #: also contribute to the training step through the context (loss, batch, step contexts).
    apply: Callable[..., Any] = attrs.field(validator=lambda _i, _a, v: _callable("Strategy.apply", v))
    description: str = attrs.field(default="", converter=_text("Strategy.description"))
    #: Parallel dimensions this strategy implements when it applies (``"tp"``, ``"dp_shard"``,
    #: ...: :data:`PARALLEL_DIMS`): a run whose degree is above 1 in a dimension no applied
    #: strategy handles fails before anything is built.
    handles: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _parallel_dims(v))
    #: ``check(config, parallel_dims, spec, model_args) -> list[str]``, or ``None``: the problems
    #: of a run this strategy applies to that its config, parallel degrees, model spec and model
    #: arguments show (``"section.field: message"`` each, naming what to set; empty when there are
    #: none). Called before anything is built, and only when ``applies`` is true: by
    #: ``run_train.sh`` in one process before torchrun starts any (``titan_core.run.preflight``)
    #: and by the trainer before the mesh and the model, so a layout the strategy cannot run is one
    #: error line, not a failure inside every worker. It builds nothing and starts no collective;
    #: what only the built model shows stays in ``apply``.
    check: Callable[..., list[str]] | None = attrs.field(
        default=None, validator=lambda _i, _a, v: v is None or _callable("Strategy.check", v)
    )


#: The parallel dimensions a :class:`Strategy` can handle (the ``parallelism`` degrees).
PARALLEL_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def _an_int(what: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__} {value!r}")


def _parallel_dims(value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise TypeError(f"Strategy.handles: expected a tuple of dimension names, got {value!r}")
    unknown = [v for v in value if v not in PARALLEL_DIMS]
    if unknown:
        raise ValueError(
            f"Strategy.handles: {', '.join(map(repr, unknown))} is not a parallel dimension; "
            f"the dimensions: {', '.join(PARALLEL_DIMS)}"
        )


@attrs.frozen
class CommBackend:
    """How a run reaches its peers: builds the :class:`~titan_core.topology.Topology`."""

    name: str
    #: ``init(config) -> Topology``; initialises process groups (or fakes them).
    init: Callable[[TrainerConfig], Topology] = attrs.field(validator=_function("CommBackend.init"))
    description: str = attrs.field(default="", converter=_text("CommBackend.description"))
    #: Environment variables this backend reads that no backend without them does
    #: (``FAKE_PP_RANK`` for ``fake``). A run whose backend does not declare one of them while it
    #: is set (not blank) is refused before anything starts: it would ignore the variable without
    #: a word, and the user would believe, say, a pipeline rank was simulated.
    env_vars: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _variable_names(v))
    #: Config values every run of this backend has, by field path (``{"debug.memory_report":
    #: True}``: the fake backends exist to size layouts). Set after the recipe and
    #: ``--comm-backend``, before validation, so ``--print-config`` and the run's ``config.toml``
    #: show what runs.
    sets: Mapping[str, Any] = attrs.field(factory=dict, hash=False, validator=lambda _i, _a, v: _settings(v))
    #: ``launch_check(config, processes)``, or ``None``: raises ``UsageError`` when this backend
    #: cannot run as ``processes`` launched processes (the fake backend is one plain process; a
    #: hybrid one needs one per pipeline rank). Called before any process group starts: by
    #: ``run_train.sh`` before torchrun starts ``NGPU`` processes, and by each process
    #: (``WORLD_SIZE``) before ``init``. Keep it torch-free: the launcher's check is one cheap
    #: process.
    launch_check: Callable[[TrainerConfig, int], None] | None = attrs.field(
        default=None, validator=_optional("CommBackend.launch_check")
    )
    #: Whether this backend's runs simulate peers (its topologies' ``simulated`` dimensions):
    #: their losses are not results, so another layout in the same dump folder is not another
    #: run even where it changes the sequences of a step (the fake backends size layouts one
    #: after another in one folder).
    simulates_peers: bool = False


def _settings(value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"CommBackend.sets: expected a mapping of config field paths to values "
            f"({{'debug.memory_report': True}}), got {value!r}"
        )


def _variable_names(value: Any) -> None:
    # A bare string would be read as its letters, each a "variable" nobody sets.
    if isinstance(value, str) or not all(isinstance(v, str) and v.strip() for v in value):
        raise TypeError(f"CommBackend.env_vars: expected a tuple of variable names, got {value!r}")


@attrs.frozen
class Dataset:
    """A source of text documents for the language-modelling data loader."""

    name: str
    #: ``documents(data_config) -> Iterable[str]``: yields documents in a fixed order; called
    #: with the ``data`` section once per epoch (and per validation when validation reads it),
    #: so each call returns a new iterable of the same documents in the same order (a resume
    #: re-reads them to skip what the saved steps consumed): not one shared iterator.
    documents: Callable[[Data], Iterable[str]] = attrs.field(validator=_function("Dataset.documents"))
    description: str = attrs.field(default="", converter=_text("Dataset.description"))
    #: ``held_out(data_config) -> Iterable[str]``: documents that ``documents`` never yields, of
    #: the same distribution, the same ones in the same order on every call (each validation
    #: reads them from the start); used for validation when validation reads this dataset with
    #: its training path (``validation.dataset`` and ``validation.path`` unset), so the
    #: validation loss is not measured on training text. ``None``: validation then reads
    #: ``documents`` (and the trainer warns that the loss is on training text).
    held_out: Callable[[Data], Iterable[str]] | None = attrs.field(
        default=None, validator=_optional("Dataset.held_out")
    )
    #: Whether ``documents`` reads ``data.path`` (files the user names). ``False`` for a source
    #: that reads none (generated text, a fixed remote corpus): a run that sets ``data.path`` or
    #: ``validation.path`` for it is refused, instead of training or validating on something
    #: other than the files it names.
    reads_path: bool = True


@attrs.frozen
class Checkpointer:
    """A checkpointer: ``build(config, topology) -> checkpointer`` with four methods.

    ``load(parts, optimizer, scheduler) -> (step, meta)`` restores the latest complete checkpoint
    (the one ``checkpoint.load_step`` names, when set) before step 1 and returns the last step it
    holds and the ``meta`` saved with it (``(0, {})``: start from scratch); a ``load`` that takes
    the keyword ``check_meta`` gets a callable ``check_meta(step, meta)`` to call with a
    checkpoint's meta before reading its tensors (it raises ``UsageError`` for a checkpoint of
    another model, which the trainer otherwise finds only after the load, when a load of other
    parameters has failed already); ``should_save(step, last) -> bool`` says whether step
    ``step`` is saved (interval, last step, ``load_only``); ``save(step, parts, optimizer,
    scheduler, *, last, meta)`` writes it, ``meta`` being a JSON-able dict the trainer stores
    with the checkpoint (the LR schedule's parameters, whether the loss was finite), and then
    keeps the newest ``checkpoint.keep_latest_k``; ``save_seed(parts)`` writes the initial
    weights (``checkpoint.create_seed_checkpoint``; one that takes the keyword ``meta`` gets the
    model record to store with them, which ``check_meta`` then sees). ``parts`` is this rank's
    list of
    model parts. The trainer never calls ``save`` with non-finite weights.

    Optional: ``loaded_seed() -> str | None``, the path of the seed checkpoint (initial weights,
    no step) that the last ``load`` restored, wherever this checkpointer keeps it, or ``None``.
    A run that also names ``checkpoint.initial_load_path`` is refused unless that is the same
    path (the trainer would read those weights over the seed's). Without the method, a ``load``
    that returned step 0 with a non-empty ``meta`` counts as a seed of unknown path, and any
    ``initial_load_path`` beside it is refused.
    """

    name: str
    build: Callable[[TrainerConfig, Topology], Any] = attrs.field(validator=_function("Checkpointer.build"))
    description: str = attrs.field(default="", converter=_text("Checkpointer.description"))
    #: ``launch_check(config, processes)``, or ``None``: raises ``UsageError`` for a config this
    #: checkpointer refuses when the run has ``processes`` processes (a seed checkpoint is
    #: written by one). Called before any process group starts: by ``run_train.sh`` before
    #: torchrun starts ``NGPU`` processes, and by each process (``WORLD_SIZE``) before its comm
    #: backend starts; torch-free, so that the launcher's check stays cheap.
    launch_check: Callable[[TrainerConfig, int], None] | None = attrs.field(
        default=None, validator=_optional("Checkpointer.launch_check")
    )
    #: ``verify(path, rank, world_size) -> str | None``, or ``None``: why a checkpoint folder
    #: this checkpointer wrote cannot be trusted (an unfinished save, damaged data, a save after
    #: a non-finite loss), ``None`` for a sound one or a folder it did not write. Called on every
    #: rank together (it may use collectives on the default group when ``world_size > 1``)
    #: before ``checkpoint.initial_load_path`` loads a folder, which a resume's own checks do
    #: not cover. Optional keyword ``check_meta``: a ``verify`` that takes it calls
    #: ``check_meta(step, meta)`` with the ``meta`` stored with a sound folder it wrote (what
    #: ``save`` or ``save_seed`` got); the trainer compares its model record with the run's as a
    #: resume does and warns naming what differs (another ``rope_theta`` keeps every shape). The
    #: trainer passes it only where ``verify``'s signature names it, so a ``verify`` without it
    #: keeps working (the trainer then cannot tell another model of the same shapes).
    verify: Callable[[str, int, int], str | None] | None = attrs.field(
        default=None, validator=_optional("Checkpointer.verify")
    )
    #: What it writes inside ``checkpoint.folder``, as glob patterns of the entries at its top
    #: (``"step-[0-9]"``: a step folder, its unfinished saves). ``--overwrite`` removes only
    #: these from the checkpoint folder: whatever else a user keeps there (notes, an exported
    #: model, another tool's files) stays. Make them match no name a user would choose. Empty:
    #: titan cannot tell the checkpointer's files from others, and refuses ``--overwrite`` over
    #: a checkpoint folder that holds anything (removing nothing would leave stale checkpoints
    #: that a later run resumes from).
    outputs: tuple[str, ...] = attrs.field(
        default=(),
        validator=lambda _i, _a, v: _output_patterns(v, "Checkpointer.outputs", "checkpoint.folder"),
    )
    #: Which of ``outputs`` hold seed checkpoints (the dcp one: ``"step-0"``), as glob patterns
    #: of the same kind. A seed is written by a seed run (``create_seed_checkpoint``) and is the
    #: input of the runs that start from it: ``--overwrite`` of such a run keeps it (it would
    #: otherwise start over from fresh weights); ``--overwrite`` of the seed run itself removes
    #: it with that run's other outputs.
    seeds: tuple[str, ...] = attrs.field(
        default=(),
        validator=lambda _i, _a, v: _output_patterns(v, "Checkpointer.seeds", "checkpoint.folder"),
    )


@attrs.frozen
class Callback:
    """Code run at fixed points of the training loop: ``build(trainer) -> object | None``.

    ``build`` is called once, after the model, optimizer and data are built and a checkpoint is
    loaded; it returns ``None`` when the callback has nothing to do in this run (then the loop
    never sees it). The object implements any of these methods (all optional); the trainer binds
    them once, so the loop pays nothing for a method a callback lacks:

    - ``on_train_start(step)``: before the first step (``step``: the last finished one);
    - ``before_forward_backward(step)`` / ``after_forward_backward(step)``;
    - ``after_optimizer_step(step)``;
    - ``metrics(step) -> Mapping[str, float]``: on logging steps only, extra values for the log
      line and the metric writers (read device values here, never on other steps);
    - ``on_step_end(step, metrics, last)``: after every step; ``metrics`` is the logged row on
      logging steps and empty otherwise, read-only (the metric writers read it after this
      callback: report values through ``metrics``, or change a copy); ``last`` is true on the
      final step;
    - ``on_train_end(step)``: after the last step of a completed run;
    - ``on_failure(step, exc)``: an exception left the loop (it is re-raised afterwards).

    Callbacks run in ascending ``order`` (ties by name).
    """

    name: str
    build: Callable[[Any], Any] = attrs.field(validator=_function("Callback.build"))
    order: int = attrs.field(default=50, validator=lambda _i, _a, v: _an_int("Callback.order", v))
    description: str = attrs.field(default="", converter=_text("Callback.description"))
    #: Files and folders it writes at the top of ``job.dump_folder``, as glob patterns
    #: (``"my_report_rank*.json"``): ``--overwrite`` removes them with the earlier run's own
    #: outputs, which would otherwise stay beside the new run's as if they were its.
    outputs: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _output_patterns(v))
    #: Core config fields this callback implements (``"debug.memory_report"``): a run that sets
    #: one of them while no loaded callback serves it is refused, instead of ignoring it.
    serves: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _field_paths(v))


def _field_paths(value: Any) -> None:
    if isinstance(value, str) or not all(isinstance(v, str) and "." in v for v in value):
        raise TypeError(
            f"Callback.serves: expected a tuple of config field paths like 'debug.x', got {value!r}"
        )


def _output_patterns(value: Any, what: str = "outputs", folder: str = "the dump folder") -> None:
    # A bare string would be read as its letters; a '/' or '..' would reach outside ``folder``.
    bad = [p for p in value if not isinstance(p, str) or not p.strip("./") or "/" in p]
    if isinstance(value, str) or bad:
        raise TypeError(
            f"{what}: expected a tuple of file or folder name patterns at the top of {folder} "
            f"(like 'my_report_rank*.json': no '/', not '.' or '..'), got {value!r}"
        )


@attrs.frozen
class Command:
    """A ``titan`` subcommand: ``titan NAME ...``.

    ``configure(parser)`` adds the command's arguments (or its own subcommands) to an
    ``argparse`` parser and must not import torch (``titan --help`` builds every command's
    parser); ``run(args) -> int | None`` does the work and returns the exit status, an int from
    0 to 255 (0: success) or ``None`` (success); anything else (a string, ``True``, ``256``) is
    refused with one error naming the command and its plugin. It may raise
    :class:`~titan_core.errors.TitanError` for a clean one-line error; any other exception is one
    error naming the command, its plugin and the line that raised, not a traceback.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None] = attrs.field(
        validator=_function("Command.configure")
    )
    run: Callable[[argparse.Namespace], int | None] = attrs.field(validator=_function("Command.run"))
    description: str = attrs.field(default="", converter=_text("Command.description"))


@attrs.frozen
class RunOption:
    """A flag of ``titan run`` that runs something else with the resolved config.

    ``flag`` (``"--all-pp-ranks"``) is a boolean option; when given, ``run(config, registry,
    args) -> int | None`` is called instead of training, with the resolved config. Its return
    value is the process's exit status, as a :class:`Command`'s: an int from 0 to 255 (0:
    success) or ``None`` (success); anything else is refused with one error naming the run
    option and its plugin. A :class:`~titan_core.errors.TitanError` it raises is its clean
    one-line error; any other exception is one error naming the option, its plugin and the line
    that raised, not a traceback.
    """

    name: str
    flag: str = attrs.field(validator=lambda _i, _a, v: _flag(v))
    help: str
    run: Callable[[TrainerConfig, Any, argparse.Namespace], int | None] = attrs.field(
        validator=_function("RunOption.run")
    )
    description: str = attrs.field(default="", converter=_text("RunOption.description"))
    #: What it writes at the top of ``job.dump_folder``, as :attr:`Callback.outputs`.
    outputs: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _output_patterns(v))


def _flag(value: Any) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"--[A-Za-z0-9][A-Za-z0-9-]*", value):
        raise ValueError(f"RunOption.flag: expected a long option like '--my-report', got {value!r}")


@attrs.frozen
class ConfigSection:
    """A config section a plugin adds: ``config.<name>.<field>`` in recipes and TOML.

    ``cls`` is an attrs class made with :func:`titan_core.config.section` (defaults for every
    field, ``#:`` docs beside the fields, validators on them); the section appears in
    ``--print-config`` and ``docs/config.md``.
    """

    name: str
    cls: type
    description: str = attrs.field(default="", converter=_text("ConfigSection.description"))
    #: ``check(config) -> list[str]``: problems that span several fields (``"section.field:
    #: message"`` each), run once after the recipe returns; single fields use validators.
    check: Callable[[TrainerConfig], list[str]] | None = attrs.field(
        default=None, validator=_optional("ConfigSection.check")
    )
    #: Fields whose values change what a run computes (its losses and weights), like
    #: ``training.lr``: they join the run's identity (``run.json``), so a rerun into the same
    #: dump folder that changes one is another run, refused instead of replacing the outputs.
    #: The other fields are operational (logging, profiling): changing them is the same run.
    results: tuple[str, ...] = attrs.field(
        default=(), converter=_names("ConfigSection.results", "field names")
    )


#: Every record type, keyed by the registry key used in ``titan plugins list``.
RECORD_TYPES: dict[str, type] = {
    "models": ModelSpec,
    "recipes": Recipe,
    "strategies": Strategy,
    "comm_backends": CommBackend,
    "datasets": Dataset,
    "checkpointers": Checkpointer,
    "callbacks": Callback,
    "commands": Command,
    "run_options": RunOption,
    "config_sections": ConfigSection,
}

__all__ = [
    "RECORD_TYPES",
    "Callback",
    "Checkpointer",
    "CommBackend",
    "Command",
    "ConfigSection",
    "Dataset",
    "ModelSpec",
    "Recipe",
    "RunOption",
    "StateDictAdapter",
    "Strategy",
]
