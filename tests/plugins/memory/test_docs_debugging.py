"""docs/debugging.md: the memory-snapshot example and the loss-curve reproduction workflow run as
written (seed checkpoint, layouts, one ``titan compare``), and a perturbed run fails it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel_harness import REPO
from tests.plugins.profiler.test_docs_profiling import run_command

DOC = REPO / "docs" / "debugging.md"


def section(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def blocks(text: str, language: str) -> list[str]:
    return [b.split("```", 1)[0] for b in text.split(f"```{language}\n")[1:]]


def commands(text: str) -> list[str]:
    return [line for block in blocks(text, "bash") for line in block.splitlines() if line.strip()]


def write_module(text: str, folder: Path) -> str:
    source = blocks(text, "python")[0]
    name = source.splitlines()[0].removeprefix("# ").strip()
    (folder / name).write_text(source)
    return name.removesuffix(".py")


def test_snapshot_example_writes_pickles_and_pages(tmp_path: Path) -> None:
    text = section("Memory snapshots")
    write_module(text, tmp_path)
    run, view = commands(text)
    result = run_command(run, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "outputs" / "snap" / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000000003", "step_000000000006"]
    for step in folder.iterdir():
        assert sorted(p.name for p in step.iterdir()) == [
            "rank0_memory_snapshot.html",
            "rank0_memory_snapshot.pickle",
        ]
    result = run_command(view, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Largest allocations live at the peak" in (tmp_path / "snap6.html").read_text()


PERTURBED = '''

def tp2_higher_lr():
    """tp2 with a 10% higher learning rate: a bug a comparison must catch."""
    config = tp2()
    config.training.lr *= 1.1
    config.job.dump_folder = "./repro/tp2_lr"
    return config
'''


@pytest.mark.slow
def test_reproducing_loss_curves_workflow(tmp_path: Path) -> None:
    text = section("Reproducing loss curves with different parallelism configs")
    module = write_module(text, tmp_path)
    steps = commands(text)
    assert steps[-1].startswith("titan compare repro/single repro/fsdp2 repro/tp2 --rtol 1e-4")
    for command in steps[:-1]:
        result = run_command(command, tmp_path)
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
    assert (tmp_path / "repro" / "seed" / "checkpoint" / "step-0").is_dir()
    result = run_command(steps[-1], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "OK: every step within rtol 0.0001, atol 0" in result.stdout
    png = tmp_path / "repro" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the three runs really ran their layouts, from the same weights
    losses = {}
    for run in ("single", "fsdp2", "tp2"):
        rows = [
            json.loads(line) for line in (tmp_path / "repro" / run / "metrics.jsonl").read_text().splitlines()
        ]
        losses[run] = [r["loss"] for r in rows]
    assert len(losses["single"]) == 8 and losses["single"][0] == pytest.approx(losses["tp2"][0], rel=1e-5)

    (tmp_path / f"{module}.py").write_text((tmp_path / f"{module}.py").read_text() + PERTURBED)
    result = run_command(f"NGPU=2 MODULE={module} CONFIG=tp2_higher_lr ./run_train.sh", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_command("titan compare repro/single repro/tp2_lr --rtol 1e-4", tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "FAILED (rtol 0.0001, atol 0)" in result.stdout and "tp2_lr: loss at step 2" in result.stdout
