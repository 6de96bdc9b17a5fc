"""The ``fake`` backend: one process stands for one rank of a job of ``NGPU`` ranks.

The default process group is PyTorch's fake process group (``FakeProcessGroup``): it has the
logical world size and this process's logical rank, so the DeviceMesh, DTensor placements,
FSDP shards and pipeline stage assignment are exactly those of that rank in the real job, but
every collective and point-to-point operation completes at once without moving data (received
buffers keep whatever they held). Nothing talks to a peer and no NCCL communicator exists.

The trainer builds the model on the meta device, applies the strategies and only then calls
``to_empty``, so only this rank's shards are ever allocated.

``torch.testing._internal.distributed.fake_pg`` is a private module: importing it registers the
``"fake"`` backend with ``torch.distributed`` and provides ``FakeStore``. It is what PyTorch's
own tests and torchtitan use; there is no public equivalent in torch 2.11-2.14 (the backend
name ``"fake"`` itself is public: ``torch.distributed.Backend.FAKE``).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from titan_core.comm import end_process_groups, env_int, select_device
from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_core.parallel_dims import MESH_DIMS
from titan_core.topology import Topology
from titan_plugins_comm.contract import pure_fake_launch


def fake_store() -> dist.Store:
    """A store that holds nothing, for a process group that never rendezvouses."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake" too

    return FakeStore()


def without_detail_debug() -> None:
    """Lower ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` to ``INFO`` for a logical world.

    DETAIL wraps every process group in a checker that compares collectives across ranks through
    the store; simulated ranks cannot answer (the fake store fails, a real one would wait forever).
    """
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        from titan_core.log import get_logger

        get_logger("titan.comm").warning(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL cannot check collectives across simulated ranks; "
            "using INFO under the fake comm backends"
        )
        dist.set_debug_level(dist.DebugLevel.INFO)


def init(config: TrainerConfig) -> Topology:
    # Several launched processes were refused before (contract.fake_launch_check, run by the
    # trainer before init).
    launch = pure_fake_launch(config.parallelism.pp, os.environ)
    if dist.is_initialized():
        raise UsageError(
            "comm backend 'fake' found torch.distributed already initialised; run it as one plain "
            "process (not under torchrun): COMM_BACKEND=fake ./run_train.sh"
        )
    local_rank = env_int("LOCAL_RANK", 0)
    device = select_device(config, local_rank)
    without_detail_debug()
    dist.init_process_group("fake", store=fake_store(), rank=launch.logical_rank, world_size=launch.ngpu)
    return Topology(
        world_size=launch.ngpu,
        rank=launch.logical_rank,
        local_rank=local_rank,
        device=device,
        backend="fake",
        simulated=frozenset(MESH_DIMS),  # every peer is simulated
        on_shutdown=lambda completed: end_process_groups(completed, barrier_group=False),
    )
