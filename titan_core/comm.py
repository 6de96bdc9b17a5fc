"""The ``default`` comm backend, the core's own: one process, or one process per rank from torchrun.

It is registered by titan's built-in plugin (``titan_core._builtin``), as tox and conda register
their built-ins, so a venv with only ``titan-core`` and a model plugin trains. Other backends
(the fake ones) reuse :func:`select_device`, :func:`env_int`, :func:`enable_flight_recorder`,
:func:`shorten_timeouts` and :func:`end_process_groups`.

On CUDA it turns on the NCCL flight recorder (``comm.trace_buf_size`` entries per rank): when a
collective times out, every rank dumps its recent collectives to
``job.dump_folder/comm_traces/rank_<rank>`` for ``python -m torch.distributed.flight_recorder``
(``torchfrtrace``). Collectives get ``comm.init_timeout_seconds`` until the first step is done,
then ``comm.train_timeout_seconds``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_core.log import get_logger
from titan_core.parallel_dims import MESH_DIMS
from titan_core.topology import Topology

log = get_logger("titan.comm")

# Flight-recorder variables of torch 2.11-2.14; the NCCL-prefixed names are their older aliases,
# still read by torch, so a value the user set under either name is kept.
_FR_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_FR_DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def select_device(config: TrainerConfig, local_rank: int) -> torch.device:
    wanted = config.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise UsageError("training.device is 'cuda' but no CUDA device is available; use 'auto'")
    if wanted != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init(config: TrainerConfig) -> Topology:
    world_size = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    device = select_device(config, local_rank)
    if world_size > 1 and not dist.is_initialized():
        enable_flight_recorder(config, device)
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=config.comm.init_timeout_seconds),
            device_id=device if device.type == "cuda" else None,
        )
    return Topology(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        device=device,
        backend="default",
        after_first_step=(lambda mesh: shorten_timeouts(config, device, mesh_groups(mesh)))
        if world_size > 1
        else None,
        on_shutdown=lambda completed: end_process_groups(
            completed, barrier_group=None if world_size > 1 else False
        ),
    )


def end_process_groups(completed: bool, barrier_group: Any = None) -> None:
    """Destroy the process groups; after a completed run, first wait on ``barrier_group``.

    Without the barrier a fast rank can tear its gloo pairs down while a peer still finishes its
    last collective, and the peer aborts at exit. After an error there is no barrier: a failed
    peer would never arrive. ``barrier_group=False``: no real peer to wait for.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if completed and barrier_group is not False:
        dist.barrier(group=barrier_group)
    dist.destroy_process_group()


def enable_flight_recorder(config: TrainerConfig, device: torch.device) -> None:
    """With ``comm.trace_buf_size > 0``: process groups created from now on record collectives.

    On CUDA, NCCL dumps them itself on a timeout; on CPU torch records gloo collectives into the
    same buffer (of ``comm.trace_buf_size`` entries) and the comm plugin's flight-recorder
    callback dumps them.
    """
    if config.comm.trace_buf_size <= 0:
        return
    if device.type == "cuda":
        os.environ.update(flight_recorder_env(config, os.environ))
        os.makedirs(os.path.join(config.job.dump_folder, "comm_traces"), exist_ok=True)
    elif not any(n in os.environ for n in _FR_BUFFER):
        os.environ[_FR_BUFFER[0]] = str(config.comm.trace_buf_size)


def flight_recorder_env(config: TrainerConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables that make NCCL's flight recorder dump to ``comm_traces/`` on a timeout.

    Read by torch when the first NCCL communicator is created, so they are set before
    ``init_process_group``. A variable already set, under its name or its older alias, wins.
    """
    wanted = {
        _FR_BUFFER: str(config.comm.trace_buf_size),
        _FR_DUMP_ON_TIMEOUT: "1",
        _FR_FILE: os.path.join(os.path.abspath(config.job.dump_folder), "comm_traces", "rank_"),
    }
    return {names[0]: value for names, value in wanted.items() if not any(n in environ for n in names)}


def mesh_groups(mesh: Any) -> list[Any]:
    """The default group (``None``) and every distinct process group of the mesh and its views."""
    groups: dict[int, Any] = {}
    if mesh is not None:
        for name in (*MESH_DIMS, *mesh.flattened):
            group = mesh[name].get_group()
            groups[id(group)] = group
    return [None, *groups.values()]


def shorten_timeouts(config: TrainerConfig, device: torch.device, groups: list[Any]) -> None:
    """Give ``groups`` (``None``: the default group) ``comm.train_timeout_seconds`` after step 1.

    The first step may be slow (compilation, lazy initialisation, checkpoint loading) and runs
    under ``comm.init_timeout_seconds``; a hang later should surface, with a flight-recorder dump,
    after the shorter training timeout. ``_set_pg_timeout`` is private: torch 2.11-2.14 has no
    public way to change a live process group's timeout, so it is looked up and skipped with a
    warning if absent.
    """
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        log.warning("this torch cannot change process-group timeouts; comm.train_timeout_seconds unused")
        return
    # Every rank has finished step 1 before any collective runs under the shorter timeout.
    dist.barrier(group=groups[0], device_ids=[device.index] if device.type == "cuda" else None)
    timeout = timedelta(seconds=config.comm.train_timeout_seconds)
    for group in groups:
        set_timeout(timeout, group)
    log.info("collective timeout set", seconds=config.comm.train_timeout_seconds, groups=len(groups))
