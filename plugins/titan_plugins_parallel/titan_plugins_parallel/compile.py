"""``torch.compile`` of each transformer block (``compile.enable``).

Blocks are compiled one by one and in place (``nn.Module.compile``), as torchtitan does: all
blocks share one compiled graph (they have the same structure), compilation stays short, FSDP
still sees plain modules to shard, and state-dict keys gain no ``_orig_mod.`` prefix. Applied
after activation checkpointing so the recomputed region is the compiled block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.compile.enable


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    for part in parts:
        layers = getattr(part, "layers", None)
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
            for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
                block.compile()
    return parts
