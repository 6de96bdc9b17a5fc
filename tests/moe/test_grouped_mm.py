"""Grouped GEMM experts against the per-expert loop on CPU, forward and backward.

torch's CPU grouped GEMM runs one matmul per group as the loop does; the results are equal up to
float32 rounding (most shapes bitwise, a few differ in the last bits: the backward's matmuls
accumulate in another order), so the checks allow 4 ulps of the largest value and no more.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from titan_plugins_moe.flavors import FLAVORS
from titan_plugins_moe.grouped_mm import grouped_mm_function, swiglu_grouped_mm, swiglu_loop, use_grouped_mm
from titan_plugins_moe.model import MoETransformer


def assert_equal_to_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    ulps = 4 * torch.finfo(expected.dtype).eps * expected.abs().max()
    assert (actual - expected).abs().max() <= ulps, (actual - expected).abs().max()


needs_grouped_mm = pytest.mark.skipif(grouped_mm_function() is None, reason="this torch has no grouped GEMM")


def _operands(counts: list[int], dim: int = 16, hidden: int = 24, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    experts = len(counts)
    x = torch.randn(sum(counts), dim, generator=g)
    w1 = torch.randn(experts, hidden, dim, generator=g)
    w2 = torch.randn(experts, dim, hidden, generator=g)
    w3 = torch.randn(experts, hidden, dim, generator=g)
    return x, torch.tensor(counts), w1, w2, w3


@needs_grouped_mm
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7, 0], [2, 2, 2, 2], [0, 0, 0, 0]])
def test_grouped_mm_equals_the_loop_exactly(counts: list[int]) -> None:
    x, n, w1, w2, w3 = _operands(counts)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    loop = swiglu_loop(leaves[0], n, *leaves[1:])
    grouped_leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    grouped = swiglu_grouped_mm(grouped_leaves[0], n, *grouped_leaves[1:])
    assert grouped.shape == (sum(counts), x.shape[1])
    assert_equal_to_rounding(grouped, loop)
    upstream = torch.randn_like(loop)
    (loop * upstream).sum().backward()
    (grouped * upstream).sum().backward()
    for a, b in zip(leaves, grouped_leaves, strict=True):
        assert_equal_to_rounding(b.grad, a.grad)
    # An expert without tokens gets a zero gradient, not garbage.
    for e, c in enumerate(counts):
        if c == 0:
            assert not grouped_leaves[1].grad[e].any()


@needs_grouped_mm
def test_grouped_mm_computes_in_the_autocast_dtype_on_cpu_too() -> None:
    """Under CPU bf16 autocast the loop's matmuls run in bf16; the grouped path must too (it
    computed in fp32, so a forced ``experts_impl = "grouped_mm"`` trained another model)."""
    x, n, w1, w2, w3 = _operands([3, 0, 5, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loop = swiglu_loop(x, n, w1, w2, w3)
        grouped = swiglu_grouped_mm(x, n, w1, w2, w3)
    assert loop.dtype == grouped.dtype == torch.bfloat16
    assert_equal_to_rounding(grouped, loop)
    full = swiglu_loop(x, n, w1, w2, w3)  # fp32: the products differ from bf16 ones
    assert (grouped.float() - full).abs().max() > 1e-3


@needs_grouped_mm
def test_model_with_grouped_experts_trains_like_the_loop() -> None:
    args = attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], dim=64, n_heads=4, vocab_size=128)
    losses = {}
    for impl in ("loop", "grouped_mm"):
        with torch.device("meta"):
            model = MoETransformer(attrs.evolve(args, experts_impl=impl))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        losses[impl] = (loss.detach(), model.layers["2"].feed_forward.experts.w1.grad.clone())
    assert_equal_to_rounding(losses["grouped_mm"][0], losses["loop"][0])
    assert_equal_to_rounding(losses["grouped_mm"][1], losses["loop"][1])


def test_auto_uses_the_loop_off_cuda() -> None:
    x, _, w1, w2, _ = _operands([1, 1])
    assert not use_grouped_mm(x, w1, w2)
    assert not use_grouped_mm(x.bfloat16(), w1.bfloat16(), w2.bfloat16())


def test_the_loop_in_a_compiled_block_does_not_recompile_for_new_counts() -> None:
    """The loop reads the counts on the host: compiled, every new pattern of counts (an expert
    with 0 or 1 tokens, other splits) was a new graph, until dynamo's recompile limit sent the
    block back to eager. It runs eagerly inside the compiled caller instead."""
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    def block(
        x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
    ) -> object:
        return 2 * swiglu_loop(torch.tanh(x), counts, w1, w2, w3) + 1

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    patterns = [[3, 2, 2, 1], [0, 4, 4, 0], [1, 1, 1, 5], [8, 0, 0, 0], [2, 3, 1, 2], [0, 1, 0, 7]]
    after_first = None
    for counts in patterns:
        x, n, w1, w2, w3 = _operands(counts)
        torch.testing.assert_close(compiled(x, n, w1, w2, w3), block(x, n, w1, w2, w3))
        after_first = len(graphs) if after_first is None else after_first
    assert len(graphs) == after_first, f"{len(graphs) - after_first} recompilations for new counts"
