"""Load one full (unsharded) state dict into this rank's model parts, whatever their layout.

This is how runs with different parallel layouts start from the same weights: a one-process
run saves ``model.state_dict()`` with ``torch.save``; every rank of another run loads the file and
``set_model_state_dict`` shards each tensor to the parameter's FSDP/TP placement. Pipeline
stages load only the keys they own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_core.errors import UsageError


def load_full_state_dict(parts: list[nn.Module], path: str) -> None:
    if not Path(path).is_file():
        raise UsageError(f"checkpoint.initial_load_path: no file at {path!r}")
    full = torch.load(path, map_location="cpu", weights_only=True)
    for part in parts:
        own = {k: v for k, v in full.items() if k in part.state_dict()}
        missing = set(part.state_dict()) - set(own)
        if missing:
            raise UsageError(
                f"checkpoint.initial_load_path: {path!r} lacks {len(missing)} tensors of the model, "
                f"e.g. {sorted(missing)[:3]}; was it saved from the same model and flavor?"
            )
        set_model_state_dict(part, own, options=StateDictOptions(full_state_dict=True, strict=False))
