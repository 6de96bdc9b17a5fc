"""Tokenizer loading and the packed language-modelling data loader.

Documents are tokenized in order, framed by BOS/EOS (an empty one is skipped), concatenated and
cut into sequences of ``seq_len + 1`` tokens (inputs and labels shifted by one). The corpus repeats
(with a new shuffle) when it runs out, as one stream: a pass's last tokens start the next pass's
first sequence. Sequence ``k`` of that stream belongs to data-parallel rank ``k % dp_degree``; each
rank shuffles its sequences through a buffer seeded by ``(seed, dp_rank)``, so the order depends
only on the seed and the DP rank. The buffer is emptied at the end of each pass, so every sequence
of a pass is served once before the next pass starts, whatever the buffer size.
"""

from __future__ import annotations

import codecs
import contextvars
import json
import os
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import attrs

from titan_core.errors import PluginError, TitanError, UsageError, describe

BUNDLED_TOKENIZER = Path(__file__).with_name("assets") / "tokenizer.json"
_BOS = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")
_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


@attrs.frozen
class Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer with its BOS/EOS ids."""

    backend: object
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    #: Whether tokenizing a text in pieces cut where :func:`document_pieces` cuts (at a line
    #: start, or before a space between words) gives the tokens of the whole text: true for
    #: byte-level BPE (GPT-2, Llama 3, titan's bundled tokenizer), false for tokenizers that
    #: mark the start of every input (SentencePiece's ``Metaspace``).
    cuts_exact: bool = True
    #: The ``tokenizer.json`` it was read from (what :func:`tokenizer_fingerprint` digests).
    file: str | None = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


#: Tokenizer files already warned about (no BOS/EOS): once per process, not per load.
_warned_tokenizers: set[str] = set()


#: The thread-pool sizes the ``tokenizers`` library's pool (Rayon) reads, once, when it starts.
_RAYON_VARS = ("RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS")
#: What :func:`share_tokenizer_threads` set ``RAYON_NUM_THREADS`` to, so a process started by
#: this one (which inherits the variable) tells titan's value from the user's and sizes its own.
_RAYON_SET_BY_TITAN = "TITAN_RAYON_NUM_THREADS"


def share_tokenizer_threads(environ: Any = os.environ) -> int | None:
    """Size this process's tokenizer thread pool to its share of the host's cores: the cores it
    may run on divided by the processes the launcher started on this host (torchrun's
    ``LOCAL_WORLD_SIZE``; 1 without one), at least 1. Rayon sizes its pool to all the cores, so
    8 ranks on a host ran 8 times as many tokenizer threads as cores, next to training (the
    prefetch thread tokenizes). Left alone where the user set ``RAYON_NUM_THREADS`` or
    ``RAYON_RS_NUM_CPUS`` (``TOKENIZERS_PARALLELISM=false`` still turns the pool off). Takes
    effect only before the pool starts (the library's first parallel encode), so it is called
    before a tokenizer is loaded. Returns the threads set, ``None`` when left alone."""
    ours = environ.get(_RAYON_SET_BY_TITAN)
    if any(environ.get(name) for name in _RAYON_VARS) and not (
        ours and environ.get("RAYON_NUM_THREADS") == ours and not environ.get("RAYON_RS_NUM_CPUS")
    ):
        return None
    try:
        cores = len(os.sched_getaffinity(0))  # a taskset or cgroup cpuset: the cores it may use
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    raw = environ.get("LOCAL_WORLD_SIZE", "").strip()
    local = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    threads = max(1, cores // local)
    environ["RAYON_NUM_THREADS"] = environ[_RAYON_SET_BY_TITAN] = str(threads)
    return threads


def load_tokenizer(path: str | None) -> Tokenizer:
    share_tokenizer_threads()
    from tokenizers import Tokenizer as HFTokenizer

    if path is not None and not path.strip():
        # Read as "no path", a blank (an unset variable in ``--data.tokenizer_path "$TOK"``)
        # trained with the bundled tokenizer, which a debug model's vocabulary fits, silently.
        raise UsageError(
            f"data.tokenizer_path: {path!r} is empty; give the path of a Hugging Face tokenizer.json "
            "(or its folder), or leave it unset (None) for titan's bundled tokenizer"
        )
    file = Path(path) if path is not None else BUNDLED_TOKENIZER
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise UsageError(
            f"data.tokenizer_path: no tokenizer file at {str(file)!r}; give the path of a Hugging "
            "Face tokenizer.json (or its folder), or None for titan's bundled tokenizer"
        )
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as exc:
        raise UsageError(f"data.tokenizer_path: cannot read {str(file)!r} as tokenizer.json: {exc}") from None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:  # every text would encode to nothing, and the run would blame the data
        raise UsageError(
            f"data.tokenizer_path: {str(file)!r} has no tokens (an empty vocabulary); give a "
            "tokenizer.json with its vocabulary, or None for titan's bundled tokenizer"
        )

    def first(names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in vocab), None)

    bos, eos = first(_BOS), first(_EOS)
    # Special-token strings inside a document (web text quotes ``<|end_of_text|>``) are text:
    # only the loader's own framing may produce BOS/EOS, or a document mask would split one
    # document into several. ``add_special_tokens=False`` alone still matches them in the text,
    # and ``encode_special_tokens`` covers special tokens only: a tokenizer whose BOS/EOS are
    # added as plain tokens gets them marked special (the same ids).
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True) for t in (bos, eos) if t is not None])
    backend.encode_special_tokens = True
    # A tokenizer.json saved with truncation or padding (``enable_truncation(512)`` before
    # ``save``) applies them in every encode: each document was cut to max_length tokens and each
    # chunk padded to its longest, silently. The loader packs whole documents itself.
    backend.no_truncation()
    backend.no_padding()
    ids = [None if t is None else backend.token_to_id(t) for t in (bos, eos)]
    if ids != [None if t is None else vocab[t] for t in (bos, eos)]:  # never seen: ids are kept
        raise UsageError(
            f"data.tokenizer_path: {str(file)!r}: its BOS/EOS tokens changed ids when marked special"
        )
    # The ids the model must embed reach the largest one, whatever the count (a tokenizer.json
    # with gaps had fewer tokens than its largest id + 1, and failed inside the embedding).
    size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    try:
        # Encodes samples of text (ASCII and not): a tokenizer that fails on text it lacks (a
        # word-level one without its unknown token) raised a bare traceback here, or deep in
        # the data on the prefetch thread.
        backend.encode(_UNICODE_SAMPLE, add_special_tokens=False)
        cuts_exact = _cuts_exact(backend)
    except Exception as exc:
        raise UsageError(
            f"data.tokenizer_path: {str(file)!r} cannot encode text ({exc}); give a tokenizer.json that "
            "encodes any text (byte-level BPE, or one whose unknown token is in its vocabulary)"
        ) from None
    if (bos is None or eos is None) and str(file) not in _warned_tokenizers:
        _warned_tokenizers.add(str(file))
        missing = [(w, names) for w, t, names in (("BOS", bos, _BOS), ("EOS", eos, _EOS)) if t is None]
        looked = "; ".join(f"{w}: {', '.join(names)}" for w, names in missing)
        _log().warning(
            f"data.tokenizer_path {str(file)!r}: no {' and '.join(w for w, _ in missing)} token "
            f"(titan looks for {looked}), so packed documents are not framed by one; a tokenizer "
            "with them keeps document boundaries (and the document mask) in the data"
        )
    return Tokenizer(backend, size, *ids, cuts_exact=cuts_exact, file=str(file))


#: The parts of a ``tokenizer.json`` that decide which ids a text gets (the decoder, the
#: post-processor, padding and truncation do not: the loader adds no special tokens itself and
#: turns padding and truncation off).
_ENCODING_KEYS = ("normalizer", "pre_tokenizer", "model", "added_tokens")


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, Any] | None:
    """The tokenizer's vocabulary size and a digest of what maps text to ids (its normalizer,
    pre-tokenizer, model: vocabulary and merges, and added tokens), as parsed JSON with sorted
    keys: a copy of the file, or one laid out otherwise, is the same tokenizer; another
    vocabulary, another id for a token or other merges are not. A checkpoint records it, so a
    resume whose token ids would mean other text says so. ``None``: no file to read."""
    import hashlib

    if tokenizer.file is None:
        return None
    try:
        with open(tokenizer.file, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):  # read once already; changed since: nothing to compare
        return None
    if not isinstance(data, dict):
        return None
    encoding = {key: data.get(key) for key in _ENCODING_KEYS}
    text = json.dumps(encoding, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return {"digest": digest, "vocab_size": tokenizer.vocab_size}


#: Texts split where :func:`document_pieces` may cut them, to check a tokenizer against.
_CUT_SAMPLES = (
    ("The end.\n\n", "Next line, here"),
    ("Hello", " world"),
    ("12\n", "x 3"),
)
#: Non-ASCII text a tokenizer must encode (one that cannot is refused when it is loaded).
_UNICODE_SAMPLE = "Caf\u00e9 \u00fcber \u65e5\u672c\u8a9e \U0001f389"


def _cuts_exact(backend: Any) -> bool:
    def ids(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    return all(ids(a + b) == ids(a) + ids(b) for a, b in _CUT_SAMPLES)


#: Suffixes of the files a folder given as ``data.path`` is read for (compared case-insensitively).
TEXT_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines", ".txt")
#: The JSON Lines spellings among them (one ``{"text": ...}`` object per line).
_JSON_LINES = (".jsonl", ".ndjson", ".jsonlines")
#: Compressed or binary formats titan does not read, by suffix (case-insensitive).
_BINARY_SUFFIXES = {
    ".gz": "gzip-compressed",
    ".gzip": "gzip-compressed",
    ".bz2": "bzip2-compressed",
    ".xz": "xz-compressed",
    ".lzma": "lzma-compressed",
    ".zst": "zstd-compressed",
    ".zstd": "zstd-compressed",
    ".lz4": "lz4-compressed",
    ".zip": "a zip archive",
    ".tar": "a tar archive",
    ".tgz": "a gzip-compressed tar archive",
    ".7z": "a 7-zip archive",
    ".parquet": "Parquet data",
    ".arrow": "Arrow data",
    ".feather": "Arrow (Feather) data",
}
#: The same formats by their first bytes (a compressed file named ``.jsonl`` or ``.txt``). Only
#: signatures no text file starts with: control or non-UTF-8 bytes, or a tail check (Parquet).
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed"),
    (b"\xfd7zXZ\x00", "xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    (b"\x04\x22\x4d\x18", "lz4-compressed"),
    (b"PK\x03\x04", "a zip archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-zip archive"),
    (b"ARROW1\x00\x00", "Arrow data"),
)
_BZIP2 = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)")
#: Folders whose skipped files were already named in a warning (once per process).
_warned_skips: set[str] = set()
#: The config field a folder being read was given by, for its warnings: the trainer sets
#: ``validation.path`` around the validation data's first read (where a folder is first listed).
path_field: contextvars.ContextVar[str] = contextvars.ContextVar("titan_path_field", default="data.path")


def _walk(root: Path) -> list[Path]:
    """Every file and folder under ``root``, sorted, through links to folders too (``rglob`` does
    not follow them: a linked subfolder was skipped without a word); a link back up is followed
    once."""
    found, seen = [], set()

    def unlistable(exc: OSError) -> None:
        # os.walk skips a folder it cannot list (no read permission) without a word: its files
        # would be left out of the data.
        raise UsageError(
            f"data.path: cannot list the folder {exc.filename}: {exc.strerror or exc}; make it readable, "
            "or move it out of the data folder"
        )

    for folder, dirs, names in os.walk(root, followlinks=True, onerror=unlistable):
        real = os.path.realpath(folder)
        if real in seen:  # a link cycle
            dirs[:] = []
            continue
        seen.add(real)
        found += [Path(folder) / name for name in (*dirs, *names)]
    return sorted(found)


def folder_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The data files of a folder (``.jsonl``, ``.txt``, ...) and the other files, each sorted."""
    files, skipped = [], []
    for p in _walk(root):
        # Hidden files and folders (.git, .ipynb_checkpoints: Jupyter's copies of the data)
        # are not data: read, they would train on a second copy of documents or on git's.
        if any(part.startswith(".") for part in p.relative_to(root).parts):
            continue
        if p.is_symlink() and not p.exists() and p.suffix.lower() in TEXT_SUFFIXES:
            # A link to a shard on a volume not mounted: skipped, the run trained on the rest.
            raise UsageError(
                f"data.path: {p} is a link to {os.readlink(p)}, which does not exist; mount or restore "
                "it, or remove the link"
            )
        if p.is_file():
            (files if p.suffix.lower() in TEXT_SUFFIXES else skipped).append(p)
    return files, skipped


#: Bytes read from each end of every data file for the fingerprint: a rewrite or a reorder of
#: the lines shows there, and a corpus of many large files is not read whole at start-up.
_SAMPLE_BYTES = 4096


def files_fingerprint(path: str | None) -> dict[str, Any] | None:
    """How many data files ``path`` holds, their bytes, and a digest of their names (relative,
    in reading order), sizes and first and last 4 KiB (``None``: no local path): what a resume
    compares, so files added, removed, renamed or rewritten since a checkpoint are named (the
    position it skips to would land in another stream). Times are left out: a copy of the same
    files is the same data. Only both ends of a file are read (start-up stays cheap on a large
    corpus), so an edit in the middle of a file over 8 KiB that keeps its size is not seen."""
    import hashlib

    if not path or not os.path.exists(path):
        return None
    root = Path(path)
    files = folder_files(root)[0] if root.is_dir() else [root]
    digest = hashlib.sha256()
    total = 0
    for file in files:
        size = file.stat().st_size
        total += size
        name = file.relative_to(root).as_posix() if root.is_dir() else ""
        digest.update(f"{name}\0{size}\0".encode("utf-8", "surrogateescape"))
        try:
            with open(file, "rb") as f:
                digest.update(f.read(_SAMPLE_BYTES))
                if size > _SAMPLE_BYTES:
                    f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
                    digest.update(f.read(_SAMPLE_BYTES))
        except OSError:
            digest.update(b"unreadable")  # the reader names the file when it gets there
    return {"files": len(files), "bytes": total, "digest": digest.hexdigest()[:16]}


def read_text_files(path: str | None) -> Iterator[str]:
    """Documents of local files: a ``.jsonl`` line's ``text`` field, or a whole text file.

    A file given itself is read as JSON Lines when its name ends in ``.jsonl`` (or ``.ndjson``,
    ``.jsonlines``; any case), and as one plain-text document otherwise (``.txt``, ``.md``, no
    suffix). A folder is read for those files (any case), recursively in sorted path order
    (through links to folders), leaving out
    hidden files and folders (``.git``, ``.ipynb_checkpoints``); the other files in it are
    named once in a warning. ``.json`` files and compressed or binary formats (``.gz``,
    ``.zst``, ``.parquet``, ..., by suffix or by their first bytes) are refused: read as text they
    would train on JSON syntax or on bytes. Files must be UTF-8. Any problem is one
    :class:`UsageError` naming the file (and line), raised when the reader reaches it (the data is
    streamed, so a bad line deep in a large corpus is found when training gets there).
    """
    if not path:
        raise UsageError("data.path: the 'text' dataset needs a file or folder of .jsonl/.txt files")
    root = Path(path)
    if not root.exists():
        raise UsageError(f"data.path: {path!r} does not exist{_wildcard_hint(root)}")
    if root.is_dir():
        files, skipped = folder_files(root)
        if not files:
            found = f" (it holds {_some(skipped, root)})" if skipped else ""
            raise UsageError(
                f"data.path: no .jsonl or .txt files under {path!r}{found}; titan reads .txt (plain "
                'text, each file one document) and .jsonl (one {"text": ...} object per line): '
                "decompress or convert the data to those"
            )
        if skipped and str(root.resolve()) not in _warned_skips:
            _warned_skips.add(str(root.resolve()))
            _log().warning(
                f"{path_field.get()} {path!r}: skipping {_some(skipped, root)}; only .jsonl and .txt files "
                "in a folder are read",
                skipped=len(skipped),
            )
    else:
        files = [root]
    for file in files:
        try:
            _check_format(file)
            if file.suffix.lower() in _JSON_LINES:
                yield from _jsonl_texts(file)
            else:
                yield from _text_file_pieces(file)
        except OSError as exc:
            raise UsageError(f"data.path: cannot read {file}: {exc.strerror or exc}") from None


def _wildcard_hint(path: Path) -> str:
    """What to give instead of a pattern (``/data/c4/*.jsonl``, as other loaders take): "does not
    exist" alone read as if the folder were missing."""
    parts = path.parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if wild is None:
        return ""
    folder = str(Path(*parts[:wild])) if wild else "."
    return (
        f"; titan does not expand wildcards (*, ?, [...]): give the folder {folder!r}, whose .jsonl "
        "and .txt files are all read"
    )


def _some(files: list[Path], root: Path, shown: int = 3) -> str:
    """``2 other files: a.md, b.json.gz`` (the first ``shown``, relative to ``root``)."""
    names = ", ".join(str(f.relative_to(root)) for f in files[:shown])
    more = f", and {len(files) - shown} more" if len(files) > shown else ""
    return f"{len(files)} other file{'s' if len(files) != 1 else ''}: {names}{more}"


def _check_format(file: Path) -> None:
    """Refuse what would be read as text but is not: ``.json``, compressed and binary formats."""
    suffix = file.suffix.lower()
    if suffix == ".json":
        jsonl = file.with_suffix(".jsonl")
        raise UsageError(
            f"data.path: {file} is a .json file, which titan does not read; titan reads .txt (plain "
            'text, each file one document) and .jsonl (one JSON object {"text": "..."} per line): '
            f"a file of JSON lines only needs renaming to {jsonl}, and a JSON array of such objects "
            f"converts with jq -c '.[]' {file} > {jsonl}"
        )
    kind = _BINARY_SUFFIXES.get(suffix)
    if kind is None:
        try:
            with file.open("rb") as f:
                head = f.read(265)
                tail = b""
                if head.startswith(b"PAR1"):
                    f.seek(-4, 2)
                    tail = f.read(4)
        except OSError as exc:
            raise UsageError(f"data.path: cannot read {file}: {exc.strerror or exc}") from None
        kind = next((k for magic, k in _MAGIC if head.startswith(magic)), None)
        if kind is None and _BZIP2.match(head):
            kind = "bzip2-compressed"
        if kind is None and tail == b"PAR1":
            kind = "Parquet data"
        # The tar magic with its NUL (POSIX "ustar\0", GNU "ustar  \0"): "ustar" alone is text
        # ("mustard" at that offset).
        if kind is None and (head[257:263] == b"ustar\x00" or head[257:265] == b"ustar  \x00"):
            kind = "a tar archive"
        if kind is None:
            _refuse_wide_text(file, head)
    if kind is not None:
        raise UsageError(
            f"data.path: {file} is {kind}, which titan does not read as text; decompress or convert it "
            'to .jsonl (one {"text": ...} object per line) or .txt (plain text, each file one document)'
        )


#: Byte-order marks of the Unicode encodings other than UTF-8 (UTF-32's first: its little-endian
#: mark starts with UTF-16's).
_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def _refuse_wide_text(file: Path, head: bytes) -> None:
    """Refuse UTF-16/UTF-32 text (what Windows tools write), named as such. Decoded as UTF-8, a
    file with a byte-order mark failed at byte 1 with advice (``iconv -f latin1``) that turns it
    into valid mojibake, and one without a mark decoded: a NUL after every ASCII letter, trained
    on silently. A NUL byte is never in UTF-8 text (nor raw in a JSON line)."""
    encoding = next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)
    if encoding is not None:
        raise UsageError(
            f"data.path: {file} is {encoding} text (it starts with a {encoding} byte-order mark); titan "
            f"reads text files as UTF-8: convert it (e.g. iconv -f {encoding.lower()} -t utf-8)"
        )
    nul = head.find(b"\x00")
    if nul >= 0:
        order = "le" if nul % 2 else "be"  # ASCII in UTF-16LE is "h\0", in UTF-16BE "\0h"
        raise UsageError(
            f"data.path: {file} is UTF-16 or UTF-32 text without a byte-order mark, or binary data: it "
            f"holds NUL bytes (the first at byte {nul + 1}), which UTF-8 text does not; titan reads text "
            f"files as UTF-8: convert it (e.g. iconv -f utf-16{order} -t utf-8)"
        )


def _log() -> Any:
    from titan_core.log import get_logger

    return get_logger("titan.data")


def _jsonl_texts(file: Path) -> Iterator[str]:
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            line = _decode(raw, file, number, bom=number == 1)
            if not line.strip():
                continue
            try:
                # Integers as floats: Python refuses to convert one of over 4300 digits (a
                # ValueError naming no line), and only 'text' is read (a number there is refused
                # below either way).
                record = json.loads(line, parse_int=float)
            except json.JSONDecodeError as exc:
                raise UsageError(
                    f"data.path: {file}:{number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line of a .jsonl file must be one JSON object with a 'text' string"
                ) from None
            except RecursionError:  # a bare traceback from inside the json module
                raise UsageError(
                    f"data.path: {file}:{number} is not valid JSON (nested deeper than Python's JSON "
                    f"reader allows, about {sys.getrecursionlimit()} levels); each line of a .jsonl "
                    "file must be one JSON object with a 'text' string"
                ) from None
            if not isinstance(record, dict) or "text" not in record:
                got = f"keys {', '.join(map(repr, list(record)[:5]))}" if record else "{}"
                if not isinstance(record, dict):
                    got = _json_type(record)
                raise UsageError(
                    f"data.path: {file}:{number} is not a JSON object with a 'text' field (got {got}); "
                    'each line must look like {"text": "..."}'
                )
            text = record["text"]
            if not isinstance(text, str):
                raise UsageError(
                    f"data.path: {file}:{number}: 'text' is {_json_type(text)}, not a string; store "
                    "the document's text as a JSON string"
                )
            if "\\ud" in line.lower() and not _encodable(text):
                raise UsageError(
                    f"data.path: {file}:{number}: 'text' holds an unpaired UTF-16 surrogate escape "
                    "(\\ud800-\\udfff), which is not text; fix the line's escapes"
                )
            yield text


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _decode(raw: bytes, file: Path, first_line: int, *, bom: bool = True) -> str:
    """``raw`` as UTF-8 (a leading byte-order mark dropped); else an error naming the line."""
    skipped = len(codecs.BOM_UTF8) if bom and raw.startswith(codecs.BOM_UTF8) else 0
    data = raw[skipped:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Positions in ``data``: the line starts ``skipped`` bytes before it (the mark's bytes
        # are the line's; decoded with "utf-8-sig", the error named the byte 3 before the bad one).
        _not_utf8(file, data, exc.start, first_line, -skipped)


def _not_utf8(file: Path, data: bytes, bad: int, line: int, line_start: int) -> NoReturn:
    """The error for the byte ``data[bad]``; ``data`` starts on line ``line``, which starts at
    ``data[line_start]`` (negative: in bytes read before ``data``)."""
    newline = data.rfind(b"\n", 0, bad)
    line += data.count(b"\n", 0, bad)
    column = bad - (newline + 1 if newline >= 0 else line_start) + 1
    raise UsageError(
        f"data.path: {file}:{line} is not UTF-8 (byte 0x{data[bad]:02x}, byte {column} of the "
        "line); titan reads text files as UTF-8: convert it (e.g. iconv -f latin1 -t utf-8)"
    )


#: Bytes read from a text file at a time. A ``.txt`` file (one document) is streamed: read whole,
#: it took twice its size in memory (its bytes and its text) on every data-parallel rank.
READ_BYTES = 1 << 20


class Continued(str):
    """A piece of a document that the next text yielded continues (the loader frames them once,
    as one document). :func:`read_text_files` yields a ``.txt`` file longer than
    :data:`PIECE_CHARS` characters as such pieces, cut where :func:`document_pieces` cuts the
    whole text, then its last piece as a plain ``str``; a dataset plugin may yield them too."""

    __slots__ = ()


def _text_blocks(file: Path) -> Iterator[str]:
    """The UTF-8 text of ``file`` (a leading byte-order mark dropped), :data:`READ_BYTES` at a
    time; a byte that is not UTF-8 is the error :func:`_decode` gives for the whole file. A read
    that ends inside a character leaves its first bytes for the next."""
    line, line_start = 1, 0  # the line at the start of ``data``, and where it starts (in data)
    pending = b""
    head = True
    with file.open("rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            data = pending + raw
            if head:
                if raw and len(data) < len(codecs.BOM_UTF8):
                    pending = data
                    continue
                head = False
                if data.startswith(codecs.BOM_UTF8):
                    data, line_start = data[len(codecs.BOM_UTF8) :], -len(codecs.BOM_UTF8)
            try:
                text, used = codecs.utf_8_decode(data, "strict", not raw)
            except UnicodeDecodeError as exc:
                _not_utf8(file, data, exc.start, line, line_start)
            newline = data.rfind(b"\n", 0, used)
            if newline >= 0:
                line += data.count(b"\n", 0, used)
                line_start = newline + 1
            line_start -= used
            pending = data[used:]
            if text:
                yield text
            if not raw:
                return


def _text_file_pieces(file: Path) -> Iterator[str]:
    """A text file as one document, streamed: its text in pieces cut exactly where
    :func:`document_pieces` cuts the whole text (each but the last a :class:`Continued`), so the
    tokens are those of the file read whole. A cut only needs the piece and the character after
    it: a piece is cut once more than :data:`PIECE_CHARS` characters are read, and the rest is
    the last piece. A file of only whitespace is one empty document (skipped, as read whole)."""
    size = PIECE_CHARS
    blocks = _text_blocks(file)
    held, dropped = "", False  # the text while it is only whitespace (not kept past a piece)
    for block in blocks:
        if not block.isspace():
            break
        if not dropped:
            held += block
            if len(held) > size:
                held, dropped = "", True
    else:
        yield held  # whitespace only (all of it, or "" where it was long): an empty document
        return
    if dropped:  # the whitespace it starts with was let go: read the file again from its start
        blocks.close()
        blocks, text = _text_blocks(file), ""
    else:
        text = held + block
    while True:
        while len(text) > size:
            cut = _line_start(text, 0, size) or _word_start(text, 0, size) or size
            yield Continued(text[:cut])
            text = text[cut:]
        block = next(blocks, None)
        if block is None:
            break
        text += block
    yield text


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    names[str] = "a string"
    return "null" if value is None else names.get(type(value), type(value).__name__)


@attrs.define
class PackedBatches:
    """Infinite iterator of ``(inputs, labels)`` LongTensors of shape ``(batch, seq_len)``."""

    #: Called once per epoch for a fresh iterable of documents.
    documents: Callable[[], Iterable[str]]
    tokenizer: Tokenizer
    seq_len: int
    batch_size: int
    dp_rank: int = 0
    dp_degree: int = 1
    seed: int = 0
    shuffle_buffer: int = 256
    #: The data in error messages, e.g. "data.dataset 'text' at data.path '/data/c4'".
    name: str = "the dataset"
    #: The setting named in a warning when a pass over the data runs out and it restarts: what
    #: asked for more batches than the data holds (``validation.steps``: every validation reads
    #: the same batches from the start, so a restart repeats batches within one validation).
    #: ``None``: the data restarts silently (training's corpus repeats, as documented).
    repeat_warning: str | None = None
    #: Batches one step reads (the microbatches of one global batch, under gradient
    #: accumulation), for the bound ``repeat_warning`` gives and the step a new pass starts at.
    batches_per_step: int = 1
    #: Batches each rank's share of one pass must fill, else the data is refused as too small:
    #: a training step's microbatches (fewer, every step would train on the same sequences, some
    #: twice). Validation needs one: a set of fewer batches than a validation step repeats them
    #: within it, which ``repeat_warning`` says.
    batches_needed: int = 1
    #: The steps the run trains (``None``: not a training stream). Set, the data running out
    #: before them is logged when the first batch of another pass is served (as torchtitan
    #: re-loops its training data, with a warning), not silently.
    steps: int | None = None
    _repeat_warned: bool = attrs.field(default=False, init=False, repr=False)
    _empty_noted: bool = attrs.field(default=False, init=False, repr=False)
    #: The pass over the data being read (1 the first), for errors.
    _pass: int = attrs.field(default=1, init=False, repr=False)

    def _sequences(self) -> Iterator[list[int] | None]:
        """This rank's sequences, pass after pass, with ``None`` after each pass's last one (the
        shuffle drains its pool there, so no pass mixes with the next)."""
        window = self.seq_len + 1
        epoch = 0
        first_pass = 0  # this rank's sequences of pass 1, for the error of an empty later pass
        # Sequence k of the whole stream, every pass in turn, goes to rank k % dp: counted over
        # the passes, not from 0 in each (a pass of an odd number of sequences handed rank 0 one
        # more per pass, so after the first wrap the ranks' global batch was not one process's).
        index = 0
        # Kept across passes: the tokens a pass ends with (fewer than one sequence) start the
        # next pass's first sequence, as torchtitan's HuggingFaceDataset keeps its token buffer
        # across a re-loop and Megatron's GPTDataset packs its epochs as one stream. Emptied at
        # each pass's start, the tail was dropped on every pass: the corpus's last document
        # (up to seq_len tokens) never trained whole, and every pass cut the very same windows,
        # so a step spanning a pass's end could train on one window twice (on two ranks or one).
        # A pass's sequences are those completed while it is read, the one across its start too.
        buffer: list[int] = []
        while True:
            produced = 0
            first_index = index
            self._pass = epoch + 1
            count = _Count()
            for tokens in self._encoded_chunks(count):
                buffer.extend(tokens)
                # Cut sequences at an offset and drop the consumed head once per chunk (slicing
                # the rest off after every sequence copied the whole buffer each time).
                start = 0
                while len(buffer) - start >= window:
                    if index % self.dp_degree == self.dp_rank:
                        produced += 1
                        yield buffer[start : start + window]
                    start += window
                    index += 1
                del buffer[:start]
            if epoch == 0:
                self._check_size(index - first_index, count)
                self._note_empty(count)
                if self.repeat_warning and not self._repeat_warned:
                    self._warn_repeat(produced)
                first_pass = produced
            elif produced == 0:  # a later pass yields nothing: the documents changed under us
                # Named before the count moves on (it named the pass after the empty one).
                raise UsageError(
                    f"data: {self.name} yielded no sequence on pass {epoch + 1} over the data (pass 1 "
                    f"gave {first_pass}): its documents changed while the run read them (files removed "
                    "under the job), or a dataset plugin's documents(data) returned one shared "
                    "iterator, spent by pass 1: it must return a new iterable on each call (a "
                    "generator function's generator, a list)"
                )
            epoch += 1
            yield None  # the pass ended

    def _note_empty(self, count: _Count) -> None:
        """Once per loader (on data-parallel rank 0: every rank reads the same stream): how many
        documents of the first pass were skipped as empty."""
        if not count.empty or self._empty_noted or self.dp_rank != 0:
            return
        self._empty_noted = True
        many = count.empty != 1
        _log().warning(
            f"{self.name}: skipped {count.empty} empty document{'s' if many else ''} of "
            f'{count.documents} in one pass (no text but whitespace: a {{"text": ""}} line, '
            f"an empty file); {'they add' if many else 'it adds'} nothing to the data, no BOS/EOS "
            "alone. Remove them from the data to silence this",
            empty_documents=count.empty,
            documents=count.documents,
        )

    def _encoded_chunks(self, count: _Count) -> Iterator[list[int]]:
        """One pass's token stream, a chunk of documents at a time: each document's tokens
        framed by BOS and EOS (those the tokenizer has). A document without tokens (an empty
        text, or only what the tokenizer drops) is left out, framing too: BOS EOS alone made a
        two-token document of nothing that the model trained on and the document mask kept
        (Megatron's preprocessing drops such documents; torchtitan kept the lone pair).
        ``count`` adds up the tokens, documents and empty ones as they come."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        opened = False  # whether the current document's BOS is out (its first tokens came)
        for chunk in _chunks(self._segments(), 128, 8 * PIECE_CHARS):
            encoded = self._encode(chunk, count.documents)
            out: list[int] = []
            for (_, first, last), ids in zip(chunk, encoded, strict=True):
                if first:
                    count.documents += 1
                    opened = False
                # A long document comes in pieces (possibly across chunks): framed once, by its
                # first piece with tokens and its last piece.
                if ids and not opened:
                    opened = True
                    if bos is not None:
                        out.append(bos)
                out.extend(ids)
                if last:
                    if not opened:
                        count.empty += 1
                    elif eos is not None:
                        out.append(eos)
            count.tokens += len(out)
            yield out

    def check_one_step(self) -> None:
        """Refuse data that cannot fill one step, reading only until it could.

        Called when the run is built, before the model: the end of the first pass (where
        :meth:`_check_size` sees it otherwise) is only reached by step 1, after the model was
        built and, on a GPU, compiled. Every rank reads the whole stream's start and counts the
        stream's sequences, not its own, so all ranks agree. Tokenizes one global batch's tokens
        at most (a large corpus is not read whole here).
        """
        needed = self.dp_degree * self.batch_size * self.batches_needed * (self.seq_len + 1)
        self._pass = 1
        count = _Count()
        for _ in self._encoded_chunks(count):
            if count.tokens >= needed:  # sequences are cut across documents: tokens decide
                return
        self._check_size(count.tokens // (self.seq_len + 1), count)

    def _encode(self, chunk: list[tuple[str, bool, bool]], started: int) -> list[list[int]]:
        """The chunk's token ids; a tokenizer failing on a text is one error naming the document
        (an exception of the tokenizers library was a bare traceback from the training step)."""
        texts = [text for text, _, _ in chunk]
        try:
            return self.tokenizer.encode_batch(texts)
        except Exception as first_exc:
            exc: Exception = first_exc
            document = started
            for text, first, _ in chunk:  # find the failing document (only on an error)
                document += first
                if not _encodable(text):
                    # Not the tokenizer's fault: a str no text file decodes to (a dataset plugin
                    # decoding bytes with surrogateescape, a JSON \ud800 escape it let through).
                    bad = next(c for c in text if "\ud800" <= c <= "\udfff")
                    raise PluginError(
                        f"{self.name} yielded document {max(document, 1)} (pass {self._pass}) holding "
                        f"an unpaired surrogate (U+{ord(bad):04X}), which is not text: "
                        f"{preview(text)}; a Dataset's documents(data) must yield valid Unicode "
                        "text: decode bytes with errors='replace' (not 'surrogateescape') and "
                        "refuse or repair unpaired \\ud800-\\udfff escapes"
                    ) from None
                try:
                    self.tokenizer.encode_batch([text])
                except Exception as piece_exc:
                    exc = piece_exc
                    break
            file = repr(self.tokenizer.file) if self.tokenizer.file else "the tokenizer"
            raise UsageError(
                f"data.tokenizer_path: {file} cannot encode document {max(document, 1)} of pass "
                f"{self._pass} of {self.name} ({exc}); give a tokenizer.json that encodes any text "
                "(byte-level BPE, or one whose unknown token is in its vocabulary)"
            ) from None

    def _segments(self) -> Iterator[tuple[str, bool, bool]]:
        """``(text, starts a document, ends it)`` for each document of a pass, a long one in
        pieces (:func:`document_pieces`): tokenized whole, a document takes about 120 times its
        size in memory (a 14 MB text file took 1.7 GB), so one large file could exhaust the host.
        A document given in pieces already (:class:`Continued`, a streamed ``.txt`` file) is one
        document: its pieces are framed once."""
        starts = True  # whether the next text starts a document (the last one was not Continued)
        for document in read_documents(self.documents, self.name, self._pass):
            if not isinstance(document, str):
                raise PluginError(
                    f"{self.name} yielded {type(document).__name__} {preview(document)} where a document "
                    "was expected: a Dataset's documents(data) must yield each document's text as a str"
                )
            more = isinstance(document, Continued)
            if starts and not more and (not document or document.isspace()):
                # No text but whitespace (an empty file, an editor's lone newline): an empty
                # document, skipped (:meth:`_encoded_chunks`), not BOS "\n" EOS as data.
                yield "", True, True
                continue
            pieces = document_pieces(document, PIECE_CHARS)
            if (len(pieces) > 1 or more or not starts) and not self.tokenizer.cuts_exact:
                _warn_inexact_cuts()
            for i, piece in enumerate(pieces):
                yield piece, starts and i == 0, not more and i == len(pieces) - 1
            starts = not more

    def _check_size(self, sequences: int, count: _Count) -> None:
        """One pass over the data must fill one step: every rank, ``batch_size`` rows for each of
        the ``batches_needed`` microbatches of a step.

        Otherwise every step would repeat the same few documents (or a rank would get none), a
        run that trains on almost nothing without saying so.
        """
        window = self.seq_len + 1
        per = self.batches_needed
        needed = self.dp_degree * self.batch_size * per
        if sequences >= needed:
            return
        if count.documents == 0:
            held = "no documents"
        else:
            held = f"{count.documents} document{'s' if count.documents != 1 else ''}"
            if count.empty == count.documents:
                held += ", empty" if count.documents == 1 else ", all empty"
            elif count.empty:
                held += f", {count.empty} of them empty"
        accumulated = f" x {per} microbatches (training.global_batch_size={needed})" if per > 1 else ""
        # A validation step of several microbatches needs only one (repeat_warning covers more).
        unit = "step" if per == self.batches_per_step else "batch"
        raise UsageError(
            f"data: {self.name} is too small for one {unit}: one pass gives {count.tokens} tokens "
            f"({held}), and one {unit} needs {needed * window} tokens ({self.dp_degree} data-parallel "
            f"rank(s) x training.local_batch_size={self.batch_size}{accumulated} x (training.seq_len="
            f"{self.seq_len} + 1)); add documents, or lower training.seq_len or "
            + ("training.global_batch_size" if per > 1 else "training.local_batch_size")
        )

    def _warn_repeat(self, sequences: int) -> None:
        """Once: one pass was not enough for what the consumer asked (only reached when it asks
        for a sequence after the pass's last, so a request that fits the data never warns)."""
        self._repeat_warned = True
        batches = sequences // self.batch_size
        per = self.batches_per_step
        fits = batches // per
        bound = (
            f"Lower {self.repeat_warning} to at most {fits}, or add documents" if fits else "Add documents"
        )
        _log().warning(
            f"{self.repeat_warning} asks for more batches than {self.name} holds: one pass gives "
            f"{sequences} sequences of training.seq_len={self.seq_len} + 1 tokens"
            + (f" on data-parallel rank {self.dp_rank}" if self.dp_degree > 1 else "")
            + f", {batches} distinct batch{'es' if batches != 1 else ''} of "
            f"training.local_batch_size={self.batch_size}"
            + (f" ({per} per step, one global batch)" if per > 1 else "")
            + f"; the batches after those read its documents again, so they count more than once. {bound}",
            distinct_batches=batches,
        )

    def __iter__(self) -> Iterator[tuple[object, object]]:
        import torch

        rng = random.Random(f"{self.seed}:{self.dp_rank}")
        pool: list[list[int]] = []
        batch: list[list[int]] = []
        current = 1  # the pass the pool's sequences are of (it is drained at each pass's end)
        served_pass = 1  # the latest pass a served row was of
        served = 0  # rows served (this rank), for the step a pass starts at
        batches = 0
        for seq in self._sequences():
            if seq is None:
                # A pass ended: serve what the pool holds (in random order) before the next pass
                # refills it. A pool kept across the end (a buffer larger than a pass, or the
                # last ones of a pass) mixed two passes: one "pass" served some sequences twice
                # and others not at all. Each pass is thus a shuffle of its own sequences, every
                # one once; a buffer of a pass or more shuffles the whole pass.
                taken = [pool.pop(rng.randrange(len(pool))) for _ in range(len(pool))]
                row_pass, current = current, current + 1
            else:
                pool.append(seq)
                if len(pool) < self.shuffle_buffer:
                    continue
                taken = [pool.pop(rng.randrange(len(pool)) if self.shuffle_buffer else 0)]
                row_pass = current
            for row in taken:
                if row_pass > served_pass:
                    # Noted where the row is served, not where the pass is read: the shuffle
                    # buffer reads up to shuffle_buffer sequences ahead of what is served.
                    self._note_new_pass(row_pass, served, batches)
                    served_pass = row_pass
                batch.append(row)
                served += 1
                if len(batch) == self.batch_size:
                    data = torch.tensor(batch, dtype=torch.long)
                    batches += 1
                    yield data[:, :-1], data[:, 1:]
                    batch = []

    def _note_new_pass(self, pass_: int, served: int, batches: int) -> None:
        """Log that the training data ran out and is read again (``pass_``, from batch
        ``batches``): once as a warning (the steps from there train on documents already seen),
        then each later pass as info. Silent when the run ends before it: a prefetched batch the
        run never trains on changes nothing."""
        per = self.batches_per_step
        if self.steps is None or batches >= self.steps * per:
            return
        step = batches // per + 1
        if pass_ > 2:
            _log().info(f"{self.name}: pass {pass_} over the data starts at step {step}", data_pass=pass_)
            return
        fits = served // (self.batch_size * per)  # the steps one pass fills on this rank
        rank = f" on data-parallel rank {self.dp_rank}" if self.dp_degree > 1 else ""
        _log().warning(
            f"{self.name} runs out before the run's {self.steps} steps: one pass gives {served} "
            f"sequences of training.seq_len={self.seq_len} + 1 tokens{rank}, {fits} step"
            f"{'s' if fits != 1 else ''} of training.local_batch_size={self.batch_size}"
            + (f" x {per} microbatches" if per > 1 else "")
            + f"; titan reads the data again, reshuffled (as torchtitan re-loops its training "
            f"data): pass 2 starts at step {step}, so the steps from there train on documents "
            f"already seen ({self.steps * per * self.batch_size / served:.1f} passes in all). To "
            f"train on each document once, add documents or lower training.steps to at most {fits}",
            data_pass=pass_,
            first_step_of_pass=step,
        )


@attrs.define
class _Count:
    """What a pass has read so far: tokens (BOS/EOS framing included; none for an empty
    document, which is skipped), documents, empty ones."""

    tokens: int = 0
    documents: int = 0
    empty: int = 0


def read_documents(documents: Callable[[], Iterable[str]], name: str, pass_: int = 1) -> Iterator[str]:
    """The documents ``documents()`` gives (a dataset plugin's, once per pass), its exceptions
    other than a :class:`TitanError` (the plugin's own clean error) one :class:`PluginError`
    naming the data, the document and the pass, chained to the original. Raised deep in a
    stream (a network shard, a bad record of pass 2), the plugin's exception came out of the
    training step as a bare traceback, attributed to the forward/backward, and from the
    prefetch thread as well."""
    count = 0
    try:
        source = documents()
        if not isinstance(source, Iterable) and not hasattr(type(source), "__getitem__"):
            # Iterated, it is a TypeError at this file's line: the loader blamed, not the plugin
            # (``__getitem__`` alone is Python's older iteration protocol, still iterable).
            got = "None" if source is None else f"{type(source).__name__} {preview(source)}"
            raise PluginError(
                f"{name} returned {got} where an iterable of documents was expected: a Dataset's "
                "documents(data) and held_out(data) return (or yield) the documents' texts, e.g. "
                "a list of str or a generator"
            )
        for document in source:
            yield document
            count += not isinstance(document, Continued)  # a document's pieces are one document
    except TitanError:
        raise
    except Exception as exc:
        raise PluginError(
            f"{name} failed reading document {count + 1} of pass {pass_} over the data: {describe(exc)}"
        ) from exc


def preview(value: object) -> str:
    """A value's repr, cut to 60 characters (a document may be large)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_NOTHING: object = object()


def same_start(documents: Iterable[str], first: object, label: str) -> Iterator[str]:
    """``documents``, refused unless they start with ``first`` (the build's first read).

    Each pass over the data and every validation read the dataset from the start. A dataset that
    returns one shared iterator (each read goes on where the last stopped) or another order on
    each call trained without the document the build read, and gave every validation other
    text, without a word.
    """
    iterator = iter(documents)
    head = next(iterator, _NOTHING)
    if head != first:
        got = "no document" if head is _NOTHING else preview(head)
        raise PluginError(
            f"{label} gave another first document on a later read ({got}) than on the first "
            f"({preview(first)}): each pass over the data and every validation read it from the "
            "start, so a dataset must yield the same documents in the same order on every call: a "
            "plugin's Dataset.documents / held_out returns a new generator or list each time (not "
            "one shared iterator) in a fixed order, and data files must not change during the run"
        )
    yield head  # type: ignore[misc]
    yield from iterator


def _chunks(
    segments: Iterable[tuple[str, bool, bool]], size: int, chars: int
) -> Iterator[list[tuple[str, bool, bool]]]:
    """Lists of at most ``size`` segments and, past the first, ``chars`` characters: the texts
    one ``encode_batch`` call tokenizes (in parallel), their tokens in memory at once."""
    chunk: list[tuple[str, bool, bool]] = []
    held = 0
    for segment in segments:
        if chunk and held + len(segment[0]) > chars:
            yield chunk
            chunk, held = [], 0
        chunk.append(segment)
        held += len(segment[0])
        if len(chunk) == size:
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


#: The longest text tokenized in one piece (characters); longer documents are cut.
PIECE_CHARS = 1 << 18


def document_pieces(text: str, size: int) -> list[str]:
    """``text`` in pieces of at most ``size`` characters that join back to it, each cut at the
    start of a line (after the newlines, before a non-space character), else before a space
    between two words, where byte-level BPE pre-tokenizers (GPT-2's, Llama 3's) split too, so the
    pieces' tokens are the whole text's (:attr:`Tokenizer.cuts_exact`). A stretch of ``size``
    characters with neither (no spaces or line breaks) is cut where it ends."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = _line_start(text, start, end) or _word_start(text, start, end) or end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _line_start(text: str, start: int, end: int) -> int:
    """The last position in ``(start, end]`` after a newline and at a non-space character; 0: none."""
    newline = text.rfind("\n", start, end)
    while newline >= start:
        if not text[newline + 1].isspace():
            return newline + 1
        newline = text.rfind("\n", start, newline)
    return 0


def _word_start(text: str, start: int, end: int) -> int:
    """The last position in ``(start, end)`` of a space between two non-space characters; 0: none."""
    space = text.rfind(" ", start + 1, end)
    while space > start:
        if not text[space - 1].isspace() and not text[space + 1].isspace():
            return space
        space = text.rfind(" ", start + 1, space)
    return 0


#: Whether the inexact-cuts warning was given (once per process).
_warned_inexact_cuts = False


def _warn_inexact_cuts() -> None:
    global _warned_inexact_cuts
    if _warned_inexact_cuts:
        return
    _warned_inexact_cuts = True
    _log().warning(
        f"a document longer than {PIECE_CHARS} characters is tokenized in pieces cut at line starts "
        "(tokenized whole, it would take about 120 times its size in memory), and this tokenizer marks "
        "the start of every input (e.g. SentencePiece's Metaspace), so the tokens at each cut can "
        "differ from the whole document's: about one token per cut. Split such files into documents "
        "(one .txt file or .jsonl line each) to avoid the cuts"
    )
