"""Who this process is in the (possibly logical) job: what a comm backend's ``init`` returns.

``world_size`` and ``rank`` are logical: a backend may simulate peers (one process standing for
one rank of a larger job), and says which mesh dimensions it simulates; the trainer and the
strategies read only these generic fields, never a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


@attrs.define
class Topology:
    #: World size of the job this process is part of (logical when peers are simulated).
    world_size: int
    #: Global rank of this process in that job.
    rank: int
    #: Device index on this host.
    local_rank: int
    #: ``torch.device`` this process computes on.
    device: Any
    #: Name of the comm backend that built this topology (for logs and reports only).
    backend: str = "default"
    #: Mesh dimensions (``parallel_dims.MESH_DIMS``) whose peers are simulated: collectives over
    #: them complete without moving data, so received values, reduced losses and gradient norms
    #: are garbage by design and the trainer skips its checks of them. Empty for real jobs.
    simulated: frozenset[str] = frozenset()
    #: Real process groups that carry a mesh dimension's traffic instead of the mesh's own group
    #: (a backend simulating the others keeps one dimension real), by dimension name.
    groups: dict[str, Any] = attrs.field(factory=dict)
    #: ``after_first_step(mesh)``, called once after the first training step of the process, or
    #: ``None``; the default backend shortens collective timeouts to ``comm.train_timeout_seconds``.
    after_first_step: Callable[[Any], None] | None = None
    #: ``on_shutdown(completed)`` ends the backend's process groups (``None``: nothing to end).
    on_shutdown: Callable[[bool], None] | None = None
    #: ``barrier()`` waits for every process of the job (the real ones, when peers are simulated),
    #: or ``None``: the default process group's barrier, when the job has several processes. A
    #: backend whose default group simulates peers sets its own (its barrier would not wait).
    barrier: Callable[[], None] | None = None

    @property
    def simulates_peers(self) -> bool:
        """Whether any mesh dimension is simulated (then losses and norms are not meaningful)."""
        return bool(self.simulated)

    def group(self, dim: str, mesh: Any) -> Any:
        """The process group of mesh dimension ``dim``: the backend's own, else the mesh's."""
        if dim in self.groups:
            return self.groups[dim]
        return None if mesh is None else mesh[dim].get_group()

    def shutdown(self, *, completed: bool = False) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown(completed)
