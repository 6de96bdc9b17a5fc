"""docs/checkpointing.md: its recipe module and commands run as written and do what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel_harness import REPO, assert_losses_close, log_records, step_losses, tiny_config
from tests.plugins.profiler.test_docs_profiling import doc_commands, run_command
from titan_core.errors import UsageError
from titan_core.topology import Topology
from titan_plugins_dcp.checkpointer import DCPCheckpointer

DOC = REPO / "docs" / "checkpointing.md"


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".titan.lock")  # not the run lock


def test_stop_and_resume_as_documented(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    assert commands[:2] == [
        "titan run --module my_recipes --recipe llama3_checkpointed_stopped",
        "titan run --module my_recipes --recipe llama3_checkpointed",
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
        "titan run --module my_recipes --recipe llama3_checkpointed",
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


def test_documented_seed_error_is_the_real_one(tmp_path: Path) -> None:
    text = " ".join(DOC.read_text().split())
    config = tiny_config(**{"checkpoint.create_seed_checkpoint": True, "parallelism.dp_shard": 2})
    with pytest.raises(UsageError) as info:
        DCPCheckpointer(config, Topology(2, 0, 0, torch.device("cpu")))
    assert f"titan: error: {info.value}" in text


@pytest.mark.slow
def test_seed_checkpoint_gives_one_process_and_fsdp_the_same_losses(tmp_path: Path) -> None:
    commands = doc_commands(DOC, tmp_path)
    assert commands[2:5] == [
        "titan run --module my_recipes --recipe llama3_seed",
        "titan run --module my_recipes --recipe llama3_from_seed",
        "NGPU=2 MODULE=my_recipes CONFIG=llama3_from_seed_fsdp2 ./run_train.sh",
    ]
    results = [run_command(command, tmp_path) for command in commands[2:5]]
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoints(tmp_path / "outputs" / "seed" / "checkpoint") == ["step-0"]
    single, fsdp = step_losses(results[1].stdout), step_losses(results[2].stdout)
    assert len(single) == 6
    assert_losses_close(fsdp, single, rtol=1e-5)
