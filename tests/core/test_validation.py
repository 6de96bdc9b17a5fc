"""Validation (``[validation]``): loss and perplexity on held data, logged and in TensorBoard."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_llama3
from tests.parallel_harness import log_records, run_titan_train, write_seed_checkpoint
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.parallelize import cross_entropy_loss
from titan_core.trainer import Trainer, train


def with_validation(tmp_path: Path, steps: int = 4) -> object:
    config = tiny_llama3(tmp_path, steps)
    config.validation.enable = True
    config.validation.freq = 2
    config.validation.steps = 2
    return config


def test_validation_loss_is_the_models_loss_on_the_validation_batches(tmp_path: Path) -> None:
    config = with_validation(tmp_path)
    config.metrics.enable_tensorboard = True
    trainer = Trainer(config, get_registry())
    history = trainer.train()
    validated = [r for r in history if "validation/loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    with torch.no_grad():
        batches = itertools.islice(iter(trainer.val_batches), 2)
        expected = sum(float(cross_entropy_loss(trainer.parts[0](i), lab)) for i, lab in batches) / 2
    last = validated[-1]
    assert last["validation/loss"] == pytest.approx(expected, rel=1e-4)
    assert last["validation/perplexity"] == pytest.approx(math.exp(expected), rel=1e-3)
    trainer.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"validation/loss", "validation/perplexity", "train/loss", "train/lr"} <= set(tags)


def test_validation_leaves_training_unchanged(tmp_path: Path) -> None:
    plain = tiny_llama3(tmp_path / "plain", 4)
    without = [r["loss"] for r in train(plain, get_registry())]
    with_it = [r["loss"] for r in train(with_validation(tmp_path / "val"), get_registry())]
    assert with_it == pytest.approx(without, rel=1e-6)


def test_validation_on_other_files(tmp_path: Path) -> None:
    corpus = tmp_path / "val.jsonl"
    corpus.write_text("\n".join(f'{{"text": "held out document {i} about rivers"}}' for i in range(300)))
    config = with_validation(tmp_path / "out", steps=2)
    config.validation.dataset, config.validation.path = "text", str(corpus)
    rows = train(config, get_registry())
    on_training_data = train(with_validation(tmp_path / "same", steps=2), get_registry())
    assert rows[-1]["validation/loss"] != pytest.approx(on_training_data[-1]["validation/loss"], rel=1e-3)


def test_missing_validation_path_names_the_validation_field(tmp_path: Path) -> None:
    config = with_validation(tmp_path)
    config.validation.dataset, config.validation.path = "text", str(tmp_path / "nowhere")
    with pytest.raises(UsageError, match=r"^validation\.path: .*nowhere' does not exist"):
        Trainer(config, get_registry())


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed") / "seed.pt")


VALIDATION = {"validation.enable": True, "validation.freq": 3, "validation.steps": 2}


def validation_losses(folder: Path, nproc: int, seed: Path, overrides: dict) -> list[tuple[int, float]]:
    overrides = {"checkpoint.initial_load_path": str(seed), **VALIDATION, **overrides}
    result = run_titan_train(folder, nproc, overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [r for r in log_records(result.stdout) if r.get("event") == "validation"]
    return [(r["step"], r["loss"]) for r in records if r.get("rank", 0) == 0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, seed: Path) -> list[tuple[int, float]]:
    return validation_losses(tmp_path_factory.mktemp("one"), 1, seed, {"training.local_batch_size": 4})


@pytest.mark.parametrize(
    "layout",
    [
        {"parallelism.dp_shard": 2, "training.local_batch_size": 2},
        {"parallelism.tp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4},
        # PP has no forward-only path: its step function runs and the gradients are dropped.
        {"parallelism.pp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4},
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_two_ranks_validate_like_one_process(
    tmp_path: Path, seed: Path, one_process: list[tuple[int, float]], layout: dict
) -> None:
    found = validation_losses(tmp_path, 2, seed, layout)
    assert [s for s, _ in found] == [s for s, _ in one_process] == [3, 6]
    assert [v for _, v in found] == pytest.approx([v for _, v in one_process], rel=1e-4)
