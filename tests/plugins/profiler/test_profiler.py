"""The profiler plugin: trace files at the right steps, memory snapshots on CUDA and CPU (with their
HTML pages), the ``_exit`` snapshot and one clear line on out-of-memory, CUDA's and the CPU's."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.parallel_harness import child_env, log_records, tiny_config, write_recipe_module
from titan_core.topology import Topology
from titan_plugins_profiler.session import ProfilerSession


def _work() -> None:
    a = torch.randn(16, 16)
    (a @ a).sum()


def _trainer(config: Any, device: torch.device, rank: int = 0, world: int = 1) -> SimpleNamespace:
    """What the session reads of the trainer: config, topology, this rank's parts and optimizer."""
    model = torch.nn.Linear(8, 8)
    return SimpleNamespace(
        config=config,
        topology=Topology(world, rank, 0, device),
        parts=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
    )


def test_traces_every_profile_freq_steps_named_by_global_step(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_profiling": True})
    config.profiler.profile_freq = 3
    session = ProfilerSession(_trainer(config, torch.device("cpu"), rank=1, world=2))
    session.on_train_start(4)  # resumed after step 4: steps 5..11 run
    for step in range(5, 12):
        _work()
        session.on_step_end(step, {}, step == 11)
    session.on_train_end(11)
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_6", "iteration_9"]
    for step in (6, 9):
        trace = json.loads((traces / f"iteration_{step}" / "rank1_trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "aten::mm" in names
        # exactly one training step is recorded per trace (torch counts steps from 0)
        assert [n for n in names if n.startswith("ProfilerStep#")] == [f"ProfilerStep#{step - 1}"]


def test_tracing_several_cycles_warns_of_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trace holds one step and is written at the end of its cycle, by design: torch's
    "Profiler clears events at the end of each cycle ... set acc_events=True" (a setting titan
    does not offer, which would keep every cycle's events in memory) was logged by every run
    that traced twice."""
    import warnings

    import torch.profiler.profiler as torch_profiler

    monkeypatch.setattr(torch_profiler, "_WARNINGS_SHOWN", set())  # torch warns once per process
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_profiling": True})
    config.profiler.profile_freq = 2
    session = ProfilerSession(_trainer(config, torch.device("cpu"), rank=0, world=1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        session.on_train_start(0)
        for step in range(1, 7):
            _work()
            session.on_step_end(step, {}, step == 6)
        session.on_train_end(6)
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == [
        "iteration_2",
        "iteration_4",
        "iteration_6",
    ]
    assert not [w for w in seen if "clears events" in str(w.message)], [str(w.message) for w in seen]


class _AllocatorHistory:
    """Stands in for torch.cuda.memory's private recorder so the CUDA path runs on a CPU machine;
    its dump writes a real (empty) snapshot so that the page beside it can be rendered."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def record(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.calls.append(("record", enabled, kwargs))

    def dump(self, path: str) -> None:
        Path(path).write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
        self.calls.append(("dump", path))


def test_cuda_snapshots_every_freq_and_on_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _AllocatorHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump)
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 2
    session = ProfilerSession(_trainer(config, torch.device("cuda", 0)))
    session.on_train_start(0)
    for step in range(1, 6):
        session.on_step_end(step, {}, False)
    session.on_failure(6, torch.OutOfMemoryError("CUDA out of memory (simulated in step 6)"))
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_000000000002",
        "step_000000000004",
        "step_000000000006_exit",
    ]
    assert (folder / "step_000000000006_exit" / "rank0_memory_snapshot.pickle").is_file()
    assert (folder / "step_000000000004" / "rank0_memory_snapshot.html").is_file()
    assert fake.calls[0] == ("record", "all", {"max_entries": 100_000})
    assert fake.calls[-1] == ("record", None, {})  # recording stopped after the OOM


def test_memory_snapshot_freq_defaults_to_profile_freq(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.profile_freq = 7
    assert ProfilerSession(_trainer(config, torch.device("cpu"))).snapshot_freq == 7


def test_cpu_oom_is_an_oom(tmp_path: Path) -> None:
    """The CPU allocator's RuntimeError gets the _exit snapshot too; other errors do not."""
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 100
    session = ProfilerSession(_trainer(config, torch.device("cpu")))
    session.on_train_start(0)
    session.on_failure(1, RuntimeError("shape mismatch"))
    assert not (tmp_path / "memory_snapshot").exists()
    session = ProfilerSession(_trainer(config, torch.device("cpu")))
    session.on_train_start(2)
    message = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
    )
    session.on_failure(3, RuntimeError(message))
    snapshot = tmp_path / "memory_snapshot" / "step_000000000003_exit" / "rank0_memory_snapshot.pickle"
    data = pickle.loads(snapshot.read_bytes())
    assert data["titan"]["oom"] is True and data["titan"]["step"] == 3
    assert snapshot.with_suffix(".html").is_file()


SNAPSHOT_RUN = {
    "training.steps": 5,
    "profiler.enable_memory_snapshot": True,
    "profiler.memory_snapshot_freq": 2,
}


def _run(tmp_path: Path, overrides: dict[str, Any], recipe_header: str = "") -> subprocess.CompletedProcess:
    module = write_recipe_module(tmp_path, overrides)
    if recipe_header:
        path = tmp_path / f"{module}.py"
        path.write_text(recipe_header + path.read_text())
    return subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"],
        cwd=tmp_path,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cpu_run_writes_traces_and_snapshots_with_pages(tmp_path: Path) -> None:
    result = _run(tmp_path, {**SNAPSHOT_RUN, "profiler.enable_profiling": True, "profiler.profile_freq": 2})
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    assert [r["step"] for r in records if r.get("event") == "step"] == [1, 2, 3, 4, 5]
    out = tmp_path / "out"
    # step 5 starts a cycle that training ends before its recorded step: no trace for it
    assert sorted(p.name for p in (out / "profile_traces").iterdir()) == ["iteration_2", "iteration_4"]
    assert (out / "profile_traces" / "iteration_4" / "rank0_trace.json").stat().st_size > 0
    folders = sorted(p.name for p in (out / "memory_snapshot").iterdir())
    assert folders == ["step_000000000002", "step_000000000004"]
    for name in folders:
        files = sorted(p.name for p in (out / "memory_snapshot" / name).iterdir())
        assert files == ["rank0_memory_snapshot.html", "rank0_memory_snapshot.pickle"]
    data = pickle.loads((out / "memory_snapshot" / folders[1] / "rank0_memory_snapshot.pickle").read_bytes())
    titan = data["titan"]
    assert (titan["device"], titan["rank"], titan["step"], titan["oom"]) == ("cpu", 0, 4, False)
    account = titan["account"]
    assert account["params_bytes"] == 4 * account["params_numel"] > 0
    assert account["optimizer_state_bytes"] >= 2 * account["params_bytes"]  # AdamW's moments
    # the parameters are blocks of the snapshot, named; the step's allocations carry their stacks
    blocks = [b for s in data["segments"] for b in s["blocks"]]
    names = {f["name"] for b in blocks for f in b["frames"] if f["filename"] == "<tensor account>"}
    assert any(n.startswith("parameter ") and n.endswith("tok_embeddings.weight") for n in names)
    trace = data["device_traces"][0]
    assert {e["action"] for e in trace} == {"alloc", "free_completed"}
    assert any(f["filename"].endswith("model.py") for e in trace for f in e["frames"])
    assert not [r for r in records if r.get("level") == "warning" and "memory snapshot" in r["event"]]


OOM_HEADER = """
import resource


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData"))


# This process may map 1.5 GiB more than it has now: far more than the tiny model needs, far less
# than the 2 GiB of logits (or the attention scores) this recipe's batch makes.
resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + 1536 * 2**20, resource.RLIM_INFINITY))
"""


def test_cpu_out_of_memory_leaves_the_exit_snapshot_and_one_clear_line(tmp_path: Path) -> None:
    huge = {
        **SNAPSHOT_RUN,
        "training.seq_len": 512,
        "training.local_batch_size": 512,  # logits: 512 x 512 x vocab 2048 in float32, 2 GiB
        "data.bundled_documents": 2500,  # enough text for one such batch
        "model.overrides": {"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
    }
    result = _run(tmp_path, huge, OOM_HEADER)
    assert result.returncode != 0
    folder = tmp_path / "out" / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000000001_exit"]
    snapshot = folder / "step_000000000001_exit" / "rank0_memory_snapshot.pickle"
    assert pickle.loads(snapshot.read_bytes())["titan"]["oom"] is True
    assert snapshot.with_suffix(".html").is_file()
    errors = [r for r in log_records(result.stdout) if r.get("level") == "error"]
    oom = [r["event"] for r in errors if r["event"].startswith("out of memory")]
    assert len(oom) == 1, errors
    assert "out of memory on cpu (rank 0) at step 1 allocating" in oom[0]
    assert str(snapshot) in oom[0] or "step_000000000001_exit" in oom[0]
    assert "training.local_batch_size" in oom[0]


def test_a_fake_mode_snapshot_holds_the_ranks_tensors(tmp_path: Path) -> None:
    """Under the fake backend (fake tensors, no real memory) the snapshot accounts the rank's
    tensors at their real sizes, as the memory report does; it was empty (0 segments)."""
    module = write_recipe_module(tmp_path, {**SNAPSHOT_RUN, "parallelism.dp_shard": 2, "training.steps": 2})
    command = [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"]
    result = subprocess.run(
        [*command, "--comm-backend", "fake"],
        cwd=tmp_path,
        env=child_env(tmp_path, NGPU="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    data = pickle.loads(
        (out / "memory_snapshot" / "step_000000000002" / "rank0_memory_snapshot.pickle").read_bytes()
    )
    account = data["titan"]["account"]
    assert account["params_bytes"] > 0
    blocks = [b for s in data["segments"] for b in s["blocks"]]
    names = {f["name"] for b in blocks for f in b["frames"] if f["filename"] == "<tensor account>"}
    assert any(n.startswith("parameter ") for n in names) and any(n.startswith("optimizer ") for n in names)
    total = sum(b["size"] for b in blocks)
    # at least this rank's parameter shards, gradients and AdamW moments, each once
    assert total >= account["params_bytes"] + account["grads_bytes"] + account["optimizer_state_bytes"]
    assert len({s["address"] for s in data["segments"]}) == len(data["segments"])
    assert "data pointer of FakeTensor" not in result.stderr + result.stdout


def test_a_run_that_ends_before_its_first_snapshot_or_trace_says_so(tmp_path: Path) -> None:
    """Pure fake mode runs one step (``run_train.sh`` sets ``TITAN_DEFAULT_MAX_STEPS=1``): with
    snapshots every 2 steps and traces every 3 it wrote neither, without a word. One warning each
    names the step the run ends at, the setting that ends it and what to change."""
    module = write_recipe_module(
        tmp_path,
        {
            **SNAPSHOT_RUN,
            "parallelism.dp_shard": 2,
            "profiler.enable_profiling": True,
            "profiler.profile_freq": 3,
        },
    )
    command = [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"]
    result = subprocess.run(
        [*command, "--comm-backend", "fake"],
        cwd=tmp_path,
        env=child_env(tmp_path, NGPU="2", TITAN_DEFAULT_MAX_STEPS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    assert [r["step"] for r in records if r.get("event") == "step"] == [1]
    out = tmp_path / "out"
    assert not (out / "memory_snapshot").exists() and not (out / "profile_traces").exists()
    warnings = [r["event"] for r in records if r.get("level") == "warning" and "profiler" in r["event"]]
    snapshot = [w for w in warnings if "no memory snapshot" in w]
    trace = [w for w in warnings if "no profiler trace" in w]
    assert len(snapshot) == 1 and len(trace) == 1, warnings
    assert "ends at step 1 (debug.max_steps = 1" in snapshot[0]
    assert "profiler.memory_snapshot_freq = 2" in snapshot[0] and "step 2" in snapshot[0]
    assert "TITAN_DEFAULT_MAX_STEPS" in snapshot[0]
    assert "profiler.profile_freq = 3" in trace[0] and "step 3" in trace[0]


def test_a_run_that_reaches_a_snapshot_does_not_warn(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 2
    trainer = _trainer(config, torch.device("cpu"))
    trainer.steps = config.training.steps = 2
    assert ProfilerSession(trainer).unreachable() == []
    trainer.steps = config.training.steps = 1
    (problem,) = ProfilerSession(trainer).unreachable()
    assert "no memory snapshot" in problem and "training.steps = 1" in problem


def _profiled(folder: Path, **overrides: Any) -> Any:
    return tiny_config(
        **{
            "job.dump_folder": str(folder),
            "training.steps": 3,
            "profiler.enable_profiling": True,
            "profiler.profile_freq": 1,
            "profiler.enable_memory_snapshot": True,
            **overrides,
        }
    )


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_the_profiler_declares_its_folders_as_outputs() -> None:
    from titan_core._registry import get_registry

    assert set(get_registry().records("callbacks")["torch_profiler"].outputs) == {
        "profile_traces",
        "memory_snapshot",
    }


def test_overwrite_removes_the_earlier_runs_traces_and_snapshots(tmp_path: Path) -> None:
    from titan_core._registry import get_registry
    from titan_core.trainer import train

    train(_profiled(tmp_path), get_registry())
    assert _names(tmp_path / "profile_traces") == ["iteration_1", "iteration_2", "iteration_3"]
    off = {"training.lr": 1e-3, "profiler.enable_profiling": False, "profiler.enable_memory_snapshot": False}
    train(_profiled(tmp_path, **off), get_registry(), overwrite=True)
    assert not (tmp_path / "profile_traces").exists() and not (tmp_path / "memory_snapshot").exists()
    again = _profiled(tmp_path, **{"training.lr": 2e-3, "profiler.profile_freq": 2})
    train(again, get_registry(), overwrite=True)
    assert _names(tmp_path / "profile_traces") == ["iteration_2"]
    assert _names(tmp_path / "memory_snapshot") == ["step_000000000002"]


def test_a_rerun_of_the_same_run_keeps_no_trace_of_the_earlier_attempt(tmp_path: Path) -> None:
    from titan_core._registry import get_registry
    from titan_core.trainer import train

    train(_profiled(tmp_path), get_registry())
    stale = tmp_path / "profile_traces" / "iteration_1" / "rank3_trace.json"  # a rank this run lacks
    stale.write_text("{}")
    (tmp_path / "profile_traces" / "iteration_1" / "notes.txt").write_text("mine")  # not a trace
    train(_profiled(tmp_path, **{"profiler.profile_freq": 2}), get_registry())  # the same run, over
    assert _names(tmp_path / "profile_traces") == ["iteration_1", "iteration_2"]
    assert _names(tmp_path / "profile_traces" / "iteration_1") == ["notes.txt"]
    assert _names(tmp_path / "memory_snapshot") == ["step_000000000002"]


def test_a_resume_keeps_the_traces_of_the_steps_it_continues(tmp_path: Path) -> None:
    from titan_core._registry import get_registry
    from titan_core.trainer import train

    checkpointed = {"training.steps": 4, "checkpoint.enable": True, "checkpoint.interval": 2}
    train(_profiled(tmp_path, **checkpointed, **{"debug.max_steps": 2}), get_registry())
    crashed = tmp_path / "profile_traces" / "iteration_3"  # after step-2, before a crash
    crashed.mkdir()
    (crashed / "rank0_trace.json").write_text("{}")
    oom = tmp_path / "memory_snapshot" / "step_000000000003_exit"  # the crash: out of memory
    oom.mkdir()
    (oom / "rank0_memory_snapshot.pickle").write_bytes(b"evidence")
    train(_profiled(tmp_path, **checkpointed, **{"profiler.profile_freq": 4}), get_registry())
    assert _names(tmp_path / "profile_traces") == ["iteration_1", "iteration_2", "iteration_4"]
    # The out-of-memory snapshot is what the resumed attempt was made to fix: kept.
    kept = [f"step_{s:012d}" for s in (1, 2)] + ["step_000000000003_exit", "step_000000000004"]
    assert _names(tmp_path / "memory_snapshot") == kept


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"profile_freq": 5}, "profiler.profile_freq: 5 does nothing here"),
        ({"memory_snapshot_freq": 2}, "profiler.memory_snapshot_freq: 2 does nothing here"),
        ({"enable_memory_snapshot": True, "profile_freq": 5}, None),  # snapshots read profile_freq
        ({"enable_profiling": True, "save_traces_folder": "t"}, None),
    ],
)
def test_a_profiler_setting_nothing_reads_is_refused(fields: dict[str, Any], refused: str | None) -> None:
    from titan_core.config import ConfigError, TrainerConfig, validate

    config = TrainerConfig()
    for name, value in fields.items():
        setattr(config.profiler, name, value)
    if refused is None:
        validate(config, source="r")
        return
    with pytest.raises(ConfigError, match=refused):
        validate(config, source="r")


@pytest.mark.parametrize(
    ("field", "enable"),
    [
        ("profiler.save_traces_folder", {"profiler.enable_profiling": True, "profiler.profile_freq": 2}),
        (
            "profiler.save_memory_snapshot_folder",
            {"profiler.enable_memory_snapshot": True, "profiler.memory_snapshot_freq": 2},
        ),
    ],
)
def test_a_folder_the_profiler_cannot_write_is_refused_before_training(
    tmp_path: Path, field: str, enable: dict[str, Any]
) -> None:
    """A trace folder titan cannot write (here a file in the way) crashed the process with a
    segmentation fault at the first traced step (torch's profiler stopped after its trace callback
    raised); a snapshot folder ended at the first snapshot as a plugin's bug. Both are bad input,
    refused before step 1."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("mine")
    result = _run(tmp_path, {"training.steps": 4, **enable, field: str(blocker)})
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert errors == [
        f"titan: error: {field} = {str(blocker)!r}: cannot write there: {blocker} is a file, not a "
        f"folder; set {field} to a folder titan can create and write (a relative path is joined to "
        "job.dump_folder)"
    ]
    assert not [r for r in log_records(result.stdout) if r.get("event") == "step"]
    assert blocker.read_text() == "mine"


DISK_FULL_HEADER = """
import errno

import torch.profiler


def _disk_full(self, path, *args, **kwargs):
    with open(path, "w") as f:
        f.write('{"traceEvents": [')  # what a full disk leaves of the trace
    raise OSError(errno.ENOSPC, "No space left on device", path)


torch.profiler.profile.export_chrome_trace = _disk_full
"""


def test_a_trace_that_cannot_be_written_is_one_line_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """The disk fills while a trace is written: the error raised inside torch's profiler left it
    half stopped and the process died of a segmentation fault, with the cut-short trace under its
    final name, read later as a complete one."""
    result = _run(
        tmp_path,
        {"training.steps": 4, "profiler.enable_profiling": True, "profiler.profile_freq": 2},
        DISK_FULL_HEADER,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    path = tmp_path / "out" / "profile_traces" / "iteration_2" / "rank0_trace.json"
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(
        f"titan: error: cannot write the profiler trace of step 2 to {path}: the disk is full "
        "(No space left on device)"
    ), errors[0]
    assert [r["step"] for r in log_records(result.stdout) if r.get("event") == "step"] == [1, 2]
    written = sorted(p.name for p in (tmp_path / "out" / "profile_traces").rglob("*") if p.is_file())
    assert written == []


def _disk_full_pickle(obj: Any, f: Any) -> None:
    f.write(b"\x80\x04partial")  # what a full disk leaves of the pickle
    raise OSError(28, "No space left on device")


def test_a_snapshot_that_cannot_be_written_is_one_error_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_core.errors import TitanError
    from titan_plugins_memory import cpu_snapshot

    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 2
    session = ProfilerSession(_trainer(config, torch.device("cpu")))
    session.on_train_start(0)
    session.on_step_end(1, {}, False)
    monkeypatch.setattr(cpu_snapshot.pickle, "dump", _disk_full_pickle)
    folder = tmp_path / "memory_snapshot" / "step_000000000002"
    with pytest.raises(TitanError, match="cannot write the memory snapshot of step 2 to ") as raised:
        session.on_step_end(2, {}, False)
    assert str(folder / "rank0_memory_snapshot.pickle") in str(raised.value)
    assert "the disk is full (No space left on device)" in str(raised.value)
    session.on_failure(2, raised.value)
    assert not folder.exists() or sorted(p.name for p in folder.iterdir()) == []


def test_an_exit_snapshot_that_cannot_be_written_keeps_the_out_of_memory_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``_exit`` snapshot of an out-of-memory step fails (the disk is full too): the failure
    replaced the out-of-memory error (as a plugin's bug) and its line was never logged."""
    from titan_plugins_memory import cpu_snapshot
    from titan_plugins_profiler import session as session_module

    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 100
    session = ProfilerSession(_trainer(config, torch.device("cpu")))
    session.on_train_start(0)
    monkeypatch.setattr(cpu_snapshot.pickle, "dump", _disk_full_pickle)
    logged: list[str] = []
    monkeypatch.setattr(session_module.log, "error", lambda event, **kw: logged.append(event))
    monkeypatch.setattr(session_module.log, "warning", lambda event, **kw: logged.append(event))
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes.")
    session.on_failure(1, oom)  # does not raise: the out-of-memory error goes on
    path = tmp_path / "memory_snapshot" / "step_000000000001_exit" / "rank0_memory_snapshot.pickle"
    assert not path.exists() and not path.with_suffix(".pickle.partial").exists()
    assert any(line.startswith(f"cannot write the memory snapshot of step 1 to {path}") for line in logged)
    assert any(
        line.startswith("out of memory on cpu (rank 0) at step 1 allocating 1,024.0 MiB") for line in logged
    )


def _stage_failure(oom: BaseException) -> RuntimeError:
    """What torch's pipeline stage raises when its forward runs out of memory: its own
    RuntimeError ('[Stage 1] failed to run forward: ...') raised from the allocator's error."""
    try:
        try:
            raise oom
        except Exception as e:
            raise RuntimeError("\n    [Stage 1] failed to run forward:\n    args: (...)") from e
    except RuntimeError as wrapped:
        return wrapped


def test_an_out_of_memory_error_inside_a_pipeline_stage_gets_the_exit_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline-parallel step that ran out of memory reached the profiler as the stage's
    wrapper RuntimeError: no ``_exit`` snapshot, no out-of-memory line (only a traceback)."""
    from titan_plugins_profiler import session as session_module

    config = tiny_config(**{"job.dump_folder": str(tmp_path), "profiler.enable_memory_snapshot": True})
    config.profiler.memory_snapshot_freq = 100
    session = ProfilerSession(_trainer(config, torch.device("cpu"), rank=2, world=4))
    session.on_train_start(0)
    logged: list[str] = []
    monkeypatch.setattr(session_module.log, "error", lambda event, **kw: logged.append(event))
    wrapped = _stage_failure(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes.")
    )
    session.on_failure(1, wrapped)
    path = tmp_path / "memory_snapshot" / "step_000000000001_exit" / "rank2_memory_snapshot.pickle"
    assert pickle.loads(path.read_bytes())["titan"]["oom"] is True
    assert any(
        line.startswith("out of memory on cpu (rank 2) at step 1 allocating 1,024.0 MiB") for line in logged
    ), logged
    # The run's final error line (titan_core.run.out_of_memory) names the snapshot from this note.
    assert f"titan-oom-snapshot: {path}" in getattr(wrapped, "__notes__", [])
    assert "titan-oom-rank: 2" in wrapped.__notes__


def test_tracing_every_step_warns_of_nothing() -> None:
    """profile_freq = 1 leaves no step for warm-up, by the user's choice: torch's 'Profiler won't
    be using warmup' UserWarning landed in every such run's log as a warning record."""
    import warnings

    from titan_plugins_profiler.session import trace_schedule

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule = trace_schedule(1)
    assert [schedule(step) for step in range(2)] == [torch.profiler.ProfilerAction.RECORD_AND_SAVE] * 2
