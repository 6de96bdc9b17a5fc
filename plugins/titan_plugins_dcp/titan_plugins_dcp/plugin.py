"""Hook implementation of the DCP plugin (no torch import here: ``titan plugins list``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_core import Checkpointer, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _build(config: TrainerConfig, topology: Topology) -> Any:
    from titan_plugins_dcp.checkpointer import DCPCheckpointer

    return DCPCheckpointer(config, topology)


@hookimpl
def titan_checkpointers() -> list[Checkpointer]:
    return [
        Checkpointer(
            "dcp",
            _build,
            "torch.distributed.checkpoint: resharding save/resume of model, optimizer, LR "
            "schedule and step; seed checkpoints",
        )
    ]
