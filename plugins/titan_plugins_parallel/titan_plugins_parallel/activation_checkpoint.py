"""Activation checkpointing: recompute transformer blocks in backward instead of storing them.

``activation_checkpoint.mode``: ``full`` wraps every block of ``model.layers``; ``selective``
wraps every other block (odd indices), trading half the memory saving for less recomputation.
The other fields go to ``torch.utils.checkpoint.checkpoint`` (non-reentrant):
``preserve_rng_state``, ``determinism_check`` and ``debug``.

Blocks are wrapped with ``checkpoint_wrapper`` from ``torch.distributed.algorithms._checkpoint``,
a private module path, because it is PyTorch's own wrapper for exactly this (torchtitan and FSDP
use it) and its state-dict hooks drop the wrapper's ``_checkpoint_wrapped_module.`` prefix: state
dict keys stay ``layers.0.attention.wq.weight``, so seed checkpoints and checkpoints load
whatever the mode. No public equivalent exists in torch 2.11-2.14. The wrapper replaces the
block under the same ``ModuleDict`` key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.activation_checkpoint.mode != "none"


def wrapped_indices(mode: str, n_blocks: int) -> list[int]:
    """Which blocks (by position in ``model.layers``) are recomputed in backward."""
    if mode == "full":
        return list(range(n_blocks))
    if mode == "selective":
        return list(range(1, n_blocks, 2))
    return []


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ac = ctx.config.activation_checkpoint
    for part in parts:
        layers = getattr(part, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            continue
        keys = list(layers.keys())
        for i in wrapped_indices(ac.mode, len(keys)):
            block = layers[keys[i]]
            layers[keys[i]] = checkpoint_wrapper(
                block,
                preserve_rng_state=ac.preserve_rng_state,
                determinism_check=ac.determinism_check,
                debug=ac.debug,
            )
    return parts
