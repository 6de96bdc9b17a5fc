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


def _first_loss(rows: list[dict[str, float]]) -> float:
    return next(r["loss"] for r in rows if int(r["step"]) == 1)


def test_a_seed_checkpoint_alone_is_the_weights_the_run_starts_from(tmp_path: Path) -> None:
    """The seed (written with debug.seed 5) is what step 1 trains, not this run's own init
    (debug.seed 0): its first loss is that of a run initialised with seed 5 (no shuffling,
    so the data does not depend on the seed)."""
    train(
        config(tmp_path / "run", **{"checkpoint.create_seed_checkpoint": True, "debug.seed": 5}),
        get_registry(),
    )
    from_seed = train(config(tmp_path / "run", **{"checkpoint.enable": True}), get_registry())
    seed_5 = train(config(tmp_path / "plain5", **{"debug.seed": 5}), get_registry())
    seed_0 = train(config(tmp_path / "plain0"), get_registry())
    assert _first_loss(from_seed) == pytest.approx(_first_loss(seed_5), rel=1e-6)
    assert _first_loss(from_seed) != pytest.approx(_first_loss(seed_0), rel=1e-6)


def test_a_seed_checkpoint_recording_no_model_still_conflicts_with_an_initial_load_path(
    tmp_path: Path,
) -> None:
    """A seed whose meta.json records nothing beside the weights (an earlier titan's, or one
    saved by ``save_seed(parts)`` without ``meta``): the trainer took "step 0, no meta" for "no
    checkpoint", so the run logged ``seed checkpoint loaded`` and then trained from
    initial_load_path's weights, read over the seed's without a word."""
    import json

    train(config(tmp_path / "run", **{"checkpoint.create_seed_checkpoint": True}), get_registry())
    meta_json = tmp_path / "run" / "checkpoint" / "step-0" / "meta.json"
    record = json.loads(meta_json.read_text())
    record["meta"] = {}
    meta_json.write_text(json.dumps(record))
    train(config(tmp_path / "other", **{"checkpoint.enable": True, "debug.seed": 5}), get_registry())
    other = str(tmp_path / "other" / "checkpoint" / "step-2")
    both = config(tmp_path / "run", **{"checkpoint.enable": True, "checkpoint.initial_load_path": other})
    with pytest.raises(UsageError, match=r"holds a seed checkpoint .*step-0.* checkpoint\.initial_load_path"):
        train(both, get_registry())
