"""Where a profiled step's time goes: ``python3 bench/trace_summary.py TRACE.json [...]``.

Reads a chrome trace of torch.profiler (titan's ``profiler.enable_profiling`` writes one per
traced step; ``bench/handloop.py --trace FILE`` writes one of the loop) and prints, per trace:

- the step's wall time (the ``ProfilerStep#N`` span) and the GPU's busy time in it (the union of
  kernels, copies and memsets), so ``idle`` is the time the GPU waited for the host;
- GPU time by kind of kernel (matmul, flex attention, NCCL, optimizer, other Triton, copies, ...),
  and each kind's heaviest kernels (total time, launches, name);
- the longest idle gaps of the GPU, each with the host operations that ran meanwhile.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections import defaultdict
from typing import Any

#: kind -> pattern of kernel names (first match wins).
KINDS = [
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm100_|_mm_", re.I)),
    ("flex attention", re.compile(r"flex|triton_tem", re.I)),
    ("sdpa/flash", re.compile(r"flash|fmha|attention", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("optimizer (multi-tensor)", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("triton fused", re.compile(r"^triton_", re.I)),
    ("elementwise/reduce (aten)", re.compile(r"elementwise|reduce|vectorized|Kernel", re.I)),
]


def _kind(event: dict[str, Any]) -> str:
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return event["cat"].replace("gpu_", "")
    for kind, pattern in KINDS:
        if pattern.search(event["name"]):
            return kind
    return "other"


def _overlaps(event: dict[str, Any], start: float, end: float) -> bool:
    return event["ts"] < end and event["ts"] + event["dur"] > start


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def summarize(path: str, top: int = 8, kernels: int = 10) -> str:
    events = json.load(open(path))["traceEvents"]  # noqa: SIM115 - read once
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if not gpu:
        return f"{path}: no GPU events"
    # The GPU work of the traced step: from its first to its last kernel (kernels launched in the
    # step run after the host span's start; the last ones end after the host synchronises).
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    busy_us = sum(b - a for a, b in busy)
    lines = [f"# {path}"]
    if steps:
        s = max(steps, key=lambda e: e["dur"])
        lines.append(f"host step span ({s['name']}): {s['dur'] / 1e3:.1f} ms")
    wall = end - start
    lines.append(
        f"GPU span {wall / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms, idle {(wall - busy_us) / 1e3:.1f} ms "
        f"({100 * (wall - busy_us) / wall:.1f}%)"
    )
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in gpu:
        by_kind[_kind(e)] += e["dur"]
        count[_kind(e)] += 1
    lines.append("| kind | GPU ms | % of busy | kernels |")
    lines.append("| --- | --- | --- | --- |")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {us / 1e3:.1f} | {100 * us / busy_us:.1f}% | {count[kind]} |")
    names: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for e in gpu:
        names[(_kind(e), e["name"][:140])] += e["dur"]
        calls[(_kind(e), e["name"][:140])] += 1
    for kind in sorted(by_kind, key=lambda k: -by_kind[k]):
        heaviest = sorted(((us, n) for (k, n), us in names.items() if k == kind), reverse=True)[:kernels]
        lines.append(f"{kind}:")
        lines.extend(f"  {us / 1e3:7.2f} ms x{calls[(kind, n)]:<4} {n}" for us, n in heaviest)
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in itertools.pairwise(busy) if b[0] - a[1] > 200]
    for length, g0, g1 in sorted(gaps, reverse=True)[:top]:
        during = sorted({e["name"][:60] for e in host if _overlaps(e, g0, g1) and e["dur"] > 0.3 * length})
        where = ", ".join(during[:6]) or "?"
        lines.append(f"idle gap {length / 1e3:.2f} ms at +{(g0 - start) / 1e3:.1f} ms; host: {where}")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summarize(p), flush=True)
