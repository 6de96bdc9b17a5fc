"""The performance table: titan, the hand-written loop and torchtitan 0.3.0 side by side.

``python3 bench/perf_table.py DIR [DIR ...] [--skip N] [--ablation CONFIG | --recompute CONFIG]``
reads the logs that ``bench/perf.sh`` leaves in each DIR (``titan_<config>.log``, ``hand_<config>.log``,
``peer/r*.log``; later DIRs win for the same run) and prints one row per run.

Every figure is computed here the same way for the three sources, from each step's tokens/s:
the mean over steps after ``--skip`` (default 5: compilation and autotuning happen in the first
steps), its spread (coefficient of variation and min..max over those steps), TFLOP/s and MFU
from one FLOP formula, torchtitan's (6 x non-embedding parameters + 12 x layers x heads x
head_dim x seq per token, the full attention square although the mask is causal and
block-diagonal; titan's ``flops_per_token``) against 989 TFLOP/s (H100/H200 dense bf16).
Memory is the largest max-reserved / max-allocated figure any step logged (torchtitan's log line
has reserved memory only). ``ratio`` is tokens/s against torchtitan on the same config; on a
hand-loop row, titan's tokens/s over the loop's; on a float8 row, float8 over titan's bf16 run of
the same shape (the same FLOP formula: float8 changes the precision, not the work).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

PEAK_TFLOPS = 989.0

#: config -> (title, torchtitan log name)
CONFIGS = {
    "bench_debugmodel": ("debug model, 2048x8, eager", "r1_debugmodel_ce_loss"),
    "bench_1b": ("1B shape, eager, 4096x8", "r2_1b_v2k_eager"),
    "bench_1b_compile": ("1B shape, compiled, 4096x8", "r3_1b_v2k_compile"),
    "bench_8b_l8_compile": ("8B shape (8 layers), compiled, 8192x4", "r4_8b_l8_v2k_compile"),
}

#: float8 config -> title; each is compared with its bf16 config (``bench.recipes.FLOAT8``).
FLOAT8_TITLES = {
    "bench_8b_l8_compile_float8": "8B shape (8 layers), compiled, 8192x4, float8 tensorwise",
    "bench_8b_l8_compile_float8_rowwise": "8B shape (8 layers), compiled, 8192x4, float8 rowwise",
}

_PEER_LINE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.naif+-]+)\s+grad_norm:\s*([\d.naif+-]+)\s+memory:\s*(-?[\d.]+)GiB"
    r"\((-?[\d.]+)%\)\s+tps:\s*([\d,]+)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def flops_per_token(config: str) -> float:
    """torchtitan's formula through titan's Llama 3 counts, for the config's shape."""
    import attrs

    from bench.recipes import CONFIGS as RECIPES
    from titan_plugins_llama3.flavors import FLAVORS
    from titan_plugins_llama3.flavors import flops_per_token as fpt

    flavor, overrides, seq, *_ = RECIPES[config]
    return fpt(attrs.evolve(FLAVORS[flavor], **overrides), seq)


def json_steps(path: Path) -> list[dict[str, Any]]:
    """Step rows of a titan or hand-loop log (JSON lines, possibly after a prefix)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if record.get("event") == "step" and "loss" in record and "tps" in record:
            rows.append(record)
    return rows


def peer_steps(path: Path) -> list[dict[str, Any]]:
    """Step rows of a torchtitan log (its console line)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        m = _PEER_LINE.search(_ANSI.sub("", line))
        if m:
            step, loss, _gn, mem, _pct, tps = m.groups()
            rows.append(
                {
                    "step": int(step),
                    "loss": float(loss),
                    "tps": float(tps.replace(",", "")),
                    "max_reserved_gib": float(mem),
                }
            )
    return rows


def summarize(rows: list[dict[str, Any]], config: str, skip: int) -> dict[str, Any]:
    steady = [r for r in rows if r["step"] > skip] or rows
    tps = [float(r["tps"]) for r in steady]
    mean = statistics.fmean(tps)
    tflops = flops_per_token(config) * mean / 1e12

    def peak(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    return {
        "steps": rows[-1]["step"],
        "tps": mean,
        "cv_pct": 100 * statistics.pstdev(tps) / mean if len(tps) > 1 else 0.0,
        "min": min(tps),
        "max": max(tps),
        "tflops": tflops,
        "mfu": 100 * tflops / PEAK_TFLOPS,
        "reserved": peak("max_reserved_gib"),
        # Titan resets the peaks at every log line: the steady steps' own peak, without step 1's
        # compilation and autotuning.
        "reserved_steady": max(
            (r["max_reserved_gib"] for r in steady if "max_reserved_gib" in r), default=None
        ),
        "allocated": peak("max_allocated_gib"),
        "loss1": rows[0]["loss"],
        "lossN": rows[-1]["loss"],
    }


def find(dirs: list[Path], name: str) -> Path | None:
    found = None
    for d in dirs:
        for candidate in (d / name, d / "peer" / name):
            if candidate.is_file():
                found = candidate
    return found


def variants(dirs: list[Path], config: str) -> list[str]:
    """The recomputation variants of CONFIG measured in DIRS: log-name suffixes such as
    ``_budget0.5_autocast`` or ``_full`` (``variant()`` in ``bench/perf.sh``): full AC, no AC,
    then the memory budgets by budget, FSDP2 before autocast."""
    found = {
        m.group(0)
        for d in dirs
        for p in d.glob(f"*_{config}_*.log")
        if (m := _VARIANT.fullmatch(p.name.removesuffix(".log").split(config, 1)[1]))
        and (m[1] or m[2] or m[4])  # selective AC with autocast alone is recompute_rows' own row
    }

    def order(v: str) -> tuple[float, str]:
        m = _VARIANT.fullmatch(v)
        return (-2.0 if not (m[1] or m[2]) else -1.0 if m[2] else float(m[1]), v)  # type: ignore[index]

    return sorted(found, key=order)


#: ``_budget0.5_autocast``, ``_full``, ``_none_autocast``, ``_reshard_never``: the memory budget
#: or the AC mode (``TITAN_BENCH_AC``), the one-GPU mixed precision when it is autocast, then
#: FSDP's resharding after forward when it is not the default (``TITAN_BENCH_RESHARD``).
_VARIANT = re.compile(r"(?:_budget([\d.]+)|_(full|none))?(_autocast)?(?:_reshard_(always|never))?")


def describe(suffix: str) -> str:
    """``_budget0.5_autocast`` -> ``memory budget 0.5, autocast``; ``_full`` -> ``full AC, FSDP2``;
    ``_reshard_never`` -> ``selective AC, op policy, FSDP2, reshard after forward: never``."""
    m = _VARIANT.fullmatch(suffix)
    if not m:
        return suffix
    modes = {"full": "full AC", "none": "no AC", None: "selective AC, op policy"}
    what = f"memory budget {m[1]}" if m[1] else modes[m[2]]
    what += ", autocast" if m[3] else ", FSDP2"
    return what + (f", reshard after forward: {m[4]}" if m[4] else "")


def peer_suffix(suffix: str) -> str:
    """The torchtitan log-name suffix of a variant (it has no autocast mode on one GPU)."""
    m = _VARIANT.fullmatch(suffix)
    if not m or not (m[1] or m[2]):
        return ""
    return f"_budget{m[1]}" if m[1] else f"_{m[2]}"


def table(dirs: list[Path], skip: int = 5) -> list[dict[str, Any]]:
    out = []
    for config, (title, peer_name) in CONFIGS.items():
        selective_peer = None
        for suffix in ["", *variants(dirs, config)]:
            runs = {}
            for kind, name, parse in (
                ("titan", f"titan_{config}{suffix}.log", json_steps),
                ("hand loop", f"hand_{config}{suffix}.log", json_steps),
                ("torchtitan 0.3.0", f"{peer_name}{peer_suffix(suffix)}.log", peer_steps),
            ):
                path = find(dirs, name)
                rows = parse(path) if path else []
                runs[kind] = summarize(rows, config, skip) | {"source": str(path)} if rows else None
            peer, titan = runs["torchtitan 0.3.0"], runs["titan"]
            if not suffix:
                selective_peer = peer
            for kind, run in runs.items():
                if run is None:
                    if kind == "titan" or (kind == "torchtitan 0.3.0" and not suffix):
                        out.append({"config": title, "variant": suffix, "run": kind, "missing": True})
                    continue
                ratios = []
                if kind == "titan" and peer:
                    variant = _VARIANT.fullmatch(suffix)
                    same = "" if not suffix else " (same budget)" if variant and variant[1] else " (same AC)"
                    ratios.append(f"{run['tps'] / peer['tps']:.3f} vs torchtitan{same}")
                if kind == "titan" and peer_suffix(suffix) and selective_peer:
                    ratios.append(f"{run['tps'] / selective_peer['tps']:.3f} vs torchtitan selective")
                if kind == "hand loop" and titan:
                    ratios.append(f"titan/loop {titan['tps'] / run['tps']:.3f}")
                ratio = "; ".join(ratios)
                out.append({"config": title, "variant": suffix, "run": kind, "ratio": ratio, **run})
    return out + float8_rows(dirs, skip)


def float8_rows(dirs: list[Path], skip: int) -> list[dict[str, Any]]:
    """titan's float8 runs, each with its ratio to titan's bf16 run of the same shape."""
    from bench.recipes import FLOAT8

    out = []
    for config, title in FLOAT8_TITLES.items():
        path = find(dirs, f"titan_{config}.log")
        rows = json_steps(path) if path else []
        if not rows:
            out.append({"config": title, "run": "titan", "missing": True})
            continue
        run = summarize(rows, config, skip) | {"source": str(path)}
        base_path = find(dirs, f"titan_{FLOAT8[config][0]}.log")
        base_rows = json_steps(base_path) if base_path else []
        ratio = ""
        if base_rows:
            base = summarize(base_rows, FLOAT8[config][0], skip)
            ratio = f"{run['tps'] / base['tps']:.3f} vs titan bf16"
        out.append({"config": title, "run": "titan", "ratio": ratio, **run})
    return out


# The per-optimisation runs of ``bench/perf.sh ablate``. Model and PyTorch-level optimisations are
# measured on the hand loop (``--without NAME``), which runs titan's model; the trainer's own on
# titan.
#: Ablation runs that turn an optimisation on that the baseline has off (the benchmark configs
#: log every step, as torchtitan's do).
_TURNED_ON = {"titan_logfreq5"}


def ablations() -> dict[str, str]:
    """Log name suffix of ``bench/perf.sh ablate`` -> the optimisation it measures."""
    return {
        **{f"hand_without_{name}": f"hand loop: {what}" for name, what in _handloop_without().items()},
        "titan_prefetch0": "titan: batches prepared on a background thread and pinned (data.prefetch = 2) "
        "instead of inside the step (0)",
        "titan_logfreq5": "titan: no host synchronisation on steps that do not log (a log line every 5 steps "
        "against every step)",
    }


def ablation_rows(dirs: list[Path], config: str, skip: int) -> list[dict[str, Any]]:
    """Each ablation run against its baseline (``ablate_hand_CONFIG`` / ``ablate_titan_CONFIG``)."""
    out = []
    for suffix, what in ablations().items():
        kind = suffix.split("_", 1)[0]
        base_path = find(dirs, f"ablate_{kind}_{config}.log")
        path = find(dirs, f"ablate_{suffix}_{config}.log")
        base_rows = json_steps(base_path) if base_path else []
        rows = json_steps(path) if path else []
        if not (rows and base_rows):
            out.append({"change": what, "missing": True})
            continue
        base, run = summarize(base_rows, config, skip), summarize(rows, config, skip)
        if suffix in _TURNED_ON:  # the run turns the optimisation on; the baseline has it off
            base, run = run, base
        out.append({"change": what, "without": run, "with": base})
    return out


def render_ablations(rows: list[dict[str, Any]], config: str, skip: int) -> str:
    head = ["optimisation", f"tok/s without -> with (steps>{skip})", "with / without", "max reserved GiB"]
    title = CONFIGS.get(config, (config,))[0]
    lines = [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['change']} | not measured | | |")
            continue
        w, b = r["without"], r["with"]
        tps = f"{w['tps']:,.0f} (cv {w['cv_pct']:.1f}%) -> {b['tps']:,.0f} (cv {b['cv_pct']:.1f}%)"
        memory = f"{_gib(w['reserved'])} -> {_gib(b['reserved'])}"
        lines.append(f"| {r['change']} | {tps} | {b['tps'] / w['tps']:.3f} | {memory} |")
    return "\n".join(lines)


#: Memory budgets ``bench/perf.sh recompute`` measures against selective AC (the ``op`` policy):
#: ``bench/recompute_plan.py`` finds 0.4 recomputing what the op policy does, 0.45-0.6 less.
BUDGETS = ("0.45", "0.5", "0.6")


def recompute_rows(dirs: list[Path], config: str, skip: int) -> list[dict[str, Any]]:
    """titan with selective AC (``titan_CONFIG.log``, ``..._autocast.log``) and with each compiler
    memory budget measured (``bench/perf.sh recompute``), under one-GPU FSDP2 and autocast."""
    out = []
    for suffix in ["", "_autocast", *variants(dirs, config)]:
        path = find(dirs, f"titan_{config}{suffix}.log")
        what = describe(suffix)
        rows = json_steps(path) if path else []
        if rows:
            out.append({"change": what, **summarize(rows, config, skip)})
        elif suffix != "_autocast":
            out.append({"change": what, "missing": True})
    return out


def render_recompute(rows: list[dict[str, Any]], config: str, skip: int) -> str:
    head = ["recomputation", f"tok/s (steps>{skip})", "/ selective, FSDP2", "MFU", "max reserved GiB"]
    head += [f"max reserved steps>{skip}", "loss first -> last"]
    title = CONFIGS.get(config, (config,))[0]
    lines = [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base = rows[0] if not rows[0].get("missing") else None
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['change']} | not measured | | | | | |")
            continue
        ratio = f"{r['tps'] / base['tps']:.3f}" if base else "n/a"
        lines.append(
            f"| {r['change']} | {r['tps']:,.0f} (cv {r['cv_pct']:.1f}%) | {ratio} | {r['mfu']:.1f}% | "
            f"{_gib(r['reserved'])} | {_gib(r['reserved_steady'])} | {r['loss1']:.3f} -> {r['lossN']:.3f} |"
        )
    return "\n".join(lines)


def _handloop_without() -> dict[str, str]:
    from bench.handloop import WITHOUT

    return WITHOUT


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render(rows: list[dict[str, Any]], skip: int) -> str:
    head = [
        "config",
        "run",
        f"tok/s (mean, steps>{skip})",
        "spread: cv, min..max",
        "TFLOP/s",
        "MFU",
        "max reserved GiB",
        "max allocated GiB",
        "loss first -> last",
        "ratio",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        config = r["config"] + (f", {describe(r['variant'])}" if r.get("variant") else "")
        if r.get("missing"):
            cells = [config, r["run"], "not measured", *[""] * (len(head) - 3)]
        else:
            cells = [
                config,
                r["run"],
                f"{r['tps']:,.0f}",
                f"{r['cv_pct']:.1f}%, {r['min']:,.0f}..{r['max']:,.0f}",
                f"{r['tflops']:.1f}",
                f"{r['mfu']:.1f}%",
                _gib(r["reserved"]),
                _gib(r["allocated"]),
                f"{r['loss1']:.3f} -> {r['lossN']:.3f} ({r['steps']} steps)",
                r["ratio"],
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    skip = 5
    if "--skip" in argv:
        i = argv.index("--skip")
        skip = int(argv[i + 1])
        del argv[i : i + 2]
    ablate = None
    if "--ablation" in argv:
        i = argv.index("--ablation")
        ablate = argv[i + 1]
        del argv[i : i + 2]
    recompute = None
    if "--recompute" in argv:
        i = argv.index("--recompute")
        recompute = argv[i + 1]
        del argv[i : i + 2]
    dirs = [Path(a) for a in argv] or [Path("/tmp/titan_perf")]
    if recompute:
        print(render_recompute(recompute_rows(dirs, recompute, skip), recompute, skip))
        return 0
    if ablate:
        print(render_ablations(ablation_rows(dirs, ablate, skip), ablate, skip))
        return 0
    print(render(table(dirs, skip), skip))
    print(
        f"\nFLOPs/token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq (torchtitan's); "
        f"MFU against {PEAK_TFLOPS:.0f} TFLOP/s. Logs: {', '.join(map(str, dirs))}"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
