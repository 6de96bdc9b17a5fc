"""The profiler plugin: trace files at the right steps, memory snapshots (and on OOM), CPU warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parallel_harness import child_env, log_records, tiny_config, write_recipe_module
from titan_core._registry import Registry
from titan_core.errors import PluginError
from titan_core.topology import Topology
from titan_core.trainer import Trainer
from titan_plugins_profiler.session import ProfilerSession


def _work() -> None:
    a = torch.randn(16, 16)
    (a @ a).sum()


def test_traces_every_profile_freq_steps_named_by_global_step(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_profiling": True})
    config.profiler.profile_freq = 3
    session = ProfilerSession(config, Topology(2, 1, 0, torch.device("cpu")))
    session.step_num = 4  # resumed after step 4: steps 5..11 run
    with session:
        for _ in range(7):
            _work()
            session.step()
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_6", "iteration_9"]
    for step in (6, 9):
        trace = json.loads((traces / f"iteration_{step}" / "rank1_trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "aten::mm" in names
        # exactly one training step is recorded per trace (torch counts steps from 0)
        assert [n for n in names if n.startswith("ProfilerStep#")] == [f"ProfilerStep#{step - 1}"]


class _FakeAllocatorHistory:
    """Stands in for torch.cuda.memory's private recorder so the CUDA path runs on CPU."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def record(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.calls.append(("record", enabled, kwargs))

    def dump(self, path: str) -> None:
        Path(path).write_bytes(b"snapshot")
        self.calls.append(("dump", path))


def test_memory_snapshots_every_freq_and_on_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeAllocatorHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump)
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 2
    session = ProfilerSession(config, Topology(1, 0, 0, torch.device("cuda", 0)))
    with pytest.raises(torch.OutOfMemoryError), session:
        for _ in range(5):
            session.step()
        raise torch.OutOfMemoryError("CUDA out of memory (simulated in step 6)")
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_000000000002",
        "step_000000000004",
        "step_000000000006_exit",
    ]
    assert (folder / "step_000000000006_exit" / "rank0_memory_snapshot.pickle").is_file()
    assert fake.calls[0] == ("record", "all", {"max_entries": 100_000})
    assert fake.calls[-1] == ("record", None, {})  # recording stopped after the OOM


def test_memory_snapshot_freq_defaults_to_profile_freq(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.profile_freq = 7
    assert ProfilerSession(config, Topology(1, 0, 0, torch.device("cuda", 0))).snapshot_freq == 7


def test_training_run_writes_traces_and_warns_once_about_cpu_snapshots(tmp_path: Path) -> None:
    module = write_recipe_module(
        tmp_path,
        {
            "training.steps": 5,
            "profiler.enable_profiling": True,
            "profiler.profile_freq": 2,
            "profiler.enable_memory_snapshot": True,
        },
    )
    result = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"],
        cwd=tmp_path,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    warnings = [r for r in records if r.get("level") == "warning" and "memory snapshot" in r["event"]]
    assert len(warnings) == 1 and "not available on cpu" in warnings[0]["event"]
    assert [r["step"] for r in records if r.get("event") == "step"] == [1, 2, 3, 4, 5]
    out = tmp_path / "out"
    # step 5 starts a cycle that training ends before its recorded step: no trace for it
    assert sorted(p.name for p in (out / "profile_traces").iterdir()) == ["iteration_2", "iteration_4"]
    assert (out / "profile_traces" / "iteration_4" / "rank0_trace.json").stat().st_size > 0
    assert not (out / "memory_snapshot").exists()


def test_missing_profiler_plugin_names_the_distribution(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_profiling": True})
    registry = Registry(disabled={"profiler"}).load_entry_points()
    expected = r"(?s)backend = 'torch'.*titan-plugins-profiler.*pip install -e plugins/titan_plugins_profiler"
    with pytest.raises(PluginError, match=expected):
        Trainer(config, registry)
