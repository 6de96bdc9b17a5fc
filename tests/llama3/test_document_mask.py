"""Llama 3 with document masking: packed documents give exactly the logits of each document run
alone; grouped-query attention without K/V copies equals the expanded-heads path."""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch

from titan_core import blocks
from titan_core.errors import UsageError
from titan_plugins_llama3.flavors import Llama3Args
from titan_plugins_llama3.model import Llama3

BOS = 1
TINY = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64)


def _build(args: Llama3Args, seed: int = 0) -> Llama3:
    with torch.device("meta"):
        model = Llama3(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _packed() -> torch.Tensor:
    """Two rows framed as the data loader frames them: BOS doc EOS BOS doc EOS ... (EOS = 2)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ((5, 9, 1, 13), (28,)):
        row = [int(t) for t in torch.randint(3, 64, (4,), generator=g)]  # tail of a cut document
        for n in lengths:
            row += [BOS, *(int(t) for t in torch.randint(3, 64, (n,), generator=g)), 2]
        rows.append(row[:32] + [2] * (32 - len(row[:32])))
    return torch.tensor(rows)


def test_packed_documents_match_each_document_run_alone() -> None:
    masked = _build(attrs.evolve(TINY, document_mask=True, bos_id=BOS))
    plain = _build(TINY)  # same seed: the same weights
    tokens = _packed()
    logits = masked(tokens)
    causal = plain(tokens)
    differs = False
    for b in range(tokens.shape[0]):
        starts = [0, *(i for i in range(1, 32) if tokens[b, i] == BOS), 32]
        for s, e in itertools.pairwise(starts):
            alone = plain(tokens[b : b + 1, s:e])[0]  # positions from 0: RoPE is relative
            torch.testing.assert_close(logits[b, s:e], alone, atol=1e-5, rtol=1e-5)
            differs |= s > 0 and not torch.allclose(causal[b, s:e], alone, atol=1e-3)
    assert differs  # without the mask later documents see earlier ones


def test_document_mask_gradients_stay_within_documents() -> None:
    model = _build(TINY)
    tokens = _packed()[:1]
    h = model.tok_embeddings(tokens).detach().requires_grad_(True)
    out, mask = h, blocks.document_mask(tokens, BOS)
    for block in model.layers.values():
        out = block(out, model.freqs_cis, mask)
    second_doc = [i for i in range(32) if tokens[0, i] == BOS][1]
    out[0, second_doc + 2].sum().backward()
    assert h.grad[0, :second_doc].abs().max() == 0  # nothing flows to the earlier documents
    assert h.grad[0, second_doc : second_doc + 3].abs().max() > 0


def test_grouped_kv_without_copies_equals_expanded_heads_in_the_model() -> None:
    model = _build(TINY)
    tokens = _packed()
    fast = model(tokens)
    for block in model.layers.values():
        # A function without `grouped_kv`: the module expands K/V before calling it.
        block.attention.attention_fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )
    torch.testing.assert_close(model(tokens), fast)


def test_document_mask_without_a_bos_id_is_one_clear_error() -> None:
    with pytest.raises(UsageError, match=r"^model.overrides.bos_id: document_mask=True needs"):
        Llama3(attrs.evolve(TINY, document_mask=True))
