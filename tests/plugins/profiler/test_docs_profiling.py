"""docs/profiling.md: its recipe module and commands run as written and produce what it describes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, child_env

DOC = REPO / "docs" / "profiling.md"


def doc_commands(doc: Path, folder: Path) -> list[str]:
    """Write the doc's Python block to ``folder/my_recipes.py``; return its bash commands."""
    text = doc.read_text()
    (folder / "my_recipes.py").write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def run_command(command: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run a documented command from ``folder`` with this checkout's titan, torchrun and run_train.sh."""
    env = child_env(folder)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    command = command.replace("./run_train.sh", str(REPO / "run_train.sh"))
    return subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=400
    )


def test_profiling_recipe_writes_traces_and_snapshots_at_the_documented_steps(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    assert commands[0] == "titan run --module my_recipes --recipe llama3_profile"
    result = run_command(commands[0], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    traces = tmp_path / "outputs" / "profile" / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_3", "iteration_6"]
    assert (traces / "iteration_3" / "rank0_trace.json").stat().st_size > 0
    # on this CPU machine: the tensor-level snapshots, each with its page, at the same steps
    snapshots = tmp_path / "outputs" / "profile" / "memory_snapshot"
    assert sorted(p.name for p in snapshots.iterdir()) == ["step_000000000003", "step_000000000006"]
    for step in ("step_000000000003", "step_000000000006"):
        names = sorted(p.name for p in (snapshots / step).iterdir())
        assert names == ["rank0_memory_snapshot.html", "rank0_memory_snapshot.pickle"]
    view = next(c for c in commands if c.startswith("titan memory view"))
    result = run_command(view, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "step6.html").read_text()
    assert "Peak allocated" in page and "Largest allocations live at the peak" in page


@pytest.mark.slow
def test_profiling_recipe_on_two_processes_writes_a_trace_per_rank(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    # A folder of its own: the one-process run's folder holds a run of another batch layout.
    assert commands[1] == (
        "NGPU=2 MODULE=my_recipes CONFIG=llama3_profile ./run_train.sh --dump-folder ./outputs/profile_2ranks"
    )
    result = run_command(commands[1], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "outputs" / "profile_2ranks" / "profile_traces" / "iteration_6"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
