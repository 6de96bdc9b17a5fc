"""``--overwrite`` of a run that started from a seed checkpoint in its checkpoint folder: it
deleted the seed with the run's own checkpoints (the dcp checkpointer's outputs include
``step-0``), and the run "started over" from fresh weights instead of the seed's, perhaps
weights imported from elsewhere that took hours to write. The seed is the run's input, written
by an earlier seed run: the checkpointer says which of its outputs are seeds
(``Checkpointer.seeds``), and ``--overwrite`` keeps them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import train


def _config(folder: Path, **overrides: Any) -> Any:
    return tiny_config(**{"job.dump_folder": str(folder), "training.steps": 2, **overrides})


def _entries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n != ".titan.lock")


def test_overwrite_of_a_run_started_from_a_seed_keeps_the_seed_and_starts_from_it(tmp_path: Path) -> None:
    # The seed's weights are not this run's own init (debug.seed 5 against 0).
    train(_config(tmp_path, **{"checkpoint.create_seed_checkpoint": True, "debug.seed": 5}), get_registry())
    first = train(_config(tmp_path, **{"checkpoint.enable": True}), get_registry())
    assert _entries(tmp_path / "checkpoint") == ["step-0", "step-2"]
    again = train(_config(tmp_path, **{"checkpoint.enable": True}), get_registry(), overwrite=True)
    assert _entries(tmp_path / "checkpoint") == ["step-0", "step-2"]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]  # from the seed again
    log = (tmp_path / "train.log").read_text()
    (line,) = [ln for ln in log.splitlines() if "--overwrite" in ln]
    assert "checkpoints_removed" in line and "step-2" in line
    assert "seed_checkpoints_kept" in line and "step-0" in line


def test_overwrite_of_the_seed_run_itself_replaces_its_seed(tmp_path: Path) -> None:
    """Its seed is that run's output: another seed run with --overwrite writes a new one."""
    train(_config(tmp_path, **{"checkpoint.create_seed_checkpoint": True, "debug.seed": 5}), get_registry())
    before = (tmp_path / "checkpoint" / "step-0" / "meta.json").read_text()
    seed = _config(tmp_path, **{"checkpoint.create_seed_checkpoint": True, "debug.seed": 6})
    train(seed, get_registry(), overwrite=True)
    assert _entries(tmp_path / "checkpoint") == ["step-0"]
    assert (tmp_path / "checkpoint" / "step-0" / "meta.json").read_text() != before
    log = (tmp_path / "train.log").read_text()
    (line,) = [ln for ln in log.splitlines() if "--overwrite" in ln]
    assert "step-0" in line and "seed_checkpoints_kept" not in line


def test_seed_patterns_are_checked_as_outputs_are() -> None:
    import pytest

    from titan_core import Checkpointer

    with pytest.raises(TypeError, match=r"Checkpointer\.seeds: expected a tuple of file or folder name"):
        Checkpointer("toy", print, seeds="step-0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Checkpointer\.seeds: expected"):
        Checkpointer("toy", print, seeds=("../seed",))
