"""Pipeline parallelism: split the model into stages and drive them with a PyTorch schedule.

The model is split at its transformer blocks (``model.layers``, an ``nn.ModuleDict``): every
stage is a copy of the (meta) model that keeps a contiguous run of blocks; the first stage also
keeps ``ModelSpec.first_stage_modules`` (``tok_embeddings``), the last ``last_stage_modules``
(``norm`` and ``output``), and the others set them to ``None`` (titan's decoder protocol: a
middle stage takes and returns hidden states). Any other top-level module with parameters is
refused: every stage would hold a copy of it. Blocks keep
their names, so state-dict keys are the same as in the whole model and a full seed checkpoint
loads into any stage.

A PP rank holds one stage for single-stage schedules (``GPipe``, ``1F1B``) and two for the
multi-stage ones (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``, placed in a loop:
rank ``r`` holds ``r, r + pp, ...``; ``ZBVZeroBubble``/``DualPipeV``, placed in a V: rank ``r``
holds ``r`` and ``2*pp - 1 - r``); ``parallelism.pp_stages_per_rank`` overrides the count.

What the config, the degrees and the model's arguments show is checked before anything is built
(:func:`check`, the strategy's ``Strategy.check``: ``run_train.sh`` runs it before torchrun starts
a process): the schedule's name, the stages per rank it runs, a block for every stage (from the
model argument ``n_layers``, when the model has one), tied embeddings, and the microbatches the
local batch and the schedule allow. :func:`apply` still refuses what only the built model shows
(no ``layers``, fewer blocks than stages), and a layout the schedule's constructor rejects for a
reason :func:`check` does not know.

Loss and logging: each microbatch's loss is divided by the number of microbatches before its
backward (so gradients are those of the whole batch's mean loss, with no rescaling pass), the
last stage adds them up, and the step broadcasts that loss over the PP group. Every PP rank thus
returns the same loss and its ``step`` log line carries it, whichever rank ``LOG_RANK`` shows.

Validation runs the schedule forward only (``schedule.eval``: no backward, no gradients, no
gradient reduction under FSDP), with the same loss and broadcast as a training step.
"""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import attrs

from titan_core.errors import PluginError, UsageError
from titan_plugins_parallel.config import checkpoints_whole_blocks

if TYPE_CHECKING:
    import torch
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext
    from titan_core.records import ModelSpec

#: Schedules whose stages sit in a V (rank r holds stages r and 2*pp-1-r).
_V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    """Whenever the pipeline degree is above 1."""
    return parallel_dims.pp > 1


#: The schedules a run can name (``get_schedule_class`` also maps two base classes).
_SCHEDULE_NAMES = "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV"


def schedule_class(name: str) -> type:
    """The torch.distributed.pipelining schedule class called ``name`` (clear error otherwise)."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        get_schedule_class,
    )

    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise UsageError(
            f"parallelism.pp_schedule={name!r} is not a schedule of torch.distributed.pipelining; "
            f"use {_SCHEDULE_NAMES}"
        ) from None
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        # torch maps its base classes' names too; neither has an order of actions of its own
        # (Single is abstract, Multi's order is empty): every rank stopped at step 1 with
        # "Can't instantiate abstract class" or a bare KeyError.
        raise UsageError(
            f"parallelism.pp_schedule={name!r} names {cls.__name__}, the base class of torch's "
            f"{'single' if cls is PipelineScheduleSingle else 'multi'}-stage schedules, which "
            f"has no order of its own to run; use {_SCHEDULE_NAMES}"
        )
    return cls


def is_single_stage(cls: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


def stages_per_rank(cls: type, configured: int | None) -> int:
    if is_single_stage(cls):
        if configured not in (None, 1):
            raise UsageError(
                f"parallelism.pp_stages_per_rank={configured}, but {cls.__name__} runs one stage "
                "per rank; set it to 1 (or None), or pick a multi-stage schedule such as Interleaved1F1B"
            )
        return 1
    if cls.__name__ in _V_SCHEDULES:
        if configured not in (None, 2):
            raise UsageError(
                f"parallelism.pp_stages_per_rank={configured}, but {cls.__name__} places exactly "
                "two stages per rank in a V; set it to 2 (or None)"
            )
        return 2
    return configured or 2


def stage_ids_of(pp_rank: int, pp: int, per_rank: int, v_style: bool) -> list[int]:
    """Stage indices a PP rank holds, in execution order."""
    if v_style:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def split_layers(names: list[str], num_stages: int) -> list[list[str]]:
    """Contiguous runs of block names, one per stage; earlier stages take the remainder."""
    base, extra = divmod(len(names), num_stages)
    runs, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        runs.append(names[start : start + size])
        start += size
    return runs


def _pp_rank(ctx: ParallelContext) -> int:
    return ctx.parallel_dims.coordinates(ctx.topology.rank)["pp"]


@attrs.frozen
class StagePlan:
    """Which stages this PP rank holds (kept in ``ctx.state["pp"]`` for the schedule)."""

    ids: list[int]
    num_stages: int

    @property
    def has_first(self) -> bool:
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.ids


def stage_end_problems(spec: Any) -> list[str]:
    """What the spec's stage ends show wrong without a model: ``layers`` named as an end (its
    blocks are split across the stages, and a stage drops its ends whole), and a module named in
    both lists, which every stage would drop (each one is not first or not last), so the model
    would train without it."""
    first, last = tuple(spec.first_stage_modules), tuple(spec.last_stage_modules)
    problems = [
        f"ModelSpec.{field} names layers, the blocks of model {spec.name!r}, which pipeline "
        "parallelism splits across the stages (a stage drops its ends whole); remove layers from "
        "it, and name only the modules before the blocks (first_stage_modules) or after them "
        "(last_stage_modules)"
        for field, names in (("first_stage_modules", first), ("last_stage_modules", last))
        if "layers" in names
    ]
    if both := [n for n in first if n in last]:
        it = "it" if len(both) == 1 else "them"
        problems.append(
            f"ModelSpec.first_stage_modules and last_stage_modules both name {', '.join(both)} of "
            f"model {spec.name!r}: pipeline parallelism would drop {it} from every stage (a stage "
            "that is not the first drops the first-stage modules, one that is not the last the "
            f"last-stage ones), so the model would train without {it}; name {it} in one list "
            "only: first_stage_modules if the model calls it before the blocks, "
            "last_stage_modules if after them (docs/plugins.md)"
        )
    return problems


def stage_ends(model: nn.Module, spec: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules only the first and only the last stage hold (``ModelSpec.first_stage_modules``
    and ``last_stage_modules``), checked against the built ``model``: the spec's ends are sound
    (:func:`stage_end_problems`), each named one exists, and nothing else beside ``layers`` holds
    parameters, since every stage would get a copy of it, only one copy would train, and a
    checkpoint could keep another."""
    if problems := stage_end_problems(spec):
        raise UsageError(problems[0])
    first, last = tuple(spec.first_stage_modules), tuple(spec.last_stage_modules)
    children = dict(model.named_children())
    for field, names in (("first_stage_modules", first), ("last_stage_modules", last)):
        if missing := [n for n in names if n not in children]:
            raise UsageError(
                f"ModelSpec.{field} names {', '.join(missing)}, but model {spec.name!r} has no such "
                f"module (its top-level modules: {', '.join(children)}); name the modules its "
                "pipeline stages drop as the model calls them (docs/plugins.md)"
            )
    stray = [f"parameter {n}" for n, _ in model.named_parameters(recurse=False)]
    stray += [
        f"module {n}"
        for n, m in children.items()
        if n != "layers" and n not in first + last and next(m.parameters(), None) is not None
    ]
    if stray:
        raise UsageError(
            f"model {spec.name!r} has the top-level {', '.join(stray)} with parameters that "
            "pipeline parallelism would copy to every stage (only one copy would train): name "
            "such a module in ModelSpec.first_stage_modules (used before the blocks, like a "
            "position table) or last_stage_modules (after them), or move it into a block "
            "(docs/plugins.md); or set parallelism.pp = 1"
        )
    return first, last


def _stage_module(model: nn.Module, keep: list[str], drop: tuple[str, ...]) -> nn.Module:
    """A copy of the meta model with only this stage's blocks, its ``drop`` ends set to None."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    for name in drop:
        setattr(stage, name, None)
    return stage


def stage_drops(ends: tuple[tuple[str, ...], tuple[str, ...]], first: bool, last: bool) -> tuple[str, ...]:
    """The end modules a stage that is (or is not) the first and the last sets to None."""
    head, tail = ends
    return (() if first else head) + (() if last else tail)


def name_contract_breaks(
    stage: nn.Module, model: str, stage_id: int, num_stages: int, dropped: tuple[str, ...]
) -> None:
    """Make a stage's forward that calls a module this stage dropped fail naming the contract.

    The model's own code raises there (``'NoneType' object is not callable``), inside the
    schedule, far from the cause: its forward does not skip the ``None`` ends (docs/plugins.md).
    Every other error of the model's passes through unchanged."""
    forward = stage.forward

    @functools.wraps(forward)  # keeps the signature the schedule inspects (``input_tokens``)
    def forward_of_stage(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except (TypeError, AttributeError) as exc:  # calling it, or reading its weight
            text = str(exc)
            if (
                "'NoneType' object is not callable" not in text
                and "'NoneType' object has no attribute" not in text
            ):
                raise
            raise PluginError(
                f"model {model!r} does not follow the pipeline contract: its forward called a "
                f"module that stage {stage_id} of {num_stages} does not hold ({exc}); there "
                f"{', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} None and the "
                "forward must skip them, taking and returning hidden states (docs/plugins.md, "
                "the model contract); or set parallelism.pp = 1"
            ) from exc

    stage.forward = forward_of_stage


def _too_few_blocks(blocks: int, pp: int, per_rank: int) -> str:
    return (
        f"pipeline parallel needs at least one block per stage: {blocks} blocks for "
        f"pp={pp} x {per_rank} stages per rank = {pp * per_rank} stages; lower parallelism.pp "
        "or pp_stages_per_rank, or use a deeper flavor"
    )


#: Schedules that run no fewer microbatches than stages (their constructors' ValueError).
_AT_LEAST_ONE_MICROBATCH_PER_STAGE = ("Schedule1F1B", "ScheduleDualPipeV")
#: Schedules whose microbatches must be a multiple of their rounds, ``max(1, n // pp)``.
_MICROBATCHES_IN_ROUNDS = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")


def schedule_problem(cls: type, n_microbatches: int, num_stages: int, pp: int) -> str | None:
    """Why the schedule ``cls`` would reject ``n_microbatches`` over ``num_stages`` stages (its
    constructor's ValueError, known before any stage exists), or ``None``."""
    name = cls.__name__.removeprefix("Schedule")
    if cls.__name__ in _AT_LEAST_ONE_MICROBATCH_PER_STAGE and n_microbatches < num_stages:
        return (
            f"parallelism.pp_schedule={name} needs at least as many microbatches as stages "
            f"({num_stages}), got parallelism.pp_microbatches={n_microbatches}; raise "
            f"pp_microbatches to at least {num_stages} (a divisor of training.local_batch_size), "
            "or use GPipe"
        )
    rounds = max(1, n_microbatches // pp)
    if cls.__name__ in _MICROBATCHES_IN_ROUNDS and n_microbatches % rounds:
        return (
            f"parallelism.pp_schedule={name} runs microbatches in rounds of pp={pp} and needs "
            f"their number to be a multiple of its {rounds} rounds, got parallelism.pp_microbatches="
            f"{n_microbatches}; set pp_microbatches to a multiple of {pp}, or to at most {pp}"
        )
    return None


def check(config: TrainerConfig, parallel_dims: ParallelDims, spec: ModelSpec, model_args: Any) -> list[str]:
    """``Strategy.check``: what the config, the degrees and the model's arguments show of the
    pipeline (the schedule, its stages, a block for each, the microbatches), before anything is
    built."""
    from titan_core.layout import model_arg

    p = config.parallelism
    pp = parallel_dims.pp
    try:
        cls = schedule_class(p.pp_schedule)
        per_rank = stages_per_rank(cls, p.pp_stages_per_rank)
    except UsageError as exc:  # the rest depends on the schedule
        return [str(exc)]
    num_stages = pp * per_rank
    problems = []
    blocks = model_arg(model_args, "n_layers")
    if isinstance(blocks, int) and blocks < num_stages:
        problems.append(_too_few_blocks(blocks, pp, per_rank))
    if model_arg(model_args, "tie_embeddings", False):
        problems.append(_TIED)
    problems += stage_end_problems(spec)  # the spec alone shows them: refuse before launch
    try:
        n_micro = microbatches(config, num_stages)
    except UsageError as exc:
        return [*problems, str(exc)]
    if (problem := schedule_problem(cls, n_micro, num_stages, pp)) is not None:
        problems.append(problem)
    if (problem := _v_schedule_on_gloo_problem(cls, config)) is not None:
        problems.append(problem)
    problems += _split_backward_problems(cls, config)
    return problems


#: Schedules that run a stage's backward as two autograd passes over the same graph: input
#: gradients first (sent upstream at once), weight gradients later (the zero-bubble "W" actions).
_SPLIT_BACKWARD = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _split_backward_problems(cls: type, config: Any) -> list[str]:
    """What cannot run a backward in two passes: both stopped step 1 on every rank (exit 1).

    A compiled block's backward is one opaque autograd node, which the input-gradient pass cannot
    split from the weights' (``Failed to run stage backward input``; pytorch#161904, whose check
    in torch sees only a compiled stage root, not titan's blocks compiled in place). The op
    policy's selective checkpoint allows one backward per recomputed region (``Trying to
    backward an extra time``). A whole-block checkpoint (``full``, or an integer option)
    recomputes for each pass and gives one process's steps, but not with the checkpoint's
    ``debug`` recording: the weight-gradient pass raised a checkpoint error, and torch's debug
    report of it failed in turn (``AttributeError: '_GeneratorContextManager' object has no
    attribute 'args'``), at step 1 on every rank."""
    if cls.__name__ not in _SPLIT_BACKWARD:
        return []
    name = cls.__name__.removeprefix("Schedule")
    problems = []
    if getattr(getattr(config, "compile", None), "enable", False):
        problems.append(
            f"compile.enable: parallelism.pp_schedule={name} splits each stage's backward into an "
            "input-gradient and a weight-gradient pass, which a compiled block's backward (one "
            "graph) cannot run; set compile.enable = False, or use Interleaved1F1B (or 1F1B)"
        )
    ac = getattr(config, "activation_checkpoint", None)
    if ac is not None and ac.mode == "selective" and ac.selective_ac_option == "op":
        problems.append(
            f"activation_checkpoint.selective_ac_option: 'op' under parallelism.pp_schedule={name}, "
            "which splits each stage's backward into an input-gradient and a weight-gradient pass: "
            "the op policy allows one backward per recomputed block; use mode 'full' or an "
            "integer selective_ac_option (whole blocks), or Interleaved1F1B (or 1F1B)"
        )
    # (The op policy with debug is refused by the config's check.)
    if ac is not None and checkpoints_whole_blocks(ac) and ac.debug:
        problems.append(
            f"activation_checkpoint.debug: parallelism.pp_schedule={name} splits each stage's "
            "backward into an input-gradient and a weight-gradient pass, which the checkpoint's "
            "debug recording cannot follow (the second pass stopped step 1); set "
            "activation_checkpoint.debug = False, or debug the recomputation under Interleaved1F1B "
            "(or 1F1B)"
        )
    return problems


def _v_schedule_on_gloo_problem(cls: type, config: TrainerConfig) -> str | None:
    """torch 2.11's V-schedule start-up sends from each stage to its neighbours, the rank's own
    other stage included, and gloo has no connection to itself: the run ended at step 1 with
    gloo's "Pair is not connected" and a peer-died error (torch 2.13 starts it without)."""
    import torch

    if cls.__name__ not in _V_SCHEDULES or config.comm.backend == "fake":  # fake: no gloo pairs
        return None
    if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        return None
    if config.training.device != "cpu" and torch.cuda.is_available():  # NCCL
        return None
    name = cls.__name__.removeprefix("Schedule")
    return (
        f"parallelism.pp_schedule={name} on the CPU (gloo) needs torch 2.13 or newer: torch "
        f"{torch.__version__} starts a V schedule by sending from each stage to the rank's own other "
        "stage, which gloo cannot; use 1F1B or Interleaved1F1B here, or a newer torch"
    )


_TIED = (
    "tied input/output embeddings cannot be split across pipeline stages; "
    "set parallelism.pp = 1 or use a flavor with tie_embeddings=False"
)


def microbatches(config: Any, num_stages: int) -> int:
    p, batch = config.parallelism, config.training.local_batch_size
    n = p.pp_microbatches or num_stages
    if batch % n:
        raise UsageError(
            f"parallelism.pp_microbatches={n}{' (the number of stages)' if not p.pp_microbatches else ''} "
            f"must divide training.local_batch_size={batch}; set pp_microbatches to a divisor of "
            "the local batch size, or change the batch size"
        )
    return n


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    """Split the one meta model into this rank's stages; the schedule replaces forward/backward
    (:func:`check` passed before anything was built)."""
    (model,) = parts
    p = ctx.config.parallelism
    pp = ctx.parallel_dims.pp
    cls = schedule_class(p.pp_schedule)
    per_rank = stages_per_rank(cls, p.pp_stages_per_rank)
    num_stages = pp * per_rank
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(layers, "keys"):
        raise UsageError(
            f"model {ctx.spec.name!r} has no `layers` ModuleDict, so it cannot be split into "
            "pipeline stages; set parallelism.pp = 1"
        )
    names = list(layers.keys())
    if len(names) < num_stages:  # a model whose arguments have no n_layers: check could not tell
        raise UsageError(_too_few_blocks(len(names), pp, per_rank))
    n_micro = microbatches(ctx.config, num_stages)
    runs = split_layers(names, num_stages)
    ids = stage_ids_of(_pp_rank(ctx), pp, per_rank, cls.__name__ in _V_SCHEDULES)
    ends = stage_ends(model, ctx.spec)
    stages = []
    for sid in ids:
        drop = stage_drops(ends, sid == 0, sid == num_stages - 1)
        stages.append(_stage_module(model, runs[sid], drop))
        name_contract_breaks(stages[-1], ctx.spec.name, sid, num_stages, drop)

    plan = StagePlan(ids, num_stages)
    ctx.state["pp"] = plan
    ctx.computes_loss = plan.has_last
    ctx.replace_forward_backward(
        "pp", lambda parts, loss_fn: Pipeline(parts, loss_fn, ctx, cls, plan, n_micro)
    )
    return stages


class Pipeline:
    """One training step through the schedule: ``step(inputs, labels, kwargs) -> loss | None``.

    The object is the trainer's step function (calling it is ``step``); ``evaluate`` is the
    forward-only step validation uses (``ParallelContext.replace_forward_backward``).

    ``kwargs`` are per-step forward arguments that are the same for every sample (context
    parallel's ``positions``); every stage's forward receives them through a pre-hook, since the
    schedule would otherwise split them like the batch.

    A stage whose ``forward`` takes the keyword ``input_tokens`` gets the token ids of each
    microbatch under it, on every stage: the schedule splits that keyword like the batch and
    hands it to each stage's forward. A stage after the first sees hidden states only, and the
    ids are what a document mask comes from (``titan_core.blocks.stage_inputs``). The ids are
    ``kwargs["input_tokens"]`` when a batch transform gave them (context parallel: the whole
    sequences, where ``inputs`` is this rank's shard), else ``inputs``.
    """

    def __init__(
        self,
        parts: list[nn.Module],
        loss_fn: Any,
        ctx: ParallelContext,
        cls: type,
        plan: StagePlan,
        n_microbatches: int,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.ctx = ctx
        self.plan = plan
        num_stages = plan.num_stages
        self.group = ctx.topology.group("pp", ctx.mesh)
        self.n_microbatches = n_microbatches
        self._step_kwargs: dict[str, Any] = {}
        self._passes_tokens = all("input_tokens" in inspect.signature(p.forward).parameters for p in parts)
        for part in parts:
            part.register_forward_pre_hook(self._add_step_kwargs, with_kwargs=True)
        from titan_plugins_parallel.fake_pipeline import peers_simulated, simulated_peer_stages

        if peers_simulated(ctx):  # the PP peers are simulated: none can tell a stage its shapes
            self.stages = simulated_peer_stages(parts, ctx, plan, n_microbatches, self.group)
        else:
            self.stages = [
                PipelineStage(part, sid, num_stages, ctx.topology.device, group=self.group)
                for part, sid in zip(parts, plan.ids, strict=True)
            ]

        def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Mean over microbatches: grads then equal the whole batch's, without rescaling.
            return loss_fn(output, target) / n_microbatches

        options: dict[str, Any] = {"n_microbatches": n_microbatches, "loss_fn": scaled_loss}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            options["scale_grads"] = False
        try:
            self.schedule = cls(self.stages[0] if is_single_stage(cls) else self.stages, **options)
        except ValueError as exc:  # a rule of the schedule's that check() does not know
            raise UsageError(
                f"parallelism.pp_schedule={cls.__name__.removeprefix('Schedule')} rejects this "
                f"layout ({exc}); change parallelism.pp_microbatches (now {n_microbatches})"
            ) from None
        dtype = ctx.config.training.dtype
        self._autocast = dtype == "bfloat16" and not ctx.mixed_precision_applied
        # The rank holding the last stage, in global numbering, for the loss broadcast.
        self.v_style = cls.__name__ in _V_SCHEDULES
        if self.v_style:
            for stage in self.stages:
                _skip_local_gradient_handoff_without_backward(stage)
        self._last_rank = self._rank_of_last_stage(num_stages)

    def _add_step_kwargs(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self._step_kwargs:
            return None
        return args, {**kwargs, **self._step_kwargs}

    def _rank_of_last_stage(self, num_stages: int) -> int | None:
        """Global rank of the PP peer holding the last stage (``None``: no broadcast)."""
        import torch.distributed as dist

        if self.group is None or self._broadcast_skipped():
            return None
        pp = self.ctx.parallel_dims.pp
        holder = 0 if self.v_style else (num_stages - 1) % pp
        return dist.get_global_rank(self.group, holder)

    def _broadcast_skipped(self) -> bool:
        # Simulated PP peers: nothing would arrive, keep None off the last stage.
        return "pp" in self.ctx.topology.simulated

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        return self.step(inputs, labels, kwargs)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """Forward and backward of every microbatch; the batch's loss on every PP rank."""
        return self._run(self.schedule.step, inputs, labels, kwargs)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """The forward alone (``schedule.eval``); the loss ``step`` would return for this batch.

        The schedule's own switch, not a second schedule: the stages, their buffers and the
        loss function (scaling included) are the training step's. Validation calls it only
        after a training step, so the backward is set up before the first eval (pytorch#162822:
        torch 2.9 left it unset when a schedule evaluated first).
        """
        return self._run(self.schedule.eval, inputs, labels, kwargs)

    def _run(self, run: Any, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        import torch
        import torch.distributed as dist

        ctx = self.ctx
        # Context parallel passes the whole sequences' token ids (its shards' document masks need
        # every position): split by microbatch like the batch, not handed whole to every stage.
        kwargs = dict(kwargs)
        tokens = kwargs.pop("input_tokens", inputs)
        self._step_kwargs = kwargs
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.plan.has_first else ()
        target = labels if self.plan.has_last else None
        # Every rank loads the batch, so each stage can get its microbatch's token ids.
        split = {"input_tokens": tokens} if self._passes_tokens else {}
        with ExitStack() as stack:
            if self._autocast:
                stack.enter_context(torch.autocast(ctx.topology.device.type, dtype=torch.bfloat16))
            run(*args, target=target, losses=losses, **split)
        self._step_kwargs = {}
        loss = torch.stack([_plain(x) for x in losses]).sum() if self.plan.has_last else None
        if self._last_rank is None:
            return loss
        if loss is None:
            loss = torch.zeros((), device=ctx.topology.device)
        loss = loss.float().contiguous()
        dist.broadcast(loss, src=self._last_rank, group=self.group)
        return loss


def _skip_local_gradient_handoff_without_backward(stage: Any) -> None:
    """Let a V schedule's forward-only ``eval`` pass a stage's backward actions.

    Rank 0 of a V holds the first and the last stage, and rank ``r`` two adjacent ones; the
    schedule hands a stage's input gradients to the rank's other stage in memory
    (``get_local_bwd_output`` / ``set_local_bwd_input``) instead of a send. ``schedule.eval``
    keeps the backward actions, skipping their computation (``has_backward`` off), but torch
    (2.13) still makes that handoff, whose methods assert ``has_backward``: validation stopped
    the run at its first batch (``can't steal_bwd_input if this stage doesn't have backward``).
    Without a backward there is no gradient to hand over, so the handoff does nothing then."""
    get_output = getattr(stage, "get_local_bwd_output", None)
    set_input = getattr(stage, "set_local_bwd_input", None)
    if get_output is None or set_input is None:
        return

    def get_local_bwd_output(mb_index: int) -> Any:
        return () if not stage.has_backward else get_output(mb_index)

    def set_local_bwd_input(outputs: Any, mb_index: int) -> None:
        if stage.has_backward:
            set_input(outputs, mb_index)

    stage.get_local_bwd_output = get_local_bwd_output
    stage.set_local_bwd_input = set_local_bwd_input


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (a DTensor loss under loss parallel is replicated)."""
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.detach()
