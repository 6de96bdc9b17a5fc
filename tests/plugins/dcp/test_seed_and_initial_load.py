"""A run whose checkpoint folder holds a seed checkpoint (``step-0``) and whose recipe also names
``checkpoint.initial_load_path``: it logged ``seed checkpoint loaded`` and then trained from the
other weights, read over the seed's without a word. It is one error naming both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import train


def config(folder: Path, **overrides: Any) -> Any:
    return tiny_config(**{"job.dump_folder": str(folder), "training.steps": 2, **overrides})


def test_a_seed_checkpoint_and_an_initial_load_path_together_are_refused(tmp_path: Path) -> None:
    train(config(tmp_path / "run", **{"checkpoint.create_seed_checkpoint": True}), get_registry())
    train(config(tmp_path / "other", **{"checkpoint.enable": True, "debug.seed": 5}), get_registry())
    other = str(tmp_path / "other" / "checkpoint" / "step-2")
    both = config(tmp_path / "run", **{"checkpoint.enable": True, "checkpoint.initial_load_path": other})
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(UsageError, match=r"holds a seed checkpoint .*step-0.* checkpoint\.initial_load_path"):
        train(both, get_registry())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing written
    # Either alone runs: the seed (initial_load_path left out) ...
    rows = {
        int(r["step"]): r
        for r in train(config(tmp_path / "run", **{"checkpoint.enable": True}), get_registry())
    }
    assert sorted(rows) == [1, 2]


def test_an_initial_load_path_naming_the_seed_itself_is_no_conflict(tmp_path: Path) -> None:
    train(config(tmp_path, **{"checkpoint.create_seed_checkpoint": True}), get_registry())
    seed = str(tmp_path / "checkpoint" / "step-0")
    same = config(tmp_path, **{"checkpoint.enable": True, "checkpoint.initial_load_path": seed})
    assert sorted(int(r["step"]) for r in train(same, get_registry())) == [1, 2]
