"""The few collectives the checkpointer itself needs, on the default process group.

Every rank must take the same path through a save or a load, or one rank raises while the
others wait in a collective forever. So decisions that one rank makes (rank 0 commits a save) or
that every rank makes alone (which checkpoint to resume) are exchanged before anyone acts on them.
With one process these are no-ops.
"""

from __future__ import annotations

import contextlib
from typing import Any


class Peers:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    @property
    def active(self) -> bool:
        import torch.distributed as dist

        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    def outlive_rank0(self) -> None:
        """On ranks other than 0: return once rank 0 has ended (at once with one process).

        For an error every rank raises alike before any collective (a refused launch): torchrun
        stops the other ranks as soon as one exits, so a rank that exits first could take rank 0
        down before rank 0 printed the error, and rank 0 is the one ``run_train.sh`` shows. Rank 0
        never joins this collective; its exit closes its connections, which ends the wait here.
        """
        if not self.active:
            return
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            return
        # A CPU tensor: gloo (also beside NCCL) notices a peer that is gone. The error it raises
        # then is the expected end of the wait; the caller raises its own error next.
        with contextlib.suppress(Exception):
            dist.all_reduce(torch.zeros(1))
