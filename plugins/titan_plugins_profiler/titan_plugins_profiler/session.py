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
from typing import Any

import torch

from titan_core.log import get_logger
from titan_plugins_memory.oom import is_out_of_memory, oom_message, requested_bytes

log = get_logger("titan.profiler")

#: Steps the profiler runs (untraced) before the traced step, so that lazy initialisation and
#: the profiler's own start-up are not in the trace.
TRACE_WARMUP = 3
#: Allocation events kept in the memory history (older events are dropped), on CUDA and CPU.
MAX_MEMORY_EVENTS = 100_000


def trace_schedule(freq: int) -> Any:
    """A torch.profiler schedule that records exactly step ``k * freq`` of every ``freq`` steps."""
    warmup = min(TRACE_WARMUP, freq - 1)
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
        if self.snapshot_freq is not None and step % self.snapshot_freq == 0:
            self._dump_snapshot(step)

    def on_train_end(self, step: int) -> None:
        self._close()

    def on_failure(self, step: int, exc: BaseException) -> None:
        """An out-of-memory error gets the ``_exit`` snapshot and one clear line; never swallowed."""
        try:
            if is_out_of_memory(exc):
                path = None
                if self.snapshot_freq is not None:
                    path = self._dump_snapshot(step, oom=True, oom_request_bytes=requested_bytes(exc))
                log.error(oom_message(exc, step, str(self.device), self.rank, path))
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
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        log.info("profiler trace written", step=prof.step_num, path=path)

    def _dump_snapshot(self, step: int, oom: bool = False, oom_request_bytes: int | None = None) -> str:
        """``step_<step>/`` (``step_<step>_exit/`` after an out-of-memory error) for this rank."""
        folder = os.path.join(self.snapshot_folder, f"step_{step:012d}" + ("_exit" if oom else ""))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        if self.cuda:
            # Private API, as above: writes the allocator state and recorded history.
            torch.cuda.memory._dump_snapshot(path)
        else:
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
            dump_snapshot(path, snapshot)
        html = None
        try:
            from titan_plugins_memory.view import write_html

            html = write_html(path)
        except Exception as exc:  # the page is a convenience; the pickle is what matters
            log.warning("memory snapshot page not written", path=path, error=f"{type(exc).__name__}: {exc}")
        log.info("memory snapshot written", step=step, path=path, html=html)
        return path
