"""A ``.txt`` file is streamed in bounded reads: the same documents, pieces and token ids as a
file read whole, and the same errors, wherever a read ends (inside a UTF-8 character, inside a
``\\r\\n``, at a file's end)."""

from __future__ import annotations

import codecs
import tracemalloc
from pathlib import Path

import pytest

from titan_core.data import corpus, loader
from titan_core.data.loader import PackedBatches, load_tokenizer, read_text_files
from titan_core.errors import UsageError

#: Text with multi-byte characters (2, 3 and 4 bytes), Windows line ends, indented lines, runs
#: of spaces and a long unspaced stretch (cut where a piece ends).
_MIXED = (
    "Caf\u00e9 cr\u00e8me, \u00fcber alles.\r\n\r\n  indented \u65e5\u672c\u8a9e line\r\n"
    + "\n".join(corpus.documents(8, seed=3))
    + "\r\nparty \U0001f389\U0001f389 time  two  spaces\n"
    + "x" * 130
    + "\u00e9" * 50
    + "\r\n\r\nlast words"
)


def _files(root: Path) -> dict[str, bytes]:
    """A folder of .txt (and one .jsonl) files, document boundaries between them."""
    files = {
        "a.txt": _MIXED.encode(),
        "b.txt": b"",  # an empty document
        "c.txt": b"\n",  # whitespace only: an empty document
        "d.jsonl": b'{"text": "a json line"}\n{"text": "another one"}\n',
        "e.txt": codecs.BOM_UTF8 + "with a byte-order mark\r\nand \u00e9".encode(),
        "f.txt": b" \r\n\t" * 40,  # whitespace only, longer than a piece
        "g.txt": b" \r\n" * 40 + "then text \u00e9\r\n".encode() * 5,  # long whitespace, then text
        "h.txt": "short \u65e5".encode(),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def _whole(root: Path, files: dict[str, bytes]) -> list[str]:
    """The documents as the loader read them before streaming: each .txt file decoded whole."""
    docs: list[str] = []
    for name, data in sorted(files.items()):
        if name.endswith(".jsonl"):
            docs += list(read_text_files(str(root / name)))
        else:
            docs.append(data.decode("utf-8-sig"))
    return docs


def _rows(batches: PackedBatches, count: int) -> list[list[int]]:
    rows: list[list[int]] = []
    for inputs, labels in batches:
        rows += [[*x.tolist(), int(y[-1])] for x, y in zip(inputs, labels, strict=True)]
        if len(rows) >= count:
            return rows[:count]
    raise AssertionError("the loader ended")


@pytest.mark.parametrize("read_bytes", [1, 2, 3, 5, 7, 64, 1 << 20])
@pytest.mark.parametrize("piece_chars", [40, 1 << 18])
def test_a_txt_file_read_in_small_pieces_gives_every_rank_the_token_ids_of_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_bytes: int, piece_chars: int
) -> None:
    """Reads of 1 to 7 bytes end inside every 2-, 3- and 4-byte character, inside every
    ``\\r\\n`` and at every file's end; pieces of 40 characters cut the documents at line starts,
    between words and inside the unspaced stretch. Every DP rank's sequences, over three passes,
    are those of the documents read whole."""
    files = _files(tmp_path)
    whole = _whole(tmp_path, files)
    monkeypatch.setattr(loader, "PIECE_CHARS", piece_chars)
    monkeypatch.setattr(loader, "READ_BYTES", read_bytes, raising=False)
    tok = load_tokenizer(None)
    # The documents join back to the files' text, in the same order, empty ones whole.
    streamed = list(read_text_files(str(tmp_path)))
    joined: list[str] = []
    for piece in streamed:
        if joined and isinstance(joined[-1], _Open):
            joined[-1] = _Open(joined[-1] + piece)
        else:
            joined.append(_Open(piece))
        if not isinstance(piece, loader.Continued):
            joined[-1] = str(joined[-1])
    # A file of only whitespace longer than a piece is not held: "" (an empty document either way).
    assert joined == ["" if d.isspace() and len(d) > piece_chars else d for d in whole]
    assert all(len(piece) <= piece_chars for piece in streamed)
    window = 9
    total = sum(len(ids) + 2 for ids in tok.encode_batch([d for d in whole if d.strip()]))
    count = 3 * total // window // 2  # three passes over the stream, shared by two ranks
    for rank in range(2):
        expected = _rows(PackedBatches(lambda: whole, tok, window - 1, 2, rank, 2, seed=5), count)
        got = _rows(
            PackedBatches(lambda: read_text_files(str(tmp_path)), tok, window - 1, 2, rank, 2, seed=5),
            count,
        )
        assert got == expected


class _Open(str):
    """A document being joined from its pieces (the test's own marker)."""


def test_a_large_txt_file_is_read_in_bounded_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read whole, a .txt file took about twice its size in memory on every rank (its bytes and
    its text), and the trainer kept the first document for the run."""
    line = "the rain falls on the valley and the bread bakes in the oven \u00e9\n"
    path = tmp_path / "big.txt"
    path.write_text(line * (4_000_000 // len(line)), encoding="utf-8")
    size = path.stat().st_size
    monkeypatch.setattr(loader, "READ_BYTES", 1 << 16, raising=False)
    tracemalloc.start()
    try:
        longest = total = 0
        for piece in read_text_files(str(path)):
            longest, total = max(longest, len(piece)), total + len(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == len(line) * (4_000_000 // len(line))
    assert longest <= loader.PIECE_CHARS
    assert peak < size / 2, f"peak {peak} bytes reading a file of {size}"


def _error(path: Path) -> str:
    with pytest.raises(UsageError) as info:
        list(read_text_files(str(path)))
    return str(info.value)


@pytest.mark.parametrize(
    ("data", "line", "column", "byte"),
    [
        (b"caf\xe9 on line one", 1, 4, 0xE9),
        (b"one\r\ntwo\r\nthr\xc3\xa9e \xff end\r\n", 3, 8, 0xFF),
        (b"abc\n" * 30 + b"x\xe9", 31, 2, 0xE9),  # past many reads
        ("ok \u65e5\n".encode() + b"cut \xe6\x97", 2, 5, 0xE6),  # a character cut by the file's end
        (codecs.BOM_UTF8 + b"ab\xe9cd", 1, 6, 0xE9),  # the byte-order mark counts as bytes of line 1
    ],
    ids=["line-1", "after-crlf", "deep", "truncated-at-end", "after-bom"],
)
@pytest.mark.parametrize("read_bytes", [1, 2, 3, 4, 1 << 20])
def test_a_byte_that_is_not_utf8_is_named_wherever_a_read_ends(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    data: bytes,
    line: int,
    column: int,
    byte: int,
    read_bytes: int,
) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(data)
    monkeypatch.setattr(loader, "READ_BYTES", read_bytes, raising=False)
    assert _error(path) == (
        f"data.path: {path}:{line} is not UTF-8 (byte 0x{byte:02x}, byte {column} of the line); titan "
        "reads text files as UTF-8: convert it (e.g. iconv -f latin1 -t utf-8)"
    )


def test_a_jsonl_first_line_after_a_byte_order_mark_names_the_bad_byte(tmp_path: Path) -> None:
    """Decoded without its byte-order mark, the error named the byte 3 places before the bad one
    (``0xbf``, part of the mark)."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + b'{"text": "caf\xe9"}\n')
    assert "a.jsonl:1 is not UTF-8 (byte 0xe9, byte 17 of the line)" in _error(path)
