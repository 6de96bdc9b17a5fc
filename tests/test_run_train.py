"""``run_train.sh``: the launcher's environment contract (NGPU, LOG_RANK, MODULE, CONFIG, COMM_BACKEND)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, child_env, log_records, write_recipe_module

SCRIPT = REPO / "run_train.sh"


def launch(folder: Path, overrides: dict, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``./run_train.sh`` with the recipe ``overrides`` (over the tiny config) as MODULE/CONFIG."""
    module = write_recipe_module(folder, {"training.steps": 2, **overrides})
    full_env = child_env(folder, MODULE=module, CONFIG="layout", **env)
    # This interpreter's python and torchrun come first, as in an activated environment.
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    return subprocess.run(
        [str(SCRIPT)], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.slow
def test_log_rank_shows_only_that_ranks_output(tmp_path: Path) -> None:
    layout = {"parallelism.dp_shard": 2, "training.local_batch_size": 2}
    result = launch(tmp_path, layout, NGPU="2", LOG_RANK="1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == 2
    assert {r.get("rank") for r in records} == {1}
    assert "[rank1]:" in result.stdout and "[rank0]:" not in result.stdout


@pytest.mark.slow
def test_bad_layout_stops_with_the_degree_error_before_building(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 3}, NGPU="4", LOG_RANK="0,1,2,3")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "exitcode: 2" in result.stderr  # torchrun reports the workers' exit status
    assert "dp_shard=3" in output and "world size 4" in output and "Fix:" in output
    assert not [r for r in log_records(result.stdout) if r.get("event") == "built"]


def test_fake_backend_bad_layout_exits_2(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 3}, NGPU="4", COMM_BACKEND="fake")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "do not fit the world size 4" in result.stderr
    assert not [r for r in log_records(result.stdout) if r.get("event") == "built"]


@pytest.mark.slow
def test_fake_backend_runs_one_process_for_one_step(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 2}, NGPU="2", COMM_BACKEND="fake")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in log_records(result.stdout) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1]  # the recipe asks for 2; pure fake stops after 1


def test_other_comm_backend_values_point_to_the_hybrid_flag(tmp_path: Path) -> None:
    result = launch(tmp_path, {}, COMM_BACKEND="real_pp_fake_spmd")
    assert result.returncode == 2
    assert "--comm-backend real_pp_fake_spmd' under torchrun" in result.stderr
    assert result.stdout == ""


def test_docs_recipe_resolves_through_the_launcher(tmp_path: Path) -> None:
    """The recipe module of docs/parallelism.md, launched as the docs show (config printed only)."""
    text = (REPO / "docs" / "parallelism.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_recipes.py").write_text(block)
    env = child_env(tmp_path, NGPU="1", MODULE="my_recipes", CONFIG="llama3_debug_fsdp_tp")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), "--print-config", "json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # torchrun's --tee prefixes each line of rank 0 with "[rank0]:".
    lines = [line.removeprefix("[rank0]:") for line in result.stdout.splitlines()]
    printed = "\n".join(lines)
    config = json.loads(printed[printed.index("{") :])
    assert config["parallelism"]["dp_shard"] == 2 and config["parallelism"]["tp"] == 2
