"""Tensor parallelism with sequence parallelism and loss parallelism, from the model's TP plan.

The model plugin owns the plan (``ModelSpec.tp_plan(model, tp_mesh, loss_parallel)``): which
linear layers are split by columns or rows and where activations are sharded along the
sequence. This strategy only checks the run can use it (:func:`check`, before anything is built)
and calls it on each model part.

Loss parallel keeps the logits sharded over the vocabulary and computes the cross-entropy on the
shards (``torch.distributed.tensor.parallel.loss_parallel``, which this strategy adds to the
step's contexts, ``ctx.step_contexts``). It is used with ``parallelism.loss_parallel`` and no pipeline
parallelism: pipeline schedules compute the loss inside their step, outside that context.

The embedding's output (sequence shards from a reduce-scatter) is an ``AsyncCollectiveTensor``,
the functional collective's not-yet-waited result. Handed to a compiled first block
(``compile.enable``), AOTAutograd's backward returns a plain tensor where DTensor's
redistribute expects its own type (``'Tensor' object has no attribute '_local_tensor'`` at
step 1), and a waiting op traced inside the block trains with a wrong gradient (torch 2.13).
So the embedding's output is waited for outside the blocks (:func:`_wait_for_the_reduce_scatter`),
which costs nothing: the first block's norm waits for it at once anyway.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext
    from titan_core.records import ModelSpec


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return parallel_dims.tp > 1


def check(config: TrainerConfig, parallel_dims: ParallelDims, spec: ModelSpec, model_args: Any) -> list[str]:
    """``Strategy.check``: the model has no TP plan, or the sequence cannot be split ``tp`` ways
    (under context parallel: the ``seq_len / cp`` tokens each CP rank holds; how the model's own
    dimensions split is the model's ``validate``)."""
    tp = parallel_dims.tp
    problems = []
    if spec.tp_plan is None:
        problems.append(
            f"parallelism.tp={tp}, but model {spec.name!r} supplies no tensor-parallel plan "
            "(ModelSpec.tp_plan); set parallelism.tp = 1 or use a model plugin with a TP plan"
        )
    seq_len, cp = config.training.seq_len, parallel_dims.cp
    if cp > 1 and seq_len % (2 * cp) == 0 and seq_len % (cp * tp):
        # CP's own check passed: each CP rank holds seq_len / cp tokens, and sequence
        # parallelism shards those over the TP ranks (gloo aborted the step, uncaught).
        problems.append(
            f"training.seq_len={seq_len} is not divisible by parallelism.cp x parallelism.tp = "
            f"{cp} x {tp} = {cp * tp}: each of the {cp} context-parallel ranks holds "
            f"{seq_len // cp} tokens of a sequence, and sequence parallelism shards them over the "
            f"{tp} TP ranks; pick a seq_len that is a multiple of {cp * tp}"
            + (f" and of 2 x cp = {2 * cp}" if (cp * tp) % (2 * cp) else "")
        )
    elif seq_len % tp:
        problems.append(
            f"training.seq_len={seq_len} is not divisible by parallelism.tp={tp}: sequence "
            "parallelism shards each sequence over the TP ranks; pick a seq_len that is a "
            "multiple of tp"
        )
    return problems


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    """The model's plan on each part (:func:`check` passed before anything was built)."""
    loss_parallel = ctx.config.parallelism.loss_parallel and ctx.parallel_dims.pp == 1
    tp_mesh = ctx.mesh["tp"]
    for part in parts:
        ctx.spec.tp_plan(part, tp_mesh, loss_parallel)
        # The modules before the blocks (the model's ``first_stage_modules``: its embedding).
        for name in ctx.spec.first_stage_modules:
            first = getattr(part, name, None)
            if first is not None:
                first.register_forward_hook(_wait_for_the_reduce_scatter)
    _refuse_plain_parameters(parts, ctx.spec, tp_mesh.size())
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

        ctx.step_contexts.append(loss_parallel_context)
    return parts


def _refuse_plain_parameters(parts: list[nn.Module], spec: ModelSpec, tp: int) -> None:
    """One :class:`PluginError` when the plan left parameters plain tensors (not DTensors).

    A plan that misses a module (a norm, a bias, a parameter added to the model later) trained
    until gradient clipping and the optimizer met both kinds in one list: every rank stopped at
    step 1 with torch's ``aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor``, naming
    neither the plan nor the parameter. ``titan_core.testing.check_model_spec`` makes the same
    check for model authors; this one is for every run."""
    from torch.distributed.tensor import DTensor

    plain = []
    for index, part in enumerate(parts):
        where = f"part {index} " if len(parts) > 1 else ""  # pipeline stages: each part's names
        plain += [f"{where}{n}" for n, p in part.named_parameters() if not isinstance(p, DTensor)]
    if not plain:
        return
    from titan_core.errors import PluginError

    shown = ", ".join(plain[:8]) + (f" and {len(plain) - 8} more" if len(plain) > 8 else "")
    raise PluginError(
        f"{_model_label(spec)}: ModelSpec.tp_plan left {len(plain)} parameters plain (torch.Tensor, "
        f"not DTensor) on the {tp}-rank TP mesh: {shown}; the optimizer and gradient clipping "
        "cannot mix them with the DTensor parameters. The model plugin must add them to the plan "
        "(e.g. SequenceParallel() for a norm, ColwiseParallel()/RowwiseParallel() for a linear) or "
        "replicate them (distribute_module(module, tp_mesh), a Replicate() placement); "
        "titan_core.testing.check_model_spec finds this without a run. Meanwhile train with "
        "parallelism.tp = 1"
    )


def _model_label(spec: ModelSpec) -> str:
    """``model 'x' (plugin p, dist 1.0)``: the model's plugin, from titan's registry, when it
    provides a model of that name; else ``model 'x'``."""
    from titan_core import get_registry

    registry = get_registry()
    if spec.name.lower() in registry.records("models"):
        return registry.label("models", spec.name)
    return f"model {spec.name!r}"


def _wait_for_the_reduce_scatter(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of the embedding: its ``AsyncCollectiveTensor`` output as a plain tensor,
    autograd-connected (see the module docstring); any other output unchanged."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        return _waited()(output)
    return output


@functools.cache
def _waited() -> Any:
    """``apply`` of an autograd function that waits for an ``AsyncCollectiveTensor`` (forward) and
    passes the gradient through (backward): no copy. Built on first use: this module imports
    torch lazily (its ``check`` runs before launch)."""
    import torch

    class Waited(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, pending: torch.Tensor) -> torch.Tensor:
            return pending.trigger_wait()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    return Waited.apply
