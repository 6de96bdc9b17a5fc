"""The profiler as a loop callback: torch.profiler traces and memory snapshots (CUDA and CPU).

Built when ``profiler.enable_profiling`` or ``profiler.enable_memory_snapshot`` is set; the
trainer calls ``on_train_start`` before the first step, ``on_step_end`` after every step and
``on_train_end`` / ``on_failure`` at the end. Steps are global: a run resumed from a checkpoint
starts at the checkpoint's step, so trace and snapshot folders carry the global step.

Output (``job.dump_folder`` is the root)::

    <profiler.save_traces_folder>/iteration_<step>/rank<rank>_trace.json
    <profiler.save_memory_snapshot_folder>/step_<step:012d>/rank<rank>_memory_snapshot.pickle
    <profiler.save_memory_snapshot_folder>/step_<step:012d>/rank<rank>_memory_snapshot.html
    <profiler.save_memory_snapshot_folder>/step_<step:012d>_exit/rank<rank>_memory_snapshot.pickle

On CUDA a snapshot is the caching allocator's (``torch.cuda.memory._dump_snapshot``); on the CPU,
which has no allocator history, it is a tensor-level account of the rank in the same layout
(:mod:`titan_plugins_memory.cpu_snapshot`). Beside every pickle is its HTML page
(``titan memory view``). A ``_exit`` snapshot is written when an out-of-memory error (CUDA's
``torch.OutOfMemoryError``, or the CPU allocator's ``RuntimeError``) leaves the loop; its step is
the step that ran out of memory, and one error line says where and what to change.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from titan_core.errors import OOM_SNAPSHOT_NOTE, TitanError, UsageError, write_failure
from titan_core.log import get_logger
from titan_core.run_folder import write_whole
from titan_plugins_memory.oom import note_rank, oom_message, out_of_memory_cause, requested_bytes

log = get_logger("titan.profiler")

#: Steps the profiler runs (untraced) before the traced step, so that lazy initialisation and
#: the profiler's own start-up are not in the trace.
TRACE_WARMUP = 3
#: Allocation events kept in the memory history (older events are dropped), on CUDA and CPU.
MAX_MEMORY_EVENTS = 100_000


def folder_problem(folder: str) -> str | None:
    """Why the profiler could not write files in ``folder``, or ``None``. Nothing is created (a run
    that never reaches its first trace leaves no empty folder): the nearest part of the path that
    exists must be a folder where a file can be made."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"no file can be made in {existing} ({exc.strerror or exc})"
    return None


def trace_schedule(freq: int) -> Any:
    """A torch.profiler schedule that records exactly step ``k * freq`` of every ``freq`` steps."""
    import warnings

    warmup = min(TRACE_WARMUP, freq - 1)
    with warnings.catch_warnings():
        # profile_freq = 1 leaves no step to warm up in: the user's choice, which torch would
        # otherwise log as a warning in every such run.
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
        return torch.profiler.schedule(wait=freq - warmup - 1, warmup=warmup, active=1)


class ProfilerSession:
    """Traces every ``profile_freq`` steps, snapshots every ``memory_snapshot_freq`` steps."""

    def __init__(self, trainer: Any) -> None:
        config = trainer.config
        p = config.profiler
        self.trainer = trainer
        self.rank = trainer.topology.rank
        self.device: torch.device = trainer.topology.device
        self.step_num = 0
        self.trace_freq = p.profile_freq if p.enable_profiling else None
        self.trace_folder = os.path.join(config.job.dump_folder, p.save_traces_folder)
        self.snapshot_freq = (p.memory_snapshot_freq or p.profile_freq) if p.enable_memory_snapshot else None
        self.snapshot_folder = os.path.join(config.job.dump_folder, p.save_memory_snapshot_folder)
        self.cuda = self.device.type == "cuda"
        self._profiler: Any = None
        self._recorder: Any = None  # the CPU allocation history (an AllocationTracker)
        self._closing = False
        #: A trace that could not be written: (step, path, the exception), raised by on_step_end.
        self._trace_failure: tuple[int, str, Exception] | None = None
        self._check_folders()

    def _check_folders(self) -> None:
        """A folder the enabled outputs cannot be written to is bad input, refused before step 1
        (found at the first trace or snapshot, it stopped a run that had trained, or crashed it)."""
        p = self.trainer.config.profiler
        for field, enabled, folder in (
            ("save_traces_folder", self.trace_freq is not None, self.trace_folder),
            ("save_memory_snapshot_folder", self.snapshot_freq is not None, self.snapshot_folder),
        ):
            problem = folder_problem(folder) if enabled else None
            if problem is not None:
                raise UsageError(
                    f"profiler.{field} = {getattr(p, field)!r}: cannot write there: {problem}; set "
                    f"profiler.{field} to a folder titan can create and write (a relative path is "
                    "joined to job.dump_folder)"
                )

    def unreachable(self, step: int = 0) -> list[str]:
        """A line for each output (traces, snapshots) that a run from ``step`` to its last step
        would never write: its first step (a multiple of its frequency) lies past the last step,
        as in pure fake mode, which ``run_train.sh`` limits to one step."""
        last = getattr(self.trainer, "steps", None)
        if last is None:
            return []
        config = self.trainer.config
        training_steps, max_steps = config.training.steps, config.debug.max_steps
        if max_steps is not None and max_steps < training_steps:
            setting = f"debug.max_steps = {max_steps}"
            if os.environ.get("TITAN_DEFAULT_MAX_STEPS") == str(max_steps):
                setting += (
                    ", from TITAN_DEFAULT_MAX_STEPS, which run_train.sh sets to 1 in pure fake mode; "
                    "set TITAN_DEFAULT_MAX_STEPS or debug.max_steps for more steps"
                )
            raise_it = "debug.max_steps"
        else:
            setting, raise_it = f"training.steps = {training_steps}", "training.steps"
        outputs = [
            (
                "memory snapshot",
                "profiler.memory_snapshot_freq"
                if config.profiler.memory_snapshot_freq is not None
                else "profiler.profile_freq",
                self.snapshot_freq,
            ),
            ("profiler trace", "profiler.profile_freq", self.trace_freq),
        ]
        problems = []
        for what, field, freq in outputs:
            if freq is None:
                continue
            first = (step // freq + 1) * freq
            if first > last:
                problems.append(
                    f"profiler: no {what} will be written: this run ends at step {last} ({setting}), "
                    f"before step {first}, the first multiple of {field} = {freq} it would reach; set "
                    f"{field} to at most {max(last - step, 1)}, or raise {raise_it} to at least {first}"
                )
        return problems

    # -- the loop's calls ----------------------------------------------------------------------------

    def on_train_start(self, step: int) -> None:
        self.step_num = step
        for problem in self.unreachable(step):
            log.warning(problem)
        if self.trace_freq is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(
                activities=activities,
                schedule=trace_schedule(self.trace_freq),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )
            # Each trace is one step, written at the end of its cycle, by design: torch's advice to
            # keep every cycle's events (acc_events=True, which titan does not offer: the events
            # would pile up in memory) was logged by every run that traced twice.
            import warnings

            warnings.filterwarnings(
                "ignore", message="Warning: Profiler clears events at the end of each", category=UserWarning
            )
            # Resume the schedule at the global step (public attributes of torch.profiler.profile).
            prof.step_num = step
            prof.current_action = prof.schedule(step)
            prof.start()
            self._profiler = prof
            log.info("profiling", every=self.trace_freq, folder=self.trace_folder)
        if self.snapshot_freq is not None:
            if self.cuda:
                # Private API: torch 2.11-2.14 has no public way to record the allocator's history;
                # this is the call PyTorch's memory_viz documentation prescribes.
                torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS)
            else:
                from titan_plugins_memory.report import execution_fake_mode
                from titan_plugins_memory.tracker import AllocationTracker

                # Under the fake backends the run's fake tensors stand for its real memory.
                fake_mode = execution_fake_mode(self.trainer.parts)
                self._recorder = AllocationTracker(history=MAX_MEMORY_EVENTS, fake_mode=fake_mode)
                self._recorder.__enter__()
            log.info("recording memory history", every=self.snapshot_freq, folder=self.snapshot_folder)

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        self.step_num = step
        if self._profiler is not None:
            self._profiler.step()
            if self._trace_failure is not None:
                failed_step, path, exc = self._trace_failure
                self._trace_failure = None
                if isinstance(exc, OSError):
                    raise write_failure(path, exc, what=f"the profiler trace of step {failed_step}") from None
                raise exc
        if self.snapshot_freq is not None and step % self.snapshot_freq == 0:
            self._dump_snapshot(step)

    def on_train_end(self, step: int) -> None:
        self._close()

    def on_failure(self, step: int, exc: BaseException) -> None:
        """An out-of-memory error gets the ``_exit`` snapshot and one clear line; never swallowed."""
        try:
            # The allocator's error itself, or the one a pipeline stage wrapped it in.
            oom = out_of_memory_cause(exc)
            if oom is not None:
                path = None
                if self.snapshot_freq is not None:
                    try:
                        path = self._dump_snapshot(step, oom=True, oom_request_bytes=requested_bytes(oom))
                    except TitanError as failed:
                        # The run ends with the out-of-memory error: a snapshot that could not be
                        # written is said, and must not take that error's place.
                        log.warning(str(failed))
                # The run's last error line (titan_core.run.out_of_memory) names the file and rank.
                if path is not None and hasattr(exc, "add_note"):
                    exc.add_note(OOM_SNAPSHOT_NOTE + path)
                note_rank(exc, self.rank)
                log.error(oom_message(oom, step, str(self.device), self.rank, path))
        finally:
            self._close()

    # -- output --------------------------------------------------------------------------------

    def _close(self) -> None:
        if self._profiler is not None:
            self._closing = True  # a cycle cut short by the end of training is not a trace
            self._profiler.stop()
            self._profiler = None
        if self.snapshot_freq is not None and self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    def _write_trace(self, prof: Any) -> None:
        if self._closing:
            return
        folder = os.path.join(self.trace_folder, f"iteration_{prof.step_num}")
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        try:
            os.makedirs(folder, exist_ok=True)
            write_whole(path, prof.export_chrome_trace)
        except Exception as exc:
            # Called inside torch's profiler step: an exception leaving it here leaves the profiler
            # half stopped, and stopping it then kills the process (a segmentation fault, torch
            # 2.13). on_step_end raises it once the profiler's step is complete.
            self._trace_failure = (prof.step_num, path, exc)
            return
        log.info("profiler trace written", step=prof.step_num, path=path)

    def _dump_snapshot(self, step: int, oom: bool = False, oom_request_bytes: int | None = None) -> str:
        """``step_<step>/`` (``step_<step>_exit/`` after an out-of-memory error) for this rank."""
        folder = os.path.join(self.snapshot_folder, f"step_{step:012d}" + ("_exit" if oom else ""))
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        try:
            os.makedirs(folder, exist_ok=True)
            self._write_snapshot(path, step, oom, oom_request_bytes)
        except OSError as exc:
            raise write_failure(path, exc, what=f"the memory snapshot of step {step}") from None
        html = None
        try:
            from titan_plugins_memory.view import write_html

            html = write_html(path)
        except Exception as exc:  # the page is a convenience; the pickle is what matters
            log.warning("memory snapshot page not written", path=path, error=f"{type(exc).__name__}: {exc}")
        log.info("memory snapshot written", step=step, path=path, html=html)
        return path

    def _write_snapshot(self, path: str, step: int, oom: bool, oom_request_bytes: int | None) -> None:
        if self.cuda:
            # Private API, as above: writes the allocator state and recorded history.
            write_whole(path, torch.cuda.memory._dump_snapshot)
            return
        from titan_plugins_memory.cpu_snapshot import build_snapshot, dump_snapshot

        snapshot = build_snapshot(
            self._recorder,
            self.trainer.parts,
            self.trainer.optimizer,
            rank=self.rank,
            step=step,
            oom=oom,
            oom_request_bytes=oom_request_bytes,
        )
        write_whole(path, lambda partial: dump_snapshot(partial, snapshot))
