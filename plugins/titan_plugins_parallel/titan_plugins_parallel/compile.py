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

``activation_checkpoint.mode = "memory_budget"`` hands recomputation to the compiler: AOTAutograd's
min-cut partitioner, given ``torch._functorch.config.activation_memory_budget``, keeps the outputs
worth the most recompute time per byte until the share ``activation_checkpoint.memory_budget`` of
the block's activations is spent (torchtitan's mode of that name). The budget is read when a graph
is partitioned, so the blocks compile through a backend that sets it around its inner backend:
scoped to titan's blocks (other compiled code keeps its setting), and a backend object of its own
per build, because dynamo reuses a compiled graph only for the backend that compiled it; a
process-wide setting would let a second trainer in the process run the first one's graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_core.errors import UsageError

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.compile.enable


def backend(config: TrainerConfig) -> Any:
    """What the blocks compile with: ``compile.backend``'s name, or a memory-budget wrapper of it."""
    name = config.compile.backend
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        # The debug and experimental backends are accepted but not listed (a dozen testing ones).
        raise UsageError(
            f"compile.backend = {name!r} is not a torch.compile backend; use one of "
            f"{', '.join(sorted({*torch._dynamo.list_backends(), 'aot_eager', 'eager'}))}"
        )
    ac = config.activation_checkpoint
    if ac.mode != "memory_budget":
        return name
    return _with_memory_budget(torch._dynamo.lookup_backend(name), ac.memory_budget)


def _with_memory_budget(inner: Any, budget: float) -> Any:
    from torch._functorch import config as functorch_config

    def compile_block(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return inner(graph, example_inputs)

    compile_block.__name__ = f"{getattr(inner, '__name__', 'backend')}_memory_budget_{budget}"
    return compile_block


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    chosen = backend(ctx.config)
    # The default is passed by omission, so a test's ``torch.compile`` replaced with another
    # default backend (``functools.partial``) still decides.
    options = {} if chosen == "inductor" else {"backend": chosen}
    for part in parts:
        layers = getattr(part, "layers", None)
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
            for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
                block.compile(**options)
    return parts
