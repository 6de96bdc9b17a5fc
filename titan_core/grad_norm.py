"""Gradient-norm clipping and loss reduction across parallel ranks.

Gradients may be plain tensors or DTensors on different meshes (FSDP only, TP only, both); each
group of one mesh and placement gets its norm through DTensor (which reduces partial sums), and
pipeline stages add their squared norms over the PP group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from titan_core.parallelize import ParallelContext


class _SequentialAllReduceAdvice(logging.Filter):
    """Drops torch's advice to flatten the mesh for the norm's sequential all-reduces.

    A gradient sharded over two mesh dimensions (expert FSDP x EP: ``efsdp``, ``ep``; FSDP x TP:
    ``dp_shard_cp``, ``tp``) has a norm partial over both, which DTensor reduces with one
    all-reduce per dimension and a warning that this "may give inconsistent results between
    ranks". It cannot here: one all-reduce gives all ranks of its group the same bits; after the
    first dimension every rank holds the sum of its own line, and each group of the next
    dimension then reduces the same values, in the same rank order, with the same algorithm, so
    every rank ends with the same total (pinned, bit for bit, by
    ``tests/plugins/parallel/test_grad_norm_layouts.py``). Only that message, only while the
    norm is reduced; any other redistribution still warns.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("sequential all_reduce operations" in message and "flatten mesh dimensions" in message)


_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
_ADVICE = _SequentialAllReduceAdvice()  # one filter, added and removed around each reduction


@contextlib.contextmanager
def _without_flattening_advice() -> Iterator[None]:
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    logger.addFilter(_ADVICE)
    try:
        yield
    finally:
        logger.removeFilter(_ADVICE)


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    # DTensor reduces the partial norms where an op needs them whole (``stack``, ``full_tensor``).
    with _without_flattening_advice():
        return _reduced_group_norm(grads)


def _reduced_group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if grads[0].device.type == "cpu":
        # CPU's float32 norm kernel adds a tensor's squares one after another: over a model's
        # gradients it is off by 1e-5 relative and more, and by a different amount for each
        # sharding (FSDP 2 sums half of each tensor per rank), so layouts that train alike would
        # log and clip with different norms. Accumulated in float64 it is exact to float32.
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    else:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.float()


def _grad_groups(parts: list[nn.Module]) -> dict[Any, list[nn.Parameter]]:
    """Parameters with a gradient, grouped by their gradient's DTensor mesh and placements."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for part in parts:
        for p in part.parameters():
            if p.grad is None:
                continue
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return groups


def total_grad_norm(parts: list[nn.Module], ctx: ParallelContext) -> torch.Tensor:
    groups = {k: [p.grad for p in ps] for k, ps in _grad_groups(parts).items()}
    if not groups:
        return torch.zeros((), device=ctx.topology.device)
    squared = sum(_group_norm(g).float() ** 2 for g in groups.values())
    pp_group = pp_process_group(ctx)
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def pp_process_group(ctx: ParallelContext) -> Any:
    """The group pipeline stages add their squared norms over (``None`` without PP)."""
    if ctx.parallel_dims.pp == 1:
        return None
    return ctx.topology.group("pp", ctx.mesh)


def clip_grad_norm(parts: list[nn.Module], max_norm: float, ctx: ParallelContext) -> torch.Tensor:
    norm = total_grad_norm(parts, ctx)
    if max_norm > 0:
        # One call per group: foreach kernels cannot mix DTensors of different meshes (expert
        # parallel's experts next to FSDP's dense weights).
        for params in _grad_groups(parts).values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def mean_over_dp(loss: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Average a per-rank loss over the data-parallel (and context-parallel) ranks."""
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if ctx.mesh is None or ctx.parallel_dims.dp * ctx.parallel_dims.cp == 1:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=ctx.mesh["dp_cp"].get_group())
    return loss
