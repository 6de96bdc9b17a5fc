"""Regenerate the shipped tokenizer: ``python -m titan_core.data.make_tokenizer``.

A byte-level BPE of 2048 tokens (the Llama 3 debug model's vocabulary) trained on the generated
corpus, with Llama 3's special tokens. The result is committed as ``assets/tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path

ASSET = Path(__file__).with_name("assets") / "tokenizer.json"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def train_tokenizer(vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_core.data.corpus import documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(2000, seed=99), trainer=trainer)
    return tokenizer


if __name__ == "__main__":
    train_tokenizer().save(str(ASSET))
    print(f"wrote {ASSET}")
