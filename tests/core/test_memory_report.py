"""The memory report outside the fake backends: its allocation tracker, and a real one-process run
with ``debug.memory_report``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import run_titan
from titan_core.memory_report import POINTS, AllocationTracker


def test_tracker_follows_allocations_frees_and_resizes() -> None:
    before = torch.ones(1000)  # exists before: never counted
    original_resize = torch.UntypedStorage.resize_
    with AllocationTracker() as tracker:
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        b = a.view(32, 32)  # a view shares the storage: no new bytes
        c = before * 2  # 4000 bytes
        assert tracker.current == 4096 + 4000
        del a, b
        assert tracker.current == 4000  # freed when the last view goes
        c.untyped_storage().resize_(0)  # as FSDP frees its all-gather buffers
        assert tracker.current == 0
        c.untyped_storage().resize_(8000)
        assert tracker.current == 8000
    assert tracker.peak == 4096 + 4000
    assert torch.UntypedStorage.resize_ is original_resize  # unpatched on exit


RECIPES = """
from titan_plugins_llama3.recipes import llama3_debugmodel


def tiny_report():
    config = llama3_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4}
    config.training.steps = 3
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.device = "cpu"
    config.metrics.enable_tensorboard = False
    config.debug.memory_report = True
    config.job.dump_folder = "./out"
    return config
"""


def test_memory_report_in_a_real_one_process_run(tmp_path: Path) -> None:
    (tmp_path / "report_recipes.py").write_text(RECIPES)
    result = run_titan("run", "--module", "report_recipes", "--recipe", "tiny_report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "memory_report_rank0.json").read_text())
    assert report["comm_backend"] == "default" and report["world_size"] == 1
    assert report["steady_step"] == 2
    points = [(o["point"], o["step"]) for o in report["observations"]]
    assert points == list(zip(POINTS, (0, 1, 2, 2), strict=True))
    assert report["params_bytes"] == 4 * report["params_numel"]
    first, _, steady, last = report["observations"]
    assert first["grads_bytes"] == 0 and first["optimizer_state_bytes"] == 0
    assert last["grads_bytes"] == report["params_bytes"]
    assert steady["step_allocations_peak_bytes"] > 0
    assert steady["peak_bytes"] >= steady["accounted_bytes"]
