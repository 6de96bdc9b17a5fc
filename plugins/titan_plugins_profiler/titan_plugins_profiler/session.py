"""A profiling session around the training loop: torch.profiler traces and CUDA memory snapshots.

The trainer enters the session before the first step and calls :meth:`ProfilerSession.step`
after every finished training step. ``step_num`` is the last finished step; a run that resumes
from a checkpoint sets it first, so trace and snapshot folders carry the global step.

Output (``job.dump_folder`` is the root)::

    <profiler.save_traces_folder>/iteration_<step>/rank<rank>_trace.json
    <profiler.save_memory_snapshot_folder>/step_<step:012d>/rank<rank>_memory_snapshot.pickle
    <profiler.save_memory_snapshot_folder>/step_<step:012d>_exit/rank<rank>_memory_snapshot.pickle

A ``_exit`` snapshot is written when ``torch.OutOfMemoryError`` leaves the training loop; its step
is the step that ran out of memory. Memory snapshots record the CUDA caching allocator, so on a
CPU run they are skipped with one warning; traces work on both.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from titan_core.log import get_logger

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology

log = get_logger("titan.profiler")

#: Steps the profiler runs (untraced) before the traced step, so that lazy initialisation and
#: the profiler's own start-up are not in the trace.
TRACE_WARMUP = 3
#: Allocator events kept in the memory-history ring buffer (older events are dropped).
MAX_MEMORY_EVENTS = 100_000


def trace_schedule(freq: int) -> Any:
    """A torch.profiler schedule that records exactly step ``k * freq`` of every ``freq`` steps."""
    warmup = min(TRACE_WARMUP, freq - 1)
    return torch.profiler.schedule(wait=freq - warmup - 1, warmup=warmup, active=1)


class ProfilerSession:
    """Context manager around the training loop; ``step()`` once per finished step."""

    def __init__(self, config: TrainerConfig, topology: Topology) -> None:
        p = config.profiler
        self.rank = topology.rank
        self.step_num = 0
        self.trace_freq = p.profile_freq if p.enable_profiling else None
        self.trace_folder = os.path.join(config.job.dump_folder, p.save_traces_folder)
        self.snapshot_freq = (p.memory_snapshot_freq or p.profile_freq) if p.enable_memory_snapshot else None
        self.snapshot_folder = os.path.join(config.job.dump_folder, p.save_memory_snapshot_folder)
        self.device = topology.device
        if self.snapshot_freq is not None and self.device.type != "cuda":
            log.warning(
                "memory snapshots record the CUDA caching allocator and are not available on "
                f"{self.device.type}; profiler.enable_memory_snapshot is ignored for this run"
            )
            self.snapshot_freq = None
        self._profiler: Any = None
        self._closing = False

    # -- context manager -----------------------------------------------------------------------

    def __enter__(self) -> ProfilerSession:
        if self.trace_freq is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(
                activities=activities,
                schedule=trace_schedule(self.trace_freq),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )
            # Resume the schedule at the global step (public attributes of torch.profiler.profile).
            prof.step_num = self.step_num
            prof.current_action = prof.schedule(self.step_num)
            prof.start()
            self._profiler = prof
            log.info("profiling", every=self.trace_freq, folder=self.trace_folder)
        if self.snapshot_freq is not None:
            # Private API: torch 2.11-2.14 has no public way to record the allocator's history;
            # this is the call PyTorch's memory_viz documentation prescribes.
            torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS)
            log.info("recording memory history", every=self.snapshot_freq, folder=self.snapshot_folder)
        return self

    def step(self) -> None:
        """Called once after each training step."""
        self.step_num += 1
        if self._profiler is not None:
            self._profiler.step()
        if self.snapshot_freq is not None and self.step_num % self.snapshot_freq == 0:
            self._dump_snapshot(f"step_{self.step_num:012d}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            if self.snapshot_freq is not None and isinstance(exc, torch.OutOfMemoryError):
                # The step that ran out of memory is the one after the last finished step.
                self._dump_snapshot(f"step_{self.step_num + 1:012d}_exit")
        finally:
            if self._profiler is not None:
                self._closing = True  # a cycle cut short by the end of training is not a trace
                self._profiler.stop()
                self._profiler = None
            if self.snapshot_freq is not None:
                torch.cuda.memory._record_memory_history(enabled=None)
        return False  # never swallow the exception (an OOM is re-raised)

    # -- output --------------------------------------------------------------------------------

    def _write_trace(self, prof: Any) -> None:
        if self._closing:
            return
        folder = os.path.join(self.trace_folder, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        log.info("profiler trace written", step=prof.step_num, path=path)

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        # Private API, as above: writes the allocator state and recorded history for memory_viz.
        torch.cuda.memory._dump_snapshot(path)
        log.info("memory snapshot written", step=self.step_num, path=path)
