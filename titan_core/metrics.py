"""Per-step throughput, FLOPs, MFU and memory; the log line and TensorBoard scalars."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# The tags callbacks.py checks callback metric names against.
from titan_core.callbacks import metric_tag
from titan_core.errors import PluginError, TitanError, write_failure
from titan_core.log import get_logger, json_dumps
from titan_core.run_folder import write_whole

GiB = 1024**3

# Dense bf16 peak TFLOP/s (without sparsity) by device-name fragment.
_PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
}


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset, in GiB (CUDA allocator, or this process's RSS on CPU)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            "max_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / GiB,
            "max_reserved_gib": reserved / GiB,
            "max_reserved_pct": 100 * reserved / total,
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"max_rss_gib": rss_kib / 1024**2}


def check_callback_metrics(values: Any, source: str) -> dict[str, int | float]:
    """``values``, what a callback's ``metrics(step)`` returned, if the metric writers can take it:
    a mapping of ``str`` keys to ``bool``, ``int`` or ``float`` values (NaN and inf included:
    TensorBoard writes them, ``metrics.jsonl`` null, as JSON has no such numbers), with each
    ``bool`` as the number 0 or 1. Anything else is one :class:`PluginError` naming ``source``
    (``callback 'x' (plugin p)``), the key and the type; TensorBoard would drop it silently and the
    log line and ``metrics.jsonl`` carry it as text."""
    from collections.abc import Mapping

    if not isinstance(values, Mapping):
        raise PluginError(
            f"{source}: metrics(step) returned {type(values).__name__}, not a mapping of metric "
            "names to numbers (return {} when there is nothing to report)"
        )
    for key, value in values.items():
        if not isinstance(key, str):
            raise PluginError(
                f"{source}: metrics(step) returned the key {key!r} ({type(key).__name__}), not a str"
            )
        if not isinstance(value, (int, float)):
            kind = type(value).__name__
            hint = " (call .item() on a one-element tensor)" if hasattr(value, "item") else ""
            raise PluginError(
                f"{source}: metrics(step) returned {key!r} = {_short(value)} ({kind}); metric values "
                f"must be bool, int or float{hint}"
            )
    # A bool as 0 or 1, as TensorBoard writes it: metrics.jsonl held `true`, which `titan compare`
    # (numbers or null only) refused as a damaged file.
    return {key: int(value) if isinstance(value, bool) else value for key, value in values.items()}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class MetricsLogger:
    """Times steps and computes one row of metrics every ``log_freq`` steps (and on step 1).

    The row goes to the log line (:meth:`emit`) and, through the loop's ``on_step_end``, to the
    metric writers (TensorBoard, ``metrics.jsonl``): those are callbacks, not part of this class.
    """

    def __init__(
        self,
        config: Any,
        device: torch.device,
        flops_per_token: float,
        tokens_per_step: float,
        total_steps: int,
        throughput: bool = True,
    ) -> None:
        """``tokens_per_step``: the tokens one device processes per step (its DP rank's over the
        rank's cp x tp x pp devices), what tokens/s and MFU are per device of. ``throughput=False``:
        rows and the summary carry no tokens/s, TFLOP/s or MFU (a run of shape-only steps computes
        nothing)."""
        self.log_freq = config.metrics.log_freq
        self.throughput = throughput
        self.device = device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.total_steps = total_steps
        self.peak = peak_tflops(device, config.metrics.peak_tflops)
        self.logger = get_logger("titan.metrics")
        self._t0 = time.perf_counter()
        self._steps = 0
        self._excluded = 0.0  # seconds spent in paused() since the last row
        #: (steps, seconds) of each row's interval, for the summary's means after warm-up.
        self._intervals: list[tuple[int, float]] = []
        self.history: list[dict[str, float]] = []

    def start(self) -> None:
        """Start the clock of the first interval: the loop calls it right before its first step.
        Started when the metrics were built, the interval counted everything until then (the
        callbacks' building, a resume's skip over the consumed batches) as step time."""
        self._t0 = time.perf_counter()
        self._steps = 0
        self._excluded = 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of step times and throughput (validation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - start

    def logs(self, step: int) -> bool:
        """Whether ``step`` logs (the first, every ``log_freq``-th and the last)."""
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def step_done(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        lr: float | None = None,
        *,
        force: bool = False,
    ) -> dict[str, float]:
        """Count the step; on logging steps (or ``force``) return its row (empty otherwise)."""
        self._steps += 1
        if not (force or self.logs(step)):
            return {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - self._t0 - self._excluded, 1e-9)
        self._intervals.append((self._steps, elapsed))
        step_time = elapsed / self._steps
        tps = self.tokens_per_step / step_time
        tflops = self.flops_per_token * tps / 1e12
        row: dict[str, float] = {"step": step}
        if loss is not None:
            row["loss"] = loss  # full precision: titan compare tells 1e-6 apart
        if grad_norm is not None:
            row["grad_norm"] = grad_norm
        if lr is not None:
            row["lr"] = lr  # full precision: a schedule is checked against its formula
        if self.throughput:
            row["tps"] = round(tps, 1)
            # Significant digits, not decimals: a small run does 1e-4 TFLOP/s, which 3 decimals
            # logged (and wrote to metrics.jsonl and TensorBoard) as 0.0 beside a real MFU.
            row["tflops"] = float(f"{tflops:.4g}")
            if self.peak:
                # Significant digits too: a small model against a GPU's peak is at 2e-4 %, which
                # 2 decimals logged as 0.0 beside its TFLOP/s.
                row["mfu_pct"] = float(f"{100 * tflops / self.peak:.4g}")
        row.update({k: round(v, 3) for k, v in memory_stats(self.device).items()})
        row["step_time_s"] = round(step_time, 4)
        self.history.append(row)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()
        self._steps = 0
        self._excluded = 0.0
        return row

    def summary(self) -> dict[str, Any]:
        """Means over the logged intervals after the first (warm-up: compilation, allocator),
        or over all of them when there is only one; and the last logged loss."""
        after = self._intervals[1:] or self._intervals
        steps = sum(n for n, _ in after)
        seconds = sum(t for _, t in after)
        out: dict[str, Any] = {"tps": None, "mfu_pct": None, "loss": None, "warmup_excluded": False}
        if steps and seconds > 0 and self.throughput:
            tps = self.tokens_per_step * steps / seconds
            out["tps"] = tps
            out["warmup_excluded"] = len(self._intervals) > 1
            if self.peak:
                out["mfu_pct"] = 100 * self.flops_per_token * tps / 1e12 / self.peak
        losses = [r["loss"] for r in self.history if "loss" in r]
        out["loss"] = losses[-1] if losses else None
        return out

    def emit(self, row: dict[str, float]) -> None:
        """The log line of a logging step: ``step N/total`` and ETA beside the row."""
        remaining = (self.total_steps - int(row["step"])) * row.get("step_time_s", 0.0)
        self.logger.info("step", **row, of=self.total_steps, eta=_duration(remaining))

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


#: How long a failing run waits for the TensorBoard writer thread to end.
_CLOSE_WAIT_S = 10.0


class TensorBoardWriter:
    """Writes every logged row as scalars (``metrics.enable_tensorboard``, logging rank only).

    A write that fails (a full disk, the folder deleted) stops the run with one error naming the
    folder, raised at the next row by the writer thread's keeper; the thread's own traceback is
    not printed (:func:`_quiet_tensorboard_threads`).
    """

    def __init__(self, folder: str, resumed_from: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        _quiet_tensorboard_threads()
        # A resumed run trains the steps after its checkpoint again: TensorBoard drops the
        # interrupted attempt's scalars of those steps (purge_step), as metrics.jsonl does.
        self.writer = SummaryWriter(folder, purge_step=resumed_from + 1 if resumed_from else None)

    @classmethod
    def build(cls, trainer: Any) -> TensorBoardWriter | None:
        m = trainer.config.metrics
        if not (m.enable_tensorboard and trainer.is_logging_rank):
            return None
        from titan_core.run_folder import tb_location

        return cls(tb_location(trainer.config.job.dump_folder, m.save_tb_folder), resumed_from=trainer.step)

    def on_step_end(self, step: int, metrics: dict[str, float], last: bool) -> None:
        if not metrics:
            return
        try:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(metric_tag(key), value, step)
            self.writer.flush()
        except OSError as exc:  # the writer thread's, raised again here
            raise write_failure(self.folder, exc, what=f"the TensorBoard scalars of step {step}") from None

    def on_train_end(self, step: int) -> None:
        try:
            self.writer.close()
        except OSError as exc:
            raise write_failure(self.folder, exc, what=f"the TensorBoard scalars of step {step}") from None

    def on_failure(self, step: int, exc: BaseException) -> None:
        # Rows are flushed as they are logged; closing only ends the writer thread. An exception
        # raised asynchronously (a second Ctrl-C) can leave that thread's queue unable to stop,
        # so the close gets a bounded wait instead of hanging the failing run's exit.
        import threading

        def close() -> None:
            # A writer whose write failed raises that error again here; the run reports it already.
            with contextlib.suppress(Exception):
                self.writer.close()

        closer = threading.Thread(target=close, name="titan-tensorboard-close", daemon=True)
        closer.start()
        closer.join(timeout=_CLOSE_WAIT_S)


def _quiet_tensorboard_threads() -> None:
    """Drop the report ``threading.excepthook`` prints for TensorBoard's writer thread when its
    write fails with an ``OSError`` (a full disk): the thread keeps the error, and the writer
    raises it at its next call in the training thread, where :class:`TensorBoardWriter` turns it
    into the run's one error. Every other thread's exception is reported as before."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "titan_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.titan_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _keep_rows_up_to(path: str, step: int) -> None:
    """Rewrite ``path`` (atomically) without the rows of steps after ``step``; lines that are no
    row of a step are kept as they are, except a last line cut short (no newline, no JSON): the
    row a crash or a full disk stopped half-way, which readers of the file would refuse."""
    kept = []
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines) and not line.endswith("\n"):
                break
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step):
            kept.append(line if line.endswith("\n") else line + "\n")

    def dump(partial: str) -> None:
        with open(partial, "w") as f:
            f.writelines(kept)

    write_whole(path, dump)


class MetricsFileWriter:
    """Appends every logged row to ``<dump_folder>/metrics.jsonl`` (logging rank only).

    One JSON object per logged step; ``titan compare`` reads it. A run that starts from step 0
    truncates the file; a run resumed from step ``resumed_from`` first drops the rows of the
    steps after it (an interrupted attempt logged them, and they are trained again), then appends.
    A row that cannot be written (a full disk) is taken out again, so the file holds whole rows
    only, and the run stops with one error; so it does when the file is deleted or replaced under
    it (the dump folder deleted or moved), instead of logging on into a file no one can read.
    """

    def __init__(self, path: str, resumed_from: int = 0) -> None:
        self.path = path
        try:
            if resumed_from > 0 and os.path.isfile(path):
                _keep_rows_up_to(path, resumed_from)
            # Unbuffered: a failed write is known at once, and nothing is left to flush at close.
            self.file = open(path, "ab" if resumed_from > 0 else "wb", buffering=0)  # noqa: SIM115 - closed at the end of the run
        except OSError as exc:
            raise write_failure(path, exc, what="the metrics rows") from None
        self.identity = _identity(os.fstat(self.file.fileno()))

    @classmethod
    def build(cls, trainer: Any) -> MetricsFileWriter | None:
        if not trainer.is_logging_rank:
            return None
        return cls(os.path.join(trainer.config.job.dump_folder, "metrics.jsonl"), resumed_from=trainer.step)

    def on_step_end(self, step: int, metrics: dict[str, float], last: bool) -> None:
        if not metrics:
            return
        try:
            there = _identity(os.stat(self.path)) == self.identity
        except OSError:
            there = False
        if not there:
            raise TitanError(
                f"{self.path} was deleted or replaced while this run wrote it (was job.dump_folder "
                f"deleted or moved?), so the rows it logs from step {step} on would be lost; the run "
                "stopped. Restore the folder, or run again (the same command resumes from the last "
                "checkpoint left in job.dump_folder, if any)"
            )
        # NaN and inf as null: JSON has no such numbers, and readers other than Python's refuse
        # a file holding them (a fake-backend run's losses are NaN).
        data = (json_dumps(metrics) + "\n").encode()
        fd = self.file.fileno()
        end = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):  # a write cut short by a full disk returns fewer bytes
                written += self.file.write(data[written:]) or 0
        except OSError as exc:
            with contextlib.suppress(OSError):  # no half row for a reader (or a resume) to trip on
                os.ftruncate(fd, end)
            raise write_failure(
                self.path, exc, what=f"the row of step {step}", kept="the rows before it are intact"
            ) from None

    def on_train_end(self, step: int) -> None:
        self.file.close()

    def on_failure(self, step: int, exc: BaseException) -> None:
        self.file.close()


def _identity(stat: os.stat_result) -> tuple[int, int]:
    """Which file a stat describes (its device and inode)."""
    return stat.st_dev, stat.st_ino
