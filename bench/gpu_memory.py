"""GPU check of the fake backends' memory figures (issue: fake comm backends).

For a PP2 and an FSDP2 layout, a real 2-GPU run (NCCL, ``debug.memory_report``) and pure fake
runs of the same logical coordinates (one process, ``--comm-backend fake``) report the CUDA
allocator's peak during the steady-state forward/backward; they should agree within 5%.
Run from the repository root on 2 GPUs: ``python3 -m bench.gpu_memory OUTDIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.parallel_harness import run_titan_train

GiB = 1024**3
BASE = {
    # Llama 3.1 8B layers, 4 of them, vocab 2048: big enough that activations and shards dominate.
    "model.flavor": "8B",
    "model.overrides": {"n_layers": 4, "vocab_size": 2048},
    "training.device": "cuda",
    "training.dtype": "bfloat16",
    "training.seq_len": 2048,
    "training.local_batch_size": 2,
    "training.steps": 3,
    "debug.memory_report": True,
}
LAYOUTS = {
    "fsdp2": ({"parallelism.dp_shard": 2}, [None]),
    "pp2": ({"parallelism.dp_shard": 1, "parallelism.pp": 2, "parallelism.pp_microbatches": 2}, [0, 1]),
}


def steady_peak(report: Path) -> dict[str, float]:
    data = json.loads(report.read_text())
    obs = {o["point"]: o for o in data["observations"]}
    return {
        # On CUDA ``peak_bytes`` is the allocator's peak (reset when the steady step begins).
        "steady_fwd_bwd_peak_gib": obs["steady_forward_backward"]["peak_bytes"] / GiB,
        "after_optimizer_gib": obs["after_optimizer_step"].get("allocated_bytes", 0) / GiB,
        "params_gib": data["params_bytes"] / GiB,
        "backend": f"{data['comm_backend']}/{data['physical_world_size']}proc",
    }


def main(out: Path) -> int:
    ok = True
    rows = []
    for name, (overrides, pp_ranks) in LAYOUTS.items():
        real_dir = out / f"{name}_real"
        run = run_titan_train(real_dir, 2, {**BASE, **overrides}, timeout=300)
        (out / f"{name}_real.log").write_text(run.stdout + run.stderr)
        print(f"{name} real rc={run.returncode}", flush=True)
        for pp_rank in pp_ranks:
            rank = 0 if pp_rank is None else pp_rank  # logical rank = pp_rank * (2 / 2)
            env = {"NGPU": "2", "LOCAL_RANK": "0"}
            if pp_rank is not None:
                env["FAKE_PP_RANK"] = str(pp_rank)
            fake_dir = out / f"{name}_fake{rank}"
            fake_args = ["--comm-backend", "fake"]
            fake = run_titan_train(fake_dir, 1, {**BASE, **overrides}, extra_args=fake_args, env=env)
            (out / f"{name}_fake{rank}.log").write_text(fake.stdout + fake.stderr)
            try:
                real = steady_peak(real_dir / "out" / f"memory_report_rank{rank}.json")
                faked = steady_peak(fake_dir / "out" / f"memory_report_rank{rank}.json")
            except (OSError, KeyError) as exc:
                print(f"{name} rank {rank}: missing report ({exc}); fake rc={fake.returncode}")
                print(fake.stderr[-2000:])
                ok = False
                continue
            diff = abs(faked["steady_fwd_bwd_peak_gib"] / real["steady_fwd_bwd_peak_gib"] - 1)
            ok &= diff < 0.05
            rows.append((name, rank, real, faked, diff))
    header = ["layout ", "rank", "real peak GiB", "fake peak GiB", "  diff", "params GiB", " real/fake"]
    print(" ".join(header))
    for name, rank, real, faked, diff in rows:
        print(
            f"{name:7s} {rank:4d} {real['steady_fwd_bwd_peak_gib']:13.3f} "
            f"{faked['steady_fwd_bwd_peak_gib']:13.3f} "
            f"{100 * diff:5.2f}% {real['params_gib']:10.3f}  {real['backend']} / {faked['backend']}"
        )
    print("MEMORY CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
