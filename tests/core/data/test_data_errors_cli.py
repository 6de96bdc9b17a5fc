"""Bad data through ``titan run``: one ``titan: error:`` line and exit status 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import child_env, write_recipe_module


def titan_run(folder: Path, overrides: dict) -> tuple[int, str]:
    """Exit status and the one error line (the ``message`` of a JSON log line in JSON mode)."""
    module = write_recipe_module(folder, {"training.steps": 2, "data.dataset": "text", **overrides})
    result = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"],
        cwd=folder,
        env=child_env(folder),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]  # one line, no traceback
    line = lines[0]
    return result.returncode, json.loads(line)["message"] if line.startswith("{") else line


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("a.txt", "caf\xe9 au lait".encode("latin-1"), "a.txt:1 is not UTF-8 (byte 0xe9"),
        ("a.jsonl", b'{"text": 42}\n', "a.jsonl:1: 'text' is a number, not a string"),
        ("a.jsonl", b'{"text": "x"\n', "a.jsonl:1 is not valid JSON"),
    ],
)
def test_bad_first_document_is_one_line_exit_2(
    tmp_path: Path, name: str, content: bytes, expected: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(content)
    code, stderr = titan_run(tmp_path, {"data.path": str(data)})
    assert code == 2, stderr
    assert stderr.startswith("titan: error: data.path: ") and expected in stderr


def test_corpus_too_small_for_one_batch_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "tiny.jsonl").write_text('{"text": "only a few words here"}\n')
    code, stderr = titan_run(tmp_path, {"data.path": str(tmp_path / "tiny.jsonl")})
    assert code == 2, stderr
    assert "is too small for one step: one pass gives " in stderr and "training.seq_len=32" in stderr
