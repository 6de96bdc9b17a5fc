"""MoE model: parameter and FLOP counts, routing against a per-token reference, causality, plugin."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_same_forward_backward, saved_storage_bytes
from titan_core.errors import UsageError
from titan_plugins_moe.flavors import FLAVORS, MoEArgs, flops_per_token, num_params
from titan_plugins_moe.model import MoE, MoETransformer

TINY = MoEArgs(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    n_experts=4,
    top_k=2,
    expert_hidden_dim=16,
    shared_expert_hidden_dim=16,
    n_dense_layers=1,
    multiple_of=32,
    max_seq_len=64,
)


def build(args: MoEArgs, seed: int = 0) -> MoETransformer:
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_analytic_counts_match_the_module(flavor: str) -> None:
    args = FLAVORS[flavor]
    with torch.device("meta"):
        model = MoETransformer(args)
    total = sum(p.numel() for p in model.parameters())
    assert total == num_params(args, include_embedding=True)
    assert total - args.vocab_size * args.dim == num_params(args, include_embedding=False)


def test_flops_count_only_the_active_experts() -> None:
    args = FLAVORS["debugmodel"]
    more_experts = attrs.evolve(args, n_experts=2 * args.n_experts)
    # Experts a token does not visit cost no FLOPs; routing to more of them does.
    router_only = 6 * (more_experts.n_experts - args.n_experts) * args.dim * (args.n_layers - 1)
    assert flops_per_token(more_experts, 256) - flops_per_token(args, 256) == router_only
    assert flops_per_token(attrs.evolve(args, top_k=args.top_k + 1), 256) > flops_per_token(args, 256)


@pytest.mark.parametrize("flavor", ["debugmodel", "deepseek_v3_debugmodel"])
def test_a_tied_output_projection_still_costs_its_flops(flavor: str) -> None:
    args = attrs.evolve(FLAVORS[flavor], tie_embeddings=False)
    tied = attrs.evolve(args, tie_embeddings=True)
    assert num_params(tied) == num_params(args) - args.vocab_size * args.dim
    assert flops_per_token(tied, 256) == flops_per_token(args, 256)


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the top-k experts' SwiGLU outputs weighted by renormalised scores."""
    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router.gate(flat), dim=-1)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        scores, experts = probs[t].topk(moe.top_k)
        scores = scores / scores.sum()
        for s, e in zip(scores, experts.tolist(), strict=True):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            out[t] += s * (w2 @ (F.silu(w1 @ flat[t]) * (w3 @ flat[t])))
    out += moe.shared_expert(flat)
    return out.view_as(x)


def test_grouped_experts_match_per_token_routing() -> None:
    model = build(TINY)
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE)
    x = torch.randn(2, 5, TINY.dim)
    torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_first_blocks_are_dense_the_rest_moe() -> None:
    model = build(TINY)
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ["FeedForward", "MoE", "MoE"]


def test_forward_is_causal_and_trains() -> None:
    model = build(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, TINY.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8])
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    experts = model.layers["2"].feed_forward.experts
    assert experts.w1.grad is not None and experts.w1.grad.abs().sum() > 0


def test_top_k_larger_than_experts_is_refused() -> None:
    with pytest.raises(UsageError, match="top_k=5 exceeds n_experts=4"):
        MoETransformer(attrs.evolve(TINY, top_k=5))


def test_plugin_module_does_not_import_torch() -> None:
    code = "import sys, titan_plugins_moe.plugin as p; p.titan_models(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("flavor", ["qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v2_lite"])
def test_real_flavor_totals_match_the_published_counts(flavor: str) -> None:
    from titan_plugins_moe.flavors import PUBLISHED, num_active_params, num_active_params_without_embedding

    total, active = PUBLISHED[flavor]
    assert abs(num_params(FLAVORS[flavor]) / total - 1) < 0.01
    # The two active-count conventions bracket the published (rounded) figure: docs/moe.md.
    args = FLAVORS[flavor]
    assert num_active_params_without_embedding(args) < num_active_params(args)
    assert num_active_params_without_embedding(args) * 0.97 < active < num_active_params(args) * 1.03


def test_docs_flavor_table_shows_the_computed_counts() -> None:
    import re
    from pathlib import Path

    from titan_plugins_moe.flavors import num_active_params

    text = (Path(__file__).resolve().parents[2] / "docs" / "moe.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| ([\d.]+)([MB]) \| ([\d.]+)([MB]) \|", text, flags=re.M)
    assert {name for name, *_ in rows} == set(FLAVORS)
    for name, total, t_unit, active, a_unit in rows:
        scale = {"M": 1e6, "B": 1e9}
        assert f"{num_params(FLAVORS[name]) / scale[t_unit]:.2f}" == total, name
        assert f"{num_active_params(FLAVORS[name]) / scale[a_unit]:.2f}" == active, name


def test_layout_checks_name_what_to_change() -> None:
    from types import SimpleNamespace

    from titan_plugins_moe.flavors import validate

    dims = SimpleNamespace(tp=3, pp=1, cp=1, ep=1)
    with pytest.raises(
        UsageError, match=r"parallelism.tp=3 must divide the model's n_heads=16, vocab_size=2048"
    ):
        validate(FLAVORS["debugmodel"], dims)
    with pytest.raises(
        UsageError, match=r"parallelism.ep=3 must divide the number of experts per layer \(8\)"
    ):
        validate(FLAVORS["debugmodel"], SimpleNamespace(tp=1, pp=1, cp=1, ep=3))
    with pytest.raises(UsageError, match=r"model.overrides.n_limited_groups: n_limited_groups=9 exceeds"):
        validate(
            attrs.evolve(FLAVORS["deepseek_v3_671b"], n_limited_groups=9),
            SimpleNamespace(tp=1, pp=1, cp=1, ep=1),
        )
    with pytest.raises(UsageError, match=r"model.overrides.score_func: expected one of 'softmax', 'sigmoid'"):
        validate(
            attrs.evolve(FLAVORS["debugmodel"], score_func="relu"), SimpleNamespace(tp=1, pp=1, cp=1, ep=1)
        )
    one = SimpleNamespace(tp=1, pp=1, cp=1, ep=1)
    with pytest.raises(UsageError, match=r"model.overrides.qk_rope_head_dim: RoPE rotates pairs"):
        validate(attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], qk_rope_head_dim=15), one)
    with pytest.raises(UsageError, match=r"model.overrides.head_dim: RoPE rotates pairs"):
        validate(attrs.evolve(FLAVORS["qwen3_debugmodel"], head_dim=15), one)


def test_qwen3_attention_fuses_qkv_with_the_separate_projections_results() -> None:
    """q/k norm and an explicit head width sit after the projections: fusing them changes nothing."""
    from titan_plugins_moe.attention import Attention, rope_frequencies

    args = FLAVORS["qwen3_debugmodel"]
    torch.manual_seed(0)
    fused, separate = Attention(args), Attention(attrs.evolve(args, fuse_qkv=False))
    separate.load_state_dict(fused.state_dict())
    x = torch.randn(2, 12, args.dim, requires_grad=True)
    freqs = rope_frequencies(args, 12)
    assert_same_forward_backward(fused, separate, x, freqs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_qwen3_fused_qkv_keeps_no_more_for_backward_than_separate_projections(compiled: bool) -> None:
    """The q/k norms and attention save Q, K and V: none may be a slice keeping the fused output."""
    from titan_plugins_moe.attention import Attention, rope_frequencies

    torch._dynamo.reset()
    args = FLAVORS["qwen3_debugmodel"]
    torch.manual_seed(0)
    fused, separate = Attention(args), Attention(attrs.evolve(args, fuse_qkv=False))
    x = torch.randn(2, 12, args.dim, requires_grad=True)
    freqs = rope_frequencies(args, 12)
    kept = saved_storage_bytes(fused, x, freqs, compiled=compiled)
    assert kept == saved_storage_bytes(separate, x, freqs, compiled=compiled)


@pytest.mark.parametrize(
    ("flavor", "overrides", "message"),
    [
        ("deepseek_v3_debugmodel", {"n_dense_layers": -1}, r"n_dense_layers: must be >= 0, got -1"),
        (
            "deepseek_v3_debugmodel",
            {"shared_expert_hidden_dim": -1},
            r"shared_expert_hidden_dim: must be >= 0",
        ),
        ("deepseek_v3_debugmodel", {"q_lora_rank": -4}, r"q_lora_rank: must be >= 0, got -4"),
        ("deepseek_v3_debugmodel", {"kv_lora_rank": 0}, r"kv_lora_rank: must be positive, got 0"),
        ("deepseek_v3_debugmodel", {"v_head_dim": 0}, r"v_head_dim: must be positive, got 0"),
        ("deepseek_v3_debugmodel", {"route_scale": float("nan")}, r"route_scale: must be a positive number"),
        ("deepseek_v3_debugmodel", {"route_scale": 0.0}, r"route_scale: must be a positive number"),
        ("qwen3_debugmodel", {"head_dim": -8}, r"head_dim: must be positive, got -8"),
        ("qwen3_debugmodel", {"n_kv_heads": -1}, r"n_kv_heads: must be positive, got -1"),
        (
            "qwen3_debugmodel",
            {"n_dense_layers": 1, "dense_hidden_dim": -5},
            r"dense_hidden_dim: must be >= 0",
        ),
        ("qwen3_debugmodel", {"max_seq_len": 0}, r"max_seq_len: must be positive, got 0"),
        # Every block dense: no router, no balancing, no expert; the MoE settings would do nothing.
        ("qwen3_debugmodel", {"n_dense_layers": 4}, r"n_dense_layers: 4 of the 4 blocks dense leaves no MoE"),
        ("deepseek_v3_debugmodel", {"n_dense_layers": 9}, r"n_dense_layers: 9 of the \d+ blocks dense"),
        # RMSNorm divides by sqrt(mean(x^2) + eps): eps <= 0 is a division by zero (or a NaN).
        (
            "qwen3_debugmodel",
            {"norm_eps": -1e-6},
            r"norm_eps: must be a small positive number \(1e-5, 1e-6\), got -1e-06",
        ),
        ("deepseek_v3_debugmodel", {"norm_eps": 0.0}, r"norm_eps: must be a small positive number"),
        ("qwen3_debugmodel", {"norm_eps": float("nan")}, r"norm_eps: must be a small positive number"),
        # MLA: the rotated part carries the positions (0 would train without any); the part
        # without position may be 0, not negative.
        ("deepseek_v3_debugmodel", {"qk_rope_head_dim": 0}, r"qk_rope_head_dim: must be positive, got 0"),
        ("deepseek_v3_debugmodel", {"qk_nope_head_dim": -2}, r"qk_nope_head_dim: must be >= 0, got -2"),
        # RoPE's frequencies: a zero base or scaling factor gave NaN at step 1 (reported as a
        # divergence, "lower training.lr"), YaRN's bounds a ZeroDivisionError / math domain error
        # from the build.
        ("qwen3_debugmodel", {"rope_theta": 0.0}, r"rope_theta: must be a positive number, got 0.0"),
        ("deepseek_v3_debugmodel", {"rope_theta": float("nan")}, r"rope_theta: must be a positive number"),
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "yarn", "rope_scaling_factor": 0.0},
            r"rope_scaling_factor: must be a positive number, got 0.0",
        ),
        (
            "qwen3_debugmodel",
            {"rope_scaling": "llama3", "rope_scaling_factor": float("inf")},
            r"rope_scaling_factor: must be a positive number, got inf",
        ),
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "yarn", "rope_original_max_len": 0},
            r"rope_original_max_len: must be positive, got 0",
        ),
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "yarn", "yarn_beta_slow": -1.0},
            r"yarn_beta_slow: must be a positive number, got -1.0",
        ),
        (
            "qwen3_debugmodel",
            {"rope_scaling": "llama3", "rope_low_freq_factor": 0.0},
            r"rope_low_freq_factor: must be a positive number, got 0.0",
        ),
        # Equal factors divided by zero in Llama 3.1's interpolation; swapped ones inverted which
        # frequencies are kept, no word (Hugging Face refuses both too).
        (
            "qwen3_debugmodel",
            {"rope_scaling": "llama3", "rope_low_freq_factor": 2.0, "rope_high_freq_factor": 2.0},
            r"rope_high_freq_factor: must be more than rope_low_freq_factor, got 2.0 <= 2.0",
        ),
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0},
            r"rope_high_freq_factor: must be more than rope_low_freq_factor, got 1.0 <= 4.0",
        ),
        # YaRN's temperature factors: NaN passed (a non-zero value) and made every logit NaN.
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "yarn", "yarn_mscale_all_dim": float("nan")},
            r"yarn_mscale_all_dim: must be a number >= 0 \(0: unset\), got nan",
        ),
        (
            "qwen3_debugmodel",
            {"rope_scaling": "yarn", "yarn_mscale": float("inf"), "yarn_mscale_all_dim": 1.0},
            r"yarn_mscale: must be a number >= 0 \(0: unset\), got inf",
        ),
        (
            "deepseek_v3_debugmodel",
            {"rope_scaling": "yarn", "yarn_mscale": -1.0, "yarn_mscale_all_dim": 1.0},
            r"yarn_mscale: must be a number >= 0 \(0: unset\), got -1.0",
        ),
        # The dense FFN's width: a ZeroDivisionError / negative-dimension traceback from the build.
        ("debugmodel", {"multiple_of": 0}, r"multiple_of: must be positive, got 0"),
        ("debugmodel", {"ffn_dim_multiplier": -1.0}, r"ffn_dim_multiplier: must be a positive number"),
        # NaN passed the ">= 0" check: MTP modules built and trained nothing, moe/mtp_loss 0.0.
        (
            "debugmodel",
            {"n_mtp_layers": 1, "mtp_loss_weight": float("nan")},
            r"mtp_loss_weight: must be a number >= 0, got nan",
        ),
    ],
)
def test_impossible_sizes_are_one_usage_error_naming_the_field(
    flavor: str, overrides: dict[str, object], message: str
) -> None:
    """Not a tensor-creation traceback from deep inside the build, nor a silently wrong model."""
    from types import SimpleNamespace

    from titan_plugins_moe.flavors import validate

    with pytest.raises(UsageError, match=rf"model\.overrides\.{message}"):
        validate(attrs.evolve(FLAVORS[flavor], **overrides), SimpleNamespace(tp=1, pp=1, cp=1, ep=1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_expert_groups": 3}, r"n_expert_groups=3 must divide n_experts=8 .*; pick a divisor"),
        ({"n_limited_groups": 5}, r"n_limited_groups=5 exceeds n_expert_groups=4 .*; lower n_limited_groups"),
    ],
)
def test_group_limited_routing_errors_say_the_fix(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        MoETransformer(attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], **overrides))


@pytest.mark.parametrize("overrides", [{"dim": 36, "n_heads": 2}, {"expert_hidden_dim": 30}])
def test_forced_grouped_gemm_with_unaligned_widths_is_refused_up_front(overrides: dict[str, int]) -> None:
    """torch's grouped GEMM needs 16-byte aligned rows; otherwise it fails inside the first step."""
    args = attrs.evolve(TINY, experts_impl="grouped_mm", **overrides)
    with pytest.raises(
        UsageError, match=r"model\.overrides\.experts_impl: 'grouped_mm' needs .*'auto' or 'loop'"
    ):
        MoETransformer(args)
    MoETransformer(attrs.evolve(args, experts_impl="auto"))  # the loop has no such limit


def test_tokens_per_expert_are_counted_without_a_data_dependent_shape() -> None:
    """``torch.bincount`` sizes its output by the largest value, so on CUDA it reads that back to
    the host in every MoE forward (a sync per layer, against "no host sync on steps that do not
    log"); it has no meta kernel for the same reason. The count from the sorted slots has a fixed
    shape, computed on meta tensors too, and equals bincount's."""
    from titan_plugins_moe.moe import tokens_per_expert

    gen = torch.Generator().manual_seed(0)
    cases = [(5, torch.tensor([3, 0, 3, 1, 3, 0])), (8, torch.randint(0, 6, (64,), generator=gen))]
    for experts, slots in cases:
        counted = tokens_per_expert(slots.sort(stable=True).values, experts)
        assert counted.tolist() == torch.bincount(slots, minlength=experts).tolist()
        assert counted.dtype == torch.int64  # as bincount's, for the grouped GEMM's offsets
        on_meta = tokens_per_expert(slots.to("meta"), experts)
        assert on_meta.shape == (experts,)  # no value needed: nothing to read back


def _grouped_gemm_layer() -> MoE:
    """A small MoE layer forced onto the grouped GEMM (skips where torch has none)."""
    from titan_plugins_moe.grouped_mm import grouped_mm_function

    if grouped_mm_function() is None:
        pytest.skip("this torch has no grouped GEMM")
    torch.manual_seed(0)
    layer = MoE(MoEArgs(dim=32, n_experts=4, top_k=2, expert_hidden_dim=16, experts_impl="grouped_mm"))
    layer.init_weights(0.02)
    return layer


def test_a_compiled_moe_layer_with_grouped_gemm_is_one_graph() -> None:
    """With grouped GEMM nothing in a MoE layer reads values on the host, so a compiled block
    holds the whole layer in one graph: router, sort, counts, experts, gather back. The counts
    were excluded from compilation (a graph break in every MoE layer) since bincount's day."""
    layer = _grouped_gemm_layer()
    layer.bfloat16()  # torch's grouped GEMM traces in bf16 only (its meta function says so)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [str(r.reason)[:120] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    # The routing is uneven, so counts taken for an even split (fake tensors') would show above.
    _, experts, _ = layer.router(x.reshape(-1, 32))
    assert torch.bincount(experts.flatten(), minlength=4).tolist() != [8, 8, 8, 8]


def test_a_compiled_moe_layer_with_grouped_gemm_in_float32_runs() -> None:
    """torch's grouped GEMM runs float32 eagerly (one matmul per group on CPU) but traces in bf16
    only: a compiled float32 block with ``experts_impl = "grouped_mm"`` stopped at step 1 with
    dynamo's fake-tensor error. The float32 grouped GEMM now runs outside the graph."""
    layer = _grouped_gemm_layer()
    x = torch.randn(2, 8, 32, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, layer(x))
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (expected,) = torch.autograd.grad(layer(x).square().sum(), x)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize(
    ("flavor", "overrides", "message"),
    [
        # MLA has its own latent norms and head widths; these were dropped without a word.
        ("deepseek_v3_debugmodel", {"qk_norm": True}, r"qk_norm: q/k norm belongs to attention='gqa'"),
        ("deepseek_v3_debugmodel", {"n_kv_heads": 2}, r"n_kv_heads: attention='mla' has one key/value"),
        ("deepseek_v3_debugmodel", {"head_dim": 64}, r"head_dim: attention='mla' sets its head widths"),
        # Grouped-query attention has no low-rank query projection.
        ("qwen3_debugmodel", {"q_lora_rank": 64}, r"q_lora_rank: attention='gqa' has no low-rank query"),
    ],
)
def test_fields_of_the_other_attention_are_refused_not_ignored(
    flavor: str, overrides: dict[str, object], message: str
) -> None:
    """A field only the other attention reads built the model without it, silently."""
    with pytest.raises(UsageError, match=rf"model\.overrides\.{message}"):
        MoETransformer(attrs.evolve(FLAVORS[flavor], **overrides))
    # The values they mean when unset are accepted (n_kv_heads equal to the query heads).
    n_heads = FLAVORS["deepseek_v3_debugmodel"].n_heads
    MoETransformer(attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], n_kv_heads=n_heads, qk_norm=False))


def test_dense_blocks_and_the_shared_expert_fuse_gate_and_up_when_told_to() -> None:
    """``fuse_w13`` reaches every ``FeedForward`` of the model (dense blocks, shared experts) and
    changes nothing but the number of matmuls."""
    from titan_core.blocks import FeedForward

    args = attrs.evolve(TINY, n_dense_layers=1, shared_expert_hidden_dim=32)
    fused, separate = build(attrs.evolve(args, fuse_w13=True)), build(args)
    separate.load_state_dict(fused.state_dict())
    ffns = [m for m in fused.modules() if isinstance(m, FeedForward)]
    assert len(ffns) == args.n_layers  # one dense block, one shared expert per MoE block
    assert all(m.fuse_w13 for m in ffns)
    assert not any(m.fuse_w13 for m in separate.modules() if isinstance(m, FeedForward))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    torch.testing.assert_close(fused(tokens), separate(tokens))


@pytest.mark.parametrize(
    ("flavor", "saved", "now", "same"),
    [
        ("debugmodel", {}, {"n_kv_heads": 16, "head_dim": 16}, True),  # gqa: the derived values
        ("debugmodel", {}, {"dense_hidden_dim": 768}, True),  # Llama's rounding of dim 256
        ("debugmodel", {"multiple_of": 128}, {"dense_hidden_dim": 768}, True),  # 768 either way
        ("debugmodel", {}, {"dense_hidden_dim": 512}, False),
        ("debugmodel", {}, {"n_kv_heads": 8}, False),
        ("deepseek_v3_debugmodel", {}, {"dense_hidden_dim": 512}, True),
    ],
)
def test_a_resume_compares_the_arguments_as_the_model_reads_them(
    flavor: str, saved: dict, now: dict, same: bool
) -> None:
    from titan_core._registry import get_registry
    from titan_core.resume import model_changes

    spec = get_registry().get("models", "moe", what="model")
    changes = model_changes(
        spec,
        {"name": "moe", "flavor": flavor, "overrides": saved},
        {"name": "moe", "flavor": flavor, "overrides": now},
    )
    assert (changes == []) is same, changes
