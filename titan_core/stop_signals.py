"""SIGTERM and Ctrl-C at every phase of a command (docs/reliability.md).

Outside the training loop SIGTERM raises :class:`SigtermStop` where the process is, as Ctrl-C
raises ``KeyboardInterrupt``: nothing is being written that a stop could cut off half-way, and the
build or an export may run long past a cluster's grace period. Inside the loop, and while the run
closes after its last step, both are flags (:class:`StopSignals`) the loop reads after each step.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from titan_core.errors import TitanError

__all__ = [
    "STOPS",
    "AgreedStop",
    "SigtermStop",
    "StopSignals",
    "Terminated",
    "sigterm_stops_the_command",
    "sigterm_waits_for_the_error_line",
    "stopped_by_sigterm",
    "stops_held",
]


class Terminated(TitanError):
    """SIGTERM (preemption) ended the run, after saving what checkpointing allows."""

    exit_code = 128 + signal.SIGTERM


class SigtermStop(BaseException):
    """SIGTERM outside the training loop, raised wherever the process is (under
    :func:`sigterm_stops_the_command`). A ``BaseException``, as ``KeyboardInterrupt``: code that
    catches a plugin's or a recipe's ``Exception`` must not take it for their failure. Its message,
    set by the layer that knows, says what the stop leaves (empty: that layer did not say)."""


#: What a signal raises where it lands: ``except STOPS: raise`` keeps a stop a stop.
STOPS = (KeyboardInterrupt, SigtermStop)


def stopped_by_sigterm(said: str) -> Terminated:
    """The error of a :class:`SigtermStop`, ``said`` saying where and what it leaves. One of
    several launched processes may have it from torchrun, which ends the others once one exits:
    then that one's error is the cause, and the line says so rather than only "run it again"."""
    import os

    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        said += (
            " (if another rank of this job failed first, this is torchrun's SIGTERM ending the rest: "
            "that rank's error says what to fix)"
        )
    return Terminated(f"stopped by SIGTERM {said}")


def _raise_sigterm_stop(signum: int, frame: Any) -> None:
    # One stop: a second SIGTERM (torchrun's after the cluster's) must not cut off the first's
    # cleanup and its error line; torchrun's SIGKILL still ends a process that does not finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SigtermStop()


@contextlib.contextmanager
def sigterm_stops_the_command() -> Iterator[None]:
    """SIGTERM raises :class:`SigtermStop` during the CLI's command (its default action ended the
    process at once, with nothing said, whatever it was doing); the handler before it comes back
    at the end."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_sigterm_stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def hold_sigterm_for_the_error_line(current: Any = None) -> bool:
    """Under :func:`sigterm_waits_for_the_error_line`: SIGTERM does nothing until the scope's
    error line is out (``current``: the handler in place now, None: read it), then the handler
    before the first hold comes back. Returns False, changing nothing, outside such a scope."""
    if not _error_line_scopes:
        return False
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    except ValueError:  # not the main thread
        return False
    if _error_line_scopes[-1][0] is None:  # the outermost handler is the one to restore
        _error_line_scopes[-1][0] = previous if current is None else current
    return True


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then the first to arrive is delivered again
    to the handler before it: for a few renames that must all happen or none (an export moving
    its files over an earlier one's), which a stop in between left mixed."""
    arrived: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda n, frame: arrived.append(n))
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


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
            if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
                # Started with Ctrl-C ignored (nohup, a background job): Python leaves it so, and
                # so does the run, rather than stopping on a first one and ignoring the second.
                continue
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
            # A second Ctrl-C's too: torchrun's SIGTERM, once a peer has ended, cut its line off.
            if (
                signum == signal.SIGTERM
                and exc_type is not None
                and hold_sigterm_for_the_error_line(previous)
            ):
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
