"""``checkpoint.folder`` naming ``job.dump_folder`` itself in another spelling (an absolute path,
``../out``, a trailing ``/.``): the field's own check caught only ``''`` and ``'.'``, and the run
failed with ``checkpoint.folder 'out/../out' is in use by another run (pid N)``, N being its
own pid (the lock it had just taken on the dump folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_titan


@pytest.mark.parametrize(
    "spelling",
    ["abs", "abs/", "../out", "../out/.", "./../out/", "..", "abs_parent"],
)
def test_a_checkpoint_folder_that_is_or_holds_the_dump_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    from titan_core.config import ConfigError, TrainerConfig, validate

    monkeypatch.chdir(tmp_path)
    folder = {
        "abs": str(tmp_path / "out"),
        "abs/": str(tmp_path / "out") + "/",
        "abs_parent": str(tmp_path),
    }.get(spelling, spelling)
    config = TrainerConfig()
    config.job.dump_folder = "out"
    config.checkpoint.folder = folder
    validate(config, source="r")  # unused while checkpoints are off
    config.checkpoint.enable = True
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    (problem,) = info.value.problems
    assert problem.startswith(f"checkpoint.folder: {folder!r}"), problem
    assert "job.dump_folder 'out'" in problem and "checkpoint" in problem


@pytest.mark.parametrize("spelling", ["ckpt", "./ckpt/", "ckpt/.", "abs", "../elsewhere"])
def test_a_checkpoint_folder_of_its_own_in_any_spelling_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    from titan_core.config import TrainerConfig, validate

    monkeypatch.chdir(tmp_path)
    config = TrainerConfig()
    config.job.dump_folder = "out"
    config.checkpoint.folder = str(tmp_path / "out" / "ckpt") if spelling == "abs" else spelling
    config.checkpoint.enable = True
    validate(config, source="r")


def test_titan_run_says_it_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "import os\nfrom titan_plugins_llama3.recipes import llama3_debugmodel\n\n\n"
        "def r():\n    c = llama3_debugmodel()\n    c.job.dump_folder = 'out'\n"
        "    c.checkpoint.enable = True\n    c.checkpoint.folder = os.path.abspath('out')\n    return c\n"
    )
    result = run_titan("run", "--module", "r", "--recipe", "r", cwd=tmp_path, PYTHONPATH=str(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "checkpoint.folder" in lines[0] and "is the dump folder" in lines[0], lines[0]
    assert "in use by another run" not in lines[0]
    assert not os.path.exists(tmp_path / "out")
