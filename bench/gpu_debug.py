"""GPU checks of the debugging toolbox (issue: the debugging toolbox), on one CUDA device.

Run from the repository root on ``nvidia-h200``: ``python3 -m bench.gpu_debug OUTDIR [STAGE...]``
(stages: ``snapshots``, ``oom``, ``fake_peak``; all by default). Each stage prints one
``CHECK <stage> PASSED|FAILED`` line; the exit status is 1 if any failed.

- ``snapshots``: a 4-step run with ``profiler.enable_memory_snapshot`` (every 2 steps) writes
  ``step_000000000002/`` and ``step_000000000004/``, each with the CUDA allocator's pickle and
  titan's HTML page; every pickle loads with ``torch.cuda._memory_viz`` (``segsum``,
  ``trace_plot``, ``segment_plot``) and its page shows the peak and the largest allocations. One
  pickle and its page are copied to ``OUTDIR/bring_back/`` to render here in headless chromium
  (``titan memory view`` on the pickle, ``chromium --headless --dump-dom`` on the page).
- ``oom``: a deliberately oversized batch runs out of CUDA memory in step 1 and leaves
  ``step_000000000001_exit/rank0_memory_snapshot.pickle`` (and its page), with one
  ``out of memory on cuda`` log line.
- ``fake_peak``: the one-step pure fake run's steady forward/backward peak (the memory report,
  optimizer state allocated before the first forward) is within 5% of a real 3-step run's
  steady-state peak (step 2) for the same single-GPU layout.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

from tests.parallel_harness import log_records, run_titan_train

GiB = 1024**3
BASE: dict[str, Any] = {
    # Four Llama 3.1 8B layers, vocab 2048: activations and weights of real size, quick steps.
    "model.flavor": "8B",
    "model.overrides": {"n_layers": 4, "vocab_size": 2048},
    "training.device": "cuda",
    "training.dtype": "bfloat16",
    "training.seq_len": 2048,
    "training.local_batch_size": 2,
    "training.steps": 4,
}


def check_snapshots(out: Path) -> bool:
    folder = out / "snapshots"
    overrides = {
        **BASE,
        "profiler.enable_memory_snapshot": True,
        "profiler.memory_snapshot_freq": 2,
    }
    run = run_titan_train(folder, 1, overrides, timeout=600)
    (out / "snapshots.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        print(run.stderr[-3000:])
        return False
    from torch.cuda import _memory_viz

    snaps = folder / "out" / "memory_snapshot"
    steps = sorted(p.name for p in snaps.iterdir() if p.name.startswith("step_"))
    ok = steps == ["step_000000000002", "step_000000000004"]
    print("snapshot folders:", steps)
    for step in steps:
        pickle_path = snaps / step / "rank0_memory_snapshot.pickle"
        html_path = pickle_path.with_suffix(".html")
        data = pickle.loads(pickle_path.read_bytes())
        segsum = _memory_viz.segsum(data)
        trace = _memory_viz.trace_plot(data)
        segments = _memory_viz.segment_plot(data)
        events = sum(len(t) for t in data.get("device_traces", []))
        page = html_path.read_text() if html_path.exists() else ""
        good = "Summary of segments" in segsum and trace and segments and events > 0
        good &= "Peak allocated" in page and "Largest allocations live at the peak" in page
        print(f"{step}: {len(data['segments'])} segments, {events} events, page {len(page)} bytes: {good}")
        ok &= bool(good)
    back = out / "bring_back"
    back.mkdir(exist_ok=True)
    last = snaps / steps[-1]
    shutil.copy(last / "rank0_memory_snapshot.pickle", back / "cuda_snapshot.pickle")
    shutil.copy(last / "rank0_memory_snapshot.html", back / "cuda_snapshot.html")
    return ok


def check_oom(out: Path) -> bool:
    folder = out / "oom"
    overrides = {
        **BASE,
        # 16 x 32768 tokens: each (tokens, dim) bf16 activation is 4 GiB, and four 8B layers keep
        # dozens of them for backward; the corpus must hold one batch (the loader checks it).
        "training.local_batch_size": 16,
        "training.seq_len": 32768,
        "model.overrides": {**BASE["model.overrides"], "max_seq_len": 32768},
        "data.bundled_documents": 120000,
        "profiler.enable_memory_snapshot": True,
        "profiler.memory_snapshot_freq": 100,
    }
    run = run_titan_train(folder, 1, overrides, timeout=600)
    (out / "oom.log").write_text(run.stdout + run.stderr)
    exit_dir = folder / "out" / "memory_snapshot" / "step_000000000001_exit"
    pickle_path = exit_dir / "rank0_memory_snapshot.pickle"
    lines = [
        r["event"] for r in log_records(run.stdout) if str(r.get("event", "")).startswith("out of memory")
    ]
    print("rc", run.returncode, "exit snapshot", pickle_path.exists(), "messages", lines)
    ok = run.returncode != 0 and pickle_path.exists() and pickle_path.with_suffix(".html").exists()
    ok &= len(lines) == 1 and lines[0].startswith("out of memory on cuda:0 (rank 0) at step 1")
    if pickle_path.exists():
        data = pickle.loads(pickle_path.read_bytes())
        ok &= any(e.get("action") == "oom" for t in data.get("device_traces", []) for e in t)
    return bool(ok)


def steady_peak(report: Path) -> float:
    data = json.loads(report.read_text())
    obs = {o["point"]: o for o in data["observations"]}
    return obs["steady_forward_backward"]["peak_bytes"] / GiB


def check_fake_peak(out: Path) -> bool:
    real_dir = out / "peak_real"
    real = run_titan_train(
        real_dir, 1, {**BASE, "training.steps": 3, "debug.memory_report": True}, timeout=600
    )
    (out / "peak_real.log").write_text(real.stdout + real.stderr)
    fake_dir = out / "peak_fake"
    env = {"NGPU": "1", "LOCAL_RANK": "0", "TITAN_DEFAULT_MAX_STEPS": "1"}
    fake = run_titan_train(fake_dir, 1, BASE, extra_args=["--comm-backend", "fake"], env=env, timeout=600)
    (out / "peak_fake.log").write_text(fake.stdout + fake.stderr)
    try:
        real_peak = steady_peak(real_dir / "out" / "memory_report_rank0.json")
        fake_peak = steady_peak(fake_dir / "out" / "memory_report_rank0.json")
    except (OSError, KeyError) as exc:
        print("missing report:", exc, real.stderr[-1500:], fake.stderr[-1500:])
        return False
    diff = abs(fake_peak / real_peak - 1)
    print(
        f"steady forward/backward peak: real (step 2) {real_peak:.3f} GiB, "
        f"fake (one step) {fake_peak:.3f} GiB, {100 * diff:.2f}%"
    )
    return diff <= 0.05


STAGES = {"snapshots": check_snapshots, "oom": check_oom, "fake_peak": check_fake_peak}


def main(out: Path, stages: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in stages or list(STAGES):
        ok = STAGES[name](out)
        print(f"CHECK {name} {'PASSED' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
