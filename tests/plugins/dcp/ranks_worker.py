"""Run under torchrun (2 ranks) by test_checkpoint_ranks.py (gloo, CPU) and
bench/checkpoint_faults_cuda.py (NCCL, ``cuda`` as second argument): the checkpointer's faults
when several ranks write and read one checkpoint. Each rank writes ``<out>/rank<R>.json``.

Scenarios, in one launch (each in its own folder under ``<out>``):

``fsdp``
    FSDP-sharded model saves step 2 and 4; one shard file of step 4 is then truncated, so both
    ranks fall back to step 2; then a full disk on rank 1 only while saving step 6 fails both
    ranks with one message and leaves no partial folder.
``stages``
    Each rank holds different layers (as pipeline stages do): a load sees the whole model across
    ranks (no false "unexpected key"), and a checkpoint of 6 layers refused by a 4-layer split.
``unshared``
    The ranks' checkpoint folders differ (not a shared filesystem): every rank stops, none hangs.
``leftovers``
    A save of step 4 killed before its rename (``step-4.tmp``, complete) and one cut short
    (``step-6.tmp``): rank 0 finishes the first and removes the second at start-up, and every
    rank resumes from step 4 (none scans the folder before rank 0 is done with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from tests.plugins.dcp.checkpoint_kit import META, Net, Run, checkpointer, same
from titan_core.errors import TitanError, UsageError

_REAL = FileSystem.create_stream


@contextlib.contextmanager
def _full(self: FileSystem, path: Any, mode: str):
    if str(path).endswith(".distcp") and "w" in mode:
        with open("/dev/full", "wb", buffering=0) as stream:
            yield stream
    else:
        with _REAL(self, path, mode) as stream:
            yield stream


DEVICE = "cpu"


def _sharded(seed: int) -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net(3, 8).to(DEVICE)
    mesh = init_device_mesh(DEVICE, (2,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Run(width=8, seed=seed, model=model)


def _stage(layers: int, rank: int, seed: int) -> Run:
    """Rank 0 holds the first half of ``layers``, rank 1 the rest (global block indices kept)."""
    torch.manual_seed(seed)
    model = Net(layers, 4).to(DEVICE)
    half = layers // 2
    own = range(half) if rank == 0 else range(half, layers)
    model.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in own})
    return Run(seed=seed, model=model)


def _save(ck: Any, run: Run, step: int) -> None:
    ck.save(step, run.parts, run.optimizer, run.scheduler, last=False, meta={**META, "step": step})


def fsdp(out: Path, rank: int) -> dict[str, Any]:
    ck = checkpointer(out, 2, rank, DEVICE, **{"checkpoint.interval": 1000})
    run = _sharded(0)
    result: dict[str, Any] = {}
    for step in (1, 2):
        run.step(step)
    _save(ck, run, 2)
    at2 = run.weights()
    for step in (3, 4):
        run.step(step)
    _save(ck, run, 4)
    dist.barrier()
    if rank == 0:
        shard = out / "checkpoint" / "step-4" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    dist.barrier()
    fresh = _sharded(5)
    result["loaded"] = ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0]
    result["weights_of_step_2"] = same(fresh.weights(), at2)

    fresh.step(3)
    original = FileSystem.create_stream
    if rank == 1:
        FileSystem.create_stream = _full  # type: ignore[method-assign]
    try:
        _save(ck, fresh, 6)
        result["full_disk"] = None
    except TitanError as exc:
        result["full_disk"] = str(exc)
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]
    dist.barrier()
    result["listing"] = sorted(os.listdir(out / "checkpoint"))
    return result


def stages(out: Path, rank: int) -> dict[str, Any]:
    ck = checkpointer(out, 2, rank, DEVICE, **{"checkpoint.interval": 1000})
    run = _stage(6, rank, 0)
    run.step(1)
    _save(ck, run, 1)
    fresh = _stage(6, rank, 3)
    result: dict[str, Any] = {"loaded": ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0]}
    result["same"] = same(fresh.weights(), run.weights())
    smaller = _stage(4, rank, 3)
    try:
        ck.load(smaller.parts, smaller.optimizer, smaller.scheduler)
        result["refused"] = None
    except UsageError as exc:
        result["refused"] = str(exc)
    return result


def unshared(out: Path, rank: int) -> dict[str, Any]:
    """Each rank has its own folder (a local disk per host): rank 0 sees a checkpoint, rank 1 none."""
    ck = checkpointer(out / f"rank{rank}", 2, rank, DEVICE)
    if rank == 0:
        (out / "rank0" / "checkpoint" / "step-3").mkdir(parents=True)
    dist.barrier()
    run = Run(model=Net().to(DEVICE))
    try:
        ck.load(run.parts, run.optimizer, run.scheduler)
        return {"error": None}
    except TitanError as exc:
        return {"error": str(exc)}


def leftovers(out: Path, rank: int) -> dict[str, Any]:
    ck = checkpointer(out, 2, rank, DEVICE, **{"checkpoint.interval": 1000})
    run = _sharded(0)
    for step in (1, 2):
        run.step(step)
    _save(ck, run, 2)
    for step in (3, 4):
        run.step(step)
    _save(ck, run, 4)
    at4 = run.weights()
    dist.barrier()
    root = out / "checkpoint"
    if rank == 0:
        os.rename(root / "step-4", root / "step-4.tmp")
        (root / "step-6.tmp").mkdir()
    dist.barrier()
    fresh = _sharded(5)
    try:
        loaded = ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0]
    except TitanError as exc:
        return {"loaded": str(exc)}
    dist.barrier()
    return {"loaded": loaded, "same": same(fresh.weights(), at4), "listing": sorted(os.listdir(root))}


def main() -> None:
    global DEVICE
    out = Path(sys.argv[1])
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    results = {
        "fsdp": fsdp(out / "fsdp", rank),
        "stages": stages(out / "stages", rank),
        "unshared": unshared(out / "unshared", rank),
        "leftovers": leftovers(out / "leftovers", rank),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from titan_core.cli import exit_process

    main()
    exit_process(0)  # titan's ranks' ending: no abort at interpreter teardown (its docstring)
