"""Session fixtures of the parallelism tests: one seed checkpoint, one single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import run_layout, write_seed_checkpoint


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's initial weights (``tiny_config``'s shape), written once per session."""
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed") / "seed.pt")


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> list[float]:
    """Per-step losses of one process on the whole global batch, from the seed checkpoint."""
    return run_layout(tmp_path_factory.mktemp("reference"), 1, seed_checkpoint, {})
