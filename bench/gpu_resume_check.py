"""CUDA checks of stopping and resuming (one device): SIGTERM saves the step in flight and the
resume continues the uninterrupted run's losses; a damaged checkpoint is refused as initial
weights. Run from the repository root on ``nvidia-h200`` after ``source bench/setup_device.sh``:
``python3 -m bench.gpu_resume_check OUTDIR``. Each check prints one ``CHECK <name> PASSED|FAILED``
line; the exit status is 1 if any failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.parallel_harness import log_records

RECIPES = """
from bench.recipes import bench_debugmodel


def run(folder, steps=12, initial=None):
    config = bench_debugmodel()
    config.job.dump_folder = folder
    config.training.steps = steps
    config.training.warmup_steps = 2
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.checkpoint.enable = initial is None
    config.checkpoint.interval = 100  # only SIGTERM's save and the last step
    config.checkpoint.initial_load_path = initial
    config.debug.deterministic = True
    return config


def whole():
    return run("whole")


def stopped():
    return run("stopped")


def from_damaged():
    return run("from_damaged", initial="stopped/checkpoint/step-damaged")
"""


def titan(folder: Path, recipe: str, stop_after: int | None = None) -> tuple[int, list[dict], str]:
    """``titan run`` of ``recipe``; with ``stop_after``, SIGTERM once that step's line is out."""
    env = {**os.environ, "PYTHONPATH": f"{folder}:{os.getcwd()}:{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        "-m",
        "titan_core.cli",
        "run",
        "--module",
        "resume_recipes",
        "--recipe",
        recipe,
    ]
    proc = subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if stop_after is not None and f'"step": {stop_after},' in line and '"event": "step"' in line:
            proc.send_signal(signal.SIGTERM)
            stop_after = None
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait()
    rows = [r for r in log_records("".join(lines)) if r.get("event") == "step"]
    return proc.returncode, rows, err


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "resume_recipes.py").write_text(RECIPES)
    failed = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"CHECK {name} {'PASSED' if ok else 'FAILED'}: {detail}", flush=True)
        if not ok:
            failed.append(name)

    code, whole, _ = titan(out, "whole")
    losses = {r["step"]: r["loss"] for r in whole}
    check(
        "uninterrupted",
        code == 0 and sorted(losses) == list(range(1, 13)),
        f"rc={code}, steps {sorted(losses)}",
    )
    code, first, err = titan(out, "stopped", stop_after=5)
    saved = sorted(p.name for p in (out / "stopped" / "checkpoint").glob("step-*"))
    last = first[-1]["step"] if first else None
    check(
        "sigterm_saves",
        code == 143 and saved == [f"step-{last}"] and "stopped by SIGTERM" in err,
        f"rc={code}, last step {last}, saved {saved}, stderr {err.strip()[-200:]!r}",
    )
    code, resumed, _ = titan(out, "stopped")
    after = {r["step"]: r["loss"] for r in resumed}
    worst = max(
        (abs(after[s] - losses[s]) / abs(losses[s]) for s in after if s in losses), default=float("inf")
    )
    check(
        "resume_continues",
        code == 0 and last is not None and sorted(after) == list(range(last + 1, 13)) and worst < 1e-3,
        f"rc={code}, steps {sorted(after)}, worst relative loss difference {worst:.2e}",
    )
    step = out / "stopped" / "checkpoint" / "step-12"
    damaged = step.with_name("step-damaged")
    subprocess.run(["cp", "-r", str(step), str(damaged)], check=True)
    data = max(damaged.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, _, err = titan(out, "from_damaged")
    check(
        "damaged_initial_weights_refused",
        code == 2 and "CRC-32 mismatch" in err,
        f"rc={code}, stderr {err.strip()[-240:]!r}",
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
