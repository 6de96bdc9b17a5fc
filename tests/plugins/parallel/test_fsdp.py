"""FSDP2 and HSDP on CPU/gloo: same per-step losses as one process on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_layout


@pytest.mark.slow
def test_fsdp_two_ranks_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2}
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_hsdp_two_by_two_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {
        "parallelism.dp_replicate": 2,
        "parallelism.dp_shard": 2,
        "training.local_batch_size": GLOBAL_BATCH // 4,
    }
    assert_losses_close(run_layout(tmp_path, 4, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_fsdp_with_full_activation_checkpointing_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    """The usual large-model combination: checkpoint wrappers inside FSDP units."""
    layout = {
        "parallelism.dp_shard": 2,
        "training.local_batch_size": GLOBAL_BATCH // 2,
        "activation_checkpoint.mode": "full",
    }
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)
