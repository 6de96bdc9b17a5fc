"""The files the memory plugin writes in ``job.dump_folder``, and which of them a run keeps.

A report belongs to the run that is writing the folder when its configuration (``config_hash``),
its logical world size and its parallel degrees are this run's: the other ranks of this layout,
which under the fake backends are processes run one after another (``FAKE_PP_RANK``), each
adding its own report. Every other report is an earlier run's and goes when a run starts, so a
reader of the folder (``titan memory compare DIR``, ``--all-pp-ranks``) never takes a rank this run
never had for one of its own. A rank's own report goes too: an attempt that fails before writing
must not leave the previous attempt's figures under its name. ``--overwrite`` removes them all
(the plugin's records declare them in ``outputs``, see :mod:`titan_plugins_memory.plugin`).

No torch here: the plugin module imports it for the names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

#: ``memory_report_rank{logical_rank}.json``: one per rank that reports.
REPORT_PATTERN = "memory_report_rank*.json"
_REPORT_NAME = re.compile(r"^memory_report_rank(\d+)\.json$")
#: ``--all-pp-ranks``: the table of every coordinate, and each child's output.
SWEEP_SUMMARY = "memory_report_all_pp_ranks.json"
SWEEP_LOGS = "memory_sweep"


def report_name(logical_rank: int) -> str:
    return f"memory_report_rank{logical_rank}.json"


def reports_in(dump_folder: str) -> dict[int, str]:
    """Logical rank -> path of every memory report in ``dump_folder``."""
    if not os.path.isdir(dump_folder):
        return {}
    found = {}
    for name in sorted(os.listdir(dump_folder)):
        match = _REPORT_NAME.match(name)
        if match:
            found[int(match.group(1))] = os.path.join(dump_folder, name)
    return found


def layout_key(data: dict[str, Any]) -> tuple[Any, Any, Any]:
    """What makes two reports ranks of one run: the configuration, world size and degrees."""
    return (data.get("config_hash"), data.get("world_size"), data.get("degrees"))


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable (a write cut short): nobody's figures
    return data if isinstance(data, dict) else None


def clear_reports(dump_folder: str, mine: tuple[Any, Any, Any] | None, rank: int) -> list[str]:
    """Remove the reports that are not of this run's other ranks; the paths removed.

    ``mine`` is this run's :func:`layout_key` (``None``: this run does not report, so every report
    is an earlier run's); ``rank`` is this process's logical rank, whose earlier report goes too.
    The ``--all-pp-ranks`` summary goes as well: the sweep that wants it writes it after its runs.
    """
    stale = []
    for logical_rank, path in reports_in(dump_folder).items():
        data = _read(path)
        if mine is None or logical_rank == rank or data is None or layout_key(data) != mine:
            stale.append(path)
    summary = os.path.join(dump_folder, SWEEP_SUMMARY)
    if os.path.isfile(summary):
        stale.append(summary)
    for path in stale:
        # Every rank of a distributed run clears: another may have removed it first.
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return stale
