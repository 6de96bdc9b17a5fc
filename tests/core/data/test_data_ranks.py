"""The packed data through real runs on two gloo ranks: DP shares, accumulation, passes, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel_harness import (
    SEQ_LEN,
    assert_losses_close,
    log_records,
    run_layout,
    run_titan_train,
    step_losses,
    write_seed_checkpoint,
)
from titan_core.data.loader import load_tokenizer


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed") / "seed.pt")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 2.5 steps of 4 sequences a pass (6 steps read it 2-3 times), a tail of a partial
    sequence at each pass's end, and empty documents among the others."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    texts = [f"document {i}: the rain falls on the valley and the tower waits" for i in range(15)]
    for i in (3, 9, 14):
        texts[i] = ""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(None)
    tokens = sum(len(ids) + 2 for ids in tok.encode_batch(texts) if ids)
    window = SEQ_LEN + 1
    assert 4 * window * 2 < tokens < 4 * window * 3 and tokens % window  # 2-3 steps, a tail
    return path


def test_two_ranks_accumulating_over_passes_train_on_the_one_process_batches(
    tmp_path: Path, seed: Path, small_corpus: Path
) -> None:
    """2 DP ranks x 1 sequence x 2 microbatches read the one-process batch of 4 every step,
    through the passes' ends (tails carried, empty documents skipped on both)."""
    data = {"data.dataset": "text", "data.path": str(small_corpus), "data.shuffle_buffer": 0}
    one = run_layout(tmp_path / "one", 1, seed, {**data, "training.local_batch_size": 4})
    two = run_layout(
        tmp_path / "two",
        2,
        seed,
        {
            **data,
            "parallelism.dp_shard": 2,
            "training.local_batch_size": 1,
            "training.global_batch_size": 4,
        },
    )
    assert_losses_close(two, one)


def test_a_resume_on_two_ranks_continues_the_data_exactly_across_a_pass(
    tmp_path: Path, seed: Path, small_corpus: Path
) -> None:
    """Stopped at step 3 (inside pass 2, shuffled), the resumed run's steps 4-6 are the
    uninterrupted run's: each rank's data position continues exactly."""
    data = {
        "data.dataset": "text",
        "data.path": str(small_corpus),
        "data.shuffle_buffer": 1000,
        "parallelism.dp_shard": 2,
        "training.local_batch_size": 1,
        "training.global_batch_size": 4,
        "checkpoint.enable": True,
        "checkpoint.initial_load_path": str(seed),
    }
    whole = step_losses(run_titan_train(tmp_path / "whole", 2, data).stdout)
    assert len(whole) == 6
    stopped = run_titan_train(tmp_path / "split", 2, {**data, "debug.max_steps": 3})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_titan_train(tmp_path / "split", 2, data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = step_losses(resumed.stdout)
    assert len(losses) == 3
    assert_losses_close(losses * 2, whole[3:] * 2)  # the harness compares at least 6 steps
    events = [r.get("event", "") for r in log_records(stopped.stdout)]
    assert any("skipped 3 empty documents of 15" in e for e in events), events
