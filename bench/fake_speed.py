"""How long one pure fake step of a large recipe takes on the CPU, shape-only or computed
(docs/debugging.md, "Shape-only steps on the CPU"). CPU only; prints one JSON line per mode.

    NGPU=64 python3 -m bench.fake_speed llama3_8b OUTDIR [MODE...]

Modes (each runs ``titan run --recipe R --comm-backend fake`` for one step in a child, with the
memory report):

- ``fake_tensors``: the recipe as shipped (``debug.fake_tensors = "auto"``: shape-only steps);
- ``computed``: the same rank with ``debug.fake_tensors = "off"`` (every kernel runs; for the 8B
  rank, many minutes on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {"fake_tensors": "auto", "computed": "off"}

RECIPE = """
from titan_core._registry import get_registry
from titan_core.recipes import call_recipe, find_recipe


def bench_recipe():
    config = call_recipe(find_recipe(get_registry(), {recipe!r}))
    config.debug.fake_tensors = {setting!r}
    return config
"""


def run(recipe: str, out: Path, mode: str) -> dict[str, object]:
    folder = out / mode
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fake_speed_recipe.py").write_text(RECIPE.format(recipe=recipe, setting=MODES[mode]))
    env = dict(os.environ, TITAN_DEFAULT_MAX_STEPS="1", TITAN_LOG_FORMAT="json")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    env.setdefault("NGPU", "64")
    command = [sys.executable, "-m", "titan_core.cli", "run", "--module", "fake_speed_recipe"]
    command += ["--recipe", "bench_recipe", "--comm-backend", "fake", "--dump-folder", str(folder / "out")]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    (out / f"{mode}.log").write_text(result.stdout + result.stderr)
    row: dict[str, object] = {"mode": mode, "rc": result.returncode, "seconds": round(elapsed, 1)}
    report = folder / "out" / "memory_report_rank0.json"
    if report.exists():
        data = json.loads(report.read_text())
        row["peak_gib"] = round(data["peak_bytes"] / 1024**3, 3)
        row["max_rss_gib"] = round(data["max_rss_bytes"] / 1024**3, 3)
    return row


def main(argv: list[str]) -> int:
    recipe, out, *modes = argv
    Path(out).mkdir(parents=True, exist_ok=True)
    for mode in modes or MODES:
        print(json.dumps(run(recipe, Path(out), mode)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
