"""``titan memory view SNAPSHOT.pickle [-o OUT.html]``: a memory snapshot as one offline HTML page.

Reads what ``torch.cuda.memory._dump_snapshot`` writes (a dict with ``segments``: the
allocator's segments and their blocks, and ``device_traces``: per device, the recorded
allocation history) and titan's CPU snapshots (:mod:`titan_plugins_memory.cpu_snapshot`, the
same layout plus a ``titan`` entry with the rank's tensor account). The page shows, per device:
the allocated bytes over the recorded history (an inline SVG timeline), the peak, and the largest
allocations live at the peak with the stack that allocated them. Everything is inline (no script,
style or font from the network), so it opens offline and can be mailed around.

The allocated bytes before the first recorded event (the "baseline") are reconstructed backwards
from the blocks live when the snapshot was taken: an allocation recorded in the history did not
exist before its ``alloc`` event; one freed in it existed before its free. This module reads
pickled plain data only and does not import torch.
"""

from __future__ import annotations

import html
import os
import pickle
from typing import Any

from titan_core.errors import UsageError
from titan_core.run_folder import write_whole

MiB = 1024**2
#: Points of the SVG polyline at most (min and max of each bucket are kept, so peaks survive).
MAX_POINTS = 1500
_ALLOCATED = ("active_allocated", "active_pending_free")


def load_snapshot(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; give a memory snapshot .pickle") from None
    except Exception as exc:  # unpickling errors come in every type
        raise UsageError(
            f"{path}: not a readable memory snapshot pickle ({type(exc).__name__}: {exc})"
        ) from None
    if isinstance(data, list):  # very old torch: the segments alone
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise UsageError(f"{path}: not a memory snapshot (no 'segments'); {_WHAT}")
    problem = _layout_problem(data)
    if problem:
        raise UsageError(f"{path}: not a memory snapshot ({problem}); {_WHAT}")
    return data


_WHAT = "give a file written by torch.cuda.memory._dump_snapshot or by titan's profiler"


def _kind(value: Any) -> str:
    return type(value).__name__


def _layout_problem(data: dict[str, Any]) -> str | None:
    """What in ``data`` is not the layout this page reads (``None``: it is), so that a pickle of
    another shape is one error, not a TypeError from deep in the analysis."""
    segments = data["segments"]
    if not isinstance(segments, list):
        return f"'segments' is {_a(segments)}, not a list"
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict):
            return f"segment {i} is {_a(seg)}, not a dict"
        for key, want in (("device", int), ("total_size", int), ("blocks", list)):
            if key in seg and not _is(seg[key], want):
                return f"segment {i}'s {key!r} is {_a(seg[key])}, not {_a(want())}"
        for j, block in enumerate(seg.get("blocks", [])):
            if not isinstance(block, dict):
                return f"segment {i}, block {j} is {_a(block)}, not a dict"
            if block.get("state") in _ALLOCATED:
                for key in ("address", "size"):
                    if not _is(block.get(key), int):
                        return f"segment {i}, block {j} has no integer {key!r}"
    traces = data.get("device_traces")
    if traces is not None and not isinstance(traces, list):
        return f"'device_traces' is {_a(traces)}, not a list"
    for d, trace in enumerate(traces or []):
        if trace is not None and not isinstance(trace, list):
            return f"the trace of device {d} is {_a(trace)}, not a list"
        for e, event in enumerate(trace or []):
            if not isinstance(event, dict):
                return f"device {d}, event {e} is {_a(event)}, not a dict"
            if event.get("action") in ("alloc", "free_requested", "free_completed"):
                for key in ("addr", "size"):
                    if not _is(event.get(key), int):
                        return f"device {d}, event {e} has no integer {key!r}"
            time_us = event.get("time_us")
            if time_us is not None and not _is(time_us, (int, float)):
                return f"device {d}, event {e}'s 'time_us' is {_a(time_us)}, not a number"
    titan = data.get("titan")
    if titan is not None and not isinstance(titan, dict):
        return f"'titan' is {_a(titan)}, not a dict"
    return None


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _a(value: Any) -> str:
    name = _kind(value)
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


# -- analysis ---------------------------------------------------------------------------------------


def _block_frames(block: dict[str, Any]) -> list[dict[str, Any]]:
    frames = block.get("frames")
    if frames is None and block.get("history"):  # torch < 2.1 snapshots
        frames = block["history"][-1].get("frames")
    return list(frames or [])


def _devices(snapshot: dict[str, Any]) -> list[int]:
    found = {s.get("device", 0) for s in snapshot["segments"]}
    found |= {i for i, trace in enumerate(snapshot.get("device_traces") or []) if trace}
    return sorted(found)


def analyze_device(snapshot: dict[str, Any], device: int, top: int = 20) -> dict[str, Any]:
    """Timeline, peak and the largest allocations live at the peak of one device."""
    live_end: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    reserved = 0
    for seg in snapshot["segments"]:
        if seg.get("device", 0) != device:
            continue
        reserved += seg.get("total_size", 0)
        for block in seg.get("blocks", []):
            if block.get("state") in _ALLOCATED:
                live_end[block["address"]] = (block["size"], _block_frames(block))
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []

    # One "alloc" and one "free" per allocation (free_requested, then free_completed, are one free).
    events: list[tuple[str, int, int, list[dict[str, Any]], int | None]] = []
    state: dict[int, str] = {}
    for e in trace:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            state[addr] = "alloc"
            events.append(("alloc", addr, e["size"], e.get("frames") or [], e.get("time_us")))
        elif action in ("free_requested", "free_completed") and state.get(addr) != "freed":
            state[addr] = "freed"
            events.append(("free", addr, e["size"], e.get("frames") or [], e.get("time_us")))

    initial = dict(live_end)
    for kind, addr, size, frames, _ in reversed(events):
        if kind == "alloc":
            initial.pop(addr, None)
        else:
            initial[addr] = (size, frames)
    baseline = sum(size for size, _ in initial.values())

    live = dict(initial)
    total, peak, peak_index = baseline, baseline, -1
    timeline: list[tuple[int, int]] = [(0, baseline)]
    for i, (kind, addr, size, frames, _) in enumerate(events):
        if kind == "alloc":
            live[addr] = (size, frames)
            total += size
        elif addr in live:
            total -= live.pop(addr)[0]
        timeline.append((i + 1, total))
        if total > peak:
            peak, peak_index = total, i

    at_peak = dict(initial)  # replayed up to the peak for what was live there
    for kind, addr, size, frames, _ in events[: peak_index + 1]:
        if kind == "alloc":
            at_peak[addr] = (size, frames)
        else:
            at_peak.pop(addr, None)
    largest = sorted(at_peak.items(), key=lambda item: item[1][0], reverse=True)[:top]
    times = [t for *_, t in events if t is not None]
    peak_time = events[peak_index][4] if 0 <= peak_index < len(events) else None
    return {
        "device": device,
        "reserved_bytes": reserved,
        "allocated_end_bytes": sum(size for size, _ in live_end.values()),
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "peak_event": peak_index + 1,
        "events": len(events),
        "duration_us": (times[-1] - times[0]) if len(times) > 1 else 0,
        "peak_time_us": None if peak_time is None or not times else peak_time - times[0],
        "live_at_peak": len(at_peak),
        "timeline": _downsample(timeline),
        "largest": [{"addr": addr, "size": size, "frames": frames} for addr, (size, frames) in largest],
    }


def _downsample(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if len(points) <= MAX_POINTS:
        return points
    bucket = len(points) / (MAX_POINTS // 2)
    out: list[tuple[int, int]] = []
    start = 0
    while start < len(points):
        end = min(len(points), int(start + bucket) + 1)
        chunk = points[start:end]
        lo, hi = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        out += sorted({lo, hi})
        start = end
    return out


def analyze(snapshot: dict[str, Any], top: int = 20) -> list[dict[str, Any]]:
    return [analyze_device(snapshot, d, top) for d in _devices(snapshot)]


# -- HTML -------------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / MiB:,.2f} MiB"


def _bytes(n: int) -> str:
    return f"{_mib(n)} ({n:,} bytes)"


_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { border: 1px solid #ccc; padding: .25em .6em; vertical-align: top; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
pre { margin: 0; font: 12px/1.3 ui-monospace, monospace; white-space: pre-wrap; }
svg { border: 1px solid #ccc; background: #fcfcfc; }
.muted { color: #777; }
"""

_SCRIPT = """
(function () {
  var svgs = document.querySelectorAll("svg.timeline");
  for (var i = 0; i < svgs.length; i++) {
    var line = svgs[i].querySelector("polyline");
    var out = svgs[i].parentNode.querySelector(".points");
    if (line && out) { out.textContent = String(line.points.numberOfItems); }
  }
  document.body.setAttribute("data-rendered", "yes");
})();
"""


def _frames_html(frames: list[dict[str, Any]], limit: int = 12) -> str:
    python = [
        f
        for f in frames
        if str(f.get("filename", "")).endswith(".py") or f.get("filename", "").startswith("<")
    ]
    shown = python or frames
    lines = [f"{f.get('name', '?')}  {f.get('filename', '?')}:{f.get('line', '?')}" for f in shown[:limit]]
    hidden = len(frames) - min(len(shown), limit)
    if hidden > 0:
        lines.append(f"... {hidden} more frame(s){' (C++)' if python else ''}")
    if not lines:
        lines = ["(no stack recorded: allocated before the history started)"]
    first, rest = lines[0], lines[1:]
    text = html.escape(first)
    if rest:
        text += (
            "<details><summary class='muted'>stack</summary><pre>"
            + html.escape("\n".join(rest))
            + "</pre></details>"
        )
    return f"<pre>{text}</pre>" if not rest else text


def _svg(timeline: list[tuple[int, int]], peak_event: int, width: int = 900, height: int = 260) -> str:
    left, right, top_pad, bottom = 80, 10, 10, 30
    xs = [p[0] for p in timeline] or [0]
    ys = [p[1] for p in timeline] or [0]
    x_max, y_max = max(max(xs), 1), max(max(ys), 1)

    def sx(x: float) -> float:
        return left + (width - left - right) * x / x_max

    def sy(y: float) -> float:
        return height - bottom - (height - bottom - top_pad) * y / y_max

    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in timeline)
    ticks = []
    for i in range(5):
        y = y_max * i / 4
        ticks.append(
            f"<line x1='{left}' x2='{width - right}' y1='{sy(y):.1f}' y2='{sy(y):.1f}' stroke='#eee'/>"
            f"<text x='{left - 6}' y='{sy(y) + 4:.1f}' text-anchor='end' font-size='11'>{y / MiB:,.1f}</text>"
        )
    peak_x = sx(peak_event)
    return (
        f"<svg class='timeline' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
        "role='img'>"
        + "".join(ticks)
        + f"<text x='14' y='{height / 2:.0f}' font-size='11' transform='rotate(-90 14 {height / 2:.0f})' "
        "text-anchor='middle'>allocated MiB</text>"
        f"<text x='{(left + width) / 2:.0f}' y='{height - 8}' font-size='11' text-anchor='middle'>"
        f"allocation events (0 .. {x_max:,})</text>"
        f"<polyline fill='none' stroke='#2a6fdb' stroke-width='1.5' points='{points}'/>"
        f"<line x1='{peak_x:.1f}' x2='{peak_x:.1f}' y1='{top_pad}' y2='{height - bottom}' stroke='#d33' "
        "stroke-dasharray='4 3'/>"
        "</svg>"
    )


def render_html(snapshot: dict[str, Any], source: str, top: int = 20) -> str:
    """The page for one snapshot (every device in it)."""
    titan = snapshot.get("titan") or {}
    kind = "CPU tensor account (titan)" if titan else "CUDA caching allocator"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'>{_GENERATOR}",
        f"<title>Memory snapshot: {html.escape(os.path.basename(source))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Memory snapshot: {html.escape(os.path.basename(source))}</h1>",
        f"<p class='muted'>{html.escape(source)} &middot; {kind}</p>",
    ]
    if titan:
        parts.append(_titan_html(titan))
    devices = analyze(snapshot, top)
    if not devices:
        parts.append("<p>The snapshot holds no segments and no recorded history.</p>")
    for d in devices:
        name = titan.get("device") or f"cuda:{d['device']}"
        peak_at = f"event {d['peak_event']:,} of {d['events']:,}"
        if d["peak_time_us"] is not None:
            peak_at += f" ({d['peak_time_us'] / 1000:,.1f} ms after the first)"
        rows = [
            (
                "Peak allocated",
                f"<span class='peak' data-bytes='{d['peak_bytes']}'>{_bytes(d['peak_bytes'])}</span>",
            ),
            ("Peak at", html.escape(peak_at)),
            ("Allocated when the snapshot was taken", _bytes(d["allocated_end_bytes"])),
            ("Allocated before the recorded history", _bytes(d["baseline_bytes"])),
            ("Reserved (segments)", _bytes(d["reserved_bytes"])),
            ("Allocations live at the peak", f"{d['live_at_peak']:,}"),
            ("Recorded events", f"{d['events']:,} over {d['duration_us'] / 1000:,.1f} ms"),
        ]
        parts.append(
            f"<section class='device' data-device='{d['device']}'><h2>{html.escape(name)}</h2><table>"
        )
        parts += [f"<tr><th>{k}</th><td class='num'>{v}</td></tr>" for k, v in rows]
        parts.append("</table>")
        if d["events"]:
            parts.append(_svg(d["timeline"], d["peak_event"]))
            parts.append(
                "<p class='muted'>allocated bytes after each recorded event; the dashed line is the peak "
                "(<span class='points'></span> points drawn)</p>"
            )
        else:
            parts.append(
                "<p class='muted'>No allocation history was recorded: the page shows the blocks live "
                "when the snapshot was taken.</p>"
            )
        parts.append(f"<h3>Largest allocations live at the peak (top {len(d['largest'])})</h3>")
        parts.append(
            "<table class='largest'><tr><th>#</th><th>size</th><th>address</th><th>allocated at</th></tr>"
        )
        for i, a in enumerate(d["largest"], 1):
            parts.append(
                f"<tr><td class='num'>{i}</td><td class='num' data-bytes='{a['size']}'>{_mib(a['size'])}</td>"
                f"<td class='num'>{a['addr']:#x}</td><td>{_frames_html(a['frames'])}</td></tr>"
            )
        parts.append("</table></section>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "".join(parts)


def _titan_html(titan: dict[str, Any]) -> str:
    account = titan.get("account") or {}
    head = (
        f"<p>Rank {titan.get('rank')} at step {titan.get('step')}"
        + (" (out of memory)" if titan.get("oom") else "")
        + (
            f", failing to allocate {_bytes(titan['oom_request_bytes'])}"
            if titan.get("oom_request_bytes")
            else ""
        )
        + f": a tensor-level account. {html.escape(titan.get('note', ''))}</p>"
    )
    rows = "".join(
        f"<tr><th>{html.escape(k.removesuffix('_bytes').replace('_', ' '))}</th>"
        f"<td class='num' data-field='{html.escape(k)}'>{_bytes(v)}</td></tr>"
        for k, v in account.items()
        if k.endswith("_bytes") and v is not None
    )
    return head + (f"<table class='account'>{rows}</table>" if rows else "")


#: Marks a page this command wrote: rewriting one is safe, any other file at OUT is refused.
_GENERATOR = "<meta name='generator' content='titan memory view'>"


def _check_output(output: str, given: bool = True) -> None:
    """Refuse to replace a file that is not a page of this command (``-o my_recipe.py`` turned a
    recipe into HTML), and to create folders for ``-o``."""
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UsageError(f"-o {output}: no folder {folder}; create it first, or give another path")
    if os.path.isdir(output):
        raise UsageError(
            f"-o {output}: is a folder; give a file path such as {output.rstrip('/')}/snapshot.html"
        )
    if os.path.exists(output):
        try:
            with open(output, encoding="utf-8", errors="replace") as f:
                ours = _GENERATOR in f.read(4096)
        except OSError:
            ours = False
        if not ours and given:
            raise UsageError(
                f"-o {output}: the file exists and is not a page titan memory view wrote; give a new "
                "path, or remove the file first"
            )
        if not ours:
            raise UsageError(
                f"the page beside the snapshot, {output}, exists and is not a page titan memory view "
                "wrote; give -o PATH for the page, or move the file"
            )


def write_html(snapshot_path: str, output: str | None = None, top: int = 20) -> str:
    """Write the page beside the snapshot (or at ``output``); returns its path."""
    given = output is not None
    if given and not output:  # -o "$OUT" with OUT unset: not the page beside the snapshot
        raise UsageError(
            "-o: an empty path; give the page's path, e.g. -o snapshot.html, or leave -o out for the "
            "page beside the snapshot"
        )
    output = output or os.path.splitext(snapshot_path)[0] + ".html"
    _check_output(output, given)
    snapshot = load_snapshot(snapshot_path)
    try:
        page = render_html(snapshot, snapshot_path, top)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        # What _layout_problem does not check (frames, the titan account): still one error.
        raise UsageError(
            f"{snapshot_path}: not a memory snapshot (reading it failed: {type(exc).__name__}: {exc}); "
            f"{_WHAT}"
        ) from None

    def dump(partial: str) -> None:
        with open(partial, "w") as f:
            f.write(page)

    try:
        # Written beside OUT and renamed: a page cut short (a full disk) never passes for a whole
        # one, and the earlier page stays as it was when the rewrite fails.
        write_whole(output, dump)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if given:
            raise UsageError(
                f"-o {output}: cannot write the page ({why}); give -o a path in a folder you can write"
            ) from None
        raise UsageError(
            f"cannot write the page beside the snapshot, {output} ({why}); give -o PATH for the page"
        ) from None
    return output


def run_view(args: Any) -> int:
    if args.top < 1:
        raise UsageError(f"--top: expected a positive integer, got {args.top}")
    path = write_html(args.snapshot, args.output, args.top)
    print(path)
    return 0
