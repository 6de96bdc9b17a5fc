"""``titan export``'s OUT_DIR must not pass for a checkpoint: a folder named as the checkpointer
names its own (``step-N``, ``step-N.tmp``, ``step-N.old``) in a checkpoint folder would be
taken for a checkpoint by a resume (or replace one, or be deleted as a leftover at the next
start), and one inside a ``step-N`` is deleted with it by ``checkpoint.keep_latest_k``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import error_line
from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.cli import main
from titan_core.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    config = tiny_config(
        **{
            "job.dump_folder": str(folder),
            "checkpoint.enable": True,
            "checkpoint.interval": 1,
            "training.steps": 2,
        }
    )
    train(config, get_registry())
    return folder


@pytest.fixture(autouse=True)
def _console_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TITAN_LOG_FORMAT", raising=False)  # errors as the one plain line users see


def export(*args: str | Path) -> int:
    return main(["export", *map(str, args)])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("out", "extra"),
    [
        ("step-5", ()),  # a resume would load it as step 5 (it is no DCP folder: skipped as damaged)
        ("step-2", ("--overwrite",)),  # into the checkpoint itself: its folder filled with safetensors
        ("step-7.tmp", ()),  # the next start removes it as the leftover of a killed save
        ("step-2/hf", ()),  # removed with step-2 by checkpoint.keep_latest_k
    ],
)
def test_an_out_dir_a_checkpoint_folder_would_take_for_its_own_is_refused(
    run: Path, out: str, extra: tuple[str, ...], capsys: Any
) -> None:
    root = run / "checkpoint"
    before = snapshot(root)
    capsys.readouterr()
    assert export(root / "step-2", "--to", "hf", root / out, *extra) == 2
    line = error_line(capsys)
    assert line.startswith("titan: error: export: OUT_DIR ") and "choose" in line, line
    assert "step-" in line and str(root) in line
    assert snapshot(root) == before  # nothing written, nothing replaced
    assert not (root / out).exists() or out == "step-2"


def test_a_name_of_its_own_beside_the_checkpoints_exports(run: Path, capsys: Any) -> None:
    root = run / "checkpoint"
    assert export(root, "--to", "hf", root / "step-2-hf") == 0
    assert (root / "step-2-hf" / "config.json").is_file()


def test_an_export_named_as_suggested_beside_the_checkpoints_draws_no_warning_at_resume(
    tmp_path: Path, events: Any
) -> None:
    """The refusal above suggests 'step-5-hf' beside the checkpoints; every resume then warned
    ``ignoring a folder among the checkpoints: not a name titan writes ...; rename it to load
    it``, advice that made the export pass for a (damaged) checkpoint. A folder of another name
    that holds a DCP checkpoint (a copy, 'step-2-copy') is still named, with that advice."""
    import shutil

    settings = {"job.dump_folder": str(tmp_path), "checkpoint.enable": True, "training.steps": 3}
    train(tiny_config(**{**settings, "debug.max_steps": 2}), get_registry())
    root = tmp_path / "checkpoint"
    assert export(root / "step-2", "--to", "hf", root / "step-2-hf") == 0
    shutil.copytree(root / "step-2", root / "step-2-copy")
    (root / "step-notes").mkdir()
    rows = train(tiny_config(**settings), get_registry())
    assert [int(r["step"]) for r in rows] == [3]
    reasons = dict(events.warnings())
    assert str(root / "step-2-hf") not in reasons and str(root / "step-notes") not in reasons
    assert "rename it to load it" in reasons[str(root / "step-2-copy")]
