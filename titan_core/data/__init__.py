"""Offline text data: a generated corpus, a shipped tokenizer, and a packing data loader."""
