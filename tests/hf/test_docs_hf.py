"""docs/checkpointing.md, "Hugging Face import and export": its module and commands run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, log_records
from tests.plugins.profiler.test_docs_profiling import run_command
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.recipes import import_module
from titan_core.trainer import Trainer

DOC = REPO / "docs" / "checkpointing.md"
SECTION = "## Hugging Face import and export"


def _section() -> str:
    text = DOC.read_text()
    assert SECTION in text
    rest = text.split(SECTION, 1)[1]
    return rest.split("\n## ", 1)[0]


def _first_losses(stdout: str) -> float:
    return next(float(r["loss"]) for r in log_records(stdout) if r.get("event") == "step")


def test_export_and_import_as_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = _section()
    module = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "hf_recipes.py").write_text(module)
    commands = [
        line
        for block in section.split("```sh\n")[1:]
        for line in block.split("```", 1)[0].splitlines()
        if line
    ]
    assert commands[:2] == [
        "titan run --module hf_recipes --recipe llama3_hf_trained",
        "titan export ./outputs/hf_trained/checkpoint --to hf ./outputs/hf_model",
    ]
    assert commands[3] == "titan run --module hf_recipes --recipe llama3_from_hf"
    trained, exported, loaded, from_hf = (run_command(c, tmp_path) for c in commands)
    for result in (trained, exported, loaded, from_hf):
        assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "outputs" / "hf_model"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert "step-4" in exported.stdout  # the newest checkpoint of the folder
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 6
    printed = re.search(r"The last line prints `(.+?)`", section.replace("\n", " "))
    assert printed is not None and loaded.stdout.strip() == printed.group(1)
    # The import starts where the trained run ended: its first loss is below the trained run's.
    assert _first_losses(from_hf.stdout) < _first_losses(trained.stdout) - 0.05

    # The documented mismatch error, word for word.
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = import_module("hf_recipes").llama3_from_hf()
    config.model.overrides = {"n_layers": 4}
    config.job.dump_folder = "./outputs/mismatch"  # a fresh folder: the model check, not the folder's
    with pytest.raises(UsageError) as info:
        Trainer(config, get_registry())
    flat = " ".join(section.split())
    assert f"`{info.value}`" in flat
