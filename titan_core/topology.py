"""Who this process is in the (possibly logical) job: what a comm backend's ``init`` returns.

``world_size`` and ``rank`` are logical: under the fake backends one process stands for one rank
of a larger job (``NGPU``), and ``pp_rank`` pins the pipeline coordinate it represents.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class Topology:
    #: Logical world size (``NGPU`` under the fake backends).
    world_size: int
    #: Logical global rank of this process.
    rank: int
    #: Device index on this host.
    local_rank: int
    #: ``torch.device`` this process computes on.
    device: Any
    #: Name of the comm backend that built this topology.
    backend: str = "default"
    #: True when peers are simulated (no data crosses processes on the SPMD axes).
    fake: bool = False
    #: Pipeline coordinate fixed by the backend (fake modes); ``None``: derived from the mesh.
    pp_rank: int | None = None
    #: Real process group carrying pipeline traffic in ``real_pp_fake_spmd``; else ``None``.
    pp_group: Any = None
    #: Physical processes of this job.
    physical_world_size: int = 1
    #: ``after_first_step(mesh)``, called once after the first training step of the process, or
    #: ``None``; the default backend shortens collective timeouts to ``comm.train_timeout_seconds``.
    after_first_step: Any = None

    @property
    def distributed(self) -> bool:
        """Whether torch.distributed is initialised (a real or fake default process group)."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def shutdown(self, *, completed: bool = False) -> None:
        """Destroy the process groups; after a completed run, first wait for every real peer.

        Without the barrier a fast rank can tear its gloo pairs down while a peer still finishes
        its last collective, and the peer aborts at exit. After an error there is no barrier: a
        failed peer would never arrive.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if completed and self.physical_world_size > 1:
            # Under real_pp_fake_spmd only the pipeline group is real.
            dist.barrier(group=self.pp_group if self.fake else None)
        dist.destroy_process_group()
