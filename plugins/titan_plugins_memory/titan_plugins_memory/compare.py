"""``titan memory compare A.json B.json``: two memory reports side by side, with differences.

The reports are the ``memory_report_rank<r>.json`` files a run writes (the fake backends, or
``debug.memory_report``). For each observation point present in either, every figure both runs
have is shown for A and B with ``B - A`` and the ratio; above the table, the configuration
fields that differ (layout, schedule, microbatches, activation checkpointing, ...). Reading JSON
only, this module does not import torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from titan_core.errors import UsageError
from titan_plugins_memory.outputs import reports_in

MiB = 1024**2

#: Configuration fields of a report, compared and shown when they differ.
IDENTITY = (
    "recipe",
    "model",
    "model_overrides",
    "comm_backend",
    "world_size",
    "logical_rank",
    "pp_rank",
    "degrees",
    "device",
    "dtype",
    "seq_len",
    "local_batch_size",
    "pp_schedule",
    "pp_microbatches",
    "pp_stages_per_rank",
    "loss_parallel",
    "fsdp_reshard_after_forward",
    "compile",
    "activation_checkpoint",
    "selective_ac_option",
    "steady_step",
    "optimizer_warmup",
    "torch_version",
    "config_hash",
)

#: Figures of one observation point, in the order they print (bytes).
FIGURES = (
    ("params_bytes", "params"),
    ("buffers_bytes", "buffers"),
    ("grads_bytes", "grads"),
    ("optimizer_state_bytes", "optimizer state"),
    ("accounted_bytes", "accounted"),
    ("step_allocations_peak_bytes", "step allocations peak"),
    ("allocated_bytes", "allocated"),
    ("allocated_peak_bytes", "allocated peak"),
    ("reserved_bytes", "reserved"),
    ("reserved_peak_bytes", "reserved peak"),
    ("peak_bytes", "peak"),
    ("rss_bytes", "rss"),
)


def load_report(path: str) -> dict[str, Any]:
    """A memory report; a folder holding exactly one report is accepted too."""
    if os.path.isdir(path):
        found = [os.path.basename(p) for p in reports_in(path).values()]
        if len(found) != 1:
            raise UsageError(
                f"{path}: expected one memory_report_rank<r>.json in the folder, found "
                f"{len(found) or 'none'}; name the report file"
            )
        path = os.path.join(path, found[0])
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(
            f"{path}: no such file; give a memory_report_rank<r>.json written by a run"
        ) from None
    except UnicodeDecodeError:
        # Binary: most likely the memory snapshot beside the reports, which is another tool's input.
        raise UsageError(
            f"{path}: not a readable JSON memory report (not text: a memory snapshot pickle? view it "
            "with titan memory view); give a memory_report_rank<r>.json"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON memory report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("observations"), list):
        raise UsageError(
            f"{path}: not a memory report (no 'observations'); give a memory_report_rank<r>.json"
        )
    problem = _malformed(data["observations"])
    peak = data.get("peak_bytes")
    if problem is None and not _number_or_none(peak):
        problem = f"peak_bytes is {peak!r}, not a number"  # the peak difference subtracts it
    if problem:
        raise UsageError(f"{path}: not a memory report ({problem}); give a memory_report_rank<r>.json")
    data["_path"] = path
    return data


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _malformed(observations: list[Any]) -> str | None:
    """What makes ``observations`` unreadable (checked here: a traceback would follow), or ``None``."""
    for i, o in enumerate(observations, start=1):
        if not isinstance(o, dict):
            return f"observation {i} is a {type(o).__name__}, not an object"
        if not isinstance(o.get("point"), str):
            return f"observation {i} has no 'point'"
        for key, _label in FIGURES:
            value = o.get(key)
            if not _number_or_none(value):
                return f"{o['point']}: {key} is {value!r}, not a number"
    return None


def _points(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["point"]: o for o in report["observations"]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The differences as plain data (what ``--json`` prints)."""
    config = [
        {"field": key, "a": a.get(key), "b": b.get(key)} for key in IDENTITY if a.get(key) != b.get(key)
    ]
    pa, pb = _points(a), _points(b)
    order = [*pa, *(p for p in pb if p not in pa)]
    points = []
    for point in order:
        oa, ob = pa.get(point, {}), pb.get(point, {})
        rows = []
        for key, label in FIGURES:
            va, vb = oa.get(key), ob.get(key)
            if va is None and vb is None:
                continue
            diff = None if va is None or vb is None else vb - va
            ratio = None if diff is None or not va else vb / va
            rows.append({"figure": key, "label": label, "a": va, "b": vb, "diff": diff, "ratio": ratio})
        points.append({"point": point, "step_a": oa.get("step"), "step_b": ob.get("step"), "figures": rows})
    peak_a, peak_b = a.get("peak_bytes"), b.get("peak_bytes")
    # A failed run's report holds the points it reached: its peak is not the one of its step, so
    # no difference is claimed (the failed run would look the smaller).
    errors = {"a": a.get("error") or None, "b": b.get("error") or None}
    comparable = None not in (peak_a, peak_b) and not (errors["a"] or errors["b"])
    return {
        "a": a["_path"],
        "b": b["_path"],
        "errors": errors,
        "last_points": {"a": _last_point(a), "b": _last_point(b)},
        "configuration": config,
        "points": points,
        "peak": {"a": peak_a, "b": peak_b, "diff": peak_b - peak_a if comparable else None},
    }


def _last_point(report: dict[str, Any]) -> str | None:
    return report["observations"][-1]["point"] if report["observations"] else None


def _mib(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value / MiB:+,.1f}" if signed else f"{value / MiB:,.1f}"


def _short(value: Any) -> str:
    if isinstance(value, dict):
        items = [f"{k}={v}" for k, v in value.items() if not (isinstance(v, int) and v == 1)]
        return " ".join(items) or ("{}" if not value else "all 1")
    return "-" if value is None else str(value)


def format_compare(result: dict[str, Any]) -> str:
    from titan_plugins_memory.table import format_rows

    lines = [f"A: {result['a']}", f"B: {result['b']}"]
    for side in ("a", "b"):
        error = result["errors"][side]
        if error:
            last = result["last_points"][side] or "none"
            lines.append(
                f"{side.upper()} failed ({error}): its figures stop at the last point it reached "
                f"({last}), and its peak is not the step's"
            )
    if result["configuration"]:
        lines.append("configuration differences:")
        rows = [["field", "A", "B"]]
        rows += [[c["field"], _short(c["a"]), _short(c["b"])] for c in result["configuration"]]
        lines.append(format_rows(rows, left=3))
    else:
        lines.append("configuration: identical")
    rows = [["point", "figure", "A MiB", "B MiB", "B - A MiB", "B / A"]]
    for p in result["points"]:
        step = p["step_a"] if p["step_a"] == p["step_b"] else f"{p['step_a']}/{p['step_b']}"
        for i, f in enumerate(p["figures"]):
            ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
            label = f"{p['point']} (step {step})" if i == 0 else ""
            rows.append([label, f["label"], _mib(f["a"]), _mib(f["b"]), _mib(f["diff"], True), ratio])
    lines.append(format_rows(rows, left=2))
    peak = result["peak"]
    failed = [side.upper() for side in ("a", "b") if result["errors"][side]]
    if failed and None not in (peak["a"], peak["b"]):
        who = "A and B failed: not their peaks" if len(failed) == 2 else f"{failed[0]} failed: not its peak"
        lines.append(f"peak: A {_mib(peak['a'])} MiB, B {_mib(peak['b'])} MiB ({who})")
    elif peak["diff"] is not None:
        pct = f", {100 * peak['diff'] / peak['a']:+.1f}%" if peak["a"] else ""
        diff = _mib(peak["diff"], True)
        lines.append(f"peak: A {_mib(peak['a'])} MiB, B {_mib(peak['b'])} MiB (B - A = {diff} MiB{pct})")
    return "\n".join(lines)


def run_compare(args: Any) -> int:
    result = compare(load_report(args.a), load_report(args.b))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_compare(result))
    return 0
