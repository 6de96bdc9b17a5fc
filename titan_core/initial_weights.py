"""Load one full (unsharded) state dict into this rank's model parts, whatever their layout.

This is how runs with different parallel layouts start from the same weights: a one-process
run saves ``model.state_dict()`` with ``torch.save``; every rank of another run loads the file and
``set_model_state_dict`` shards each tensor to the parameter's FSDP/TP placement. Pipeline
stages load only the keys they own.

The path may also be a DCP checkpoint folder (one with a ``.metadata`` file, e.g. a seed
checkpoint ``.../checkpoint/step-0`` written by the dcp plugin): its ``model`` entry is loaded with
``torch.distributed.checkpoint.load``, which reshards it to this run's layout.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_core.errors import UsageError


def load_full_state_dict(parts: list[nn.Module], path: str) -> None:
    if Path(path).is_dir():
        load_dcp_model(parts, path)
        return
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


def load_dcp_model(parts: list[nn.Module], path: str) -> None:
    """Load the ``model`` entry of a DCP checkpoint folder into this rank's parts (resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not (Path(path) / ".metadata").is_file():
        raise UsageError(
            f"checkpoint.initial_load_path: {path!r} is a folder without .metadata, so not a DCP "
            "checkpoint; give a checkpoint folder such as <dump_folder>/checkpoint/step-0, or a .pt file"
        )
    own = [get_model_state_dict(part) for part in parts]
    merged = {k: v for state in own for k, v in state.items()}
    try:
        with warnings.catch_warnings():  # one process: DCP warns it assumes one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": merged}, checkpoint_id=path)
    except dcp.CheckpointException as exc:
        raise UsageError(
            f"checkpoint.initial_load_path: cannot load the model from {path!r}; was it saved from "
            f"the same model and flavor? ({str(exc).strip().splitlines()[-1][:300]})"
        ) from None
    for part, state in zip(parts, own, strict=True):
        set_model_state_dict(part, {k: merged[k] for k in state})
