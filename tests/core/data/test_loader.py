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


# -- bad input: one error naming the file and line -----------------------------------------------


def test_non_utf8_text_file_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes("first line\nsecond caf\xe9\n".encode("latin-1"))
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(tmp_path)))
    assert str(info.value).startswith(f"data.path: {tmp_path / 'a.txt'}:2 is not UTF-8 (byte 0xe9, byte 11 ")
    assert "iconv" in str(info.value)


def test_non_utf8_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    lines = [b'{"text": "fine"}', b"", b'{"text": "caf\xe9"}']
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    docs = read_text_files(str(tmp_path))
    assert next(docs) == "fine"  # streamed: the bad line fails when it is reached
    with pytest.raises(UsageError, match=r"a\.jsonl:3 is not UTF-8 \(byte 0xe9"):
        next(docs)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("5", "a number"),
        ("null", "null"),
        ('["a"]', "a list"),
        ('{"a": 1}', "an object"),
        ("true", "a boolean"),
    ],
)
def test_jsonl_text_that_is_not_a_string(tmp_path: Path, value: str, kind: str) -> None:
    (tmp_path / "a.jsonl").write_text(f'{{"text": "ok"}}\n{{"text": {value}}}\n')
    with pytest.raises(UsageError, match=rf"a\.jsonl:2: 'text' is {kind}, not a string"):
        list(read_text_files(str(tmp_path)))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"text": "a",}',
            r"a\.jsonl:1 is not valid JSON \(Expecting property name enclosed in double quotes",
        ),
        ('{"text": "unterminated', r"a\.jsonl:1 is not valid JSON"),
        ('["a", "b"]', r"a\.jsonl:1 is not a JSON object with a 'text' field \(got a list\)"),
        (
            '{"body": "x", "id": 3}',
            r"a\.jsonl:1 is not a JSON object with a 'text' field \(got keys 'body', 'id'\)",
        ),
        ('{"text": "\\ud800"}', r"a\.jsonl:1: 'text' holds an unpaired UTF-16 surrogate"),
    ],
)
def test_jsonl_lines_that_are_not_text_records(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "a.jsonl").write_text(line + "\n")
    with pytest.raises(UsageError, match=message):
        list(read_text_files(str(tmp_path)))


def test_byte_order_mark_and_folders_named_like_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes('\ufeff{"text": "one"}\n'.encode())
    (tmp_path / "b.txt").write_bytes("\ufefftwo".encode())
    (tmp_path / "c.txt").mkdir()  # a folder, not a document
    assert list(read_text_files(str(tmp_path))) == ["one", "two"]


def _tokens(texts: list[str]) -> int:
    """Tokens one pass yields, BOS and EOS framing included."""
    tok = load_tokenizer(None)
    return sum(len(ids) + 2 for ids in tok.encode_batch(texts))


@pytest.mark.parametrize(
    ("seq_len", "batch_size", "dp_degree"),
    [(64, 1, 1), (8, 4, 1), (8, 2, 2)],  # not one sequence; sequences, not a batch; not one per rank
)
def test_corpus_too_small_for_one_batch_names_tokens_found_and_needed(
    seq_len: int, batch_size: int, dp_degree: int
) -> None:
    texts = ["a short document about rain.", "and one about bread."]
    loader = PackedBatches(
        lambda: texts,
        load_tokenizer(None),
        seq_len=seq_len,
        batch_size=batch_size,
        dp_degree=dp_degree,
        name="data.dataset 'text' at data.path '/data/tiny'",
    )
    found, needed = _tokens(texts), dp_degree * batch_size * (seq_len + 1)
    assert found < needed
    with pytest.raises(UsageError) as info:
        next(iter(loader))
    assert str(info.value) == (
        f"data: data.dataset 'text' at data.path '/data/tiny' is too small for one batch: one pass "
        f"gives {found} tokens, and one batch needs {needed} ({dp_degree} data-parallel rank(s) x "
        f"training.local_batch_size={batch_size} x (training.seq_len={seq_len} + 1)); add documents, "
        "or lower training.seq_len or training.local_batch_size"
    )


def test_corpus_of_exactly_one_batch_trains() -> None:
    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2  # two sequences of this many tokens in one pass
    loader = PackedBatches(
        lambda: texts, load_tokenizer(None), seq_len=window - 1, batch_size=2, shuffle_buffer=0
    )
    inputs, _ = next(iter(loader))
    assert inputs.shape == (2, window - 1)
