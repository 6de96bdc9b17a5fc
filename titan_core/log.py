"""structlog set-up: one logger for titan and torch, carrying the rank on every line.

Lines are rendered for a terminal when stdout is a TTY and as JSON otherwise (override with
``TITAN_LOG_FORMAT=console|json``). The standard library's logging (torch's warnings among it)
goes through the same processors.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def json_logs() -> bool:
    """Whether log lines are JSON: ``TITAN_LOG_FORMAT=json``, or stdout is not a terminal."""
    fmt = os.environ.get("TITAN_LOG_FORMAT", "").lower()
    return fmt == "json" or (fmt != "console" and not sys.stdout.isatty())


def _renderer() -> Any:
    if json_logs():
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty(), sort_keys=False)


def setup_logging(**context: Any) -> None:
    """Configure structlog once per process and bind ``context`` (e.g. ``rank=3``) to every line."""
    global _configured
    if not _configured:
        shared = [
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
        ]
        structlog.configure(
            processors=[*shared, structlog.processors.format_exc_info, _renderer()],
            logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            cache_logger_on_first_use=True,
        )
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processor=_renderer(),
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
