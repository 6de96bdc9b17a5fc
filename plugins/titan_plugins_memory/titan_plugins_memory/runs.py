"""``titan compare RUN_DIR... [--rtol R] [--atol A] [--plot OUT.png]``: loss curves side by side.

Every run writes ``<job.dump_folder>/metrics.jsonl`` (one JSON object per logged step:
``{"step": 1, "loss": ..., "grad_norm": ..., ...}``) and ``config.toml``. This command reads the
per-step losses and gradient norms of several runs, prints them side by side with each run's
difference to the first (the reference) and the largest differences, and with ``--rtol`` /
``--atol`` asserts ``|x - ref| <= atol + rtol * |ref|`` at every step (exit status 1 beyond it, or
when a run lacks a step the reference has, or a value is not finite). Bad input is exit status 2
with nothing compared: a metric value that is not a number, a ``--plot`` path that cannot be
written (checked first). A run made with ``debug.deterministic_warn_only`` is refused when
asserting: that setting is for exploration, not for numerical validation; a run without
``config.toml`` cannot be checked for it, and a warning says so. ``--plot`` writes a PNG of the
curves (matplotlib when installed, else pillow).

This is the last step of "Reproducing loss curves with different parallelism configs"
(docs/debugging.md): one seed checkpoint, the layouts loading it, then one ``titan compare``.
Reading JSON and TOML only, this module does not import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from titan_core.errors import UsageError

METRICS_FILE = "metrics.jsonl"
DEFAULT_METRICS = ("loss", "grad_norm")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compare the per-step losses and gradient norms of runs (their job.dump_folder: "
        "metrics.jsonl and config.toml). The first run is the reference. With --rtol/--atol, exit "
        "with status 1 when a run differs beyond |x - ref| <= atol + rtol * |ref|."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="job.dump_folder of each run")
    parser.add_argument("--rtol", type=float, metavar="R", help="relative tolerance to assert")
    parser.add_argument("--atol", type=float, metavar="A", help="absolute tolerance to assert")
    parser.add_argument(
        "--metrics",
        default=",".join(DEFAULT_METRICS),
        metavar="M[,M]",
        help="comma-separated metrics to compare (default: loss,grad_norm)",
    )
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of the curves")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# -- reading runs -----------------------------------------------------------------------------------


def _not_metrics(path: str, number: int) -> str:
    """The error for a line of ``path`` that is not a metrics row, naming the command for the
    memory tools' files that sit in a run's folder beside ``metrics.jsonl`` (a report or a
    snapshot handed to ``titan compare`` instead of ``titan memory ...``)."""
    said = f"{path}:{number}: not a metrics row (a JSON object with an integer 'step')"
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            whole = json.loads(head + f.read()) if number == 1 and head[:1] == b"{" else None
    except (OSError, ValueError):  # not JSON as a whole (or not text): a damaged metrics file
        return said
    if head[:1] == b"\x80":  # a pickle's protocol marker: the memory snapshot
        return f"{path}: a pickle (the memory snapshot?), not a run's metrics; view it with titan memory view"
    if isinstance(whole, dict) and "observations" in whole:
        return f"{path}: a memory report, not a run's metrics; compare reports with titan memory compare A B"
    return said


def read_metrics(run: str, metrics: list[str] | tuple[str, ...] = ()) -> dict[int, dict[str, Any]]:
    """Step -> logged values of one run (the last row of a step wins, e.g. after a resume).

    The values of ``metrics`` must be numbers (``bool`` is not one) or null; anything else is one
    error naming the file, line, step and metric (compared, it was a TypeError or, for ``true``,
    the number 1)."""
    path = run if os.path.isfile(run) else os.path.join(run, METRICS_FILE)
    if not os.path.exists(run):
        raise UsageError(f"{run}: no such file or folder; give the job.dump_folder of a run")
    if not os.path.exists(path):
        raise UsageError(
            f"{run}: no {METRICS_FILE}; give the job.dump_folder of a run (it writes {METRICS_FILE} "
            "with one line per logged step)"
        )
    rows: dict[int, dict[str, Any]] = {}
    lines: dict[int, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                step = row["step"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                step = None
            if not isinstance(step, int) or isinstance(step, bool):
                raise UsageError(_not_metrics(path, number))
            rows[step], lines[step] = row, number
    if not rows:
        raise UsageError(f"{path}: no logged steps; did the run finish a step?")
    for step, row in rows.items():
        for m in metrics:
            value = row.get(m)
            if value is not None and not _is_number(value):
                raise UsageError(
                    f"{path}:{lines[step]}: {m} at step {step} is {_short(value)} ({_json_type(value)}), "
                    "not a number; titan writes a number (or null) there: the file is damaged or not "
                    "a run's metrics.jsonl"
                )
    return rows


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def run_config(run: str) -> dict[str, Any] | None:
    """The run's ``config.toml`` as a dict; ``None`` when the run has none (nothing to tell it by)."""
    path = os.path.join(run if os.path.isdir(run) else os.path.dirname(run), "config.toml")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10: the top-level scalars of each section are enough
        return _sections_of(raw.decode(errors="replace"))
    try:
        return tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(
            f"{path}: cannot be read as TOML ({exc}); it is the run's config, which --rtol/--atol "
            "checks (debug.deterministic_warn_only, comm.backend): restore it from the run"
        ) from None


def _sections_of(text: str) -> dict[str, Any]:
    """``[section]`` / ``key = true|false|"string"`` lines of a config.toml (no tomllib)."""
    config: dict[str, Any] = {}
    section: dict[str, Any] = config
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]\s*", line):
            section = config.setdefault(m.group(1), {})
        elif m := re.fullmatch(r'(\w+)\s*=\s*(true|false|"[^"]*")\s*', line):
            value = m.group(2)
            section[m.group(1)] = value == "true" if value in ("true", "false") else value.strip('"')
    return config


def warn_only(run: str) -> bool | None:
    """Whether the run's ``config.toml`` has ``debug.deterministic_warn_only = true``; ``None``
    when the run has no ``config.toml``."""
    config = run_config(run)
    if config is None:
        return None
    debug = config.get("debug", {})
    return bool(isinstance(debug, dict) and debug.get("deterministic_warn_only", False))


def simulated_peers(run: str) -> str | None:
    """The run's ``comm.backend`` when it is one whose runs simulate peers (its record's
    ``simulates_peers``: the fake backends, or a third party's), else ``None``."""
    comm = (run_config(run) or {}).get("comm", {})
    name = comm.get("backend") if isinstance(comm, dict) else None
    if not isinstance(name, str):
        return None
    from titan_core import get_registry

    record = get_registry().records("comm_backends").get(name.lower())
    return name if record is not None and record.simulates_peers else None


def _labels(runs: list[str]) -> list[str]:
    names = [os.path.basename(os.path.normpath(r)) or r for r in runs]
    return names if len(set(names)) == len(names) else [os.path.normpath(r) for r in runs]


# -- comparing --------------------------------------------------------------------------------------


def _close(value: Any, ref: Any, rtol: float, atol: float) -> bool:
    if not (_is_number(value) and _is_number(ref)):
        return False
    if not (math.isfinite(value) and math.isfinite(ref)):
        return False
    return abs(value - ref) <= atol + rtol * abs(ref)


def compare_runs(
    runs: list[str], metrics: list[str], rtol: float | None = None, atol: float | None = None
) -> dict[str, Any]:
    """Side-by-side values and differences as plain data (what ``--json`` prints)."""
    data = [read_metrics(r, metrics) for r in runs]
    labels = _labels(runs)
    ref = data[0]
    _check_metrics_exist(metrics, data, labels, asserting=rtol is not None or atol is not None)
    steps = sorted(set().union(*data))
    asserting = rtol is not None or atol is not None
    rtol_, atol_ = rtol or 0.0, atol or 0.0
    table = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for m in metrics:
            row[m] = [d.get(step, {}).get(m) for d in data]
        table.append(row)
    worst: list[dict[str, Any]] = []
    failures: list[str] = []
    for i in range(1, len(runs)):
        for m in metrics:
            largest: dict[str, Any] = {"run": labels[i], "metric": m, "abs": 0.0, "rel": 0.0, "step": None}
            for step in sorted(ref):
                r = ref[step].get(m)
                if r is None:
                    continue
                v = data[i].get(step, {}).get(m)
                if v is None:
                    if asserting:
                        failures.append(f"{labels[i]}: no {m} at step {step} (the reference has {r:.6g})")
                    continue
                if not (math.isfinite(v) and math.isfinite(r)):
                    diff = math.inf if v != r else 0.0
                else:
                    diff = abs(v - r)
                rel = diff / abs(r) if r else (0.0 if diff == 0 else math.inf)
                if diff > largest["abs"] or largest["step"] is None:
                    largest.update({"abs": diff, "rel": rel, "step": step, "value": v, "ref": r})
                if asserting and not _close(v, r, rtol_, atol_) and not math.isfinite(diff):
                    failures.append(
                        f"{labels[i]}: {m} at step {step} is {v:.6g}, the reference {labels[0]} has "
                        f"{r:.6g}: a value that is not finite compares equal to nothing"
                    )
                elif asserting and not _close(v, r, rtol_, atol_):
                    failures.append(
                        f"{labels[i]}: {m} at step {step} is {v:.6g}, the reference {labels[0]} has {r:.6g} "
                        f"(|diff| {diff:.3g} > atol {atol_:g} + rtol {rtol_:g} * |ref|)"
                    )
            if largest["step"] is not None:
                worst.append(largest)
    return {
        "runs": runs,
        "labels": labels,
        "metrics": metrics,
        "steps": table,
        "largest_differences": worst,
        "rtol": rtol,
        "atol": atol,
        "failures": failures,
    }


def _check_metrics_exist(
    metrics: list[str], data: list[dict[int, dict[str, Any]]], labels: list[str], *, asserting: bool
) -> None:
    """A metric no run logs (a typo) is an error, and so, when comparing against tolerances, is
    one the reference lacks: nothing would be compared, and the check would pass."""
    named = [{m for row in d.values() for m in row} for d in data]  # null values included
    logged = [{m for row in d.values() for m, v in row.items() if v is not None} for d in data]
    known = sorted(set().union(*named) - {"step"})
    unknown = [m for m in metrics if not any(m in names for names in named)]
    if unknown:
        raise UsageError(
            f"--metrics {', '.join(unknown)}: no run logs {'it' if len(unknown) == 1 else 'them'}; "
            f"the runs log: {', '.join(known)}"
        )
    missing = [m for m in metrics if m not in logged[0]]
    if asserting and missing:
        raise UsageError(
            f"the reference run {labels[0]} logs no {', '.join(missing)}, so nothing would be compared; "
            "put a run that logs it first, or leave it out of --metrics"
        )


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.6f}" if isinstance(value, float) else str(value)


def format_runs(result: dict[str, Any]) -> str:
    from titan_plugins_memory.table import format_rows

    labels, metrics = result["labels"], result["metrics"]
    lines = ["runs: " + ", ".join(f"{lab} ({run})" for lab, run in zip(labels, result["runs"], strict=True))]
    head = ["step"]
    for m in metrics:
        head += [f"{m} {labels[0]}"] + [f"{m} {lab} (diff)" for lab in labels[1:]]
    rows = [head]
    for row in result["steps"]:
        cells = [str(row["step"])]
        for m in metrics:
            values = row[m]
            ref = values[0]
            cells.append(_fmt(ref))
            for v in values[1:]:
                if v is None or ref is None:
                    cells.append(_fmt(v))
                else:
                    cells.append(f"{v:.6f} ({v - ref:+.2e})")
        rows.append(cells)
    lines.append(format_rows(rows, left=0))
    if result["largest_differences"]:
        lines.append("largest differences to the reference:")
        for w in result["largest_differences"]:
            lines.append(
                f"  {w['run']} {w['metric']}: {w['abs']:.3g} at step {w['step']} (relative {w['rel']:.3g})"
            )
    if result["rtol"] is not None or result["atol"] is not None:
        tol = f"rtol {result['rtol'] or 0:g}, atol {result['atol'] or 0:g}"
        if result["failures"]:
            lines.append(f"FAILED ({tol}): {len(result['failures'])} value(s) beyond the tolerance")
            lines += [f"  {f}" for f in result["failures"][:20]]
            if len(result["failures"]) > 20:
                lines.append(f"  ... and {len(result['failures']) - 20} more")
        else:
            lines.append(f"OK: every step within {tol}")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------


def check_plot_path(path: str) -> None:
    """``--plot``'s file can be written: checked before comparing, so that a bad path is exit
    status 2 with nothing compared, never confused with a verdict (0: within the tolerance, 1:
    beyond it)."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: expected a .png file name")
    if os.path.isdir(path):
        raise UsageError(f"--plot {path}: is a folder; give the .png file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(
            f"--plot {path}: the folder {folder} does not exist; create it or give a .png path in an "
            "existing folder"
        )
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        what = path if os.path.exists(path) else f"the folder {folder}"
        raise UsageError(f"--plot {path}: {what} is not writable; give another .png path")


def run(args: argparse.Namespace) -> int:
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if not metrics:
        raise UsageError("--metrics: give at least one metric name, e.g. --metrics loss")
    if len(args.runs) < 2 and not args.plot:
        raise UsageError("give at least two run folders to compare (the first is the reference)")
    for name, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{name}: expected a finite number >= 0, got {value}")
    if args.plot:
        check_plot_path(args.plot)
    unchecked = []
    if args.rtol is not None or args.atol is not None:
        for r in args.runs:
            loose = warn_only(r)
            if loose:
                raise UsageError(
                    f"{r}: made with debug.deterministic_warn_only = true, which is for exploration "
                    "and unfit for numerical validation; rerun it with debug.deterministic_warn_only "
                    "= false, or leave out --rtol/--atol to only look at the curves"
                )
            if loose is None and os.path.exists(r):  # a missing run is read_metrics' error
                unchecked.append(r)
            if backend := simulated_peers(r):
                raise UsageError(
                    f"{r}: made under comm.backend = {backend!r}, which simulates peers: its "
                    "losses are no training values (its processes stood for ranks of a simulated "
                    "job, whose collectives moved no data; fake tensors carry no numbers at all); "
                    "compare real runs, or leave out --rtol/--atol to only look at the curves"
                )
    result = compare_runs(args.runs, metrics, args.rtol, args.atol)
    for r in unchecked:
        print(
            f"titan: warning: {r}: no config.toml, so whether it was made with "
            "debug.deterministic_warn_only = true (unfit for numerical validation) cannot be checked; "
            "compare the run's own job.dump_folder",
            file=sys.stderr,
        )
    if args.plot:
        from titan_plugins_memory.plot import plot_curves

        try:
            plot_curves(result, args.plot)
        except OSError as exc:  # checked above; the disk can still fill up
            raise UsageError(f"--plot {args.plot}: cannot write it ({exc.strerror or exc})") from None
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_runs(result))
        if args.plot:
            print(f"plot written: {args.plot}")
    return 1 if result["failures"] else 0
