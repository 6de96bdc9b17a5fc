"""SIGTERM and Ctrl-C during training: flags the loop reads after each step (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

__all__ = ["StopSignals"]


class StopSignals:
    """SIGTERM and a first Ctrl-C become flags the loop reads after each step.

    SIGTERM (preemption): the step finishes, a checkpoint is saved, the run stops. Ctrl-C: the
    step finishes and the run stops, so no writer (TensorBoard, metrics.jsonl, a checkpoint) is
    cut off half-way by an exception raised at a random line; a second Ctrl-C stops at once.
    """

    def __init__(self) -> None:
        self.terminated = False  # SIGTERM
        self.interrupted = False  # Ctrl-C
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum, handler in ((signal.SIGTERM, self._on_sigterm), (signal.SIGINT, self._on_sigint)):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[signum] = signal.signal(signum, handler)
        return self

    # The handlers only set flags: the signal may arrive while this thread holds the log's lock
    # (a handler that logged would wait for it forever), or any other lock.
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)
