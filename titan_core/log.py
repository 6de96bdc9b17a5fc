"""structlog set-up: one logger for titan and torch, carrying the rank on every line.

Lines are rendered for a terminal when stdout is a TTY and as JSON otherwise (override with
``TITAN_LOG_FORMAT=console|json``). The standard library's logging (torch's warnings among it)
goes through the same processors.

In the console format the trainer's ``step`` lines read ``step 12/30 | loss 3.2100 | lr 8.00e-04
| 1.2k tok/s | ...`` and the end-of-run ``summary`` is a block of lines; JSON keeps every value
as a key. A run may also copy its lines, in the console format without colours, to a log file
(:func:`attach_file`; the trainer's ``<dump_folder>/train.log``): lines logged from
:func:`capture` on are buffered until the file is attached, so the file starts with the run's
first line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from typing import IO, Any

import structlog

_configured = False
_SHARED_KEYS = ("timestamp", "level", "event", "rank")


#: The variable choosing the line format, and its values (``titan`` refuses others).
LOG_FORMAT_ENV = "TITAN_LOG_FORMAT"
LOG_FORMATS = ("json", "console")


def json_logs() -> bool:
    """Whether log lines are JSON: ``TITAN_LOG_FORMAT=json``, or stdout is not a terminal."""
    fmt = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
    return fmt == "json" or (fmt != "console" and not sys.stdout.isatty())


def _format() -> str:
    return "json" if json_logs() else "console"


def _si(value: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def fixed(value: Any, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, or in scientific notation when those would show a
    non-zero value as zero (a vanishing gradient norm of 3e-5 read ``0.000``)."""
    if isinstance(value, (int, float)) and 0 < abs(value) < 0.5 * 10**-decimals:
        return f"{value:.3e}"
    return f"{value:.{decimals}f}"


def _step_text(event: dict[str, Any]) -> str:
    """``step 12/30 | loss 3.2100 | lr 8.00e-04 | ...``; the values used are removed from ``event``."""
    step, total = event.pop("step"), event.pop("of", None)
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if "loss" in event:
        parts.append(f"loss {fixed(event.pop('loss'), 4)}")
    if "lr" in event:
        parts.append(f"lr {event.pop('lr'):.2e}")
    if "grad_norm" in event:
        parts.append(f"gnorm {fixed(event.pop('grad_norm'), 3)}")
    if "tps" in event:
        parts.append(f"{_si(event.pop('tps'))} tok/s")
    if "mfu_pct" in event:
        parts.append(f"mfu {fixed(event.pop('mfu_pct'), 1)}%")
    event.pop("tflops", None)
    for key in ("max_reserved_gib", "max_rss_gib"):
        if key in event:
            parts.append(f"mem {event.pop(key):.2f}GiB")
            event.pop("max_allocated_gib", None)
            event.pop("max_reserved_pct", None)
            break
    if "step_time_s" in event:
        parts.append(f"{event.pop('step_time_s'):.3f}s/step")
    if "eta" in event:
        parts.append(f"eta {event.pop('eta')}")
    return " | ".join(parts)


def _summary_text(event: dict[str, Any]) -> str:
    """The end-of-run block: one ``name  value`` line per field."""
    head = str(event.pop("event"))
    if "rank" in event:
        head += f" (rank {event.pop('rank')})"
    keys = [k for k in list(event) if k not in _SHARED_KEYS]
    labels = {k: k.replace("_per_s", "/s").replace("_", " ") for k in keys}
    width = max((len(v) for v in labels.values()), default=0)
    lines = [head] + [f"    {labels[k]:<{width}}  {event.pop(k)}" for k in keys]
    return "\n".join(lines)


def _for_console(event: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``event`` with the trainer's ``step`` and ``summary`` lines made readable."""
    event = dict(event)
    if event.get("event") == "step" and "step" in event:
        event["event"] = _step_text(event)
    elif event.get("event") in ("validation",) and "step" in event:
        step = event.pop("step")
        event["event"] = f"validation at step {step}"
        for key, decimals in (("loss", 5), ("perplexity", 3)):
            if isinstance(event.get(key), float):
                event[key] = fixed(event[key], decimals)
    elif event.pop("_block", False):
        event["event"] = _summary_text(event)
    return event


def _finite_json(value: Any) -> Any:
    """``value`` with every NaN and infinite float (in dicts, lists and tuples) replaced by
    ``None``: JSON has no such numbers, and Python's ``json`` writes them as bare ``NaN`` and
    ``Infinity``, which other readers (jq, JavaScript, Go, strict parsers) refuse, the whole
    file with them. A fake-backend run's losses are NaN, and a callback may report NaN. The JSON
    log lines and ``metrics.jsonl`` are both written with it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def json_dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`_finite_json`'s ``value``: always valid JSON (non-finite -> null)."""
    return json.dumps(_finite_json(value), allow_nan=False, **kwargs)


class _Render:
    """The last processor: the line for stdout, and its console copy for the log file."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.json = structlog.processors.JSONRenderer(serializer=json_dumps)
        self.console = structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty(), sort_keys=False)
        self.plain = structlog.dev.ConsoleRenderer(colors=False, sort_keys=False)

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> str:
        if _sink.capturing:
            _sink.write(self.plain(logger, method, _for_console(event)))
        if self.fmt == "json":
            event.pop("_block", None)
            return self.json(logger, method, event)
        return self.console(logger, method, _for_console(event))


class _FileSink:
    """Where console copies of the lines go: a buffer until the file is attached, then the file.

    A line the file cannot take (a full disk) ends the copying, and the error is kept for the
    trainer to report (:func:`file_failure`): raised here, it would come out of whichever log
    call wrote the line, a call in the run's own failure handling too."""

    def __init__(self) -> None:
        self.capturing = False
        self.buffer: list[str] = []
        self.file: IO[str] | None = None
        self.path = ""
        #: The log file's path and the error of the write that failed, until reported.
        self.failure: tuple[str, OSError] | None = None

    def write(self, line: str) -> None:
        if self.file is not None:
            try:
                self.file.write(line + "\n")
                self.file.flush()
            except OSError as exc:
                self.failure = (self.path, exc)
                self.close()
                self.capturing = False
        elif len(self.buffer) < 10_000:
            self.buffer.append(line)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # lines it could not write are lost either way
                self.file.close()
        self.file = None


_sink = _FileSink()


class _Stdout:
    """The log's stdout (the current ``sys.stdout``, as structlog's own logger writes to), which
    outlives its reader: when the pipe it writes into closes (``titan run ... | head``, a ``tee``
    that ended), the run goes on with its lines in the log file alone, and says so once on stderr.
    A ``BrokenPipeError`` out of a log call stopped the training at that line instead, and
    ``titan`` (which ends ``titan models list | head`` quietly) exited 0 after a partial run."""

    def __init__(self) -> None:
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return sys.stdout.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self.gone = True
        # Python flushes stdout again at exit: onto /dev/null, where it cannot fail (an
        # "Exception ignored ... BrokenPipeError" line otherwise).
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        where = _sink.path or "train.log in job.dump_folder"
        with contextlib.suppress(OSError):  # stderr may be the same closed pipe (2>&1 | head)
            print(
                f"titan: warning: stdout was closed (its reader went away, e.g. `| head`); the run "
                f"goes on, its log lines in {where} only",
                file=sys.stderr,
                flush=True,
            )


_stdout = _Stdout()


def capture() -> None:
    """Start keeping this process's lines for a log file attached later (see :func:`attach_file`)."""
    detach_file()
    _sink.capturing = True


def attach_file(path: str, *, append: bool = False) -> None:
    """Write the lines kept since :func:`capture`, and every later one, to ``path``; an
    ``OSError`` (a full disk) leaves no file attached."""
    file = open(path, "a" if append else "w")  # noqa: SIM115 - closed by detach_file
    try:
        for line in _sink.buffer:
            file.write(line + "\n")
        file.flush()
    except OSError:
        with contextlib.suppress(OSError):
            file.close()
        raise
    _sink.buffer = []
    _sink.file = file
    _sink.path = path
    _sink.capturing = True


def detach_file() -> None:
    """Stop copying lines (closing the log file, dropping lines kept for it)."""
    _sink.close()
    _sink.buffer = []
    _sink.capturing = False
    _sink.failure = None


def file_failure() -> Exception | None:
    """The error to end the run with when the log file could not be written (once), or ``None``."""
    if _sink.failure is None:
        return None
    from titan_core.errors import write_failure

    path, exc = _sink.failure
    _sink.failure = None
    return write_failure(path, exc, what="the log")


def setup_logging(**context: Any) -> None:
    """Configure structlog once per process and bind ``context`` (e.g. ``rank=3``) to every line."""
    global _configured
    if not _configured:
        shared = [
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
        ]
        render = _Render(_format())
        structlog.configure(
            processors=[*shared, structlog.processors.format_exc_info, render],
            # One write per line, its newline included: print() writes the two apart, and under
            # PYTHONUNBUFFERED=1 (many container images) each write goes to the pipe at once, so
            # ranks sharing torchrun's pipe ran their lines together.
            logger_factory=structlog.WriteLoggerFactory(file=_stdout),  # type: ignore[arg-type]
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            cache_logger_on_first_use=True,
        )
        handler = logging.StreamHandler(_stdout)  # type: ignore[arg-type]
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, render],
                foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            )
        )
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.WARNING)
        logging.captureWarnings(True)  # Python warnings (torch's many) through the same renderer
        _configured = True
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str = "titan") -> Any:
    return structlog.get_logger(name)
