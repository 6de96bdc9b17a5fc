"""The default backend's flight-recorder variables and its shorter timeout after step 1 (titan_core.comm)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_core.comm import (
    enable_flight_recorder,
    flight_recorder_env,
    mesh_groups,
    shorten_timeouts,
)
from titan_core.config import TrainerConfig
from titan_core.parallel_dims import ParallelDims


def test_flight_recorder_dumps_into_comm_traces(tmp_path: Path) -> None:
    config = TrainerConfig()
    config.job.dump_folder = str(tmp_path / "run")
    config.comm.trace_buf_size = 1234
    env = flight_recorder_env(config, {})
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "1234",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # torch appends the rank: comm_traces/rank_0, rank_1, ...
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(tmp_path / "run"), "comm_traces", "rank_"),
    }


@pytest.mark.parametrize(
    ("device", "size", "enabled", "buffer"),
    [
        ("cuda", 1234, True, "1234"),
        ("cuda", 0, False, None),
        ("cpu", 1234, False, "1234"),
        ("cpu", 0, False, None),
    ],
)
def test_flight_recorder_dumps_from_nccl_on_cuda_and_sizes_gloo_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, size: int, enabled: bool, buffer: str | None
) -> None:
    """Both the default backend and real_pp_fake_spmd call this before their groups exist.

    On CUDA NCCL dumps on a timeout; on CPU only the buffer size is set (gloo records into it and
    the comm plugin's callback dumps), and ``comm.trace_buf_size = 0`` turns recording off."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")
    for name in (*names, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.setenv(name, "")  # recorded, so what the call sets is undone after the test
        monkeypatch.delenv(name)
    config = TrainerConfig()
    config.job.dump_folder = str(tmp_path / "run")
    config.comm.trace_buf_size = size
    enable_flight_recorder(config, torch.device(device, 0) if device == "cuda" else torch.device(device))
    assert os.environ.get("TORCH_FR_BUFFER_SIZE") == buffer
    assert ("TORCH_NCCL_DUMP_ON_TIMEOUT" in os.environ) is enabled
    assert (tmp_path / "run" / "comm_traces").is_dir() is enabled


def test_flight_recorder_keeps_what_the_user_set_under_either_name() -> None:
    config = TrainerConfig()
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "7", "TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/r_"}
    assert flight_recorder_env(config, user) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def _timeout(group: object) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[attr-defined]


def test_train_timeout_reaches_every_group_of_the_mesh(tmp_path: Path) -> None:
    config = TrainerConfig()
    config.comm.train_timeout_seconds = 42
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(300)
    )
    try:
        mesh = ParallelDims.from_config(config.parallelism, 1).build_mesh("cpu")
        groups = [None, mesh["dp_shard"].get_group(), mesh["dp"].get_group(), mesh["tp"].get_group()]
        assert _timeout(dist.distributed_c10d._get_default_group()) != timedelta(seconds=42)
        shorten_timeouts(config, torch.device("cpu"), mesh_groups(mesh))
        for group in groups:
            group = group or dist.distributed_c10d._get_default_group()
            assert _timeout(group) == timedelta(seconds=42)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_switch_to_the_train_timeout_after_step_1(tmp_path: Path) -> None:
    from titan_core._registry import get_registry

    if "fsdp" not in get_registry().records("strategies"):
        pytest.skip("needs the fsdp strategy (titan-plugins-parallel)")
    from tests.parallel_harness import log_records, run_titan_train

    result = run_titan_train(
        tmp_path, 2, {"comm.train_timeout_seconds": 77, "training.steps": 2, "parallelism.dp_shard": 2}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    done = [r for r in records if r.get("event") == "collective timeout set"]
    assert {r["rank"] for r in done} == {0, 1} and all(r["seconds"] == 77 for r in done)
    # it happens after step 1 finished, before step 2
    events = [(r.get("event"), r.get("step")) for r in records if r.get("rank") == 0]
    assert ("step", 2) in events, result.stdout[-3000:]
    order = [events.index(e) for e in (("step", 1), ("collective timeout set", None), ("step", 2))]
    assert order == sorted(order), events
