"""The log's lines on stdout (titan_core/log.py): how they reach the stream others read."""

from __future__ import annotations

import io
import logging
import sys

import pytest


class _Writes(io.StringIO):
    """A stdout that records each ``write`` call, as a pipe records each ``write(2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)

    def isatty(self) -> bool:
        return False


def test_each_log_line_reaches_stdout_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``PYTHONUNBUFFERED=1`` (set in many container images) stdout passes every ``write``
    straight to the pipe, and structlog's ``print`` wrote a line and its newline in two: ranks
    sharing torchrun's pipe ran their lines together (``... rank=12026-12-05 07:47:06 [info ]
    step 1/7 ...`` followed by an empty line), which no reader of the log could split again."""
    from titan_core.log import LOG_FORMAT_ENV, get_logger, setup_logging

    monkeypatch.setenv(LOG_FORMAT_ENV, "json")  # as under pytest already: the format is chosen once
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    setup_logging()
    log = get_logger("titan.test")
    log.info("step", step=1, of=2, loss=3.0, lr=1e-3)
    log.info("run summary", _block=True, steps="1-2 of 2", final_loss="3.00000")
    logging.getLogger("a_library").warning("a library's warning")  # torch keeps its own
    written = [call for call in out.calls if call]
    assert len(written) == 3, written
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in written), written
