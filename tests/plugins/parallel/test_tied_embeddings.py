"""Tied input/output embeddings stay ONE initialised parameter under 1 process, FSDP 2 and TP 2.

The core records parameter sharing on the meta model and restores it after every strategy and
after ``to_empty`` (``titan_core.tied``); without that, TP's per-module DTensor parameters and the
materialisation would leave two independent matrices, one of them never initialised.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import (
    GLOBAL_BATCH,
    TINY_MODEL,
    assert_losses_close,
    log_records,
    run_layout,
    run_titan_train,
    write_seed_checkpoint,
)

TIED = {"model.overrides": {**TINY_MODEL, "tie_embeddings": True}}


@pytest.fixture(scope="module")
def tied_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed_checkpoint(tmp_path_factory.mktemp("tied") / "seed.pt", **TIED)


def test_the_tied_seed_holds_one_matrix(tied_seed: Path) -> None:
    """The seed every tied layout loads is a tied model's: one matrix under both names."""
    import torch

    state = torch.load(tied_seed)
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


def _built(folder: Path, nproc: int, overrides: dict) -> dict:
    result = run_titan_train(folder, nproc, {**TIED, **overrides})
    assert result.returncode == 0, result.stderr[-3000:]
    return next(r for r in log_records(result.stdout) if r.get("event") == "built" and r.get("rank", 0) == 0)


def test_one_process_counts_one_embedding_matrix(tmp_path: Path) -> None:
    built = _built(tmp_path, 1, {"training.steps": 1})
    assert built["params_total"] == built["params_local"]


@pytest.mark.slow
def test_fsdp_shards_one_matrix(tmp_path: Path) -> None:
    built = _built(
        tmp_path, 2, {"training.steps": 1, "parallelism.dp_shard": 2, "training.local_batch_size": 2}
    )
    assert 2 * built["params_local"] == built["params_total"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
        {"parallelism.tp": 2, "parallelism.dp_shard": 1},
        {"parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.loss_parallel": False},
        {"parallelism.tp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
    ],
    ids=["fsdp2", "tp2", "tp2_no_loss_parallel", "fsdp2_tp2"],
)
def test_tied_layouts_match_one_process(tmp_path: Path, tied_seed: Path, layout: dict) -> None:
    reference = run_layout(tmp_path / "one", 1, tied_seed, TIED)
    nproc = layout["parallelism.tp"] * layout["parallelism.dp_shard"] if "parallelism.tp" in layout else 2
    assert_losses_close(run_layout(tmp_path / "two", nproc, tied_seed, {**TIED, **layout}), reference)
