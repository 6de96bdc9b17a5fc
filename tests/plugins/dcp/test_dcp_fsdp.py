"""DCP across layouts: a one-process seed checkpoint loads into a 2-process FSDP run (resharded),
and a 2-process FSDP run resumes exactly from its own sharded checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.parallel_harness import (
    GLOBAL_BATCH,
    STEPS,
    assert_losses_close,
    log_records,
    run_titan_train,
    step_losses,
)
from titan_core._registry import get_registry

pytestmark = pytest.mark.slow

FSDP2 = {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2}
SINGLE = {"parallelism.dp_shard": -1, "training.local_batch_size": GLOBAL_BATCH}


@pytest.fixture(scope="module", autouse=True)
def _needs_fsdp() -> None:
    if "fsdp" not in get_registry().records("strategies"):
        pytest.skip("needs the fsdp strategy (titan-plugins-parallel)")


def losses_of(folder: Path, nproc: int, overrides: dict, count: int = STEPS) -> list[float]:
    result = run_titan_train(folder, nproc, overrides)
    losses = step_losses(result.stdout)
    assert result.returncode == 0 and len(losses) == count, (
        f"{overrides} on {nproc} processes: exit {result.returncode}, {len(losses)} losses\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return losses


def test_seed_checkpoint_loads_into_fsdp_and_fsdp_resumes(tmp_path: Path) -> None:
    seed_out = tmp_path / "seed" / "out"
    seed = {"checkpoint.create_seed_checkpoint": True, "debug.seed": 7}
    losses_of(tmp_path / "seed", 1, seed, count=0)
    assert sorted(p.name for p in (seed_out / "checkpoint").glob("step-*")) == ["step-0"]

    # The documented workflow: every layout runs in the seed's dump folder with load_only.
    from_seed = {"job.dump_folder": str(seed_out), "checkpoint.enable": True, "checkpoint.load_only": True}
    single = losses_of(tmp_path / "single", 1, from_seed)
    fsdp = losses_of(tmp_path / "fsdp", 2, {**from_seed, **FSDP2})
    assert fsdp[0] == pytest.approx(single[0], rel=1e-5)
    assert_losses_close(fsdp, single)
    assert sorted(p.name for p in (seed_out / "checkpoint").glob("step-*")) == ["step-0"]  # load_only

    # FSDP saves sharded (one file per rank) and resumes with the losses of the whole run.
    step0 = str(seed_out / "checkpoint" / "step-0")
    resumable = {
        **FSDP2,
        "checkpoint.enable": True,
        "checkpoint.interval": 2,
        "checkpoint.initial_load_path": step0,
    }
    first = losses_of(tmp_path / "resume", 2, {**resumable, "debug.max_steps": 4}, count=4)
    shards = sorted(p.name for p in (tmp_path / "resume" / "out" / "checkpoint" / "step-4").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    # One process resumes the FSDP checkpoint (weights and optimizer state resharded) the same way.
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "resume" / "out" / "checkpoint", tmp_path / "one" / "checkpoint")
    one = run_titan_train(
        tmp_path / "one", 1, {**resumable, **SINGLE, "job.dump_folder": str(tmp_path / "one")}
    )
    assert not [r for r in log_records(one.stdout) if "data geometry changed" in r.get("event", "")]
    rest = losses_of(tmp_path / "resume", 2, resumable, count=STEPS - 4)
    assert first + rest == pytest.approx(fsdp, rel=1e-6)
    assert step_losses(one.stdout) == pytest.approx(rest, rel=1e-5)
