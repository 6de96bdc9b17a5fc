"""``checkpoint.initial_load_path`` naming a titan DCP checkpoint of another model of the same
tensor shapes (another ``rope_theta``): its ``meta.json`` records the model, but only a resume
read it, so the weights loaded without a word (a Hugging Face folder whose config.json differs
is refused). The checkpointer hands the recorded meta to the trainer through ``verify``'s
``check_meta`` (``Checkpointer.verify``), which names what differs in one warning."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LogWarnings, record_warnings
from tests.parallel_harness import tiny_config
from titan_core import trainer as trainer_module
from titan_core._registry import get_registry
from titan_core.trainer import train

_INITIAL = "checkpoint.initial_load_path"


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> LogWarnings:
    return record_warnings(monkeypatch, trainer_module)


def _started_from(folder: Path, source: Path, **overrides: Any) -> list[int]:
    config = tiny_config(**{"job.dump_folder": str(folder), _INITIAL: str(source), "debug.max_steps": 2})
    config.model.overrides = {**config.model.overrides, **overrides}
    return sorted(int(row["step"]) for row in train(config, get_registry()))


@pytest.fixture
def step_2(tmp_path: Path) -> Path:
    source = tiny_config(
        **{"job.dump_folder": str(tmp_path / "source"), "checkpoint.enable": True, "debug.max_steps": 2}
    )
    train(source, get_registry())
    return tmp_path / "source" / "checkpoint" / "step-2"


def _model_warnings(warnings: LogWarnings) -> list[str]:
    return [w for w in warnings.seen if "saved by another model" in w]


def test_initial_weights_of_another_model_of_the_same_shapes_are_named(
    tmp_path: Path, step_2: Path, warnings: LogWarnings
) -> None:
    assert _started_from(tmp_path / "new", step_2, rope_theta=10_000.0) == [1, 2]  # loads: a warning
    (message,) = _model_warnings(warnings)
    assert message.startswith(f"checkpoint.initial_load_path: {str(step_2)!r} was saved by another model")
    assert re.search(r"arguments that differ: rope_theta: 500000(\.0)? -> 10000\b", message)
    assert "model.flavor / model.overrides" in message  # what to change if it is not meant


def test_initial_weights_of_the_same_model_draw_no_warning(
    tmp_path: Path, step_2: Path, warnings: LogWarnings
) -> None:
    _started_from(tmp_path / "same", step_2)
    _started_from(tmp_path / "fused", step_2, fuse_qkv=False)  # compute-only: the same weights
    assert _model_warnings(warnings) == []


def test_a_seed_checkpoint_of_another_model_is_named_too(tmp_path: Path, warnings: LogWarnings) -> None:
    seed = tiny_config(
        **{"job.dump_folder": str(tmp_path / "seed"), "checkpoint.create_seed_checkpoint": True}
    )
    train(seed, get_registry())
    _started_from(tmp_path / "new", tmp_path / "seed" / "checkpoint" / "step-0", norm_eps=1e-6)
    (message,) = _model_warnings(warnings)
    assert "arguments that differ: norm_eps: 1e-05 -> 1e-06" in message
