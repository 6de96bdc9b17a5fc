"""Applying strategies to the model: the one place that defines their order.

The model is built on the meta device as one part. Strategies then run in ascending
``Strategy.order``; each takes the list of model parts and returns it (pipeline parallelism turns
one part into this rank's stages; the others transform each part in place):

    PP split (10) -> TP (20) -> EP (25) -> CP (30) -> activation checkpointing (40)
    -> torch.compile (50) -> FSDP/HSDP (60)

Only then are the parts materialised on the device and initialised by ``init_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.records import ModelSpec, Strategy
    from titan_core.topology import Topology

#: Named order slots; third-party strategies may use values in between.
ORDER = {
    "pp": 10,
    "tp": 20,
    "ep": 25,
    "cp": 30,
    "activation_checkpoint": 40,
    "compile": 50,
    "fsdp": 60,
}


@attrs.define
class ParallelContext:
    """What strategies see and what they leave for the trainer."""

    config: TrainerConfig
    parallel_dims: ParallelDims
    #: The world DeviceMesh and its flattened views (``parallel_dims.Meshes``; index it like a
    #: DeviceMesh: ``mesh["tp"]``, ``mesh["dp_shard_cp"]``); ``None`` on a single process.
    mesh: Any
    spec: ModelSpec
    model_args: Any
    topology: Topology
    #: Set by the PP strategy: ``build_schedule(parts, loss_fn) -> schedule`` with ``step()``.
    build_pipeline: Callable[..., Any] | None = None
    #: This rank's pipeline stage indices (``[0]`` without PP).
    stage_ids: list[int] = attrs.field(factory=lambda: [0])
    #: Whether this rank holds the first / last pipeline stage.
    has_first_stage: bool = True
    has_last_stage: bool = True
    #: Set by the FSDP strategy when parameters are cast by mixed precision (no autocast needed).
    mixed_precision_applied: bool = False
    #: Set by TP when the loss must be computed under ``loss_parallel()``.
    loss_parallel: bool = False
    #: Set by CP: ``shard_batch(inputs, labels) -> (inputs, labels, forward kwargs)``.
    shard_batch: Callable[..., Any] | None = None
    #: Names of the strategies applied, in order (logged once).
    applied: list[str] = attrs.field(factory=list)


def select_strategies(
    strategies: dict[str, Strategy], config: TrainerConfig, parallel_dims: ParallelDims
) -> list[Strategy]:
    chosen = [s for s in strategies.values() if s.applies(config, parallel_dims)]
    return sorted(chosen, key=lambda s: (s.order, s.name))


def apply_strategies(model: nn.Module, strategies: list[Strategy], ctx: ParallelContext) -> list[nn.Module]:
    parts = [model]
    for strategy in strategies:
        parts = strategy.apply(parts, ctx)
        ctx.applied.append(strategy.name)
    return parts


def required_strategies(config: TrainerConfig, parallel_dims: ParallelDims) -> list[str]:
    """Strategy names this run cannot do without (checked before anything is built)."""
    needs = [d for d in ("pp", "tp", "ep", "cp") if getattr(parallel_dims, d) > 1]
    if parallel_dims.dp > 1 or parallel_dims.cp > 1:
        needs.append("fsdp")
    if config.activation_checkpoint.mode != "none":
        needs.append("activation_checkpoint")
    if config.compile.enable:
        needs.append("compile")
    return needs
