"""Out-of-memory errors, on every device: what counts as one, and the one line that says so.

CUDA raises ``torch.OutOfMemoryError``; the CPU allocator raises a plain ``RuntimeError``
("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes", or "not enough
memory" on some builds). Both are out-of-memory errors for titan: the profiler writes the
``_exit`` snapshot and logs :func:`oom_message`.
"""

from __future__ import annotations

import re

# One predicate for every device, the search through wrapping errors and the notes: the core's.
from titan_core.errors import OOM_RANK_NOTE, is_out_of_memory, out_of_memory_cause

_TRIED = re.compile(r"you tried to allocate (\d+) bytes")

__all__ = ["is_out_of_memory", "note_rank", "oom_message", "out_of_memory_cause", "requested_bytes"]


def note_rank(exc: BaseException, rank: int) -> None:
    """Add ``OOM_RANK_NOTE`` to ``exc`` once (the profiler and the memory report both may)."""
    note = f"{OOM_RANK_NOTE}{rank}"
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, when the error says ("you tried to allocate N bytes")."""
    asked = _TRIED.search(str(exc))
    return int(asked.group(1)) if asked else None


def oom_message(exc: BaseException, step: int, device: str, rank: int, snapshot: str | None) -> str:
    """One line: where memory ran out, how much was asked, where the snapshot is, what to change."""
    asked = requested_bytes(exc)
    size = f" allocating {asked / 1024**2:,.1f} MiB" if asked is not None else ""
    where = f"; memory snapshot: {snapshot}" if snapshot else ""
    return (
        f"out of memory on {device} (rank {rank}) at step {step}{size}{where}; lower "
        "training.local_batch_size or training.seq_len, turn on activation_checkpoint.mode, or "
        "shard more (parallelism.dp_shard, tp, pp)"
    )
