"""A dump folder's memory reports are those of the run that wrote it last: reports of another
layout or configuration go when a run starts, ``--overwrite`` removes every earlier one, and the
printed config says the report is on where it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.comm.test_fake import RECIPES, env
from titan_plugins_memory.outputs import SWEEP_LOGS, SWEEP_SUMMARY, clear_reports, reports_in


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    (tmp_path / "my_debug_configs.py").write_text(RECIPES)
    return tmp_path


def _fake(recipes: Path, recipe: str, *extra: str, **variables: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "titan_core.cli", "run", "--module", "my_debug_configs"),
            *("--recipe", recipe, "--comm-backend", "fake", *extra),
        ],
        cwd=recipes,
        env=env(NGPU="4", TITAN_DEFAULT_MAX_STEPS="1", **variables),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _reports(folder: Path) -> dict[int, dict]:
    """Logical rank -> report, of every memory report in ``folder``."""
    found = {}
    for path in folder.glob("memory_report_rank*.json"):
        found[int(path.stem.removeprefix("memory_report_rank"))] = json.loads(path.read_text())
    return found


def _write(folder: Path, rank: int, key: tuple) -> None:
    data = {"config_hash": key[0], "world_size": key[1], "degrees": key[2], "observations": []}
    (folder / f"memory_report_rank{rank}.json").write_text(json.dumps(data))


MINE = ("abc", 4, {"pp": 2, "dp_shard": 2})


def test_a_run_keeps_only_the_other_ranks_of_its_layout(tmp_path: Path) -> None:
    _write(tmp_path, 0, MINE)  # another coordinate of this run: kept
    _write(tmp_path, 2, MINE)  # this rank's earlier attempt: replaced, so it goes now
    _write(tmp_path, 1, ("abc", 2, {"pp": 2}))  # another world size
    _write(tmp_path, 3, ("def", 4, MINE[2]))  # another configuration
    (tmp_path / "memory_report_rank5.json").write_text('{"config_hash": ')  # cut short
    (tmp_path / SWEEP_SUMMARY).write_text("{}")  # a sweep writes its own after its runs
    (tmp_path / "memory_report_rank7.json.bak").write_text("{}")  # not a report: left alone
    clear_reports(str(tmp_path), MINE, rank=2)
    assert sorted(reports_in(str(tmp_path))) == [0]
    assert not (tmp_path / SWEEP_SUMMARY).exists() and (tmp_path / "memory_report_rank7.json.bak").exists()


def test_a_run_without_the_report_keeps_none(tmp_path: Path) -> None:
    _write(tmp_path, 0, MINE)
    _write(tmp_path, 2, MINE)
    assert len(clear_reports(str(tmp_path), None, rank=0)) == 2
    assert reports_in(str(tmp_path)) == {}


@pytest.mark.slow
def test_another_layout_replaces_the_earlier_layouts_reports(recipes: Path) -> None:
    out = recipes / "out"
    _fake(recipes, "llama3_debugmodel_fsdp4")  # logical rank 0 of FSDP 4
    _fake(recipes, "llama3_debugmodel_pp2_fsdp2", FAKE_PP_RANK="1")  # logical rank 2 of PP 2 x FSDP 2
    reports = _reports(out)
    assert list(reports) == [2]  # the FSDP 4 report of rank 0 was never this layout's
    # The other coordinate of the same layout joins it: both are ranks of this run.
    _fake(recipes, "llama3_debugmodel_pp2_fsdp2", FAKE_PP_RANK="0")
    reports = _reports(out)
    assert sorted(reports) == [0, 2]
    assert {r["degrees"]["pp"] for r in reports.values()} == {2}


@pytest.mark.slow
def test_overwrite_removes_the_earlier_runs_reports(recipes: Path) -> None:
    out = recipes / "out"
    _fake(recipes, "llama3_debugmodel_pp2_fsdp2", FAKE_PP_RANK="1")
    _fake(recipes, "llama3_debugmodel_pp2_fsdp2", "--overwrite", FAKE_PP_RANK="0")
    assert list(_reports(out)) == [0]  # rank 2's report was the earlier run's


@pytest.mark.slow
def test_all_pp_ranks_overwrite_leaves_every_coordinate_of_its_run(recipes: Path) -> None:
    out = recipes / "out"
    _fake(recipes, "llama3_debugmodel_fsdp4", "--overwrite")
    (out / SWEEP_LOGS).mkdir()
    (out / SWEEP_LOGS / "pp_rank3.log").write_text("a deeper pipeline's")
    _fake(recipes, "llama3_debugmodel_pp2_fsdp2", "--all-pp-ranks", "--overwrite")
    assert sorted(_reports(out)) == [0, 2]  # the sweep's first child overwrote; the second kept it
    assert sorted(p.name for p in (out / SWEEP_LOGS).iterdir()) == ["pp_rank0.log", "pp_rank1.log"]
    assert (out / SWEEP_SUMMARY).is_file()


def test_print_config_shows_the_report_on_under_the_fake_backends(tmp_path: Path) -> None:
    def printed(*extra: str) -> dict:
        result = subprocess.run(
            [sys.executable, "-m", "titan_core.cli", "run", "--recipe", "llama3_debugmodel", *extra],
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    assert printed("--comm-backend", "fake", "--print-config", "json")["debug"]["memory_report"] is True
    assert printed("--print-config", "json")["debug"]["memory_report"] is False
