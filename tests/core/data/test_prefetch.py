"""Batches prepared on a background thread: same batches, same order, same errors, and the
training thread never waits for one that is already being prepared."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_llama3
from titan_core._registry import get_registry
from titan_core.data import corpus
from titan_core.data.loader import PackedBatches, load_tokenizer
from titan_core.data.prefetch import Prefetcher
from titan_core.errors import UsageError
from titan_core.trainer import Trainer, train


def packed(n_docs: int = 200) -> PackedBatches:
    return PackedBatches(
        documents=lambda: corpus.documents(n_docs),
        tokenizer=load_tokenizer(None),
        seq_len=32,
        batch_size=2,
        seed=1,
        shuffle_buffer=8,
    )


def test_same_batches_in_the_same_order() -> None:
    inline = iter(packed())
    ahead = Prefetcher(iter(packed()), depth=3)
    try:
        for _ in range(12):
            (x, y), (px, py) = next(inline), next(ahead)
            assert torch.equal(x, px) and torch.equal(y, py)
    finally:
        ahead.close()


def test_prepares_up_to_depth_batches_before_they_are_asked_for() -> None:
    made: list[int] = []

    def counted() -> Iterator[tuple[torch.Tensor]]:
        for i in range(10):
            made.append(i)
            yield (torch.tensor([i]),)

    ahead = Prefetcher(counted(), depth=2)
    try:
        assert next(ahead)[0].item() == 0
        deadline = time.monotonic() + 30  # generous: only a stalled thread misses it
        while len(made) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Batches 1 and 2 wait in the queue, batch 3 waits for room: prepared, not yet asked for.
        assert made == [0, 1, 2, 3]
        time.sleep(0.2)
        assert made == [0, 1, 2, 3]  # and no further: depth bounds the memory it holds
        assert [next(ahead)[0].item() for _ in range(3)] == [1, 2, 3]
    finally:
        ahead.close()


def test_an_error_of_the_data_is_raised_in_the_training_thread() -> None:
    def broken() -> Iterator[tuple[torch.Tensor]]:
        yield (torch.zeros(1),)
        raise UsageError("data: the file went away")

    ahead = Prefetcher(broken(), depth=2)
    next(ahead)
    with pytest.raises(UsageError, match="the file went away"):
        next(ahead)
    with pytest.raises(StopIteration):  # and it stays ended
        next(ahead)


def test_the_end_of_the_data_ends_iteration() -> None:
    ahead = Prefetcher(iter([(torch.zeros(1),), (torch.ones(1),)]), depth=4)
    assert [t.item() for (t,) in ahead] == [0.0, 1.0]


def test_close_stops_the_thread_that_waits_for_room() -> None:
    ahead = Prefetcher(iter(packed()), depth=1)  # an endless loader: the thread fills the queue and waits
    next(ahead)
    ahead.close()
    assert not any(t.name == "titan-data-prefetch" and t.is_alive() for t in threading.enumerate())


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Prefetcher(iter([]), depth=0)


def test_training_with_and_without_prefetch_gives_the_same_losses(tmp_path: Path) -> None:
    def run(prefetch: int) -> list[float]:
        config = tiny_llama3(tmp_path / f"p{prefetch}", steps=4)
        config.data.prefetch = prefetch
        return [row["loss"] for row in train(config, get_registry())]

    assert run(0) == run(3)


def test_the_trainer_stops_its_prefetch_thread_on_close(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=2)
    trainer = Trainer(config, get_registry())
    try:
        trainer.train()
        assert trainer.prefetcher is not None and trainer.prefetcher._thread.is_alive()
    finally:
        trainer.close(completed=True)
    assert not trainer.prefetcher._thread.is_alive()


@pytest.mark.parametrize("failing_call", [1, 2], ids=["first read", "on the prefetch thread"])
def test_a_dataset_plugin_failing_is_one_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_call: int
) -> None:
    """The trainer reads one document before building the model (call 1), then the loader reads
    pass 1 on the prefetch thread (call 2): a plugin's exception in either was a bare traceback."""
    from tests.conftest import plugin_module
    from titan_core import _registry
    from titan_core.errors import PluginError
    from titan_core.records import Dataset

    calls = {"n": 0}
    at = 0 if failing_call == 1 else 3  # the first read takes one document

    def documents(data: object) -> Iterator[str]:
        calls["n"] += 1
        for i, document in enumerate(corpus.documents(200)):
            if calls["n"] == failing_call and i == at:
                raise ConnectionError("the shard server went away")
            yield document

    registry = _registry.Registry().load_entry_points()
    registry.register(
        plugin_module("flaky", titan_datasets=[Dataset("flaky", documents, reads_path=False)]), "flaky"
    )
    monkeypatch.setattr(_registry, "_default", registry)
    config = tiny_llama3(tmp_path, steps=2)
    config.data.dataset = "flaky"
    with pytest.raises(PluginError) as info:
        train(config, registry)
    message = str(info.value)
    assert message.startswith(
        f"data.dataset 'flaky' (plugin flaky) failed reading document {at + 1} of pass 1 over the data: "
    )
    assert "ConnectionError: the shard server went away (at " in message
