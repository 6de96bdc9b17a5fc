"""The divergence error (``Diverged``) says what a rerun of this run does: resume from the
checkpoint it names, or start over when checkpointing is off or nothing was saved yet."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_llama3
from tests.core.test_reliability import _PoisonGradAt
from titan_core._registry import Registry
from titan_core.trainer import Diverged, train


def _diverge(tmp_path: Path, at: int, steps: int = 6, **checkpoint: object) -> str:
    """Train ``steps`` steps with a NaN gradient at step ``at``; the divergence message."""
    config = tiny_llama3(tmp_path, steps)
    config.metrics.log_freq = 10
    for name, value in checkpoint.items():
        setattr(config.checkpoint, name, value)
    registry = Registry().load_entry_points()
    registry.register(_PoisonGradAt(at, []), "poison")
    with pytest.raises(Diverged) as info:
        train(config, registry)
    return str(info.value)


def test_with_checkpointing_off_it_says_nothing_was_saved(tmp_path: Path) -> None:
    """It said "resume from the last checkpoint" of a run that saves none."""
    message = _diverge(tmp_path, 3)
    assert "at step 3; stopped at step 6" in message and "Lower training.lr" in message
    assert "last checkpoint" not in message
    assert "checkpointing is off (checkpoint.enable = False)" in message
    assert "starts over from step 1" in message


def test_it_names_the_last_checkpoint_saved_before_the_bad_step(tmp_path: Path) -> None:
    message = _diverge(tmp_path, 3, enable=True, interval=2)
    assert "at step 3; stopped at step 4" in message
    assert "resumes from the last checkpoint, of step 2" in message
    assert (tmp_path / "checkpoint" / "step-2").is_dir()
    assert not (tmp_path / "checkpoint" / "step-4").exists()  # nothing saved from the bad step


def test_with_no_checkpoint_saved_yet_it_says_so_and_what_to_change(tmp_path: Path) -> None:
    message = _diverge(tmp_path, 3, enable=True, interval=5)
    assert "at step 3; stopped at step 5" in message
    assert "last checkpoint" not in message
    assert "no checkpoint was saved yet" in message and "checkpoint.interval = 5" in message
    assert "starts over from step 1" in message


def test_a_resumed_run_names_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 2)
    config.checkpoint.enable = True
    train(config, Registry().load_entry_points())  # step-2, the run's last step
    message = _diverge(tmp_path, 4, enable=True, interval=10)
    assert "at step 4; stopped at step 6" in message
    assert "resumes from the last checkpoint, of step 2" in message


def test_with_load_only_it_says_no_checkpoint_is_saved(tmp_path: Path) -> None:
    message = _diverge(tmp_path, 3, enable=True, load_only=True)
    assert "last checkpoint" not in message
    assert "checkpoint.load_only = True" in message and "starts over from step 1" in message
