"""Offline data: generated corpus, shipped tokenizer, packing, DP sharding, local files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
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


def test_a_wildcard_path_says_titan_reads_folders_not_patterns(tmp_path: Path) -> None:
    """``/data/c4/*.jsonl`` (what other loaders take) said only "does not exist", as if the folder
    were missing."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(tmp_path / "*.jsonl")))
    assert str(info.value) == (
        f"data.path: {str(tmp_path / '*.jsonl')!r} does not exist; titan does not expand wildcards "
        f"(*, ?, [...]): give the folder {str(tmp_path)!r}, whose .jsonl and .txt files are all read"
    )


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


def test_a_jsonl_line_nested_too_deeply_is_one_error_naming_its_line(tmp_path: Path) -> None:
    """Python's JSON reader raised RecursionError (not a JSONDecodeError): a bare traceback that
    named neither the file nor the line."""
    deep = '{"text": "a", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n' + deep + "\n")
    with pytest.raises(UsageError, match=r"a\.jsonl:2 is not valid JSON \(nested deeper than"):
        list(read_text_files(str(tmp_path)))


def test_a_jsonl_line_with_an_integer_of_many_digits_is_read(tmp_path: Path) -> None:
    """Valid JSON that Python's int conversion refuses (over 4300 digits, in a field titan does
    not read): a ValueError traceback naming neither the file nor the line. The number is not
    needed; the document is read, and a number as 'text' is still refused."""
    big = "1" + "0" * 5000
    (tmp_path / "a.jsonl").write_text(f'{{"text": "kept", "id": {big}}}\n')
    assert list(read_text_files(str(tmp_path))) == ["kept"]
    (tmp_path / "a.jsonl").write_text(f'{{"text": {big}}}\n')
    with pytest.raises(UsageError, match=r"a\.jsonl:1: 'text' is a number, not a string"):
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


@pytest.mark.parametrize("when", ["built", "first batch"])
@pytest.mark.parametrize(
    ("seq_len", "batch_size", "dp_degree"),
    [(64, 1, 1), (8, 4, 1), (8, 2, 2)],  # not one sequence; sequences, not a batch; not one per rank
)
def test_corpus_too_small_for_one_step_names_tokens_found_and_needed(
    seq_len: int, batch_size: int, dp_degree: int, when: str
) -> None:
    """The same error from the check the trainer runs before the model is built and from the
    end of the first pass; with 2 DP ranks, on either rank (each reads the whole stream's start)."""
    texts = ["a short document about rain.", "and one about bread."]
    found, needed = _tokens(texts), dp_degree * batch_size * (seq_len + 1)
    assert found < needed
    for rank in range(dp_degree):
        loader = PackedBatches(
            lambda: texts,
            load_tokenizer(None),
            seq_len=seq_len,
            batch_size=batch_size,
            dp_rank=rank,
            dp_degree=dp_degree,
            name="data.dataset 'text' at data.path '/data/tiny'",
        )
        with pytest.raises(UsageError) as info:
            loader.check_one_step() if when == "built" else next(iter(loader))
        assert str(info.value) == (
            f"data: data.dataset 'text' at data.path '/data/tiny' is too small for one step: one pass "
            f"gives {found} tokens (2 documents), and one step needs {needed} tokens ({dp_degree} "
            f"data-parallel rank(s) x training.local_batch_size={batch_size} x (training.seq_len="
            f"{seq_len} + 1)); add documents, or lower training.seq_len or training.local_batch_size"
        )


def test_the_check_before_the_model_reads_only_what_one_step_needs() -> None:
    """The check runs on every rank at start-up: it must not read (and tokenize) a large corpus
    whole, only until one step's tokens are there; data of exactly one step passes."""
    read = []

    def documents() -> Iterator[str]:
        for i in range(100_000):
            read.append(i)
            yield f"document {i} about the rain in the valley and the bread of the town"

    PackedBatches(documents, load_tokenizer(None), seq_len=32, batch_size=4, dp_degree=2).check_one_step()
    assert len(read) <= 256  # two chunks of 128 documents: 8 x 33 tokens fit in the first
    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2  # exactly two sequences
    PackedBatches(lambda: texts, load_tokenizer(None), seq_len=window - 1, batch_size=2).check_one_step()


def test_corpus_of_exactly_one_batch_trains() -> None:
    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2  # two sequences of this many tokens in one pass
    loader = PackedBatches(
        lambda: texts, load_tokenizer(None), seq_len=window - 1, batch_size=2, shuffle_buffer=0
    )
    inputs, _ = next(iter(loader))
    assert inputs.shape == (2, window - 1)


@pytest.mark.parametrize(
    ("name", "content", "encoding"),
    [
        ("bom16.txt", "hello world\nsecond".encode("utf-16"), "UTF-16"),
        ("bom16.jsonl", '{"text": "hi"}\n'.encode("utf-16"), "UTF-16"),
        ("bom32.txt", "hello".encode("utf-32"), "UTF-32"),
        ("le16.txt", "hello world".encode("utf-16-le"), "UTF-16 or UTF-32"),  # no byte-order mark
        ("be16.jsonl", '{"text": "hi"}\n'.encode("utf-16-be"), "UTF-16 or UTF-32"),
    ],
    ids=["utf16-bom-txt", "utf16-bom-jsonl", "utf32-bom-txt", "utf16le-txt", "utf16be-jsonl"],
)
def test_utf16_and_utf32_files_are_named_with_the_conversion_that_fits(
    tmp_path: Path, name: str, content: bytes, encoding: str
) -> None:
    """Windows tools write UTF-16: with a byte-order mark the error advised ``iconv -f latin1``,
    which turns it into valid UTF-8 mojibake; without one it was read silently as text with a NUL
    character after every letter."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(path)))
    message = str(info.value)
    assert message.startswith(f"data.path: {path} ") and f"is {encoding} text" in message
    assert "iconv -f utf-" in message and "latin1" not in message


# -- formats titan does not read: refused, not read as text --------------------------------------


def _refusal(path: Path, content: bytes) -> str:
    """The error reading ``path`` (written with ``content``) as data ends in."""
    path.write_bytes(content)
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(path)))
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("lines.json", b'{"text": "one"}\n{"text": "two"}\n'),  # JSON lines named .json
        ("arr.json", b'[{"text": "one"}, {"text": "two"}]'),  # a JSON array
        ("UP.JSON", b'{"text": "one"}\n'),
    ],
    ids=["json-lines", "json-array", "upper-case"],
)
def test_a_json_file_is_refused_saying_what_titan_reads(tmp_path: Path, name: str, content: bytes) -> None:
    message = _refusal(tmp_path / name, content)
    assert message.startswith(f"data.path: {tmp_path / name} is a .json file, which titan does not read")
    assert ".jsonl (one JSON object" in message and ".txt (plain text" in message
    jsonl = (tmp_path / name).with_suffix(".jsonl")
    assert f"renaming to {jsonl}" in message and f"jq -c '.[]' {tmp_path / name} > {jsonl}" in message


def test_jsonl_suffixes_are_case_insensitive(tmp_path: Path) -> None:
    (tmp_path / "UP.JSONL").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert list(read_text_files(str(tmp_path / "UP.JSONL"))) == ["one", "two"]  # not the raw JSON
    (tmp_path / "b.TXT").write_text("three")
    assert list(read_text_files(str(tmp_path))) == ["one", "two", "three"]  # a folder reads both


def test_files_without_a_known_suffix_are_read_as_text(tmp_path: Path) -> None:
    """What docs/data.md promises: a file given itself that is not .jsonl is one document."""
    (tmp_path / "README").write_text("a document")
    (tmp_path / "notes.md").write_text("# notes")
    assert list(read_text_files(str(tmp_path / "README"))) == ["a document"]
    assert list(read_text_files(str(tmp_path / "notes.md"))) == ["# notes"]


def _compressed() -> list[tuple[str, bytes]]:
    import bz2
    import gzip
    import io
    import lzma
    import zipfile

    data = b'{"text": "one"}\n'
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("a.jsonl", data)
    return [
        ("c.jsonl.gz", gzip.compress(data)),
        ("c.jsonl.bz2", bz2.compress(data)),
        ("c.jsonl.xz", lzma.compress(data)),
        ("c.jsonl.zst", b"\x28\xb5\x2f\xfd" + bytes(12)),
        ("c.zip", archive.getvalue()),
        ("c.parquet", b"PAR1" + bytes(8) + b"PAR1"),
        ("c.arrow", b"ARROW1\x00\x00" + bytes(8)),
        ("c.JSONL.GZ", gzip.compress(data)),
        # named as text, compressed inside: found by the first bytes
        ("gz_inside.jsonl", gzip.compress(data)),
        ("bz2_inside.txt", bz2.compress(data)),
        ("xz_inside", lzma.compress(data)),
        ("zip_inside.txt", archive.getvalue()),
        ("parquet_inside.txt", b"PAR1" + bytes(8) + b"PAR1"),
        ("tar_inside.txt", _tar(data)),
    ]


def _tar(data: bytes) -> bytes:
    import io
    import tarfile

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo("a.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return archive.getvalue()


@pytest.mark.parametrize(("name", "content"), _compressed(), ids=[n for n, _ in _compressed()])
def test_compressed_and_binary_files_are_refused_with_what_to_do(
    tmp_path: Path, name: str, content: bytes
) -> None:
    message = _refusal(tmp_path / name, content)
    assert message.startswith(f"data.path: {tmp_path / name} is ")
    assert "decompress or convert it to .jsonl" in message and "or .txt" in message
    assert "UTF-8" not in message and "iconv" not in message  # not the advice for a text encoding


def test_text_that_starts_like_a_signature_is_still_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("PAR1 is the first part. BZh9 is not bzip2 either.")
    assert list(read_text_files(str(tmp_path / "a.txt"))) == [
        "PAR1 is the first part. BZh9 is not bzip2 either."
    ]


def test_text_with_ustar_where_tar_keeps_its_magic_is_still_text(tmp_path: Path) -> None:
    """Tar's magic sits at byte 257: "mustard" there is a word, not an archive."""
    text = "x" * 256 + "mustard seeds and custard"
    (tmp_path / "a.txt").write_text(text)
    assert list(read_text_files(str(tmp_path / "a.txt"))) == [text]
    line = '{"text": "' + "y" * 246 + 'mustard"}\n'
    assert line.index("ustar") == 257
    (tmp_path / "b.jsonl").write_text(line)
    assert list(read_text_files(str(tmp_path / "b.jsonl"))) == ["y" * 246 + "mustard"]


def test_a_folder_names_the_files_it_skips_once(tmp_path: Path) -> None:
    import gzip

    from structlog.testing import capture_logs

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "two"}\n'))
    (tmp_path / "c.json").write_text('{"text": "three"}\n')
    (tmp_path / "d.md").write_text("# readme")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.parquet").write_bytes(b"PAR1")
    with capture_logs() as logs:
        assert list(read_text_files(str(tmp_path))) == ["one"]
        assert list(read_text_files(str(tmp_path))) == ["one"]  # the next pass: no second warning
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    event = warnings[0]["event"]
    assert (
        f"data.path {str(tmp_path)!r}: skipping 4 other files: b.jsonl.gz, c.json, d.md, and 1 more" in event
    )
    assert "only .jsonl and .txt files in a folder are read" in event


def test_a_folder_of_only_unread_files_names_them(tmp_path: Path) -> None:
    import gzip

    (tmp_path / "c4-00000.json.gz").write_bytes(gzip.compress(b'{"text": "one"}\n'))
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(tmp_path)))
    message = str(info.value)
    assert (
        f"no .jsonl or .txt files under {str(tmp_path)!r} (it holds 1 other file: c4-00000.json.gz)"
        in message
    )
    assert "decompress or convert" in message


# -- validation.steps beyond the validation data --------------------------------------------------


def _val_loader(texts: list[str], seq_len: int, **kwargs: object) -> PackedBatches:
    return PackedBatches(
        lambda: texts, load_tokenizer(None), seq_len=seq_len, batch_size=1, shuffle_buffer=0, **kwargs
    )


def test_validation_steps_beyond_the_data_warns_once_naming_the_distinct_batches() -> None:
    import itertools

    from structlog.testing import capture_logs

    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2  # two sequences in one pass
    loader = _val_loader(
        texts, window - 1, name="validation.dataset 'text'", repeat_warning="validation.steps"
    )

    def validation() -> list[tuple[list, list]]:
        return [(x.tolist(), y.tolist()) for x, y in itertools.islice(iter(loader), 5)]

    with capture_logs() as logs:
        first, again = validation(), validation()
    assert first == again  # every validation reads the same batches
    # What the warning is about: the batches after the first pass's two repeat its documents
    # (the pass's tail token starts the next pass, as in training).
    stream = [t for x, y in first for t in [*x[0], y[0][-1]]]
    tokens = _tokens(texts)
    assert stream[tokens : 2 * tokens] == stream[:tokens]
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    event = warnings[0]["event"]
    assert event.startswith("validation.steps asks for more batches than validation.dataset 'text' holds")
    assert "2 distinct batches of training.local_batch_size=1" in event
    assert "Lower validation.steps to at most 2" in event


@pytest.mark.parametrize(
    ("per_step", "advice"), [(2, "Lower validation.steps to at most 1"), (3, "Add documents")]
)
def test_the_repeat_warning_bounds_validation_steps_of_several_microbatches(
    per_step: int, advice: str
) -> None:
    """Under gradient accumulation a validation step reads one global batch of ``per_step``
    microbatches: the bound the warning gives counts steps, not microbatches."""
    import itertools

    from structlog.testing import capture_logs

    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2  # two sequences in one pass
    loader = _val_loader(
        texts, window - 1, name="validation.dataset 'text'", repeat_warning="validation.steps"
    )
    loader.batches_per_step = per_step
    with capture_logs() as logs:
        list(itertools.islice(iter(loader), 2 * per_step))
    (warning,) = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert f"({per_step} per step, one global batch)" in warning and advice in warning


def test_validation_steps_that_fit_the_data_do_not_warn() -> None:
    import itertools

    from structlog.testing import capture_logs

    texts = ["a short document about rain.", "and one about bread."]
    window = _tokens(texts) // 2
    fits = _val_loader(texts, window - 1, name="validation.dataset 'text'", repeat_warning="validation.steps")
    with capture_logs() as logs:
        assert len(list(itertools.islice(iter(fits), 2))) == 2  # exactly the data: no restart
    assert [e for e in logs if e["log_level"] == "warning"] == []


def _training(passes_of: int, steps: int, **kwargs: Any) -> PackedBatches:
    """A training stream of ``passes_of`` sequences of 17 tokens per pass, for ``steps`` steps."""
    tok = load_tokenizer(None)
    kept = [" ".join(["rain"] * 14)] * passes_of  # 17 tokens with BOS/EOS: a sequence each
    assert all(len(ids) + 2 == 17 for ids in tok.encode_batch(kept))
    return PackedBatches(lambda: kept, tok, 16, 2, name="data.dataset 'text'", steps=steps, **kwargs)


@pytest.mark.parametrize("shuffle", [0, 256])
def test_training_data_running_out_before_the_last_step_is_logged_where_it_starts_again(
    shuffle: int,
) -> None:
    """The data repeating (as torchtitan re-loops its training data) was silent: a run of more
    steps than the data holds trained on its documents again without a word."""
    import itertools

    from structlog.testing import capture_logs

    loader = _training(20, steps=25, shuffle_buffer=shuffle)  # 10 steps a pass, 2.5 passes
    with capture_logs() as logs:
        assert len(list(itertools.islice(iter(loader), 25))) == 25
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == (
        "data.dataset 'text' runs out before the run's 25 steps: one pass gives 20 sequences of "
        "training.seq_len=16 + 1 tokens, 10 steps of training.local_batch_size=2; titan reads the data "
        "again, reshuffled (as torchtitan re-loops its training data): pass 2 starts at step 11, so "
        "the steps from there train on documents already seen (2.5 passes in all). To train on each "
        "document once, add documents or lower training.steps to at most 10"
    )
    infos = [e["event"] for e in logs if e["log_level"] == "info"]
    assert infos == ["data.dataset 'text': pass 3 over the data starts at step 21"]


@pytest.mark.parametrize("shuffle", [0, 256])
def test_training_that_fits_one_pass_says_nothing_of_passes_read_ahead(shuffle: int) -> None:
    """The shuffle buffer (and the prefetch thread) read past what the run trains on: a pass
    ending there is no repeat (and a loader of no run's steps never logs it)."""
    import itertools

    from structlog.testing import capture_logs

    with capture_logs() as logs:
        list(itertools.islice(iter(_training(20, steps=10, shuffle_buffer=shuffle)), 12))
        list(itertools.islice(iter(_training(20, steps=None, shuffle_buffer=shuffle)), 25))  # type: ignore[arg-type]
    assert [e for e in logs if e["log_level"] in ("warning", "info")] == []


def test_hidden_files_and_folders_of_a_data_folder_are_not_data(tmp_path: Path) -> None:
    """Jupyter keeps a copy of each edited file in .ipynb_checkpoints: read, every such document
    would train twice; git's files are not documents either."""
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("one")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "description.txt").write_text("Unnamed repository")
    (tmp_path / ".hidden.jsonl").write_text('{"text": "secret"}\n')
    assert list(read_text_files(str(tmp_path))) == ["one"]


@pytest.mark.parametrize("marker", ["<|begin_of_text|>", "<|end_of_text|>"])
def test_special_token_strings_in_a_document_are_text_not_framing(tmp_path: Path, marker: str) -> None:
    """Web text quotes ``<|end_of_text|>``: only the loader's framing may yield BOS/EOS, or the
    document mask splits one document into several without a word."""
    path = tmp_path / "docs.jsonl"
    with path.open("w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"Doc {i} quotes {marker} in its prose. " * 3}) + "\n")
    tok = load_tokenizer(None)
    assert tok.bos_id not in tok.encode_batch([marker])[0] and tok.eos_id not in tok.encode_batch([marker])[0]
    loader = PackedBatches(
        documents=lambda: read_text_files(str(path)),
        tokenizer=tok,
        seq_len=256,
        batch_size=4,
        shuffle_buffer=0,
    )
    inputs, labels = next(iter(loader))
    for row in torch.cat([inputs[:, :1], labels], dim=1).tolist():  # every token of the sequence
        bos = [i for i, t in enumerate(row) if t == tok.bos_id]
        eos = [i for i, t in enumerate(row) if t == tok.eos_id]
        assert bos and eos
        # Framing only: each BOS follows an EOS (a document's end), each EOS precedes a BOS.
        assert all(row[i - 1] == tok.eos_id for i in bos if i > 0)
        assert all(row[i + 1] == tok.bos_id for i in eos if i + 1 < len(row))


def test_bos_and_eos_added_as_plain_tokens_are_not_read_from_the_text(tmp_path: Path) -> None:
    """``encode_special_tokens`` covers special tokens only: a tokenizer.json whose ``<s>`` and
    ``</s>`` are plain added tokens matched them inside the text, splitting the document."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world this is text"] * 50, trainer=trainer)
    backend.add_tokens([AddedToken("<s>", special=False), AddedToken("</s>", special=False)])
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    tok = load_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (backend.token_to_id("<s>"), backend.token_to_id("</s>"))
    (ids,) = tok.encode_batch(["hello </s> world <s>"])
    assert tok.bos_id not in ids and tok.eos_id not in ids


def test_two_dp_ranks_give_one_processs_batches_after_the_data_wraps(tmp_path: Path) -> None:
    """A pass of an odd number of sequences: the rank of sequence k restarted from 0 each pass,
    so after the first wrap rank 0 got two in a row and the global batch was not one process's."""
    path = tmp_path / "odd.jsonl"
    tok = load_tokenizer(None)
    texts = [f"document {i} with some words " * (1 + i % 3) for i in range(23)]
    while (sum(len(ids) + 2 for ids in tok.encode_batch(texts)) // 17) % 2 == 0:
        texts.append("one more document")  # until one pass holds an odd number of sequences
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def loader(rank: int, degree: int, batch: int) -> Any:
        documents = lambda: read_text_files(str(path))
        return iter(PackedBatches(documents, tok, 16, batch, rank, degree, shuffle_buffer=0))

    one = loader(0, 1, 4)
    ranks = [loader(0, 2, 2), loader(1, 2, 2)]
    for step in range(40):  # several passes
        inputs, _ = next(one)
        parts = [next(r)[0] for r in ranks]
        # Rows k of the one process's batch: rank k % 2's row k // 2.
        interleaved = torch.stack([parts[k % 2][k // 2] for k in range(4)])
        assert torch.equal(inputs, interleaved), step


def test_a_linked_subfolder_of_data_path_is_read(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("from the linked folder")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.ndjson").write_text(json.dumps({"text": "json lines"}) + "\n")
    (tmp_path / "data" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "data" / "loop").symlink_to(tmp_path / "data", target_is_directory=True)  # read once
    assert list(read_text_files(str(tmp_path / "data"))) == ["json lines", "from the linked folder"]


def test_a_data_file_linking_to_nothing_is_one_error_not_skipped(tmp_path: Path) -> None:
    """A folder of links to shards on a volume not mounted: the dangling links were skipped
    without a word (training on the rest); a link of another suffix stays a skipped file."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "here"}) + "\n")
    (data / "b.jsonl").symlink_to(tmp_path / "unmounted" / "b.jsonl")
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(data)))
    message = str(info.value)
    assert message.startswith(f"data.path: {data / 'b.jsonl'} is a link to ")
    assert "unmounted/b.jsonl, which does not exist" in message


def test_a_subfolder_that_cannot_be_listed_is_one_error_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.walk drops a folder it cannot list (no read permission): its files were skipped
    without a word. Faked: the tests may run as root, who reads any folder."""
    import os

    data = tmp_path / "data"
    (data / "locked").mkdir(parents=True)
    (data / "a.txt").write_text("readable")
    (data / "locked" / "b.txt").write_text("never read")
    scandir = os.scandir

    def refuse(path: Any = ".") -> Any:
        if Path(path) == data / "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(UsageError, match=r"data.path: cannot list the folder .*locked: Permission denied"):
        list(read_text_files(str(data)))


def test_a_tokenizer_with_id_gaps_counts_up_to_its_largest_id(tmp_path: Path) -> None:
    """300 tokens, one of them id 3000: a model of vocabulary 2048 passed the check and failed in
    its embedding."""
    data = json.loads(BUNDLED_TOKENIZER.read_text())
    for token in data["added_tokens"]:
        if token["content"] == "<|begin_of_text|>":
            old, token["id"] = token["id"], 3000
    data["model"]["vocab"] = {k: (3000 if v == old else v) for k, v in data["model"]["vocab"].items()}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    tok = load_tokenizer(str(path))
    assert tok.bos_id == 3000 and tok.vocab_size == 3001


def test_a_tokenizer_without_bos_and_eos_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["plain words only"] * 20, trainer=trainers.BpeTrainer(vocab_size=280))
    path = tmp_path / "plain.json"
    backend.save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.bos_id is None and tok.eos_id is None
    out = capsys.readouterr()
    assert "no BOS and EOS token" in out.out + out.err


class _Recording:
    """A tokenizer that records the longest text it was asked to tokenize at once."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.longest = max([self.longest, *map(len, texts)])
        return self.tok.encode_batch(texts)


def _stream(tok: Any, texts: list[str], seq_len: int = 64) -> list[list[int]]:
    loader = PackedBatches(lambda: texts, tok, seq_len, 1, shuffle_buffer=0)
    tokens = sum(len(ids) + 2 for ids in load_tokenizer(None).encode_batch(texts))
    it = iter(loader)
    return [next(it)[0][0].tolist() for _ in range(tokens // (seq_len + 1))]


def test_a_long_document_is_tokenized_in_pieces_with_the_tokens_of_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 14 MB text file was tokenized in one call and took 1.7 GB (about 120x its size): one
    large .txt file could exhaust the host. Pieces keep each call small and the tokens the same."""
    from titan_core.data import loader

    long = "\n".join(corpus.documents(60, seed=5)) + "\n\n  indented line\nlast words with  two spaces"
    texts = ["short one", long, "after it"]
    whole = _stream(load_tokenizer(None), texts)
    monkeypatch.setattr(loader, "PIECE_CHARS", 500)
    recording = _Recording(load_tokenizer(None))
    assert _stream(recording, texts) == whole
    assert recording.longest <= 500  # the long document went in pieces, framed once (as whole)


@pytest.mark.parametrize(
    ("text", "size", "cuts"),
    [
        ("aaaa\nbbbb\ncccc", 7, ["aaaa\n", "bbbb\n", "cccc"]),  # at line starts
        ("aa.\n\n\nbb cc", 8, ["aa.\n\n\n", "bb cc"]),  # after all the newlines
        ("one two three", 6, ["one", " two", " three"]),  # before a space between words
        ("one  two", 5, ["one  ", "two"]),  # no boundary in the first 5: cut where it ends
        ("abcdefgh", 3, ["abc", "def", "gh"]),
        ("short", 10, ["short"]),
    ],
)
def test_document_pieces_cut_where_byte_level_bpe_splits(text: str, size: int, cuts: list[str]) -> None:
    from titan_core.data.loader import document_pieces

    pieces = document_pieces(text, size)
    assert pieces == cuts and "".join(pieces) == text and all(len(p) <= size for p in pieces)


def test_a_tokenizer_that_marks_each_inputs_start_is_warned_about_when_a_document_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from titan_core.data import loader

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"])
    backend.train_from_iterator(corpus.documents(100, seed=1), trainer=trainer)
    path = tmp_path / "metaspace.json"
    backend.save(str(path))
    tok = load_tokenizer(str(path))
    assert not tok.cuts_exact and load_tokenizer(None).cuts_exact
    monkeypatch.setattr(loader, "_warned_inexact_cuts", False)
    monkeypatch.setattr(loader, "PIECE_CHARS", 200)
    _stream(tok, ["\n".join(corpus.documents(5, seed=2))], seq_len=16)
    out = capsys.readouterr()
    assert "is tokenized in pieces cut at line starts" in out.out + out.err


@pytest.mark.parametrize("item", [b"bytes", {"text": "a dict"}, 7])
def test_a_dataset_yielding_something_else_than_text_is_one_error_naming_it(item: object) -> None:
    """Bytes, a record or a number reached the tokenizer: a TypeError from inside it (or
    ``unhashable type: 'slice'``), naming neither the dataset nor what it yielded."""
    from titan_core.errors import PluginError

    loader = PackedBatches(
        lambda: ["some text", item], load_tokenizer(None), 16, 1, shuffle_buffer=0, name="data.dataset 'gen'"
    )
    with pytest.raises(PluginError, match=rf"data.dataset 'gen' yielded {type(item).__name__} .* must yield"):
        next(iter(loader))


# Every pass served whole, whatever the shuffle buffer, and the DP ranks' shares of the stream
# across passes: tests/core/data/test_packing.py (the tail of a pass starts the next one).


def _flaky(fail_on_pass: int, at: int) -> Any:
    """A dataset plugin's ``documents``: the bundled corpus, failing at document ``at`` of a pass."""
    calls = {"passes": 0}

    def documents() -> Iterator[str]:
        calls["passes"] += 1
        for i, document in enumerate(corpus.documents(20)):
            if calls["passes"] == fail_on_pass and i == at:
                raise RuntimeError("connection reset by the shard server")
            yield document

    return documents


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_dataset_failing_deep_in_its_stream_is_one_error_naming_it(prefetch: bool) -> None:
    """A plugin's exception while reading (a network shard, a bad record) came out of the step as
    a bare traceback, attributed to the forward/backward phase; with the prefetch thread too."""
    from titan_core.data.prefetch import Prefetcher
    from titan_core.errors import PluginError

    loader = PackedBatches(
        _flaky(2, 5), load_tokenizer(None), 32, 4, shuffle_buffer=8, name="data.dataset 'flaky'"
    )
    batches: Iterator[Any] = Prefetcher(iter(loader), 2) if prefetch else iter(loader)
    with pytest.raises(PluginError) as info:
        for _ in range(1000):
            next(batches)
    message = str(info.value)
    assert message.startswith("data.dataset 'flaky' failed reading document 6 of pass 2 over the data: ")
    assert "RuntimeError: connection reset by the shard server (at " in message and __file__ in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_dataset_whose_documents_call_fails_is_one_error_naming_it() -> None:
    from titan_core.errors import PluginError

    def documents() -> list[str]:  # not a generator: the call itself fails
        raise KeyError("shards")

    loader = PackedBatches(documents, load_tokenizer(None), 32, 4, name="data.dataset 'flaky'")
    with pytest.raises(
        PluginError, match=r"data.dataset 'flaky' failed reading document 1 of pass 1 .*KeyError"
    ):
        next(iter(loader))


@pytest.mark.parametrize("returned", [None, 7], ids=["None", "a number"])
def test_a_dataset_returning_no_iterable_is_one_error_naming_the_contract(returned: object) -> None:
    """A ``documents`` (or ``held_out``) that forgot its ``return`` failed with ``TypeError:
    'NoneType' object is not iterable (at .../titan_core/data/loader.py:691)``: titan's line, as if
    the loader were at fault, and not what the function must return."""
    from titan_core.errors import PluginError

    loader = PackedBatches(lambda: returned, load_tokenizer(None), 32, 4, name="data.dataset 'gen'")
    with pytest.raises(PluginError) as info:
        next(iter(loader))
    message = str(info.value)
    assert message.startswith(
        f"data.dataset 'gen' returned {'None' if returned is None else 'int 7'} where an iterable "
        "of documents was expected: "
    )
    assert "loader.py" not in message


def test_a_dataset_returning_one_shared_iterator_is_told_what_documents_must_return() -> None:
    """``documents`` returning one iterator (a pass went on where the last stopped; the second
    found it spent) ended with ``its documents changed while the run read them`` alone: true of
    files removed under a job, but a plugin author read it as a data problem, not the contract."""
    shared = iter([f"The river falls {i} times and the market opens." for i in range(50)])
    loader = PackedBatches(
        lambda: shared, load_tokenizer(None), 32, 2, shuffle_buffer=0, name="data.dataset 'once'"
    )
    batches = iter(loader)
    with pytest.raises(UsageError) as info:
        for _ in range(1000):
            next(batches)
    assert "yielded no sequence on pass 2 over the data" in str(info.value)
    assert "a new iterable on each call" in str(info.value)


def test_a_tokenizer_without_tokens_is_refused_naming_the_file(tmp_path: Path) -> None:
    """An empty vocabulary (a conversion that lost it) encoded every text to nothing, and the run
    stopped blaming the data: 'too small for one batch: one pass gives 0 tokens'."""
    data = json.loads(BUNDLED_TOKENIZER.read_text())
    data["model"]["vocab"], data["model"]["merges"], data["added_tokens"] = {}, [], []
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=r"data.tokenizer_path: .*tokenizer.json' has no tokens"):
        load_tokenizer(str(path))


def test_a_tokenizer_json_with_truncation_and_padding_keeps_every_token(tmp_path: Path) -> None:
    """A tokenizer.json saved with ``truncation`` and ``padding`` (common in Hugging Face files
    saved after ``enable_truncation(512)``): every document was cut to max_length tokens and
    every chunk padded to its longest, silently training on pad ids and losing the rest."""
    data = json.loads(BUNDLED_TOKENIZER.read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    texts = ["the river falls in the morning and the wind rises over the valley", "a"]
    assert load_tokenizer(str(path)).encode_batch(texts) == load_tokenizer(None).encode_batch(texts)


def test_a_tokenizer_that_cannot_encode_text_is_one_error_naming_the_file(tmp_path: Path) -> None:
    """A word-level tokenizer.json without its unknown token fails on any word it lacks: a bare
    ``Exception: WordLevel error: Missing [UNK] token`` traceback from loading the tokenizer,
    and, past that, from inside the loader (on the prefetch thread)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2, "</s>": 3}))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    with pytest.raises(UsageError) as info:
        load_tokenizer(str(path))
    message = str(info.value)
    assert message.startswith(f"data.tokenizer_path: {str(path)!r} cannot encode text")
    assert "Missing [UNK] token" in message
    tok = load_tokenizer(None)
    broken = attrs.evolve(tok, backend=backend, file=str(path))
    loader = PackedBatches(lambda: ["a b c"] * 50, broken, 8, 2, shuffle_buffer=0)
    with pytest.raises(UsageError, match=r"data.tokenizer_path: .* cannot encode document 1 of pass 1"):
        next(iter(loader))


def test_a_pass_that_yields_nothing_is_named_by_its_number() -> None:
    """Documents gone after the first pass (files removed under a running job): the error
    named pass 3 for the second pass."""
    calls = []

    def documents() -> list[str]:
        calls.append(1)
        return ["the river falls in the morning " * 10] * 20 if len(calls) == 1 else []

    loader = iter(PackedBatches(documents, load_tokenizer(None), 16, 2, shuffle_buffer=0))
    with pytest.raises(UsageError, match=r"yielded no sequence on pass 2 over the data \(pass 1 gave 88\)"):
        for _ in range(1000):
            next(loader)
