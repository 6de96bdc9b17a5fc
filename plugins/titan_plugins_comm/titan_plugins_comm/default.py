"""The default backend: a single process, or one process per rank launched by torchrun."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_core.topology import Topology


def _env_int(name: str, default: int) -> int:
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
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = select_device(config, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if config.comm.trace_buf_size > 0 and device.type == "cuda":
            # Flight recorder: dumped on timeout, see docs/debugging.md.
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(config.comm.trace_buf_size))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault(
                "TORCH_FR_DUMP_TEMP_FILE",
                os.path.join(os.path.abspath(config.job.dump_folder), "comm_traces", "rank_"),
            )
            os.makedirs(os.path.join(config.job.dump_folder, "comm_traces"), exist_ok=True)
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
        physical_world_size=world_size,
    )
