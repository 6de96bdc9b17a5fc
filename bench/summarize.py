"""Summarise titan JSON step lines: python bench/summarize.py LOG [LOG...] [--skip N].

Prints the mean of tokens/s, TFLOP/s and MFU over steps > N (default 5: warm-up, compile,
autotuning) and the largest memory figure, one row per log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if record.get("event") == "step" and "loss" in record:
            out.append(record)
    return out


def main(argv: list[str]) -> None:
    skip = 5
    if "--skip" in argv:
        i = argv.index("--skip")
        skip = int(argv[i + 1])
        del argv[i : i + 2]
    names = ("steps", "tps", "tflops", "mfu%", "max_alloc", "max_resv", "loss1", "lossN")
    widths = (5, 10, 8, 6, 9, 9, 7, 7)
    print(f"{'log':26s} " + " ".join(f"{n:>{w}s}" for n, w in zip(names, widths, strict=True)))
    for name in argv:
        found = rows(Path(name))
        label = Path(name).name
        if not found:
            print(f"{label:26s} no step lines")
            continue
        steady = [r for r in found if r["step"] > skip] or found

        def mean(key: str, steady: list[dict] = steady) -> float:
            return sum(r.get(key, 0.0) for r in steady) / len(steady)

        print(
            f"{label:26s} {found[-1]['step']:5d} {mean('tps'):10,.0f} {mean('tflops'):8.1f} "
            f"{mean('mfu_pct'):6.2f} {max(r.get('max_allocated_gib', 0) for r in found):9.2f} "
            f"{max(r.get('max_reserved_gib', 0) for r in found):9.2f} {found[0]['loss']:7.3f} "
            f"{found[-1]['loss']:7.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
