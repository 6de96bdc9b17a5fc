"""``--all-pp-ranks``: the pure fake run of every pipeline coordinate, compared in one table.

The first question of a memory investigation is "which stage runs out of memory?". Each PP
coordinate is run as its own ``--comm-backend fake`` process (``FAKE_PP_RANK=p``), one after the
other: a fresh process per coordinate keeps their allocations apart (a CUDA allocator and the
process RSS cannot be reset in-process) and lets one coordinate fail, e.g. by running out of
memory, without hiding the others. Each writes its memory report
(:mod:`titan_plugins_memory.report`); this module reads them back and prints one row per
coordinate. A coordinate that fails keeps its cause: the error line in its row and in the summary
JSON, and the child's whole output in ``memory_sweep/pp_rank<p>.log``.

This module does not import torch (the children do).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from titan_core.errors import UsageError
from titan_plugins_memory.outputs import SWEEP_LOGS, SWEEP_SUMMARY, reports_in

GiB = 1024**3


def _child_command(args: argparse.Namespace, dump_folder: str, *, first: bool) -> list[str]:
    """The child's command line: the options of this ``titan run`` that select the run.

    ``--overwrite`` goes to the first child only: the later ones are ranks of the same run, and
    overwriting would remove the reports the earlier children just wrote.
    """
    cmd = [sys.executable, "-m", "titan_core.train", "--recipe", args.recipe]
    if getattr(args, "module", None):
        cmd += ["--module", args.module]
    cmd += ["--comm-backend", "fake", "--dump-folder", dump_folder]
    for name in getattr(args, "disable_plugin", []) or []:
        cmd += ["--disable-plugin", name]
    if first and getattr(args, "overwrite", False):
        cmd.append("--overwrite")
    return cmd


def _fresh_logs(folder: str) -> None:
    """The log folder without an earlier sweep's logs (a deeper pipeline had more of them)."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith("pp_rank") and name.endswith(".log"):
            os.remove(os.path.join(folder, name))


def _last_error(output: str, returncode: int) -> str:
    """The child's one-line titan error, else the last line that looks like an exception."""
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("titan: error:"):
            return line.removeprefix("titan: error:").strip()
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's out-of-memory killer?)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return lines[-1][-300:] if lines else f"exit status {returncode}, no output"


def run_all_pp_ranks(config: Any, registry: Any, args: argparse.Namespace) -> int:
    """Run ``fake`` for FAKE_PP_RANK = 0..pp-1 in turn; print and return 0 if all finished."""
    if config.comm.backend != "fake":
        raise UsageError(
            f"--all-pp-ranks runs the pure fake backend for every pipeline coordinate, but the comm "
            f"backend is {config.comm.backend!r}; add --comm-backend fake (and set NGPU)"
        )
    if os.environ.get("FAKE_PP_RANK", "").strip():
        raise UsageError(
            f"FAKE_PP_RANK={os.environ['FAKE_PP_RANK']!r} is set, but --all-pp-ranks runs every "
            "pipeline coordinate itself; unset FAKE_PP_RANK"
        )
    pp = config.parallelism.pp
    dump_folder = config.job.dump_folder
    logs = os.path.abspath(os.path.join(dump_folder, SWEEP_LOGS))
    _fresh_logs(logs)
    rows: list[dict[str, Any]] = []
    for pp_rank in range(pp):
        env = dict(os.environ, FAKE_PP_RANK=str(pp_rank), LOCAL_RANK="0")
        env.setdefault("TITAN_DEFAULT_MAX_STEPS", "1")
        print(f"--all-pp-ranks: running pp_rank {pp_rank} of {pp} (FAKE_PP_RANK={pp_rank})", flush=True)
        started = time.time()
        result = subprocess.run(
            _child_command(args, dump_folder, first=pp_rank == 0),
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        output = result.stdout + result.stderr
        os.makedirs(logs, exist_ok=True)  # the first child's --overwrite removes it
        log_path = os.path.join(logs, f"pp_rank{pp_rank}.log")
        with open(log_path, "w") as f:
            f.write(output)
        if result.returncode == UsageError.exit_code and pp_rank == 0:
            # A launch-contract or config error is the same for every coordinate: say it once.
            raise UsageError(_last_error(result.stderr + result.stdout, result.returncode))
        row: dict[str, Any] = {"pp_rank": pp_rank, "returncode": result.returncode, "log": log_path}
        report = _find_report(dump_folder, pp_rank, started)
        if report is not None:
            row.update(report)
        if result.returncode != 0 or report is None:
            row["error"] = (report or {}).get("error") or _last_error(output, result.returncode)
            if result.returncode == 0:
                row["error"] = "finished without writing its memory report"
        rows.append(row)
    print(format_sweep(config, rows), flush=True)
    summary = os.path.join(dump_folder, SWEEP_SUMMARY)
    with open(summary, "w") as f:
        json.dump({"recipe": config.recipe, "coordinates": rows}, f, indent=2)
    print(
        f"(per-coordinate reports: {dump_folder}/memory_report_rank*.json; logs: {logs}; summary: {summary})"
    )
    failed = [r["pp_rank"] for r in rows if r.get("error")]
    return 1 if failed else 0


def _find_report(dump_folder: str, pp_rank: int, since: float) -> dict[str, Any] | None:
    """The report this coordinate wrote after ``since`` (the child knows its logical rank)."""
    since -= 1.0  # file-system timestamps may be coarser than time.time()
    candidates = []
    for path in reports_in(dump_folder).values():
        if os.path.getmtime(path) < since:
            continue
        with open(path) as f:
            data = json.load(f)
        if data.get("pp_rank") == pp_rank and data.get("comm_backend") == "fake":
            candidates.append((os.path.getmtime(path), data))
    if not candidates:
        return None
    return max(candidates, key=lambda c: c[0])[1]


def _gib(value: Any) -> str:
    return "-" if value is None else f"{value / GiB:.3f}"


def format_sweep(config: Any, rows: list[dict[str, Any]]) -> str:
    from titan_plugins_memory.table import format_rows

    head = ["pp_rank", "logical_rank", "params", "params GiB", "optim GiB", "peak GiB", "max RSS GiB"]
    table = [head]
    failures = []
    for r in rows:
        if r.get("error"):
            failures.append(f"pp_rank {r['pp_rank']} FAILED: {r['error']} (log: {r['log']})")
        if r.get("params_numel") is None:
            table.append([str(r["pp_rank"]), "-", "-", "-", "-", "-", "FAILED"])
            continue
        table.append(
            [
                str(r["pp_rank"]),
                str(r["logical_rank"]),
                f"{r['params_numel']:,}",
                _gib(r["params_bytes"]),
                _gib(r["optimizer_state_bytes"]),
                _gib(r["peak_bytes"]),
                _gib(r["max_rss_bytes"]) + (" FAILED" if r.get("error") else ""),
            ]
        )
    lines = [f"memory by pipeline coordinate: {config.recipe} ({config.model.name}/{config.model.flavor})"]
    lines.append(format_rows(table, left=0))
    lines += failures
    if rows and not failures:
        worst = max(rows, key=lambda r: r["peak_bytes"] or 0)
        lines.append(f"highest peak: pp_rank {worst['pp_rank']} ({_gib(worst['peak_bytes'])} GiB)")
    return "\n".join(lines)
