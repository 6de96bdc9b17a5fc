"""A fresh venv with only titan-core and titan-plugins-llama3 trains the debug model on CPU.

The core registers its own ``default`` comm backend (like tox's and conda's built-ins), so
no other titan distribution is needed for a one-device run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# The venv does not hold titan's tests: the recipe is written out whole.
RECIPE = """
from titan_plugins_llama3.recipes import llama3_debugmodel


def short():
    c = llama3_debugmodel()
    c.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4}
    c.training.steps, c.training.seq_len, c.training.local_batch_size = 3, 32, 2
    c.data.bundled_documents, c.metrics.log_freq = 200, 1
    return c
"""


@pytest.mark.slow
def test_core_and_llama3_alone_train(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    import torch

    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", torch_pin, str(REPO), str(REPO / "titan_plugins_llama3")],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run(
        [str(venv / "bin" / "titan"), "plugins", "list", "--json"], capture_output=True, text=True
    )
    names = sorted(p["name"] for p in json.loads(listed.stdout))
    assert names == ["core", "llama3"], names
    (tmp_path / "short_recipe.py").write_text(RECIPE)
    run = subprocess.run(
        [
            str(venv / "bin" / "titan"),
            "run",
            "--module",
            "short_recipe",
            "--recipe",
            "short",
            "--dump-folder",
            "out",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": str(venv / "bin"), "TITAN_LOG_FORMAT": "json", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in run.stdout.splitlines() if '"event": "step"' in line]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert (tmp_path / "out" / "metrics.jsonl").exists()
