"""Per-step metric rows (titan_core/metrics.py): what the log line, metrics.jsonl and TensorBoard get."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def _rows(n: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, n + 1))


@contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes fail as on a full disk (``ulimit -f``: Python ignores SIGXFSZ,
    so the write that crosses the limit is cut short and the next one raises EFBIG)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_under_metrics_jsonl_is_one_error_and_leaves_no_half_row(tmp_path: Path) -> None:
    """Disk full mid-row: a PluginError blaming 'plugin core' (or an OSError traceback), and the
    half row stayed in the file, where titan compare refused the whole run (`not a metrics row`)."""
    from titan_core.errors import TitanError
    from titan_plugins_memory.runs import read_metrics

    path = tmp_path / "metrics.jsonl"
    writer = MetricsFileWriter(str(path))
    for step in (1, 2):
        writer.on_step_end(step, {"step": step, "loss": 1.0}, last=False)
    before = path.read_bytes()
    with (
        _file_size_limit(len(before) + 10),
        pytest.raises(TitanError) as caught,
    ):  # the row is cut at 10 bytes
        writer.on_step_end(3, {"step": 3, "loss": 1.0}, last=False)
    message = str(caught.value)
    assert type(caught.value) is TitanError and "plugin" not in message
    assert f"cannot write the row of step 3 to {path}: File too large" in message
    assert "the rows before it are intact" in message
    writer.on_failure(3, caught.value)
    assert path.read_bytes() == before  # no half row
    assert sorted(read_metrics(str(path))) == [1, 2]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_named_as_one() -> None:
    from titan_core.errors import TitanError

    writer = MetricsFileWriter("/dev/full")  # every write: ENOSPC
    with pytest.raises(
        TitanError, match=r"the disk is full \(No space left on device\); .*\. Free space on that disk"
    ):
        writer.on_step_end(1, {"step": 1, "loss": 1.0}, last=False)
    writer.on_failure(1, RuntimeError())


def test_a_resume_drops_a_row_an_earlier_attempt_left_cut_short(tmp_path: Path) -> None:
    """A row cut off by a crash or a full disk (no newline, not JSON) was kept by the resume, on a
    line of its own: titan compare then refused the run's metrics.jsonl for good."""
    from titan_plugins_memory.runs import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(_rows(6) + '{"step": 7, "lo')
    writer = MetricsFileWriter(str(path), resumed_from=6)
    writer.on_step_end(7, {"step": 7, "loss": 3.0}, last=False)
    writer.on_train_end(7)
    assert path.read_text() == _rows(6) + json.dumps({"step": 7, "loss": 3.0}) + "\n"
    assert sorted(read_metrics(str(path))) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("deleted", ["the file", "the dump folder"])
def test_metrics_jsonl_deleted_during_the_run_stops_it(tmp_path: Path, deleted: str) -> None:
    """The dump folder deleted mid-run: rows went on into the deleted file, the run ended with
    exit 0 and no metrics.jsonl (nor train.log) anywhere."""
    import shutil

    from titan_core.errors import TitanError

    dump = tmp_path / "run"
    dump.mkdir()
    path = dump / "metrics.jsonl"
    writer = MetricsFileWriter(str(path))
    writer.on_step_end(1, {"step": 1, "loss": 1.0}, last=False)
    if deleted == "the file":
        path.unlink()
    else:
        shutil.rmtree(dump)
    with pytest.raises(TitanError, match=rf"{path} was deleted or replaced while this run wrote it"):
        writer.on_step_end(2, {"step": 2, "loss": 1.0}, last=False)
    writer.on_failure(2, RuntimeError())
    assert not path.exists()  # nothing recreated


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_tensorboard_folder_that_cannot_be_written_is_one_error_without_thread_tracebacks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The TensorBoard folder gone (or its disk full) mid-run: `Exception in thread Thread-1`
    and `titan-tensorboard-close` tracebacks on stderr, and a PluginError blaming 'plugin core'."""
    import shutil

    from titan_core.errors import TitanError
    from titan_core.metrics import TensorBoardWriter

    folder = tmp_path / "tb"
    board = TensorBoardWriter(str(folder))
    board.on_step_end(1, {"step": 1, "loss": 1.0}, last=False)
    shutil.rmtree(folder)
    with pytest.raises(TitanError) as caught:
        for step in range(2, 5):  # the writer thread fails on the first write after the deletion
            board.on_step_end(step, {"step": step, "loss": 1.0}, last=False)
    assert type(caught.value) is TitanError
    assert f"cannot write the TensorBoard scalars of step 2 to {folder}: No such file" in str(caught.value)
    board.on_failure(2, caught.value)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err


def _strict(line: str) -> dict:
    """``json.loads`` as every other JSON reader parses: ``NaN`` and ``Infinity`` are no JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_null_in_metrics_jsonl(tmp_path: Path) -> None:
    """A fake-backend run logs NaN losses, a callback may report NaN or inf: metrics.jsonl held
    bare ``NaN``/``Infinity``, which jq, JavaScript, Go and other strict readers refuse (the
    whole file, for one row)."""
    row = {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "x/y": -math.inf}
    writer = MetricsFileWriter(str(tmp_path / "metrics.jsonl"))
    writer.on_step_end(1, row, last=True)
    writer.on_train_end(1)
    written = _strict((tmp_path / "metrics.jsonl").read_text())
    assert written == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "x/y": None}


def test_the_console_line_shows_small_values_without_rounding_them_to_zero() -> None:
    """A vanishing gradient norm of 3e-5 showed as ``gnorm 0.000``, a loss of 4e-6 as ``loss
    0.0000``: zeros that were not (metrics.jsonl kept the values; the line a person reads did not)."""
    from titan_core.log import _for_console

    row = {"event": "step", "step": 2, "of": 3, "loss": 4.2e-6, "lr": 1e-3, "grad_norm": 3.1e-5}
    line = _for_console(row)["event"]
    assert "loss 4.200e-06" in line and "gnorm 3.100e-05" in line
    usual = _for_console({**row, "loss": 3.21, "grad_norm": 1.5})["event"]
    assert "loss 3.2100" in usual and "gnorm 1.500" in usual  # the usual sizes as before
    zero = _for_console({**row, "loss": 0.0, "grad_norm": float("nan")})["event"]
    assert "loss 0.0000" in zero and "gnorm nan" in zero


def test_json_log_lines_write_non_finite_values_as_null(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON log lines on stdout (what `titan run ... | jq` and log collectors read) held bare
    ``NaN`` for a fake-backend run's loss, refused by strict readers like metrics.jsonl was."""
    from titan_core.log import LOG_FORMAT_ENV, get_logger, setup_logging

    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    setup_logging()
    get_logger("titan.test").info("step", step=1, loss=float("nan"), grad_norm=math.inf, lr=1e-3)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    record = _strict(line)
    assert (record["loss"], record["grad_norm"], record["lr"]) == (None, None, 1e-3)


@pytest.mark.parametrize(("tp", "pp", "cp"), [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_tokens_per_second_and_mfu_are_per_device_under_tp_pp_and_cp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int, cp: int
) -> None:
    """A DP rank's tokens are processed by its tp x pp x cp devices together, each doing that share
    of the FLOPs: tokens/s (per device) and MFU divide by all three (torchtitan's
    ``non_data_parallel_size``). Only cp was divided by, so TP 2 or PP 2 logged twice the tokens/s
    of each device and twice its MFU (MFU over 100% on a well-tuned run), without a word."""
    from tests.conftest import tiny_llama3
    from titan_core._registry import get_registry
    from titan_core.trainer import Trainer

    monkeypatch.setenv("NGPU", "4")  # a logical 4-rank job, this process one of its ranks
    if pp > 1:
        monkeypatch.setenv("FAKE_PP_RANK", "1")
    config = tiny_llama3(tmp_path, 2)
    config.comm.backend = "fake"
    config.debug.fake_tensors = "off"  # computed steps, so throughput is measured
    config.training.device = "cpu"
    config.training.local_batch_size = 4
    config.training.global_batch_size = 4 * 2 * (4 // (tp * pp * cp))  # two microbatches per step
    config.parallelism.tp, config.parallelism.pp, config.parallelism.cp = tp, pp, cp
    config.metrics.log_freq = 1
    config.metrics.peak_tflops = 1e-3  # a small CPU run does about 1e-4 TFLOP/s
    trainer = Trainer(config, get_registry())
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    per_device = 2 * 4 * 32 / (tp * pp * cp)  # microbatches x local batch x seq_len over the devices
    assert trainer.metrics.tokens_per_step == per_device
    for row in rows:
        assert row["tps"] * row["step_time_s"] == pytest.approx(per_device, rel=2e-2)
        assert row["tflops"] == pytest.approx(trainer.metrics.flops_per_token * row["tps"] / 1e12, rel=2e-3)
        assert row["mfu_pct"] == pytest.approx(100 * row["tflops"] / 1e-3, rel=2e-3, abs=0.01)


def test_the_first_step_time_starts_when_training_starts(tmp_path: Path) -> None:
    """The clock of the first logged interval started when the metrics were built, so what came
    between (the callbacks' building, a TensorBoard writer, a resume's skip over the consumed
    batches, ``on_train_start``) was counted as step time: the first interval after a resume logged
    too low a tokens/s and too long a step time. Here one second passes before ``train()``."""
    from tests.conftest import tiny_llama3
    from titan_core._registry import get_registry
    from titan_core.trainer import Trainer

    config = tiny_llama3(tmp_path, 2)
    config.metrics.log_freq = 1
    trainer = Trainer(config, get_registry())
    try:
        time.sleep(1.0)
        rows = trainer.train()
    finally:
        trainer.close()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["step_time_s"] < 0.5, rows[0]  # a tiny CPU step takes about 0.05 s
    assert rows[0]["tps"] * rows[0]["step_time_s"] == pytest.approx(2 * 32, rel=2e-2)


def test_mfu_keeps_four_significant_digits_beside_the_tflops() -> None:
    """MFU was rounded to 2 decimals: a small model against a GPU's peak (2e-6 TFLOP/s of 989)
    logged ``"mfu_pct": 0.0`` beside ``"tflops": 2e-06`` in metrics.jsonl and TensorBoard, and
    ``mfu 0.0%`` on the console line, a zero that was not."""
    from titan_core.log import _for_console

    row = _row(2e3, peak=989.0)
    assert row["mfu_pct"] > 0
    assert row["mfu_pct"] == pytest.approx(100 * row["tflops"] / 989.0, rel=2e-3)
    assert row["mfu_pct"] == float(f"{row['mfu_pct']:.4g}")
    line = _for_console({"event": "step", "step": 1, "of": 1, **row})["event"]
    assert "mfu 0.0%" not in line and f"mfu {row['mfu_pct']:.3e}%" in line
    usual = _for_console({"event": "step", "step": 1, "of": 1, "mfu_pct": 41.27})["event"]
    assert "mfu 41.3%" in usual  # the usual sizes as before


def test_a_boolean_callback_metric_is_written_as_a_number_titan_compare_reads(tmp_path: Path) -> None:
    """A callback may report a ``bool``; metrics.jsonl held ``true``, and ``titan compare --metrics``
    of it called titan's own file damaged (``... is true (a boolean), not a number; titan writes a
    number (or null) there: the file is damaged ...``)."""
    from titan_core.metrics import check_callback_metrics
    from titan_plugins_memory.runs import read_metrics

    values = check_callback_metrics({"probe/ok": True, "probe/n": 3}, "callback 'probe' (plugin p)")
    assert values == {"probe/ok": 1, "probe/n": 3} and type(values["probe/ok"]) is int
    writer = MetricsFileWriter(str(tmp_path / "metrics.jsonl"))
    writer.on_step_end(1, {"step": 1, "loss": 2.0, **values}, last=True)
    writer.on_train_end(1)
    assert read_metrics(str(tmp_path), ["probe/ok"])[1]["probe/ok"] == 1


def test_a_checkpoint_save_is_not_counted_in_the_next_steps_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint save runs after its step's row, so its seconds went into the next logged
    interval: the step after each save logged the save's time as step time, and a tokens/s far too
    low. Here each save takes 100 s of a shifted clock (deterministic, no sleeping)."""
    from tests.conftest import tiny_llama3
    from titan_core._registry import get_registry
    from titan_core.trainer import Trainer

    shift = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + shift[0])
    config = tiny_llama3(tmp_path, 4)
    config.metrics.log_freq = 1
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    trainer = Trainer(config, get_registry())
    save = trainer.checkpointer.save

    def slow_save(*args: object, **kwargs: object) -> object:
        shift[0] += 100.0
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpointer, "save", slow_save)
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert shift[0] == 200.0  # saved at steps 2 and 4
    assert max(r["step_time_s"] for r in rows) < 50, rows
    assert rows[2]["tps"] * rows[2]["step_time_s"] == pytest.approx(2 * 32, rel=2e-2)
