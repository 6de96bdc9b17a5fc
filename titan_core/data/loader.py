"""Tokenizer loading and the packed language-modelling data loader.

Documents are tokenized in order, framed by BOS/EOS, concatenated and cut into sequences of
``seq_len + 1`` tokens (inputs and labels shifted by one). Sequence ``k`` belongs to data-parallel
rank ``k % dp_degree``; each rank shuffles its sequences through a buffer seeded by
``(seed, dp_rank)``, so the order depends only on the seed and the DP rank. The corpus repeats
(with a new shuffle) when it runs out.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs

from titan_core.errors import UsageError

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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(path: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    file = Path(path) if path else BUNDLED_TOKENIZER
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

    def first(names: tuple[str, ...]) -> int | None:
        return next((vocab[n] for n in names if n in vocab), None)

    return Tokenizer(backend, backend.get_vocab_size(with_added_tokens=True), first(_BOS), first(_EOS))


def read_text_files(path: str | None) -> Iterator[str]:
    """Documents of local files: a ``.jsonl`` line's ``text`` field, or a whole ``.txt`` file."""
    if not path:
        raise UsageError("data.path: the 'text' dataset needs a file or folder of .jsonl/.txt files")
    root = Path(path)
    if not root.exists():
        raise UsageError(f"data.path: {path!r} does not exist")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".txt")) if root.is_dir() else [root]
    if not files:
        raise UsageError(f"data.path: no .jsonl or .txt files under {path!r}")
    for file in files:
        if file.suffix != ".jsonl":
            yield file.read_text(encoding="utf-8")
            continue
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UsageError(
                        f"data.path: {file}:{number} is not a JSON object with a 'text' field"
                    ) from None
                yield text


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

    def _sequences(self) -> Iterator[list[int]]:
        window = self.seq_len + 1
        epoch = 0
        while True:
            produced = 0
            buffer: list[int] = []
            index = 0
            for chunk in _chunks(self.documents(), 128):
                for ids in self.tokenizer.encode_batch(chunk):
                    if self.tokenizer.bos_id is not None:
                        buffer.append(self.tokenizer.bos_id)
                    buffer.extend(ids)
                    if self.tokenizer.eos_id is not None:
                        buffer.append(self.tokenizer.eos_id)
                while len(buffer) >= window:
                    if index % self.dp_degree == self.dp_rank:
                        produced += 1
                        yield buffer[:window]
                    buffer = buffer[window:]
                    index += 1
            epoch += 1
            if produced == 0:
                raise UsageError(
                    f"the dataset is too small: fewer than {self.dp_degree} sequences of "
                    f"{window} tokens; add data or lower training.seq_len"
                )

    def __iter__(self) -> Iterator[tuple[object, object]]:
        import torch

        rng = random.Random(f"{self.seed}:{self.dp_rank}")
        pool: list[list[int]] = []
        batch: list[list[int]] = []
        for seq in self._sequences():
            pool.append(seq)
            if len(pool) < self.shuffle_buffer:
                continue
            batch.append(pool.pop(rng.randrange(len(pool)) if self.shuffle_buffer else 0))
            if len(batch) == self.batch_size:
                data = torch.tensor(batch, dtype=torch.long)
                yield data[:, :-1], data[:, 1:]
                batch = []


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
