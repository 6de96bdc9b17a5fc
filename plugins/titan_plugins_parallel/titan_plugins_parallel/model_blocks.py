"""The blocks of a model part that the per-block strategies (FSDP, activation checkpointing,
compile) act on: those of ``part.layers``, the decoder protocol's container (docs/plugins.md)."""

from __future__ import annotations

from typing import Any

from torch import nn


def model_blocks(part: nn.Module) -> list[tuple[Any, int]] | None:
    """``(key, model-wide index)`` of each block of ``part.layers``; ``None``: no such container.

    ``layers`` may be an ``nn.ModuleDict`` (titan's models: keys ``"0"``, ``"1"``, ..., which a
    pipeline stage keeps for the blocks it holds, so they are the model-wide indices), an
    ``nn.ModuleList`` or an ``nn.Sequential`` (keys are positions). Keys that are not all
    numbers count by position.
    """
    layers = getattr(part, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        keys: list[Any] = list(layers.keys())
        numbered = all(k.isascii() and k.isdigit() for k in keys)
        return [(k, int(k) if numbered else i) for i, k in enumerate(keys)]
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return [(i, i) for i in range(len(layers))]
    return None
