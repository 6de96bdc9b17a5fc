"""Hook implementations of the comm plugin; backends are imported only when a run selects one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_core import CommBackend, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _default(config: TrainerConfig) -> Topology:
    from titan_plugins_comm.default import init

    return init(config)


@hookimpl
def titan_comm_backends() -> list[CommBackend]:
    return [
        CommBackend(
            "default",
            _default,
            "one process, or torchrun's env:// rendezvous (NCCL on CUDA, gloo on CPU)",
        ),
    ]
