"""The memory report outside the fake backends: its allocation tracker, the optimizer warm-up, and
a real one-process run with ``debug.memory_report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_titan, step_rows
from titan_plugins_memory.report import POINTS, warm_up_optimizer
from titan_plugins_memory.tracker import AllocationTracker


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


def test_tracker_history_has_the_allocating_line() -> None:
    with AllocationTracker(history=100) as tracker:
        x = torch.zeros(256)  # 1 KiB, allocated on this line
        del x
    actions = [(e["action"], e["size"]) for e in tracker.events]
    assert actions == [("alloc", 1024), ("free_completed", 1024)]
    frame = tracker.events[0]["frames"][0]
    assert frame["filename"] == __file__ and frame["name"] == "test_tracker_history_has_the_allocating_line"


def _adamw_pair(
    weight_decay: float,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    kw = {"lr": 0.1, "weight_decay": weight_decay, "foreach": True}
    return a, b, torch.optim.AdamW(a.parameters(), **kw), torch.optim.AdamW(b.parameters(), **kw)


def test_optimizer_warmup_allocates_state_and_changes_nothing() -> None:
    a, b, opt_a, opt_b = _adamw_pair(weight_decay=0.5)  # a large decay would show at once
    before = {k: v.clone() for k, v in b.state_dict().items()}
    assert warm_up_optimizer(opt_b, list(b.parameters())) is True
    assert all(torch.equal(before[k], v) for k, v in b.state_dict().items())  # weights untouched
    state = opt_b.state[b.weight]
    assert state["exp_avg"].shape == b.weight.shape and float(state["step"]) == 0
    assert all(p.grad is None for p in b.parameters())
    assert opt_b.param_groups[0]["lr"] == 0.1 and opt_b.param_groups[0]["weight_decay"] == 0.5
    x = torch.randn(16, 8)
    for _ in range(3):  # the same steps as a run whose state was allocated lazily
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    assert warm_up_optimizer(opt_b, list(b.parameters())) is False  # state exists: left alone


RECIPES = """
from titan_plugins_llama3.recipes import llama3_debugmodel


def tiny_report():
    config = llama3_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4}
    config.training.steps = 3
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.device = "cpu"
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.debug.memory_report = True
    config.job.dump_folder = "./out"
    return config


def tiny_no_report():
    config = tiny_report()
    config.debug.memory_report = False
    config.job.dump_folder = "./out_plain"
    return config
"""


def test_memory_report_in_a_real_one_process_run(tmp_path: Path) -> None:
    (tmp_path / "report_recipes.py").write_text(RECIPES)
    result = run_titan("run", "--module", "report_recipes", "--recipe", "tiny_report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "memory_report_rank0.json").read_text())
    assert report["comm_backend"] == "default" and report["world_size"] == 1
    assert report["steady_step"] == 2 and report["optimizer_warmup"] is True
    points = [(o["point"], o["step"]) for o in report["observations"]]
    assert points == list(zip(POINTS, (0, 0, 2, 2), strict=True))
    assert report["params_bytes"] == 4 * report["params_numel"]
    first, warm, steady, last = report["observations"]
    assert first["grads_bytes"] == 0 and first["optimizer_state_bytes"] == 0
    # the state exists before the first forward: AdamW's two moments (plus step counters)
    assert warm["optimizer_state_bytes"] >= 2 * report["params_bytes"] and warm["grads_bytes"] == 0
    assert last["optimizer_state_bytes"] == warm["optimizer_state_bytes"]
    assert last["grads_bytes"] == report["params_bytes"]
    assert steady["step_allocations_peak_bytes"] > 0
    assert steady["peak_bytes"] >= steady["accounted_bytes"]
    # what identifies the configuration
    assert report["model_overrides"] == {"dim": 64, "n_layers": 2, "n_heads": 4}
    assert (report["seq_len"], report["local_batch_size"], report["dtype"]) == (32, 2, "float32")
    assert report["activation_checkpoint"] == "none" and report["compile"] is False
    assert len(report["config_hash"]) == 16
    assert "memory report: tiny_report" in result.stdout

    # The warm-up changes no weight: the losses equal those of a run without the report.
    plain = run_titan("run", "--module", "report_recipes", "--recipe", "tiny_no_report", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not (tmp_path / "out_plain" / "memory_report_rank0.json").exists()
    losses = [r["loss"] for r in step_rows(result.stdout)]
    assert len(losses) == 3 and losses == [r["loss"] for r in step_rows(plain.stdout)]


def test_tracker_does_not_count_views_of_existing_tensors() -> None:
    weight = torch.ones(1000, 10)  # a parameter, say: allocated before the step
    with AllocationTracker() as tracker:
        t = weight.t()  # F.linear's transpose of a weight: a view, no new memory
        weight.add_(1)  # in place
        d = weight.detach()
        assert tracker.current == 0
        y = t.contiguous()  # a real copy
        assert tracker.current == 40000
    del t, d, y


def _step_peak(fake: bool) -> tuple[int, int]:
    """Tracker peak of one forward/backward of a small MLP, computed or under FakeTensorMode."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else nullcontext()
    with mode:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        x = torch.randn(64, 256)
        with AllocationTracker(fake_mode=mode if fake else None) as tracker:
            model(x).square().mean().backward()
        return tracker.peak, tracker.current


def test_tracker_counts_fake_tensors_as_the_real_run_allocates() -> None:
    """Under FakeTensorMode nothing is computed or allocated, yet the step's account is the real one."""
    real = _step_peak(fake=False)
    assert real[0] > 64 * 1024 * 4  # at least the hidden activations
    assert _step_peak(fake=True) == real


def test_tracker_ignores_fake_tensors_of_another_mode() -> None:
    """DTensor infers shapes on fake tensors of its own: they hold no memory of the run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with AllocationTracker() as tracker:
        with FakeTensorMode():
            shape_only = torch.empty(1024, 1024)
        real = torch.empty(256)
    assert tracker.current == 1024 and shape_only.shape == (1024, 1024)
    del real


def test_tracker_counts_storages_resized_under_fake_execution() -> None:
    """FSDP allocates and frees unsharded parameters by resizing their storage: under fake
    execution those storages stand for real memory too (missing them hid the peak's gathered
    parameters)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        unsharded = torch.empty(1024)
        unsharded.untyped_storage().resize_(0)
        with AllocationTracker(fake_mode=mode) as tracker:
            unsharded.untyped_storage().resize_(4096)
            gathered = tracker.current
            unsharded.untyped_storage().resize_(0)
    assert gathered == 4096 and tracker.peak == 4096 and tracker.current == 0


def test_tracker_under_fake_execution_ignores_dtensor_global_shape_inference() -> None:
    """DTensor infers each new operator's output on fake tensors of the *global* shape, in the
    active fake mode: the run's allocations are the local shards only."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        n = dist.get_world_size()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            x = distribute_tensor(torch.empty(n * 64, 1024), mesh, [Shard(0)])
            with AllocationTracker(fake_mode=mode) as tracker:
                y = (x * 3.0).sin()  # two new operators: two global-shape inferences
        local = 64 * 1024 * 4
        assert tracker.peak == 2 * local and y.to_local().shape == (64, 1024)
    finally:
        if owned:
            dist.destroy_process_group()


def _report_of_a_tiny_run(dump: Path) -> object:
    """A memory report on a stand-in trainer: a linear layer and AdamW, one rank, on the CPU."""
    from types import SimpleNamespace

    from tests.parallel_harness import tiny_config
    from titan_core.parallel_dims import ParallelDims
    from titan_core.topology import Topology
    from titan_plugins_memory.report import MemoryReport

    config = tiny_config(**{"job.dump_folder": str(dump), "debug.memory_report": True})
    model = torch.nn.Linear(8, 8)
    trainer = SimpleNamespace(
        config=config,
        topology=Topology(1, 0, 0, torch.device("cpu")),
        parallel_dims=ParallelDims.from_config(config.parallelism, 1),
        parts=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
        steps=2,
    )
    return MemoryReport(trainer)


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


def test_a_report_that_cannot_be_written_keeps_the_runs_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is full when a failed run writes its report: the OSError took the place of the
    run's error (the trainer reported a plugin's failure, not the out-of-memory step), and a
    report cut short was left under its final name."""
    import titan_plugins_memory.report as report_module

    report = _report_of_a_tiny_run(tmp_path)
    report.on_train_start(0)
    monkeypatch.setattr(report_module.json, "dump", _disk_full)
    warned: list[str] = []
    monkeypatch.setattr(report_module.log, "warning", lambda event, **kw: warned.append(event))
    report.on_failure(
        1, RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    )
    path = tmp_path / "memory_report_rank0.json"
    assert warned and warned[0].startswith(f"cannot write the memory report to {path}: the disk is full")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_report_that_cannot_be_written_at_the_end_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import titan_plugins_memory.report as report_module
    from titan_core.errors import TitanError

    report = _report_of_a_tiny_run(tmp_path)
    report.on_train_start(0)
    monkeypatch.setattr(report_module.json, "dump", _disk_full)
    with pytest.raises(TitanError, match=r"cannot write the memory report to .*: the disk is full"):
        report.on_train_end(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_reports_error_names_the_out_of_memory_error_a_pipeline_stage_wrapped(
    tmp_path: Path,
) -> None:
    """The report of a coordinate whose pipeline stage ran out of memory said only
    'RuntimeError: [Stage 1] failed to run forward:' (what --all-pp-ranks shows as its cause)."""
    report = _report_of_a_tiny_run(tmp_path)
    report.on_train_start(0)
    oom = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
    try:
        try:
            raise RuntimeError(oom)
        except RuntimeError as e:
            raise RuntimeError("\n            [Stage 1] failed to run forward:\n") from e
    except RuntimeError as exc:
        wrapped = exc
    report.on_failure(1, wrapped)
    data = json.loads((tmp_path / "memory_report_rank0.json").read_text())
    assert data["error"] == f"step 1: out of memory: RuntimeError: {oom}"
    # the rank this process stands for, for the run's last line (fake backends: not RANK)
    assert "titan-oom-rank: 0" in wrapped.__notes__
