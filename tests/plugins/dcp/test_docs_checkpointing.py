"""docs/checkpointing.md: its recipe module and commands run as written and do what it says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import REPO, assert_losses_close, log_records, step_losses
from tests.plugins.profiler.test_docs_profiling import run_command

DOC = REPO / "docs" / "checkpointing.md"
#: The page's recipe module: a name of its own, so that following another page's examples in the
#: same folder (profiling.md's ``my_recipes.py``) replaces neither.
MODULE = "my_checkpoint_recipes"


def doc_commands(doc: Path, folder: Path) -> list[str]:
    """Write the page's first Python block to ``folder/<MODULE>.py``; return its bash commands."""
    text = doc.read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert block.startswith(f'"""{MODULE}.py:'), block[:80]
    (folder / f"{MODULE}.py").write_text(block)
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".titan.lock")  # not the run lock


def test_stop_and_resume_as_documented(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    assert commands[:2] == [
        "titan run --module my_checkpoint_recipes --recipe llama3_checkpointed_stopped",
        "titan run --module my_checkpoint_recipes --recipe llama3_checkpointed",
    ]
    saved = tmp_path / "outputs" / "checkpointed" / "checkpoint"
    stopped = run_command(commands[0], tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert checkpoints(saved) == ["step-2", "step-3"]
    resumed = run_command(commands[1], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = log_records(resumed.stdout)
    assert [r["step"] for r in records if r.get("event") == "checkpoint loaded"] == [3]
    assert [r["step"] for r in records if r.get("event") == "step"] == [4, 5, 6]
    assert checkpoints(saved) == ["step-2", "step-3", "step-4", "step-6"]

    whole_folder = tmp_path / "whole"
    whole_folder.mkdir()
    doc_commands(DOC, whole_folder)
    whole = run_command(commands[1], whole_folder)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert step_losses(stopped.stdout) + step_losses(resumed.stdout) == step_losses(whole.stdout)

    # The damaged-checkpoint example: the truncated step-6 is skipped, step-4 loads.
    assert commands[5:7] == [
        "truncate -s 0 outputs/checkpointed/checkpoint/step-6/.metadata",
        "titan run --module my_checkpoint_recipes --recipe llama3_checkpointed",
    ]
    damaged = run_command(commands[5], tmp_path)
    assert damaged.returncode == 0, damaged.stderr
    again = run_command(commands[6], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    records = log_records(again.stdout)
    skipped = [r for r in records if r.get("event") == "skipping a checkpoint that cannot be loaded"]
    assert [(Path(r["path"]).name, r["reason"]) for r in skipped] == [
        ("step-6", "its .metadata is empty (0 bytes)")
    ]
    assert [r["step"] for r in records if r.get("event") == "checkpoint loaded"] == [4]
    assert step_losses(again.stdout) == step_losses(whole.stdout)[4:]
    assert checkpoints(saved) == ["step-2", "step-3", "step-4", "step-6"]
    assert (saved / "step-6" / ".metadata").stat().st_size > 0  # saved anew

    # The replay example: step 5 from step-4, in outputs/replay, the run's folder untouched.
    assert commands[7:] == ["titan run --module my_checkpoint_recipes --recipe llama3_checkpointed_replay"]
    rows = (saved.parent / "metrics.jsonl").read_text()
    replay = run_command(commands[7], tmp_path)
    assert replay.returncode == 0, replay.stderr[-3000:]
    records = log_records(replay.stdout)
    assert [r["step"] for r in records if r.get("event") == "checkpoint loaded"] == [4]
    assert step_losses(replay.stdout) == step_losses(whole.stdout)[4:5]
    assert checkpoints(saved) == ["step-2", "step-3", "step-4", "step-6"]
    assert (saved.parent / "metrics.jsonl").read_text() == rows
    assert (tmp_path / "outputs" / "replay" / "metrics.jsonl").is_file()
    assert not (tmp_path / "outputs" / "replay" / "checkpoint").exists()


def _fenced_blocks(text: str) -> list[str]:
    """The text of every fenced block of a Markdown page, whatever its language."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_documented_seed_error_is_the_real_one(tmp_path: Path) -> None:
    """The page quoted the error of a recipe with dp_shard = 2, which it does not have: its own
    ``llama3_seed`` launched as it shows prints another line. Run the quoted command."""
    (quoted,) = [b for b in _fenced_blocks(DOC.read_text()) if b.startswith("$ ")]
    command, _, expected = quoted.partition("\n")
    doc_commands(DOC, tmp_path)
    result = run_command(command.removeprefix("$ "), tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert errors == [" ".join(expected.split())], result.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()  # refused before anything was written


@pytest.mark.slow
def test_seed_checkpoint_gives_one_process_and_fsdp_the_same_losses(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    assert commands[2:5] == [
        "titan run --module my_checkpoint_recipes --recipe llama3_seed",
        "titan run --module my_checkpoint_recipes --recipe llama3_from_seed",
        "NGPU=2 MODULE=my_checkpoint_recipes CONFIG=llama3_from_seed_fsdp2 ./run_train.sh",
    ]
    results = [run_command(command, tmp_path) for command in commands[2:5]]
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoints(tmp_path / "outputs" / "seed" / "checkpoint") == ["step-0"]
    single, fsdp = step_losses(results[1].stdout), step_losses(results[2].stdout)
    assert len(single) == 6
    for name in ("from_seed", "from_seed_fsdp2"):  # each keeps its own metrics (titan compare)
        assert len((tmp_path / "outputs" / name / "metrics.jsonl").read_text().splitlines()) == 6, name
    assert_losses_close(fsdp, single, rtol=1e-5)
