"""Llama 3: parameter counts on meta, shapes, RoPE scaling, GQA, causality, init."""

from __future__ import annotations

import attrs
import pytest
import torch

from titan_plugins_llama3.flavors import FLAVORS, Llama3Args, flops_per_token, num_params
from titan_plugins_llama3.model import Llama3, rope_frequencies

TINY = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)


@pytest.mark.parametrize(("flavor", "billions"), [("8B", 8.03), ("70B", 70.55), ("405B", 405.85)])
def test_published_sizes_on_meta(flavor: str, billions: float) -> None:
    with torch.device("meta"):
        model = Llama3(FLAVORS[flavor] if flavor == "8B" else attrs.evolve(FLAVORS[flavor], n_layers=2))
    counted = sum(p.numel() for p in model.parameters())
    if flavor == "8B":
        assert abs(counted / 1e9 - 8.03) / 8.03 < 0.005
        assert all(p.device.type == "meta" for p in model.parameters())
    # The analytic count matches the built module, for every flavor (2 layers for the big ones).
    assert counted == num_params(attrs.evolve(FLAVORS[flavor], n_layers=len(model.layers)))
    assert abs(num_params(FLAVORS[flavor]) / 1e9 - billions) / billions < 0.005


def test_debugmodel_hyper_parameters() -> None:
    args = FLAVORS["debugmodel"]
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (256, 6, 16, 2048)


def test_flops_per_token_formula() -> None:
    args = FLAVORS["8B"]
    non_embedding = num_params(args, include_embedding=False)
    assert flops_per_token(args, 8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192


def test_a_tied_output_projection_still_costs_its_flops() -> None:
    """Tying shares the weight, not the matmul: the output projection runs either way."""
    args = FLAVORS["debugmodel"]
    tied = attrs.evolve(args, tie_embeddings=True)
    assert num_params(tied) == num_params(args) - args.vocab_size * args.dim
    assert flops_per_token(tied, 2048) == flops_per_token(args, 2048)


def build_tiny(seed: int = 0) -> Llama3:
    with torch.device("meta"):
        model = Llama3(TINY)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_forward_shapes_and_causality() -> None:
    model = build_tiny()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, TINY.vocab_size)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size
    # Positions before the change see the same prefix: identical logits.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_positions_argument_matches_default_positions() -> None:
    model = build_tiny()
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    torch.testing.assert_close(model(tokens, positions=torch.arange(12)), model(tokens))


def test_init_is_seeded_and_not_empty() -> None:
    a, b, c = build_tiny(1), build_tiny(1), build_tiny(2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    assert a.freqs_cis.device.type == "cpu" and a.freqs_cis.shape == (64, 8)


def test_rope_scaling_slows_low_frequencies_only() -> None:
    base = attrs.evolve(FLAVORS["8B"], rope_scaling=False)
    plain = rope_frequencies(base, 2).angle()[1]
    scaled = rope_frequencies(FLAVORS["8B"], 2).angle()[1]
    torch.testing.assert_close(scaled[:4], plain[:4])  # high frequencies unchanged
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)  # lowest frequencies divided by 8


def test_grouped_query_attention_shapes() -> None:
    model = build_tiny()
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (64, 64)
    assert attention.wk.weight.shape == (32, 64)  # 2 KV heads of 16


def test_model_learns_on_repeated_batch() -> None:
    model = build_tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17))
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_tied_embeddings_are_one_parameter_initialised_once() -> None:
    args = attrs.evolve(TINY, tie_embeddings=True)
    model = Llama3(args)
    assert model.output.weight is model.tok_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names  # deduplicated
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    # Initialised as the output projection (std dim**-0.5), not as an embedding (std 1).
    assert abs(model.tok_embeddings.weight.std().item() - TINY.dim**-0.5) < 0.2 * TINY.dim**-0.5
    logits = model(torch.randint(0, TINY.vocab_size, (1, 8)))
    assert logits.std() < 3.0


def test_untied_output_keeps_its_own_init() -> None:
    model = build_tiny()
    assert model.output.weight is not model.tok_embeddings.weight
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.1
    assert abs(model.output.weight.std().item() - TINY.dim**-0.5) < 0.2 * TINY.dim**-0.5


@pytest.mark.parametrize(
    ("saved", "now", "same"),
    [
        ({}, {"n_kv_heads": 16}, True),  # debugmodel: 16 heads, n_kv_heads None is 16
        ({"n_kv_heads": 16}, {}, True),
        ({}, {"n_kv_heads": 8}, False),
    ],
)
def test_a_resume_compares_the_arguments_as_the_model_reads_them(saved: dict, now: dict, same: bool) -> None:
    from titan_core._registry import get_registry
    from titan_core.resume import model_changes

    spec = get_registry().get("models", "llama3", what="model")
    changes = model_changes(
        spec,
        {"name": "llama3", "flavor": "debugmodel", "overrides": saved},
        {"name": "llama3", "flavor": "debugmodel", "overrides": now},
    )
    assert (changes == []) is same, changes
