"""The few collectives the checkpointer itself needs, on the default process group.

Every rank must take the same path through a save or a load, or one rank raises while the
others wait in a collective forever. So decisions that one rank makes (rank 0 commits a save) or
that every rank makes alone (which checkpoint to resume) are exchanged before anyone acts on them.
With one process these are no-ops.
"""

from __future__ import annotations

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
