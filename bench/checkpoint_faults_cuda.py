"""GPU check: the checkpointer's multi-rank fault handling on CUDA + NCCL.

What it verifies (tests/plugins/dcp/test_checkpoint_ranks.py covers gloo on CPU; this covers the
same scenarios with CUDA tensors and NCCL object collectives, which need the current device set):

- an FSDP-sharded CUDA model saves step 2 and 4; rank 1's shard of step 4 is truncated; both
  ranks skip step 4 and load step 2 with its exact weights;
- a full disk on rank 1 only (its shard file written to /dev/full) while saving step 6 ends every
  rank with the same ``checkpoint: the disk is full ...`` message and leaves no partial folder;
- pipeline-like disjoint parts load strictly (no false "unexpected key"; a 6-layer checkpoint
  is refused by a 4-layer split on both ranks);
- ranks whose checkpoint folders differ all stop with one error (no hang).

    python bench/checkpoint_faults_cuda.py /tmp/ck_cuda      # launches torchrun on 2 GPUs

Exits 0 and prints ``checkpoint faults on cuda: PASS`` or exits 1 with ``FAIL`` and the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "-m",
        "tests.plugins.dcp.ranks_worker",
        str(out),
        "cuda",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        print(f"checkpoint faults on cuda: FAIL (exit {result.returncode})\n{result.stderr[-4000:]}")
        return 1
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    problems = []
    for r, rank in enumerate(ranks):
        if rank["fsdp"]["loaded"] != 2 or not rank["fsdp"]["weights_of_step_2"]:
            problems.append(f"rank {r} did not fall back to step 2 exactly: {rank['fsdp']}")
        full = rank["fsdp"]["full_disk"] or ""
        if not (full.startswith("checkpoint: the disk is full") and "(rank 1)" in full):
            problems.append(f"rank {r}: full-disk message {full!r}")
        if rank["stages"]["loaded"] != 1 or not rank["stages"]["same"]:
            problems.append(f"rank {r}: disjoint parts did not load: {rank['stages']}")
        if "tensors in it that the model lacks" not in (rank["stages"]["refused"] or ""):
            problems.append(f"rank {r}: 6-layer checkpoint not refused: {rank['stages']['refused']!r}")
        if "the ranks see different checkpoints" not in (rank["unshared"]["error"] or ""):
            problems.append(f"rank {r}: unshared folders not caught: {rank['unshared']}")
    if ranks[0]["fsdp"]["listing"] != ["step-2", "step-4"]:
        problems.append(f"folder after the full disk: {ranks[0]['fsdp']['listing']}")
    if problems:
        print("checkpoint faults on cuda: FAIL\n" + "\n".join(problems))
        return 1
    print("checkpoint faults on cuda: PASS (fallback, full disk on one rank, strict disjoint parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/checkpoint_faults_cuda")))
