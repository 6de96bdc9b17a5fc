"""titan_core.blocks: grouped-query attention without K/V copies, the attention-function contract,
document (block-causal) masks against per-document attention, RoPE and SwiGLU."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_same_forward_backward, saved_storage_bytes
from titan_core import blocks

BOS = 0


def _qkv(batch: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 24, hd: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, hd, generator=g)
    k = torch.randn(batch, kv_heads, seq, hd, generator=g)
    v = torch.randn(batch, kv_heads, seq, hd, generator=g)
    return q, k, v


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = q.shape[1] // k.shape[1]
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)


def _packed_tokens() -> torch.Tensor:
    # Row 0 starts mid-document (tail of a cut document), row 1 with a BOS; documents of 1 token too.
    return torch.tensor(
        [
            [5, 6, BOS, 7, 8, 9, BOS, 4, BOS, 3, 3, 3, 3, BOS, 2, 2],
            [BOS, 1, 1, 1, 1, 1, 1, BOS, BOS, 9, 9, 9, 9, 9, 9, 9],
        ]
    )


def test_grouped_kv_without_copies_equals_expanded_heads() -> None:
    q, k, v = _qkv()
    ek, ev = _expanded(q, k, v)
    torch.testing.assert_close(
        blocks.attention(q, k, v), F.scaled_dot_product_attention(q, ek, ev, is_causal=True)
    )
    mask = torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(1)) > 0.3
    mask |= torch.eye(24, dtype=torch.bool)  # no fully masked row
    torch.testing.assert_close(
        blocks.attention(q, k, v, mask=mask), F.scaled_dot_product_attention(q, ek, ev, attn_mask=mask)
    )


def test_call_attention_expands_kv_for_a_function_that_does_not_declare_grouped_kv() -> None:
    q, k, v = _qkv()
    seen: list[tuple[int, bool]] = []

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append((k.shape[1], "mask" in kwargs))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = blocks.call_attention(plain, q, k, v)
    assert seen == [(4, False)]  # expanded to the 4 query heads; no mask argument without a mask
    torch.testing.assert_close(out, blocks.attention(q, k, v))
    mask = blocks.document_mask(torch.zeros(2, 24, dtype=torch.long), BOS)
    blocks.call_attention(plain, q, k, v, mask)
    assert seen[-1] == (4, True)


def test_document_ids_count_bos_tokens() -> None:
    docs = blocks.document_ids(_packed_tokens(), BOS)
    assert docs[0].tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4]
    assert docs[1].tolist() == [1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3]


def test_document_ends_are_the_last_position_of_each_document() -> None:
    ends = blocks.document_ends(_packed_tokens(), BOS)
    assert ends[0].tolist() == [1, 1, 5, 5, 5, 5, 7, 7, 12, 12, 12, 12, 12, 15, 15, 15]
    assert ends[1].tolist() == [6] * 7 + [7] + [15] * 8


def test_document_mask_is_causal_within_documents_only() -> None:
    mask = blocks.document_mask(_packed_tokens(), BOS)
    assert mask.shape == (2, 1, 16, 16) and mask.dtype == torch.bool
    row = mask[0, 0]
    assert row[5].tolist() == [False] * 2 + [True] * 4 + [False] * 10  # token 5 sees 2..5
    assert row[7].tolist() == [False] * 6 + [True] * 2 + [False] * 8  # its own document from BOS at 6
    assert not row[1, 2] and row[1, :2].all()  # the leading partial document is a document too


def _per_document_reference(q, k, v, tokens):
    """Attention run on each document alone (unpacked), put back in place."""
    out = torch.empty_like(q)
    r = q.shape[1] // k.shape[1]
    for b in range(tokens.shape[0]):
        starts = [0, *[i for i in range(1, tokens.shape[1]) if tokens[b, i] == BOS], tokens.shape[1]]
        for s, e in itertools.pairwise(starts):
            qs, ks, vs = q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e]
            ks, vs = ks.repeat_interleave(r, dim=1), vs.repeat_interleave(r, dim=1)
            out[b : b + 1, :, s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    return out


def test_document_masked_attention_equals_each_document_alone() -> None:
    tokens = _packed_tokens()
    q, k, v = _qkv(seq=16)
    reference = _per_document_reference(q, k, v, tokens)
    out = blocks.attention(q, k, v, mask=blocks.document_mask(tokens, BOS))
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    # Plain causal attention over the packed row is not the same thing.
    assert not torch.allclose(blocks.attention(q, k, v), reference, atol=1e-3)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_selects_the_same_keys_as_the_boolean_mask() -> None:
    """The CUDA path's mask_mod, run through eager flex attention on CPU (with GQA)."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (2, 256), generator=g)  # BOS = 0: many documents, some blocks full
    q, k, v = _qkv(seq=256, seed=4)
    block_mask = blocks._document_block_mask(blocks.document_ends(tokens, BOS), compiled=False)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    reference = blocks.attention(q, k, v, mask=blocks.document_mask(tokens, BOS))
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_rope_is_relative_and_scaling_changes_only_low_frequencies() -> None:
    hd = 16
    freqs = blocks.rope_frequencies(hd, 64, theta=10000.0)
    assert freqs.shape == (64, hd // 2)
    torch.testing.assert_close(freqs.abs(), torch.ones(64, hd // 2))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 64, 1, hd, generator=g), torch.randn(1, 64, 1, hd, generator=g)
    same_q, same_k = q[:, 3:4].expand(1, 64, 1, hd), k[:, 1:2].expand(1, 64, 1, hd)
    rq, rk = blocks.apply_rope(same_q, freqs), blocks.apply_rope(same_k, freqs)
    # The score of a query/key pair depends on their distance only: (10, 8) == (40, 38).
    torch.testing.assert_close((rq[0, 10] * rk[0, 8]).sum(), (rq[0, 40] * rk[0, 38]).sum())
    scaled = blocks.rope_frequencies(hd, 2, theta=10000.0, scaling=blocks.RopeScaling(original_max_len=64))
    plain = blocks.rope_frequencies(hd, 2, theta=10000.0)
    assert torch.equal(scaled[1, 0], plain[1, 0])  # the highest frequency is kept
    torch.testing.assert_close(scaled[1, -1].angle(), plain[1, -1].angle() / 8.0)


def _complex_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The rotation as a complex multiplication (Llama's reference form)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def _real_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``apply_rope``'s form under ``torch.compile``, run eagerly."""
    return blocks._rotate_real(x, freqs_cis[: x.shape[1]])


@pytest.mark.parametrize("rope", [blocks.apply_rope, _real_rope], ids=["eager", "compiled_form"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_complex_rotation_with_either_table_form(rope: Any, dtype: torch.dtype) -> None:
    freqs = blocks.rope_frequencies(16, 64, theta=5e5, scaling=blocks.RopeScaling(original_max_len=32))
    x = torch.randn(2, 40, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = _complex_rope(x, freqs)
    got = rope(x, freqs)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(rope(x, torch.view_as_real(freqs)), expected, atol=0, rtol=0)


def test_eager_rope_is_one_complex_multiply_forward_and_backward() -> None:
    """Eager, each elementwise op is its own kernel and a full float32 pass over q or k: the real
    form's ten passes (and their backward) against the complex multiply's one each way
    (torchtitan's form); 3-4x the time on CPU, and the likely cause of an eager 1B-shape H100 run
    at 0.92x torchtitan."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Multiplies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[torch.dtype] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.stack):
                self.dtypes.append(out.dtype)
            return out

    freqs = blocks.rope_frequencies(16, 32, theta=10000.0)
    x = torch.randn(2, 32, 2, 16, requires_grad=True)
    for table in (freqs, torch.view_as_real(freqs)):
        with Multiplies() as forward:
            y = blocks.apply_rope(x, table)
        with Multiplies() as backward:
            y.backward(torch.ones_like(y))
        assert forward.dtypes == [torch.complex64]
        assert backward.dtypes == [torch.complex64]
        torch.testing.assert_close(y, _complex_rope(x, freqs), atol=0, rtol=0)
        x.grad = None
    # A float32 slice at an odd offset with odd strides (no complex view of it exists): rotated
    # the same as its contiguous copy.
    wide = torch.randn(2, 32, 2, 17)
    torch.testing.assert_close(
        blocks.apply_rope(wide[..., 1:], freqs),
        _complex_rope(wide[..., 1:].contiguous(), freqs),
        atol=0,
        rtol=0,
    )


def test_compiled_rope_runs_no_complex_arithmetic_forward_or_backward() -> None:
    """Inductor generates no code for complex operators: a complex multiply in a compiled block
    runs as eager kernels. The traced forward and backward graphs hold no complex tensor but
    the table's own input and its real view."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    freqs = blocks.rope_frequencies(16, 32, theta=10000.0)
    x = torch.randn(2, 32, 2, 16, requires_grad=True)
    compiled = torch.compile(
        blocks.apply_rope, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture)
    )
    compiled(x, freqs).square().sum().backward()
    assert len(graphs) == 2  # forward and backward
    complex_ops = [
        f"{node.target}"
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function"
        and isinstance(node.meta.get("val"), torch.Tensor)
        and node.meta["val"].is_complex()
        and node.target not in (torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default)
    ]
    assert complex_ops == []
    torch.testing.assert_close(x.grad, torch.func.grad(lambda t: _complex_rope(t, freqs).square().sum())(x))


def test_feed_forward_is_swiglu_and_init_scales_by_depth() -> None:
    torch.manual_seed(0)
    ffn = blocks.FeedForward(64, 256)
    ffn.init_weights(std=0.005)
    x = torch.randn(3, 64)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected)
    assert math.isclose(ffn.w1.weight.std().item(), 0.02, rel_tol=0.1)
    assert math.isclose(ffn.w2.weight.std().item(), 0.005, rel_tol=0.1)


def test_attention_module_refuses_heads_that_do_not_group() -> None:
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        blocks.Attention(48, 6, 4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_joins_a_compiled_callers_graph_without_recompiling() -> None:
    """Inside a compiled block the BlockMask path is one graph (fullgraph: no break) and a new
    mask per batch, from a new closure, compiles nothing more."""
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, m: blocks.attention(q, k, v, mask=m), backend=backend, fullgraph=True
    )
    q, k, v = _qkv(seq=256, seed=5)
    for seed in (0, 1, 2):
        tokens = torch.randint(0, 6, (2, 256), generator=torch.Generator().manual_seed(seed))
        block_mask = blocks._document_block_mask(blocks.document_ends(tokens, BOS), compiled=False)
        reference = blocks.attention(q, k, v, mask=blocks.document_mask(tokens, BOS))
        torch.testing.assert_close(compiled(q, k, v, block_mask), reference, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1


def _matmuls(module: torch.nn.Module, *args: object) -> int:
    """aten matmul calls of one forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += func in ops
            return func(*args, **(kwargs or {}))

    with Count():
        module(*args)
    return Count.n


class _Scaled(torch.nn.Linear):
    """A Linear subclass computing something else (as torchao's Float8Linear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def _pair() -> tuple[blocks.Attention, blocks.Attention]:
    torch.manual_seed(0)
    fused = blocks.Attention(64, 8, 2)
    separate = blocks.Attention(64, 8, 2, fuse_qkv=False)
    separate.load_state_dict(fused.state_dict())
    return fused, separate


def test_fused_qkv_is_one_matmul_with_the_separate_projections_results() -> None:
    fused, separate = _pair()
    x = torch.randn(2, 12, 64, requires_grad=True)
    freqs = blocks.rope_frequencies(8, 12, 1e4)
    assert _matmuls(fused, x, freqs) == 2 and _matmuls(separate, x, freqs) == 4  # qkv + wo / q, k, v + wo
    assert_same_forward_backward(fused, separate, x, freqs)
    assert list(fused.state_dict()) == ["wq.weight", "wk.weight", "wv.weight", "wo.weight"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_qkv_keeps_no_more_for_backward_than_separate_projections(compiled: bool) -> None:
    """Without activation checkpointing attention saves V: a slice of the fused output would keep
    Q and K alive with it, a (dim + kv_dim)-wide activation per token more than separate
    projections keep (seen on the H200 as 2-3 GiB more reserved memory without AC)."""
    torch._dynamo.reset()
    fused, separate = _pair()
    x = torch.randn(2, 12, 64, requires_grad=True)
    freqs = blocks.rope_frequencies(8, 12, 1e4)
    kept = saved_storage_bytes(fused, x, freqs, compiled=compiled)
    assert kept == saved_storage_bytes(separate, x, freqs, compiled=compiled)


def test_fused_qkv_falls_back_where_a_projection_must_run_itself() -> None:
    """A hooked projection, a Linear subclass (torchao's Float8Linear) and a biased one each run
    as their own module: fusing would skip the hook or compute something else."""
    freqs = blocks.rope_frequencies(8, 12, 1e4)
    x = torch.randn(2, 12, 64)

    hooked, _ = _pair()
    seen: list[torch.Size] = []
    hooked.wk.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert _matmuls(hooked, x, freqs) == 4 and seen == [torch.Size([2, 12, 16])]

    subclassed, separate = _pair()
    subclassed.wv = _Scaled(64, 16, bias=False)
    subclassed.wv.weight = separate.wv.weight
    separate.wv = subclassed.wv
    torch.testing.assert_close(subclassed(x, freqs), separate(x, freqs))
    assert _matmuls(subclassed, x, freqs) == 4

    biased, _ = _pair()
    biased.wq = torch.nn.Linear(64, 64, bias=True)
    assert _matmuls(biased, x, freqs) == 4


def _ffn_pair() -> tuple[blocks.FeedForward, blocks.FeedForward]:
    torch.manual_seed(0)
    fused = blocks.FeedForward(64, 96, fuse_w13=True)
    separate = blocks.FeedForward(64, 96)
    separate.load_state_dict(fused.state_dict())
    return fused, separate


def test_fused_w13_is_one_matmul_with_the_separate_projections_results() -> None:
    fused, separate = _ffn_pair()
    x = torch.randn(2, 12, 64, requires_grad=True)
    assert _matmuls(fused, x) == 2 and _matmuls(separate, x) == 3  # w13 + w2 / w1, w3 + w2
    assert_same_forward_backward(fused, separate, x)
    assert list(fused.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_w13_keeps_no_more_for_backward_than_separate_projections(compiled: bool) -> None:
    """Without activation checkpointing SwiGLU keeps the gate and the up projection either way:
    as views of the fused output they must not cost more than as two tensors."""
    torch._dynamo.reset()
    fused, separate = _ffn_pair()
    x = torch.randn(2, 12, 64, requires_grad=True)
    assert saved_storage_bytes(fused, x, compiled=compiled) == saved_storage_bytes(
        separate, x, compiled=compiled
    )


def test_fused_w13_falls_back_where_a_projection_must_run_itself() -> None:
    """A hooked gate projection and a Linear subclass (torchao's Float8Linear) run as modules."""
    x = torch.randn(2, 12, 64)
    hooked, separate = _ffn_pair()
    seen: list[torch.Size] = []
    hooked.w1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert _matmuls(hooked, x) == 3 and seen == [torch.Size([2, 12, 96])]

    subclassed, separate = _ffn_pair()
    subclassed.w3 = _Scaled(64, 96, bias=False)
    subclassed.w3.weight = separate.w3.weight
    separate.w3 = subclassed.w3
    torch.testing.assert_close(subclassed(x), separate(x))
    assert _matmuls(subclassed, x) == 3


def test_stage_inputs_embed_tokens_slice_rotary_rows_and_mask_from_the_token_ids() -> None:
    from types import SimpleNamespace

    from titan_core.errors import UsageError

    tokens = torch.tensor([[0, 5, 6, 0, 7, 8]])
    freqs = torch.arange(10.0)
    stage = SimpleNamespace(
        args=SimpleNamespace(document_mask=True, bos_id=0),
        tok_embeddings=torch.nn.Embedding(9, 4),
        freqs_cis=freqs,
    )
    h, f, mask = blocks.stage_inputs(stage, tokens, torch.tensor([4, 5, 6, 7, 8, 9]))
    assert h.shape == (1, 6, 4)
    assert f.tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert torch.equal(mask, blocks.document_mask(tokens, 0))
    assert blocks.stage_inputs(stage, tokens, None)[1] is freqs
    stage.args.document_mask = False
    assert blocks.stage_inputs(stage, tokens, None)[2] is None
    later = SimpleNamespace(
        args=SimpleNamespace(document_mask=True, bos_id=0), tok_embeddings=None, freqs_cis=freqs
    )
    hidden = torch.randn(1, 6, 4)
    # A later stage masks from the token ids the pipeline passes, never from its hidden states.
    h, _, mask = blocks.stage_inputs(later, hidden, None, input_tokens=tokens)
    assert h is hidden and torch.equal(mask, blocks.document_mask(tokens, 0))
    with pytest.raises(
        UsageError, match="this pipeline stage has no embedding, and its forward got no input_tokens"
    ):
        blocks.stage_inputs(later, hidden, None)
    later.args.document_mask = False
    assert blocks.stage_inputs(later, hidden, None)[0] is hidden
