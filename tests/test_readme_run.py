"""The README's run command: the default recipe trains on CPU and the loss falls by 30%+."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, step_rows, titan_env


@pytest.mark.slow
def test_readme_run_command_trains_llama3_debugmodel(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert "titan run --recipe llama3_debugmodel" in readme
    start = time.perf_counter()
    result = subprocess.run(
        [str(Path(sys.executable).parent / "titan"), "run", "--recipe", "llama3_debugmodel"],
        cwd=tmp_path,
        env=titan_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-2000:]
    rows = step_rows(result.stdout)
    assert rows[-1]["step"] == 30 and len(rows) == 30
    assert rows[-1]["loss"] <= 0.7 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    for key in ("grad_norm", "tps", "tflops", "max_rss_gib"):
        assert rows[-1][key] > 0
    assert elapsed < 180, f"took {elapsed:.0f}s"
    dump = tmp_path / "outputs" / "llama3_debugmodel"
    assert "steps = 30" in (dump / "config.toml").read_text()
    assert list((dump / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    command = "pip install -r requirements-dev.txt && python -m pytest"
    assert command in readme
    assert command in (REPO / ".ci" / "run").read_text()
    blocks = [b for b in readme.split("```bash\n")[1:3]]
    assert [b.split("\n")[0] for b in blocks] == [
        "pip install -r requirements.txt && titan run --recipe llama3_debugmodel",
        command,
    ]
