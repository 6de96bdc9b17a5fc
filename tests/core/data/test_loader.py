"""Offline data: generated corpus, shipped tokenizer, packing, DP sharding, local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_core.data import corpus
from titan_core.data.loader import BUNDLED_TOKENIZER, PackedBatches, load_tokenizer, read_text_files
from titan_core.data.make_tokenizer import train_tokenizer
from titan_core.errors import UsageError


def batches(dp_rank: int = 0, dp_degree: int = 1, seed: int = 0, n: int = 3, shuffle: int = 16, bs: int = 2):
    loader = PackedBatches(
        documents=lambda: corpus.documents(200),
        tokenizer=load_tokenizer(None),
        seq_len=32,
        batch_size=bs,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=seed,
        shuffle_buffer=shuffle,
    )
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_corpus_is_deterministic() -> None:
    assert list(corpus.documents(5)) == list(corpus.documents(5))
    assert list(corpus.documents(5, seed=1)) != list(corpus.documents(5, seed=2))


def test_shipped_tokenizer_is_what_the_generator_makes() -> None:
    shipped = json.loads(BUNDLED_TOKENIZER.read_text())
    regenerated = json.loads(train_tokenizer().to_str())
    assert shipped["model"]["vocab"] == regenerated["model"]["vocab"]
    tok = load_tokenizer(None)
    assert tok.vocab_size <= 2048 and tok.bos_id is not None and tok.eos_id is not None


def test_packed_shapes_and_shift() -> None:
    inputs, labels = batches(n=1)[0]
    assert inputs.shape == labels.shape == (2, 32) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_order_depends_only_on_seed_and_dp_rank() -> None:
    first, again = batches(seed=3), batches(seed=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    other = batches(seed=4)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))


def test_dp_ranks_see_disjoint_sequences() -> None:
    seen = [{tuple(row.tolist()) for x, _ in batches(r, 2, n=4) for row in x} for r in range(2)]
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_unshuffled_global_batch_is_layout_independent() -> None:
    """With shuffling off, DP ranks together see exactly the one-rank global batch."""
    ((single, _),) = batches(n=1, shuffle=0, bs=4)
    parts = [batches(r, 2, n=1, shuffle=0, bs=2)[0][0] for r in range(2)]
    assert {tuple(r.tolist()) for r in single} == {tuple(r.tolist()) for p in parts for r in p}


def test_text_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "one doc"}\n\n{"text": "two doc"}\n')
    (tmp_path / "b.txt").write_text("a whole file")
    assert list(read_text_files(str(tmp_path))) == ["one doc", "two doc", "a whole file"]
    (tmp_path / "c.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(UsageError, match=r"c.jsonl:1 is not a JSON object with a 'text' field"):
        list(read_text_files(str(tmp_path)))


@pytest.mark.parametrize(
    ("path", "message"),
    [(None, "needs a file or folder"), ("/no/such/dir", "does not exist")],
)
def test_text_dataset_errors(path: str | None, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        list(read_text_files(path))


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"data\.tokenizer_path: no tokenizer file"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_too_small_dataset_is_an_error() -> None:
    loader = PackedBatches(lambda: ["tiny"], load_tokenizer(None), seq_len=64, batch_size=1)
    with pytest.raises(UsageError, match="dataset is too small"):
        next(iter(loader))
