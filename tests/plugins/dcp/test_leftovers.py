"""What killed saves leave in the checkpoint folder (``step-N.tmp``, ``step-N.old``): a run that
resumes there removes them at start-up (rank 0, before any rank of it saves), finishes a save that
was complete but not yet renamed, and never touches a checkpoint, a user's file or a folder that a
``load_only`` replay only reads (its run may be writing it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.parallel_harness import REPO, child_env
from tests.plugins.dcp.checkpoint_kit import META, Events, Run, checkpointer, same
from tests.plugins.dcp.test_checkpoint_faults import listing, saved_at, train

#: Saves step 2, then dies by SIGKILL in the middle of saving step 4: every shard of step 4 is
#: written into step-4.tmp, its meta.json and the rename are not.
_KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
import titan_plugins_dcp.checkpointer as module
from tests.plugins.dcp.checkpoint_kit import META, Run, checkpointer

ck = checkpointer(Path(sys.argv[1]), **{"checkpoint.interval": 2})
run = Run()
for i in range(1, 5):
    run.step(i)
    if i == 4:
        module.commit = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    if ck.should_save(i, False):
        ck.save(i, run.parts, run.optimizer, run.scheduler, last=False, meta={**META, "step": i})
"""


def test_a_save_killed_mid_write_leaves_nothing_after_the_next_start(tmp_path: Path, events: Events) -> None:
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert listing(tmp_path) == ["step-2", "step-4.tmp"]
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 100})
    run = Run(seed=3)
    assert ck.load(run.parts, run.optimizer, run.scheduler)[0] == 2
    assert "step-4.tmp" not in listing(tmp_path)  # was kept forever: every later run warned about it
    (removed,) = events.of("removed the leftover of an interrupted save")
    assert removed["path"] == str(tmp_path / "checkpoint" / "step-4.tmp")


def test_leftovers_of_any_step_go_and_everything_else_stays(tmp_path: Path, events: Events) -> None:
    ck, weights = saved_at(tmp_path, 2, 4)
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-2", root / "step-9.tmp")  # a killed save, its shards written
    (root / "step-9.tmp" / "meta.json").unlink()
    (root / "step-7.tmp").mkdir()  # killed before its first shard
    (root / "step-3.old").mkdir()  # a retention cut short: being removed already
    (root / "step-3.old" / "__0_0.distcp").write_bytes(b"x")
    for kept in ("step-3-hf", "step-006", "step-5.tmp.bak"):  # a user's, not titan's names
        (root / kept).mkdir()
    (root / "notes.txt").write_text("a user's file")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 4
    assert same(fresh.weights(), weights[4])
    assert listing(tmp_path) == ["notes.txt", "step-006", "step-2", "step-3-hf", "step-4", "step-5.tmp.bak"]
    gone = sorted(Path(e["path"]).name for e in events.of("removed the leftover of an interrupted save"))
    assert gone == ["step-3.old", "step-7.tmp", "step-9.tmp"]


def test_a_complete_save_cut_before_its_rename_is_finished_not_deleted(
    tmp_path: Path, events: Events
) -> None:
    """A kill between ``meta.json`` (written last, after every rank's shards) and the rename leaves
    a whole checkpoint under the temporary name: it is renamed, as the save would have."""
    ck, weights = saved_at(tmp_path, 2, 4)
    root = tmp_path / "checkpoint"
    os.rename(root / "step-4", root / "step-4.tmp")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 4
    assert same(fresh.weights(), weights[4])
    assert listing(tmp_path) == ["step-2", "step-4"]
    (finished,) = events.of("finished an interrupted save")
    assert finished["path"] == str(root / "step-4")


def test_a_complete_save_cut_between_the_renames_of_a_replacement_is_finished(
    tmp_path: Path, events: Events
) -> None:
    """Replacing a damaged ``step-N``: it was moved to ``step-N.old``, and the kill came before the
    new save was renamed: the new one is the checkpoint, the old one goes."""
    ck, weights = saved_at(tmp_path, 2, 4)
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-2", root / "step-4.old")  # the replaced folder, whatever it held
    os.rename(root / "step-4", root / "step-4.tmp")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 4
    assert same(fresh.weights(), weights[4])
    assert listing(tmp_path) == ["step-2", "step-4"]


def test_a_load_only_replay_leaves_the_folder_it_reads_as_it_is(tmp_path: Path, events: Events) -> None:
    """A replay reads another run's folder, which that run may be saving into right now."""
    saved_at(tmp_path, 2)
    root = tmp_path / "checkpoint"
    (root / "step-4.tmp").mkdir()
    replay = checkpointer(tmp_path, **{"checkpoint.load_only": True})
    run = Run(seed=2)
    assert replay.load(run.parts, run.optimizer, run.scheduler)[0] == 2
    assert listing(tmp_path) == ["step-2", "step-4.tmp"]


def test_a_later_save_after_the_tidy_keeps_working(tmp_path: Path, events: Events) -> None:
    ck, _ = saved_at(tmp_path, 2)
    root = tmp_path / "checkpoint"
    (root / "step-4.tmp").mkdir()
    run = Run()
    assert ck.load(run.parts, run.optimizer, run.scheduler)[0] == 2
    train(run, range(3, 5), checkpointer(tmp_path, **{"checkpoint.interval": 2}), meta=META)
    assert listing(tmp_path) == ["step-2", "step-4"]


def test_a_meta_json_whose_checksums_are_not_titans_record_is_skipped_not_a_traceback(
    tmp_path: Path, events: Events
) -> None:
    """A ``meta.json`` that parses but whose ``checksums`` are damaged (another type, a string
    for a number) stopped the resume with a ``ValueError``/``AttributeError`` traceback; it is
    skipped as damaged like any other record titan cannot read, and the previous one loads."""
    import json

    ck, weights = saved_at(tmp_path, 2, 4, 6)
    root = tmp_path / "checkpoint"
    for step, damage in ((6, ["not", "a", "dict"]), (4, {"chunk_bytes": "x", "files": {}})):
        meta = root / f"step-{step}" / "meta.json"
        record = json.loads(meta.read_text())
        record["checksums"] = damage
        meta.write_text(json.dumps(record))
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
    assert same(fresh.weights(), weights[2])
    reasons = dict(events.warnings())
    assert "checksums" in reasons[str(root / "step-6")] and "checksums" in reasons[str(root / "step-4")]
