"""``torch.compile`` of each transformer block (``compile.enable``).

Blocks are compiled one by one and in place (``nn.Module.compile``), as torchtitan does: all
blocks share one compiled graph (they have the same structure), compilation stays short, FSDP
still sees plain modules to shard, and state-dict keys gain no ``_orig_mod.`` prefix. Applied
after activation checkpointing so the recomputed region is the compiled block.

Nothing recompiles after the first step: dynamo inlines the blocks' modules (their parameters
are graph inputs, not guarded constants), so every block reuses the graph of the first, and a
block's inputs keep their shapes, dtypes and types from step to step. That includes a document
mask that is new each batch (a boolean tensor on CPU, a flex-attention ``BlockMask`` built from a
fresh closure on CUDA: dynamo guards on the closure's code, its tensors are inputs).
``tests/plugins/parallel/test_compile.py`` counts the graphs over several steps.
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
