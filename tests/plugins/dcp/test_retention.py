"""``checkpoint.keep_latest_k`` (old checkpoints removed after each save) and
``checkpoint.load_step`` (resume from a named step), in one process without the trainer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.dcp.checkpoint_kit import Events, Run, checkpointer, same
from tests.plugins.dcp.test_checkpoint_faults import listing, train
from titan_core.config import ConfigError, validate
from titan_core.errors import UsageError


def trained(tmp_path: Path, steps: int, **overrides: Any) -> tuple[Any, dict[int, dict]]:
    """A run saving every step 1..steps; the weights after each step."""
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 1, **overrides})
    run, weights = Run(), {}
    for i in range(1, steps + 1):
        train(run, range(i, i + 1), ck)
        weights[i] = run.weights()
    return ck, weights


def test_only_the_newest_k_checkpoints_are_kept(tmp_path: Path, events: Events) -> None:
    ck, weights = trained(tmp_path, 5, **{"checkpoint.keep_latest_k": 2})
    assert listing(tmp_path) == ["step-4", "step-5"]
    removed = events.of("removed old checkpoints")
    assert [r["steps"] for r in removed] == [[1], [2], [3]]
    run = Run(seed=7)  # another initialisation: the load must bring step 5's weights back
    assert ck.load(run.parts, run.optimizer, run.scheduler)[0] == 5
    assert same(run.weights(), weights[5])


def test_keep_latest_k_0_keeps_every_checkpoint_and_the_default_keeps_10(tmp_path: Path) -> None:
    trained(tmp_path / "all", 4, **{"checkpoint.keep_latest_k": 0})
    assert listing(tmp_path / "all") == ["step-1", "step-2", "step-3", "step-4"]
    trained(tmp_path / "default", 12)
    assert listing(tmp_path / "default") == sorted(f"step-{i}" for i in range(3, 13))


def test_a_seed_newer_runs_and_leftovers_are_never_removed(tmp_path: Path, events: Events) -> None:
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 1, "checkpoint.keep_latest_k": 1})
    run = Run()
    ck.save_seed(run.parts)
    root = tmp_path / "checkpoint"
    (root / "step-9.tmp").mkdir()  # a killed save: not ours to judge
    (root / "notes").mkdir()
    train(run, range(1, 4), ck)
    assert listing(tmp_path) == ["notes", "step-0", "step-3", "step-9.tmp"]


def test_a_checkpoint_that_cannot_be_removed_is_a_warning_and_the_save_stands(
    tmp_path: Path, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    rename = os.rename

    def refuse(src: str, dst: str) -> None:
        if str(dst).endswith(".old"):
            raise PermissionError(13, "Permission denied", src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse)
    trained(tmp_path, 3, **{"checkpoint.keep_latest_k": 2})
    assert listing(tmp_path) == ["step-1", "step-2", "step-3"]
    warned = events.of("could not remove an old checkpoint")
    assert warned and "Permission denied" in warned[0]["reason"], events.lines
    assert "checkpoint.keep_latest_k" in warned[0]["reason"]


def test_load_step_restores_that_step_for_a_replay_in_a_folder_of_its_own(tmp_path: Path) -> None:
    trained(tmp_path, 4)
    elsewhere = {"checkpoint.folder": str(tmp_path / "checkpoint"), "checkpoint.load_only": True}
    ck = checkpointer(tmp_path / "replay", **{"checkpoint.load_step": 2, **elsewhere})
    _, weights = trained(tmp_path / "again", 2)  # the same steps: the weights step 2 had
    run = Run(seed=7)
    assert ck.load(run.parts, run.optimizer, run.scheduler)[0] == 2
    assert same(run.weights(), weights[2])


@pytest.mark.parametrize("load_only", [False, True], ids=["saving", "replay-in-the-runs-folder"])
def test_load_step_with_newer_checkpoints_is_refused_where_it_would_mix_runs(
    tmp_path: Path, load_only: bool
) -> None:
    # Saves would replace some of the newer steps and leave others: the next resume would take
    # the newest, of the abandoned run, without a word. A replay in the run's own dump folder
    # would replace the metrics.jsonl rows of the steps after it.
    trained(tmp_path, 4)
    ck = checkpointer(tmp_path, **{"checkpoint.load_step": 2, "checkpoint.load_only": load_only})
    run = Run()
    with pytest.raises(UsageError) as info:
        ck.load(run.parts, run.optimizer, run.scheduler)
    text = str(info.value)
    assert "checkpoint.load_step = 2" in text and "(step-3, step-4)" in text, text
    assert "move them out" in text and "job.dump_folder of its own" in text, text
    assert f"checkpoint.folder = {str(tmp_path / 'checkpoint')!r}" in text, text
    assert listing(tmp_path) == ["step-1", "step-2", "step-3", "step-4"]


def test_a_load_step_that_is_not_there_names_the_steps_that_are(tmp_path: Path) -> None:
    trained(tmp_path, 3, **{"checkpoint.keep_latest_k": 2})
    ck = checkpointer(tmp_path, **{"checkpoint.load_step": 1})
    run = Run()
    with pytest.raises(UsageError, match=r"checkpoint.load_step = 1: .* holds step-2, step-3"):
        ck.load(run.parts, run.optimizer, run.scheduler)


def test_a_damaged_load_step_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    trained(tmp_path, 3)
    os.remove(tmp_path / "checkpoint" / "step-3" / "meta.json")
    ck = checkpointer(tmp_path, **{"checkpoint.load_step": 3})
    run = Run()
    with pytest.raises(
        UsageError, match=r"checkpoint.load_step = 3: .*step-3 cannot be loaded: it has no meta"
    ):
        ck.load(run.parts, run.optimizer, run.scheduler)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"checkpoint.keep_latest_k": -1}, "checkpoint.keep_latest_k"),
        ({"checkpoint.load_step": -1}, "checkpoint.load_step"),
        ({"checkpoint.enable": False, "checkpoint.load_step": 3}, "checkpoint.load_step: has no effect"),
    ],
)
def test_bad_retention_and_load_step_values_are_refused(overrides: dict, problem: str) -> None:
    from tests.parallel_harness import tiny_config

    with pytest.raises(ConfigError) as info:
        validate(tiny_config(**{"checkpoint.enable": True, **overrides}), source="r")
    assert problem in str(info.value), str(info.value)


def test_through_the_trainer_the_newest_k_stay_and_a_load_step_run_continues_from_it(tmp_path: Path) -> None:
    from tests.plugins.dcp.test_dcp import config_in, run, saved_steps

    whole = run(config_in(tmp_path / "whole", **{"checkpoint.interval": 1, "checkpoint.keep_latest_k": 2}))
    assert saved_steps(tmp_path / "whole") == ["step-5", "step-6"]
    rows = (tmp_path / "whole" / "metrics.jsonl").read_text()
    # Step 6 again from step 5's checkpoint, saving nothing, in a folder of its own: the loss
    # of the uninterrupted run, and the run's own folder as it was.
    replay = {
        "checkpoint.load_step": 5,
        "checkpoint.load_only": True,
        "checkpoint.folder": str(tmp_path / "whole" / "checkpoint"),
    }
    assert run(config_in(tmp_path / "replay", **replay)) == {6: whole[6]}
    assert saved_steps(tmp_path / "whole") == ["step-5", "step-6"]
    assert (tmp_path / "whole" / "metrics.jsonl").read_text() == rows
