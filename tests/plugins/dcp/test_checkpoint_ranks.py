"""The checkpointer with two ranks (torchrun, gloo): every rank takes the same path through a
fallback, a full disk on one rank, and a strict load of pipeline-like disjoint parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.parallel_harness import REPO, child_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "-m",
        "tests.plugins.dcp.ranks_worker",
        str(out),
    ]
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_truncated_shard_of_one_rank_makes_every_rank_fall_back(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["fsdp"]["loaded"] == 2
        assert rank["fsdp"]["weights_of_step_2"]


def test_full_disk_on_one_rank_fails_every_rank_with_one_message(ranks: list[dict]) -> None:
    messages = [rank["fsdp"]["full_disk"] for rank in ranks]
    assert messages[0] == messages[1]
    assert messages[0].startswith("checkpoint: the disk is full (No space left on device) saving step-6")
    assert "(rank 1)" in messages[0] and "step-2 is intact" in messages[0]  # step-4 was damaged
    assert ranks[0]["fsdp"]["listing"] == ["step-2", "step-4"]  # no step-6, no step-6.tmp


def test_disjoint_stage_parts_load_strictly(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["stages"]["loaded"] == 1 and rank["stages"]["same"]
    refused = [rank["stages"]["refused"] for rank in ranks]
    assert refused[0] == refused[1]
    assert "4 tensors in it that the model lacks (model.layers.4.bias, model.layers.4.weight" in refused[0]


def test_ranks_that_see_different_checkpoint_folders_all_stop(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        error = result["unshared"]["error"]
        assert error.startswith("checkpoint: the ranks see different checkpoints in /")
        assert f"rank{rank}/checkpoint;" in error and "shared filesystem" in error


def test_leftovers_of_killed_saves_are_tidied_by_rank_0_before_any_rank_looks(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["leftovers"]["loaded"] == 4 and rank["leftovers"]["same"]
    assert ranks[0]["leftovers"]["listing"] == ["step-2", "step-4"]
