"""One short GPU pass over what CPU CI cannot show (run on the device machine after
``source bench/setup_device.sh``): the default recipe trains on CUDA, a compiled MoE flavor trains
(its routing code has a shape-only branch for fake tensors that compiled graphs must not take),
and the fake backend on CUDA computes (``debug.fake_tensors = "auto"``) so its memory report is
the caching allocator's. Prints one JSON line per case; exit 1 if any case fails.

    python3 -m bench.gpu_smoke OUTDIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RECIPES = """
from titan_plugins_llama3.recipes import llama3_debugmodel
from titan_plugins_moe.recipes import qwen3_moe_debugmodel


def dense():
    config = llama3_debugmodel()
    config.training.steps = 30
    return config


def moe_compiled():
    config = qwen3_moe_debugmodel()
    config.training.steps = 20
    config.compile.enable = True
    return config
"""


def run(out: Path, name: str, recipe: str, extra: list[str], env: dict[str, str]) -> dict[str, object]:
    folder = out / name
    command = [sys.executable, "-m", "titan_core.cli", "run", "--module", "gpu_smoke_recipes"]
    command += ["--recipe", recipe, "--dump-folder", str(folder), *extra]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    (out / f"{name}.log").write_text(result.stdout + result.stderr)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"step"')]
    row: dict[str, object] = {"case": name, "rc": result.returncode, "steps": len(rows)}
    if rows:
        row |= {"first_loss": rows[0].get("loss"), "last_loss": rows[-1].get("loss")}
        row |= {k: rows[-1].get(k) for k in ("tps", "mfu_pct", "max_reserved_gib") if k in rows[-1]}
    report = folder / "memory_report_rank0.json"
    if report.exists():
        data = json.loads(report.read_text())
        row["report_peak_gib"] = round(data["peak_bytes"] / 1024**3, 3)
    if result.returncode:
        row["stderr"] = result.stderr[-600:]
    return row


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_smoke_recipes.py").write_text(RECIPES)
    env = dict(os.environ, TITAN_LOG_FORMAT="json")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(out), env.get("PYTHONPATH", "")) if p)
    cases = [
        ("dense", "dense", [], env),
        ("moe_compiled", "moe_compiled", [], env),
        ("fake_cuda", "dense", ["--comm-backend", "fake"], dict(env, NGPU="8", TITAN_DEFAULT_MAX_STEPS="2")),
    ]
    failed = False
    for name, recipe, extra, case_env in cases:
        row = run(out, name, recipe, extra, case_env)
        failed |= row["rc"] != 0
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
