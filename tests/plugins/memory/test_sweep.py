"""``titan run ... --comm-backend fake --all-pp-ranks``: every pipeline coordinate in its own
process, compared in one table; a failing coordinate keeps its cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.comm.test_fake import RECIPES, env, local_param_share
from titan_plugins_llama3.flavors import FLAVORS

FAILING = """
import os

from my_debug_configs import llama3_debugmodel_pp2_fsdp2

if os.environ.get("FAKE_PP_RANK") == "1":  # the last stage computes the loss, and fails there
    import torch.nn.functional as F

    def _broken_loss(*args, **kwargs):
        raise RuntimeError("stage 1 loss exploded on purpose")

    F.cross_entropy = _broken_loss


def pp2_second_stage_fails():
    return llama3_debugmodel_pp2_fsdp2()
"""


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    (tmp_path / "my_debug_configs.py").write_text(RECIPES)
    (tmp_path / "failing_configs.py").write_text(FAILING)
    return tmp_path


def _sweep(recipes: Path, module: str, recipe: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", "titan_core.cli", "run", "--module", module),
            *("--recipe", recipe, "--comm-backend", "fake", "--all-pp-ranks"),
        ],
        cwd=recipes,
        env=env(NGPU="4"),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_all_pp_ranks_compares_every_coordinate(recipes: Path) -> None:
    result = _sweep(recipes, "my_debug_configs", "llama3_debugmodel_pp2_fsdp2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "memory by pipeline coordinate" in result.stdout
    summary = json.loads((recipes / "out" / "memory_report_all_pp_ranks.json").read_text())
    coords = summary["coordinates"]
    assert [(c["pp_rank"], c["logical_rank"]) for c in coords] == [(0, 0), (1, 2)]
    for c in coords:
        share = local_param_share(FLAVORS["debugmodel"], pp=2, pp_rank=c["pp_rank"], tp=1, fsdp=2)
        assert c["params_numel"] == share
        assert c["optimizer_state_bytes"] >= 2 * c["params_bytes"]
        assert f"{share:,}" in result.stdout  # the table row
        assert not c.get("error")


@pytest.mark.slow
def test_a_failed_coordinate_keeps_its_error(recipes: Path) -> None:
    result = _sweep(recipes, "failing_configs", "pp2_second_stage_fails")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    coords = json.loads((recipes / "out" / "memory_report_all_pp_ranks.json").read_text())["coordinates"]
    ok, failed = coords
    assert not ok.get("error") and ok["peak_bytes"] > 0
    assert "stage 1 loss exploded on purpose" in failed["error"]
    assert "RuntimeError" in failed["error"] and failed["returncode"] == 1
    # what the coordinate reported before failing is kept, and so is its whole output
    assert failed["params_numel"] == local_param_share(FLAVORS["debugmodel"], pp=2, pp_rank=1, tp=1, fsdp=2)
    assert "Traceback" in Path(failed["log"]).read_text()
    assert "pp_rank 1 FAILED: " in result.stdout and "stage 1 loss exploded" in result.stdout
