"""The one exception type the CLI turns into a clean message and an exit status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TitanError(Exception):
    """A problem the user can fix; printed as one message (no traceback) with ``exit_code``."""

    exit_code = 1


class UsageError(TitanError):
    """Bad input: an unknown name, an invalid config value, a broken launch contract."""

    exit_code = 2


class PluginError(TitanError):
    """A plugin failed to load, returned bad records, or clashes with another plugin."""

    exit_code = 1


def describe(exc: BaseException) -> str:
    """One line: the exception and the innermost place it was raised outside titan's core and
    attrs (a record's validator raises inside them, but the line to fix is the caller's)."""
    import os
    import traceback

    import attr
    import attrs

    frames = traceback.extract_tb(exc.__traceback__)
    ours = (
        *(os.path.dirname(m.__file__) + os.sep for m in (attr, attrs)),
        os.path.dirname(__file__) + os.sep,
    )
    outside = [f for f in frames if not f.filename.startswith((*ours, "<attrs"))]
    frame = (outside or frames or [None])[-1]
    where = f" (at {frame.filename}:{frame.lineno})" if frame is not None else ""
    return f"{type(exc).__name__}: {exc}{where}"


def call_plugin(
    what: Callable[[], str],
    fn: Callable[..., Any],
    *args: Any,
    message: Callable[[str, Exception], str] = lambda what, exc: f"{what}: {describe(exc)}",
    passes: Callable[[Exception], bool] = lambda exc: False,
) -> Any:
    """``fn(*args)``, plugin code: an exception other than a :class:`TitanError` (the plugin's
    own, already one clean error) becomes one :class:`PluginError`, ``message(what(), exc)``,
    chained to it; ``passes(exc)``: the exceptions the caller reports its own way (the trainer's
    out-of-memory and failed-collective errors) go through unchanged. The trainer and
    ``run_train.sh``'s check before torchrun (:func:`titan_core.run.preflight`) share it, so a
    plugin's failure reads the same in both. ``what`` is called only on a failure."""
    try:
        return fn(*args)
    except TitanError:
        raise
    except Exception as exc:
        if passes(exc):
            raise
        raise PluginError(message(what(), exc)) from exc


def problems_returned(found: Any, returned: str) -> list[str]:
    """A plugin check's result (a config section's, a strategy's) as the list of problem lines it
    must be; anything else is one :class:`PluginError`, ``returned`` (e.g. ``"the check of X
    returned"``) followed by the value and what a check must return."""
    if not isinstance(found, (list, tuple)) or not all(isinstance(p, str) for p in found):
        raise PluginError(
            f"{returned} {found!r}; it must return a list of problems (strings, 'section.field: "
            "message'), empty when there are none"
        )
    return list(found)


_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's out-of-memory error: CUDA's ``torch.OutOfMemoryError``, or
    the ``RuntimeError`` the CPU allocator raises. (Checked by name: no torch import.)"""
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _CPU_OOM)


#: Notes (``BaseException.add_note``) a plugin may put on a failing step's out-of-memory error for
#: the run's last line (``titan_core.run.out_of_memory``): the ``_exit`` snapshot's path once
#: written, and the rank the process stands for (under the fake backends a logical rank that
#: ``RANK`` does not give).
OOM_SNAPSHOT_NOTE = "titan-oom-snapshot: "
OOM_RANK_NOTE = "titan-oom-rank: "


def out_of_memory_cause(exc: BaseException) -> BaseException | None:
    """The out-of-memory error (:func:`is_out_of_memory`) ``exc`` is or was raised from, else ``None``.

    torch wraps errors on the way out of some of its machinery: a pipeline stage re-raises what
    its forward or backward raised as ``RuntimeError('[Stage 1] failed to run forward: ...') from
    e``, so the allocator's error is the wrapper's cause, not the exception that leaves the loop."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_out_of_memory(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_failure(path: str, exc: OSError, *, what: str, kept: str = "") -> TitanError:
    """One error for a file of the run that cannot be written (a full disk or quota, a file-size
    limit, a read-only or vanished folder): ``cannot write <what> to <path>: <why>``, then
    ``kept`` (what is still intact) and what to do. The caller raises it ``from None``: the
    ``OSError`` alone says neither which file nor what to change."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why, fix = (
            f"the disk is full ({exc.strerror})",
            "Free space on that disk, or point job.dump_folder at one with room",
        )
    elif exc.errno == errno.EFBIG:
        why, fix = (
            exc.strerror,
            "Raise the file-size limit (ulimit -f), or point job.dump_folder at another disk",
        )
    else:
        why, fix = exc.strerror or str(exc), "Make the folder writable again (permissions, mount)"
    return TitanError(
        f"cannot write {what} to {path}: {why}{'; ' + kept if kept else ''}. {fix}, "
        "then run again (with checkpointing on, the same command resumes from the last checkpoint)"
    )
