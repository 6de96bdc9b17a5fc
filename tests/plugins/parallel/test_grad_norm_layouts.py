"""The total gradient norm under 2-D shardings: every rank gets the same bits, and torch's advice
to flatten the mesh (its two sequential all-reduces "may give inconsistent results between ranks")
stays out of the logs.

Expert FSDP x EP (experts sharded over ``efsdp`` and ``ep``) and FSDP x TP (weights sharded over
``dp_shard_cp`` and ``tp``) reduce the norm's partial sums with one all-reduce per mesh dimension;
HSDP reduces over ``dp_shard`` only. Gradients are set on every rank with values equal along the
mesh dimensions where their placement replicates (as real gradients are), spanning many orders of
magnitude so that a different summation order would show in the last bits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import GLOBAL_BATCH, REPO, STEPS, child_env, log_records, run_titan_train
from tests.plugins.parallel.test_expert_parallel import MOE

#: Runs on each of 4 gloo ranks; prints one line per layout with what every rank agreed on.
SCRIPT = """
import logging, struct, sys
from types import SimpleNamespace

import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_core.grad_norm import clip_grad_norm
from titan_core.parallel_dims import ParallelDims
from titan_plugins_parallel.expert_parallel import _shard_experts, expert_mesh
from titan_plugins_parallel.fsdp import dp_mesh

dist.init_process_group("gloo")
rank = dist.get_rank()


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 64, 33))


def build(layout):
    degrees = {"ep": dict(dp_shard=4, ep=2), "fsdp_tp": dict(dp_shard=2, tp=2),
               "hsdp": dict(dp_replicate=2, dp_shard=2)}[layout]
    kw = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=4) | degrees
    pd = ParallelDims(**kw)
    ctx = SimpleNamespace(parallel_dims=pd, mesh=pd.build_mesh("cpu"),
                          topology=SimpleNamespace(device=torch.device("cpu")))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    if layout == "ep":  # as expert_parallel.apply shards the experts
        model.experts = Experts()
        mesh = expert_mesh(ctx)
        distribute_module(model.experts, mesh["ep"], _shard_experts)
        fully_shard(model.experts, mesh=mesh["efsdp"])
    if layout == "fsdp_tp":
        parallelize_module(model, ctx.mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh(ctx))
    return model, ctx


def replica_key(p):
    # Ranks that hold the same values of p: equal coordinates where the placement shards.
    coord = p.device_mesh.get_coordinate()
    return tuple(0 if pl.is_replicate() else c for c, pl in zip(coord, p.placements))


def bits(t):
    return t.detach().contiguous().view(torch.int32).flatten().tolist()


for layout in sys.argv[1:]:
    model, ctx = build(layout)
    names = [n for n, _ in model.named_parameters()]
    norms, params = [], []
    for step in range(4):
        for name, p in model.named_parameters():
            local = p.to_local()
            seed = hash((step, name, replica_key(p))) % 2**31
            g = torch.Generator().manual_seed(seed)
            value = torch.randn(local.shape, generator=g) * torch.rand(local.shape, generator=g).pow(8)
            p.grad = DTensor.from_local(value * 10.0**step, p.device_mesh, p.placements,
                                        shape=p.shape, stride=p.stride())
        norms.append(struct.pack("f", clip_grad_norm([model], 1e-3, ctx).item()).hex())
        with torch.no_grad():  # an SGD step with the clipped gradients
            for p in model.parameters():
                p.to_local().sub_(p.grad.to_local())
    params = [(n, replica_key(p), bits(p.to_local())) for n, p in model.named_parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (norms, params))
    same_norms = all(e[0] == everyone[0][0] for e in everyone)
    held = {}
    for _, ps in everyone:
        for n, key, b in ps:
            held.setdefault((n, key), []).append(b)
    same_params = all(all(b == bs[0] for b in bs) for bs in held.values())
    replicated = sum(len(bs) - 1 for bs in held.values())
    if rank == 0:
        print(f"layout {layout} same_norms={same_norms} same_replicas={same_params} "
              f"replica_copies={replicated} norms={everyone[0][0]}", flush=True)
dist.barrier()
dist.destroy_process_group()
from titan_core.cli import exit_process

exit_process(0)
"""


@pytest.mark.slow
def test_every_rank_gets_the_same_norm_and_no_flattening_advice(tmp_path: Path) -> None:
    script = tmp_path / "grad_norm_layouts.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(script),
        "ep",
        "fsdp_tp",
        "hsdp",
    ]
    # A fixed hash seed: every rank derives the same gradient seeds from the same names.
    env = child_env(PYTHONHASHSEED="0")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("layout ")}
    assert set(lines) == {"ep", "fsdp_tp", "hsdp"}, out[-4000:]
    for line in lines.values():
        assert "same_norms=True" in line, line
        assert "same_replicas=True" in line, line
    # HSDP's replicas and TP's replicated biases were compared, not only sharded weights.
    assert "replica_copies=0" not in lines["hsdp"] and "replica_copies=0" not in lines["fsdp_tp"]
    # Torch's "flatten mesh dimensions [...]" advice for the norm's reduction is not logged.
    assert "sequential all_reduce" not in out, out[-4000:]


@pytest.mark.slow
def test_an_expert_fsdp_run_logs_one_norm_on_every_rank_and_no_advice(tmp_path: Path) -> None:
    """A real MoE run, EP 2 with expert FSDP 2 (4 ranks): each rank logs the gradient norm it
    clipped with, and they are equal at every step (a rank that clipped with another coefficient
    would silently drift from its peers)."""
    overrides = {**MOE, "parallelism.ep": 2, "training.local_batch_size": GLOBAL_BATCH // 4}
    result = run_titan_train(tmp_path, 4, overrides)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    norms: dict[int, set[float]] = {}
    ranks: dict[int, set[int]] = {}
    for r in log_records(result.stdout):
        if r.get("event") == "step":
            norms.setdefault(r["step"], set()).add(r["grad_norm"])
            ranks.setdefault(r["step"], set()).add(r.get("rank", 0))
    assert len(norms) == STEPS and all(ranks[s] == {0, 1, 2, 3} for s in ranks), ranks
    assert all(len(n) == 1 for n in norms.values()), norms
    assert "sequential all_reduce" not in out, out[-4000:]
