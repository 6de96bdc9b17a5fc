"""The ``real_pp_fake_spmd`` backend: real pipeline traffic, fake everything else.

torchrun launches exactly one process per pipeline (PP) rank; the physical ``RANK`` is the PP
coordinate. Each process represents SPMD coordinate zero of its PP rank in a logical job of
``NGPU`` ranks (``logical_rank = RANK * NGPU / P``), so all processes together form one
pipeline line through the logical mesh.

How the groups are made, with public ``torch.distributed`` calls only:

1. ``dist.rendezvous("env://", rank=RANK, world_size=P)`` connects to the TCPStore torchrun
   announced in ``MASTER_ADDR``/``MASTER_PORT`` (the agent's store under torchrun, or one hosted
   by physical rank 0), exactly as ``init_process_group``'s env:// would.
2. The default process group is the fake backend with the *logical* world size and rank, and
   that real store. The fake group ignores the store, so the DeviceMesh and every DP/TP/CP/EP
   subgroup are fake (no data moves, no NCCL communicator); the store only serves step 3.
3. ``dist.new_group(ranks=<logical ranks of the pipeline line>, backend=gloo|nccl,
   use_local_synchronization=True)`` builds the one real group. Its members are named by their
   logical ranks, so ``dist.get_global_rank(pp_group, i)`` is the logical rank of PP stage rank
   ``i`` and pipeline ``P2POp``s address peers in the same numbering as the mesh; the group's
   own ranks are 0..P-1, i.e. the PP coordinates. Local synchronisation keeps the creation from
   waiting for the ``NGPU - P`` logical ranks that have no process.

The PP strategy takes this group from ``Topology.groups['pp']`` (``titan_core.grad_norm
.pp_process_group``); gradient-norm reduction over stages uses it too.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from titan_core.comm import (
    enable_flight_recorder,
    end_process_groups,
    env_int,
    select_device,
    shorten_timeouts,
)
from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_core.parallel_dims import MESH_DIMS
from titan_core.topology import Topology
from titan_plugins_comm.contract import DOC, hybrid_launch


def init(config: TrainerConfig) -> Topology:
    launch = hybrid_launch(config.parallelism.pp, os.environ)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UsageError(
            f"{' and '.join(missing)} not set: real_pp_fake_spmd rendezvouses the pipeline "
            f"processes through torchrun's store; launch with torchrun --nproc_per_node="
            f"{launch.pp}; {DOC}"
        )
    if dist.is_initialized():
        raise UsageError("comm backend 'real_pp_fake_spmd' found torch.distributed already initialised")
    local_rank = env_int("LOCAL_RANK", 0)
    device = select_device(config, local_rank)
    timeout = timedelta(seconds=config.comm.init_timeout_seconds)
    # A store-based barrier after group creation would wait for all NGPU logical ranks, of
    # which only P exist; it is off unless TORCH_DIST_INIT_BARRIER=1, so keep it off.
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"

    store, _, _ = next(dist.rendezvous("env://", rank=launch.pp_rank, world_size=launch.pp, timeout=timeout))
    store = dist.PrefixStore("titan_real_pp_fake_spmd", store)

    from titan_plugins_comm.fake import fake_store, without_detail_debug

    fake_store()  # imports the module that registers the "fake" backend
    without_detail_debug()
    dist.init_process_group(
        "fake", store=store, rank=launch.logical_rank, world_size=launch.ngpu, timeout=timeout
    )
    enable_flight_recorder(config, device)  # the real PP group's NCCL communicator dumps on a hang
    pp_group = dist.new_group(
        ranks=launch.pp_line,
        backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        timeout=timeout,
        use_local_synchronization=True,
        group_desc="real_pp",
    )
    return Topology(
        world_size=launch.ngpu,
        rank=launch.logical_rank,
        local_rank=local_rank,
        device=device,
        backend="real_pp_fake_spmd",
        simulated=frozenset(MESH_DIMS) - {"pp"},  # only the pipeline peers are real processes
        groups={"pp": pp_group},
        on_shutdown=lambda completed: end_process_groups(completed, barrier_group=pp_group),
        barrier=lambda: dist.barrier(group=pp_group),  # the default group is fake: it would not wait
        # Only the pipeline group is real: it alone gets the training timeout after step 1.
        after_first_step=lambda mesh: shorten_timeouts(config, device, [pp_group]),
    )
