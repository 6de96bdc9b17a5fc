"""The last line of a run that ran out of memory (``titan_core.run.out_of_memory``): one
``titan: error:`` line also when torch wrapped the allocator's error (a pipeline stage), naming
the snapshot the profiler wrote, and never a snapshot that does not exist."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from titan_core.errors import TitanError
from titan_core.run import out_of_memory

CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 536870912 bytes."


def _config(snapshots: bool) -> SimpleNamespace:
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder="./out"),
        profiler=SimpleNamespace(enable_memory_snapshot=snapshots),
    )


def _stage_failure() -> RuntimeError:
    """torch.distributed.pipelining's stage: ``raise RuntimeError(exc_msg) from e``."""
    try:
        try:
            raise RuntimeError(CPU_OOM)
        except RuntimeError as e:
            raise RuntimeError("\n    [Stage 1] failed to run forward:\n    args: (...)") from e
    except RuntimeError as wrapped:
        return wrapped


def test_an_out_of_memory_error_wrapped_by_a_pipeline_stage_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    error = out_of_memory(_stage_failure(), _config(snapshots=False))
    assert isinstance(error, TitanError)
    assert str(error).startswith(f"out of memory on rank 0 ({CPU_OOM}")


def test_without_snapshots_the_line_says_how_to_get_one_and_claims_none() -> None:
    error = out_of_memory(RuntimeError(CPU_OOM), _config(snapshots=False))
    assert error is not None
    assert "a memory snapshot is in" not in str(error)
    assert "profiler.enable_memory_snapshot = True" in str(error)


def test_the_line_names_the_exit_snapshot_the_profiler_wrote() -> None:
    exc = _stage_failure()
    path = "./out/memory_snapshot/step_000000000001_exit/rank2_memory_snapshot.pickle"
    exc.add_note(f"titan-oom-snapshot: {path}")
    error = out_of_memory(exc, _config(snapshots=True))
    assert error is not None and f"memory snapshot: {path}" in str(error)


def test_a_snapshot_that_could_not_be_written_is_not_claimed() -> None:
    error = out_of_memory(RuntimeError(CPU_OOM), _config(snapshots=True))
    assert error is not None
    assert "a memory snapshot is in" not in str(error)
    assert "no memory snapshot was written" in str(error)


def test_other_errors_are_not_out_of_memory() -> None:
    try:
        try:
            raise ValueError("shape mismatch")
        except ValueError as e:
            raise RuntimeError("[Stage 1] failed to run forward") from e
    except RuntimeError as wrapped:
        assert out_of_memory(wrapped, _config(snapshots=True)) is None


def test_the_line_names_the_logical_rank_a_plugin_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the fake backend the process stands for logical rank FAKE_PP_RANK * NGPU / pp, but
    RANK is unset: the line said 'rank 0' beside the profiler's and the report's 'rank 2'."""
    monkeypatch.delenv("RANK", raising=False)
    exc = _stage_failure()
    exc.add_note("titan-oom-rank: 2")
    error = out_of_memory(exc, _config(snapshots=False))
    assert error is not None and str(error).startswith("out of memory on rank 2 (")
