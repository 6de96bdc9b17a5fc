"""SIGTERM and Ctrl-C during training: flags the loop reads after each step (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

__all__ = ["AgreedStop", "StopSignals", "sigterm_waits_for_the_error_line"]

#: The open :func:`sigterm_waits_for_the_error_line` scopes, innermost last: each holds the SIGTERM
#: handler to restore once its error line is out (None: no run failed under it).
_error_line_scopes: list[list[Any]] = []


@contextlib.contextmanager
def sigterm_waits_for_the_error_line() -> Iterator[None]:
    """A run that fails inside :class:`StopSignals` under this scope (the CLI's command, up to its
    ``titan: error:`` line) keeps SIGTERM a flag until the scope ends.

    torchrun sends SIGTERM to every survivor as soon as one rank exits; one arriving after a
    survivor's collective failed, while it found and printed why (which names the rank that failed
    first), ended it at once with nothing said. The process ends right after the scope anyway,
    and torchrun's SIGKILL still follows its grace period. A library caller of ``train`` opens no
    scope, so its SIGTERM handler is restored as the run fails.
    """
    held: list[Any] = [None]
    _error_line_scopes.append(held)
    try:
        yield
    finally:
        _error_line_scopes.remove(held)
        if held[0] is not None:
            signal.signal(signal.SIGTERM, held[0])


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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            if previous is None:
                continue
            failing = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
            if signum == signal.SIGTERM and failing and _error_line_scopes:
                _error_line_scopes[-1][0] = previous  # restored once the error line is out
                continue
            signal.signal(signum, previous)


class AgreedStop:
    """Several processes decide together, every step, whether a signal stops them.

    A signal reaches each process at its own moment; a rank that stopped (and saved) alone left
    its peers waiting in a collective until the timeout, with nothing saved. So each step ends by
    posting this process's flags in an asynchronous all-reduce (MAX) and reading the one posted
    the step before: every process reads the same flags after the same step, and stops there. A
    signal is acted on one or two steps after it arrives, whatever ``metrics.log_freq`` (agreeing
    only on logging steps could outlast a cluster's grace period between SIGTERM and SIGKILL).
    The flags are CPU tensors over gloo, so no step waits for the device: the default group
    carries them when it has gloo (``cpu:gloo,cuda:nccl``), else a gloo group of its own does.
    """

    def __init__(self, signals: StopSignals) -> None:
        import torch.distributed as dist

        self.signals = signals
        self.group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
        self._posted: tuple[Any, Any] | None = None  # (flags tensor, its all-reduce's work)

    def step(self, *, post: bool) -> tuple[bool, bool]:
        """``(terminated, interrupted)`` as agreed by every process from the flags posted the
        step before; then, unless they stop the run or ``post`` is false (the last step), post
        this step's. Every process calls it once per step with the same ``post``."""
        import torch
        import torch.distributed as dist

        agreed = (False, False)
        if self._posted is not None:
            flags, work = self._posted
            work.wait()
            agreed = (bool(flags[0]), bool(flags[1]))
            self._posted = None
        if post and not any(agreed):
            flags = torch.tensor([self.signals.terminated, self.signals.interrupted], dtype=torch.int32)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._posted = (flags, work)
        return agreed
