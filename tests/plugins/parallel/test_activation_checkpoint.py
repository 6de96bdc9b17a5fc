"""Activation checkpointing: which blocks are wrapped, unchanged state-dict keys, unchanged losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import Trainer
from titan_plugins_parallel.activation_checkpoint import wrapped_indices


def test_full_wraps_every_block_selective_every_other() -> None:
    assert wrapped_indices("full", 4) == [0, 1, 2, 3]
    assert wrapped_indices("selective", 5) == [1, 3]
    assert wrapped_indices("none", 4) == []


def train_tiny(tmp_path: Path, seed: Path, **overrides: Any) -> tuple[Trainer, list[float]]:
    config = tiny_config(
        **{"checkpoint.initial_load_path": str(seed), "job.dump_folder": str(tmp_path), **overrides}
    )
    trainer = Trainer(config, get_registry())
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return trainer, [row["loss"] for row in history]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> tuple[list[str], list[float]]:
    """State-dict keys and losses without activation checkpointing."""
    trainer, losses = train_tiny(tmp_path_factory.mktemp("plain"), seed_checkpoint)
    return list(trainer.parts[0].state_dict()), losses


@pytest.mark.parametrize(
    ("mode", "extra", "wrapped"),
    [
        ("full", {"activation_checkpoint.preserve_rng_state": True}, {"0", "1", "2", "3"}),
        (
            "selective",
            {"activation_checkpoint.determinism_check": "none", "activation_checkpoint.debug": True},
            {"1", "3"},
        ),
    ],
)
def test_checkpointed_blocks_give_the_losses_of_no_checkpointing(
    tmp_path: Path,
    seed_checkpoint: Path,
    plain: tuple[list[str], list[float]],
    mode: str,
    extra: dict,
    wrapped: set[str],
) -> None:
    keys, expected = plain
    trainer, losses = train_tiny(tmp_path, seed_checkpoint, **{"activation_checkpoint.mode": mode, **extra})
    layers = trainer.parts[0].layers
    assert {k for k, block in layers.items() if type(block).__name__ == "CheckpointWrapper"} == wrapped
    assert "activation_checkpoint" in trainer.ctx.applied
    # Keys are those of the unwrapped model, so the seed (and any checkpoint) loads as is.
    assert list(trainer.parts[0].state_dict()) == keys
    assert len(losses) == len(expected) >= 5
    assert losses == pytest.approx(expected, rel=1e-5)
