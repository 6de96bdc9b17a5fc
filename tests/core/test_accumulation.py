"""Gradient accumulation (``training.global_batch_size``): the same losses as the large batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_llama3
from tests.parallel_harness import assert_losses_close, run_layout, write_seed_checkpoint
from titan_core._registry import get_registry
from titan_core.config import ConfigError, validate
from titan_core.trainer import Trainer, train


def rows(tmp_path: Path, local: int, global_batch: int | None, steps: int = 3) -> list[dict]:
    config = tiny_llama3(tmp_path, steps)
    config.training.local_batch_size = local
    config.training.global_batch_size = global_batch
    return train(config, get_registry())


def test_two_microbatches_of_two_equal_one_batch_of_four(tmp_path: Path) -> None:
    big = rows(tmp_path / "big", local=4, global_batch=None)
    accumulated = rows(tmp_path / "accumulated", local=2, global_batch=4)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in accumulated] == pytest.approx([r[key] for r in big], rel=1e-5), key
    # Without accumulation the same local batch trains on half the data: the losses differ.
    small = rows(tmp_path / "small", local=2, global_batch=None)
    assert [r["loss"] for r in small][1:] != pytest.approx([r["loss"] for r in big][1:], rel=1e-5)
    # Throughput counts every microbatch's tokens.
    assert accumulated[0]["step"] == 1


def test_gradient_sync_only_on_the_last_microbatch(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 1)
    config.training.global_batch_size = 3 * config.training.local_batch_size
    trainer = Trainer(config, get_registry())
    calls: list[bool] = []
    trainer.parts[0].set_requires_gradient_sync = calls.append  # what FSDP2 modules have
    batches = iter(trainer.batches)
    loss = trainer.accumulate(batches)
    assert calls == [False, False, True]
    assert loss is not None and float(loss) > 0
    trainer.close()


def test_global_batch_not_a_multiple_of_the_local_batch_is_refused(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path)
    config.training.global_batch_size = 3  # local batch 2
    with pytest.raises(ConfigError, match=r"training\.global_batch_size: 3 is not a multiple of .*=2"):
        validate(config)


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed") / "seed.pt")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, seed: Path) -> list[float]:
    """The reference: one process, batch 4 per step."""
    return run_layout(tmp_path_factory.mktemp("one"), 1, seed, {"training.local_batch_size": 4})


def test_fsdp_two_ranks_accumulating_matches_one_process(
    tmp_path: Path, seed: Path, one_process: list[float]
) -> None:
    # 2 ranks x 1 sequence x 2 microbatches = the same 4 sequences per step.
    overrides = {
        "parallelism.dp_shard": 2,
        "training.local_batch_size": 1,
        "training.global_batch_size": 4,
    }
    assert_losses_close(run_layout(tmp_path, 2, seed, overrides), one_process)


def test_pipeline_two_ranks_accumulating_matches_one_process(
    tmp_path: Path, seed: Path, one_process: list[float]
) -> None:
    # PP: each microbatch of 2 sequences is one schedule step (2 pipeline microbatches of 1).
    overrides = {
        "parallelism.pp": 2,
        "parallelism.dp_shard": 1,
        "parallelism.pp_schedule": "GPipe",
        "training.local_batch_size": 2,
        "training.global_batch_size": 4,
    }
    assert_losses_close(run_layout(tmp_path, 2, seed, overrides), one_process)
