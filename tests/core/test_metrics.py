"""Per-step metric rows (titan_core/metrics.py): what the log line, metrics.jsonl and TensorBoard get."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_core.metrics import MetricsFileWriter, MetricsLogger


def _row(flops_per_token: float, tokens_per_step: int = 1000, peak: float | None = None) -> dict:
    config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1, peak_tflops=peak))
    metrics = MetricsLogger(config, torch.device("cpu"), flops_per_token, tokens_per_step, total_steps=1)
    metrics._t0 = time.perf_counter() - 1.0  # about one second per step
    return metrics.step_done(1, 2.5, 1.0)


@pytest.mark.parametrize("flops_per_token", [2e3, 3e5, 7e7, 4e11])
def test_tflops_keep_four_significant_digits_at_every_scale(flops_per_token: float) -> None:
    """A small CPU run does 1e-4 TFLOP/s: rounded to 3 decimals it logged 0.0 beside a real MFU."""
    row = _row(flops_per_token, peak=1e-5)
    exact = flops_per_token * row["tps"] / 1e12  # tps is rounded to 0.1 tok/s: near enough
    assert row["tflops"] > 0
    assert row["tflops"] == pytest.approx(exact, rel=2e-3)
    assert row["tflops"] == float(f"{row['tflops']:.4g}")  # no more digits than four
    assert row["mfu_pct"] == pytest.approx(100 * row["tflops"] / 1e-5, rel=2e-3)


def test_metrics_jsonl_and_tensorboard_get_the_row_as_logged(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_core.metrics import TensorBoardWriter

    row = _row(2e3)  # 2e-6 TFLOP/s
    assert row["tflops"] > 0
    writer = MetricsFileWriter(str(tmp_path / "metrics.jsonl"))
    writer.on_step_end(1, row, last=True)
    writer.on_train_end(1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == row
    board = TensorBoardWriter(str(tmp_path / "tb"))
    board.on_step_end(1, row, last=True)
    board.on_train_end(1)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    (scalar,) = events.Scalars("train/tflops")
    assert scalar.value == pytest.approx(row["tflops"], rel=1e-6)  # float32 of the same value


def test_the_learning_rate_is_logged_at_full_precision() -> None:
    """A schedule is checked against its formula from metrics.jsonl: 1e-3 / 3 is not 0.0003333."""
    config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1, peak_tflops=None))
    metrics = MetricsLogger(config, torch.device("cpu"), 1.0, 1000, total_steps=1)
    assert metrics.step_done(1, 2.5, 1.0, 1e-3 / 3)["lr"] == 1e-3 / 3


def test_a_resume_drops_the_rows_an_interrupted_attempt_logged_after_its_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C after step 6 of a run checkpointed at 4: the resume trains 5 and 6 again, and
    metrics.jsonl held both attempts' rows of them."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 7)))
    writer = MetricsFileWriter(str(path), resumed_from=4)
    writer.on_step_end(5, {"step": 5, "loss": 4.5}, last=False)
    writer.on_train_end(5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["loss"] == 4.5


def test_a_resumed_tensorboard_drops_the_interrupted_attempts_later_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_core.metrics import TensorBoardWriter

    first = TensorBoardWriter(str(tmp_path))
    for step in range(1, 7):
        first.on_step_end(step, {"step": step, "loss": 10.0 - step}, last=False)
    first.on_train_end(6)
    time.sleep(1.1)  # event files are named by the second: the resume's is a new one
    resumed = TensorBoardWriter(str(tmp_path), resumed_from=4)
    for step in (5, 6):
        resumed.on_step_end(step, {"step": step, "loss": 1.0}, last=False)
    resumed.on_train_end(6)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == [1, 2, 3, 4, 5, 6]
    assert [s.value for s in scalars][4:] == [1.0, 1.0]
