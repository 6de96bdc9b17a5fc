"""MoE hyper-parameters per flavor, analytic parameter and FLOP counts, and the layout checks.

One argument class covers the three architectures the model builds (see ``model``):

* Llama-style (``attention="gqa"``, the debug flavors): grouped-query attention, softmax top-k;
* Qwen3-MoE (``attention="gqa"``, ``qk_norm=True``, explicit ``head_dim``, no shared expert);
* DeepSeek-V2/V3 (``attention="mla"``: multi-head latent attention; dense first layers, shared
  expert, sigmoid scores with a selection bias, group-limited top-k, routed scaling factor).

Nothing here imports torch: ``titan models list`` reads the counts without building a model.

Counting convention: ``num_params`` counts every parameter, the embedding table and output
projection included; ``num_active_params`` counts the same minus the routed experts a token is
not sent to, so a dense model's active count is its total (``titan models list`` shows both).
That is how Mixtral's 12.9B and Qwen3-30B-A3B's 3.3B (3.35B exactly) are counted. The DeepSeek
papers leave the embedding table out of the active count (V3: 36.6B of "37B", V2-Lite: 2.45B
of "2.4B"); ``docs/moe.md`` gives both figures for every real flavor.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from titan_core.errors import UsageError

_CHOICES = {
    "attention": ("gqa", "mla"),
    "score_func": ("softmax", "sigmoid"),
    "rope_scaling": ("none", "llama3", "yarn"),
}


@attrs.frozen
class MoEArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    #: Key/value heads of grouped-query attention; ``None``: ``n_heads`` (``attention="gqa"``).
    n_kv_heads: int | None = None
    #: Width of one attention head; ``None``: ``dim // n_heads`` (Qwen3 sets 128 explicitly).
    head_dim: int | None = None
    vocab_size: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    #: ``none``, ``llama3`` (Llama 3.1 frequency scaling) or ``yarn`` (DeepSeek's YaRN).
    rope_scaling: str = "none"
    #: The scaling factor of ``llama3`` and ``yarn``; ``rope_original_max_len`` is the context
    #: the model was trained with before the extension.
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    #: YaRN's ramp bounds (rotations) and attention-temperature factors (Hugging Face names:
    #: beta_fast, beta_slow, mscale, mscale_all_dim; 0 for an unset mscale).
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    max_seq_len: int = 4096
    #: Tie the output projection to the token embedding (one parameter).
    tie_embeddings: bool = False
    #: Block-causal attention over packed documents (a ``bos_id`` token starts one).
    document_mask: bool = False
    #: The token that starts a document; set by the trainer from the tokenizer's BOS id.
    bos_id: int | None = None
    #: ``gqa`` attention computes Q, K and V with one matmul over the concatenated weights
    #: (parameters and checkpoints keep ``wq``/``wk``/``wv``; ``titan_core.blocks.project_qkv``).
    fuse_qkv: bool = True
    #: Dense feed-forward blocks and the shared expert compute the SwiGLU gate and up
    #: projections with one matmul over the concatenated ``w1``/``w3`` weights
    #: (``titan_core.blocks.FeedForward``; a trade of memory for recomputation under selective
    #: AC, see there); the routed experts are unchanged.
    fuse_w13: bool = False
    #: ``gqa`` (grouped-query, optional q/k RMSNorm) or ``mla`` (multi-head latent attention).
    attention: str = "gqa"
    #: RMSNorm over each query and key head before RoPE (Qwen3).
    qk_norm: bool = False
    #: MLA: rank of the low-rank query projection (0: a full ``dim -> heads`` projection, as
    #: DeepSeek-V2-Lite), of the compressed key/value latent, and the head widths (the query/key
    #: head is ``qk_nope_head_dim`` without position plus ``qk_rope_head_dim`` with RoPE).
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    #: Routed experts per MoE layer and experts each token is sent to.
    n_experts: int = 8
    top_k: int = 2
    #: Hidden width of one routed expert (SwiGLU).
    expert_hidden_dim: int = 256
    #: Hidden width of the always-on shared expert; 0 disables it (DeepSeek: width of one expert
    #: times the number of shared experts).
    shared_expert_hidden_dim: int = 256
    #: Router scores: ``softmax`` over the experts or a per-expert ``sigmoid`` (DeepSeek-V3).
    score_func: str = "softmax"
    #: Renormalise the top-k scores of a token to sum to 1 (top-1: weight 1, as Mixtral, Qwen3
    #: and torchtitan; the router then learns only from a load-balancing loss, see docs/moe.md).
    route_norm: bool = True
    #: Multiplies the routed experts' weights (DeepSeek-V3's routed scaling factor, 2.5).
    route_scale: float = 1.0
    #: Group-limited routing: experts form ``n_expert_groups`` groups, a token picks its top-k
    #: experts among the ``n_limited_groups`` groups with the best top-2 score sums (DeepSeek-V3).
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    #: Leading blocks with a dense SwiGLU FFN instead of a MoE (DeepSeek-V3: 3).
    n_dense_layers: int = 1
    #: Hidden width of the dense FFN; 0 uses Llama's rounding (``multiple_of``,
    #: ``ffn_dim_multiplier``).
    dense_hidden_dim: int = 0
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    #: Expert computation: ``auto`` (grouped GEMM on CUDA devices whose kernels support it, a
    #: loop over experts elsewhere), ``grouped_mm`` (always ``torch._grouped_mm``) or ``loop``.
    experts_impl: str = "auto"
    #: Multi-token prediction (DeepSeek-V3): modules after the last block, the k-th predicting
    #: the token k+1 places ahead from the (k-1)-th one's hidden state and the next token's
    #: embedding, through one MoE block; they share the embedding and output projection. Their
    #: mean cross-entropy times ``mtp_loss_weight`` joins the objective (DeepSeek-V3: 1 module,
    #: weight 0.3, later 0.1). Not with pipeline, tensor or context parallelism.
    n_mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attn_head_dim(self) -> int:
        """Width of one grouped-query attention head."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Dimensions rotated by RoPE in each head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.dense_hidden_dim:
            return self.dense_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - min(self.n_dense_layers, self.n_layers)


#: Qwen3-30B-A3B (Hugging Face ``Qwen/Qwen3-30B-A3B``, config.json).
_QWEN3_30B_A3B = MoEArgs(
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    max_seq_len=40960,
    qk_norm=True,
    n_experts=128,
    top_k=8,
    expert_hidden_dim=768,
    shared_expert_hidden_dim=0,
    n_dense_layers=0,
    dense_hidden_dim=6144,
)

#: DeepSeek-V3 (``deepseek-ai/DeepSeek-V3``), pre-training shape: 4K context, no YaRN (the
#: published checkpoint adds YaRN x40 for the 128K extension: ``rope_scaling="yarn"``).
_DEEPSEEK_V3_671B = MoEArgs(
    dim=7168,
    n_layers=61,
    n_heads=128,
    vocab_size=129280,
    norm_eps=1e-6,
    rope_theta=10000.0,
    max_seq_len=4096,
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_experts=256,
    top_k=8,
    expert_hidden_dim=2048,
    shared_expert_hidden_dim=2048,
    score_func="sigmoid",
    route_norm=True,
    route_scale=2.5,
    n_expert_groups=8,
    n_limited_groups=4,
    n_dense_layers=3,
    dense_hidden_dim=18432,
)

#: DeepSeek-V2-Lite (``deepseek-ai/DeepSeek-V2-Lite``): softmax scores, no top-k
#: renormalisation, no low-rank query, two shared experts; 4K pre-training context (the
#: published checkpoint adds YaRN x40 with mscale 0.707).
_DEEPSEEK_V2_LITE = MoEArgs(
    dim=2048,
    n_layers=27,
    n_heads=16,
    vocab_size=102400,
    norm_eps=1e-6,
    rope_theta=10000.0,
    max_seq_len=4096,
    attention="mla",
    q_lora_rank=0,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_experts=64,
    top_k=6,
    expert_hidden_dim=1408,
    shared_expert_hidden_dim=2 * 1408,
    score_func="softmax",
    route_norm=False,
    n_dense_layers=1,
    dense_hidden_dim=10944,
)

FLAVORS: dict[str, MoEArgs] = {
    "debugmodel": MoEArgs(),
    # Same shape, no shared expert and top-1 routing: the plainest MoE, for tests. Without
    # route_norm a token's output is scaled by its expert's probability (Switch Transformer), so
    # the router learns from the language-model loss alone.
    "debugmodel_top1": MoEArgs(top_k=1, shared_expert_hidden_dim=0, route_norm=False),
    # Qwen3-MoE architecture at debug size (q/k norm, head_dim != dim / n_heads, every layer MoE).
    "qwen3_debugmodel": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=96,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        qk_norm=True,
        n_experts=8,
        top_k=2,
        expert_hidden_dim=128,
        shared_expert_hidden_dim=0,
        n_dense_layers=0,
    ),
    "qwen3_30b_a3b": _QWEN3_30B_A3B,
    # DeepSeek-V3 architecture at debug size (MLA, dense first layer, shared expert, sigmoid
    # scores, 4 groups of 2 experts of which a token sees 2 groups, routed scaling).
    "deepseek_v3_debugmodel": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        norm_eps=1e-6,
        rope_theta=10000.0,
        attention="mla",
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_experts=8,
        top_k=2,
        expert_hidden_dim=128,
        shared_expert_hidden_dim=128,
        score_func="sigmoid",
        route_scale=2.5,
        n_expert_groups=4,
        n_limited_groups=2,
        n_dense_layers=1,
        dense_hidden_dim=512,
    ),
    "deepseek_v3_671b": _DEEPSEEK_V3_671B,
    "deepseek_v2_lite": _DEEPSEEK_V2_LITE,
}

#: Published (total, active) parameter counts of the real flavors, for docs and tests.
PUBLISHED = {
    "qwen3_30b_a3b": (30.5e9, 3.3e9),
    "deepseek_v3_671b": (671e9, 37e9),
    "deepseek_v2_lite": (15.7e9, 2.4e9),
}


# -- YaRN's factors (here, not in ``attention``: the Hugging Face import needs them without torch) --


def resolve_args(args: MoEArgs) -> MoEArgs:
    """The arguments as the model reads them (``ModelSpec.resolve_args``): under grouped-query
    attention ``n_kv_heads = None`` is ``n_heads`` and ``head_dim = None`` is ``dim // n_heads``;
    the dense FFN's width ``0`` is Llama's rounding of ``multiple_of`` and
    ``ffn_dim_multiplier``, which nothing else reads. MLA reads neither ``n_kv_heads`` nor
    ``head_dim`` (``validate`` refuses them there), so they are left as written."""
    default = MoEArgs()
    resolved = attrs.evolve(
        args,
        dense_hidden_dim=args.ffn_hidden_dim,
        multiple_of=default.multiple_of,
        ffn_dim_multiplier=default.ffn_dim_multiplier,
    )
    if args.attention == "gqa":
        resolved = attrs.evolve(resolved, n_kv_heads=args.kv_heads, head_dim=args.attn_head_dim)
    return resolved


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(args: MoEArgs) -> float:
    """The magnitude YaRN gives cos/sin (Hugging Face's ``attention_factor``)."""
    f = args.rope_scaling_factor
    if args.yarn_mscale and args.yarn_mscale_all_dim:
        return _yarn_mscale(f, args.yarn_mscale) / _yarn_mscale(f, args.yarn_mscale_all_dim)
    return _yarn_mscale(f)


# -- counts -------------------------------------------------------------------------------------


def attention_params(args: MoEArgs) -> int:
    dim = args.dim
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank:
            q = dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * args.n_heads * qk
        else:
            q = dim * args.n_heads * qk
        kv = dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
        kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        return q + kv + args.n_heads * args.v_head_dim * dim
    hd = args.attn_head_dim
    norms = 2 * hd if args.qk_norm else 0
    return 2 * dim * args.n_heads * hd + 2 * dim * args.kv_heads * hd + norms


def _counts(args: MoEArgs) -> tuple[int, int]:
    """(every non-embedding parameter, those one token uses), the output projection included."""
    dim = args.dim
    per_block = attention_params(args) + 2 * dim
    dense = 3 * dim * args.ffn_hidden_dim
    expert = 3 * dim * args.expert_hidden_dim
    moe_fixed = dim * args.n_experts + 3 * dim * args.shared_expert_hidden_dim
    n_moe = args.n_moe_layers
    n_dense = args.n_layers - n_moe
    base = args.n_layers * per_block + n_dense * dense + n_moe * moe_fixed + dim
    # Each MTP module: two input norms, the 2*dim -> dim projection, a MoE block, its final norm.
    n_mtp = args.n_mtp_layers
    base += n_mtp * (3 * dim + 2 * dim * dim + per_block + moe_fixed)
    output = 0 if args.tie_embeddings else args.vocab_size * dim
    total = base + (n_moe + n_mtp) * args.n_experts * expert + output
    active = base + (n_moe + n_mtp) * args.top_k * expert + output
    return total, active


def num_params(args: MoEArgs, include_embedding: bool = True) -> int:
    """Every parameter (every expert); without the embedding table when not ``include_embedding``."""
    total, _ = _counts(args)
    return total + args.vocab_size * args.dim if include_embedding else total


def num_active_params(args: MoEArgs) -> int:
    """Every parameter but the routed experts a token is not sent to (embedding table included,
    see the module docstring)."""
    return _counts(args)[1] + args.vocab_size * args.dim


def num_active_params_without_embedding(args: MoEArgs) -> int:
    """The DeepSeek papers' active count: also without the embedding table (one row is read)."""
    return _counts(args)[1]


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """6 x the active parameters without the embedding table (top-k experts, not all) +
    attention, as for Llama 3; a tied output projection still runs its matmul and is counted."""
    if args.attention == "mla":
        qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
        attention = 6 * (args.n_layers + args.n_mtp_layers) * args.n_heads * (qk + v) * seq_len
    else:
        attention = 12 * (args.n_layers + args.n_mtp_layers) * args.n_heads * args.attn_head_dim * seq_len
    mtp_heads = 6 * args.n_mtp_layers * args.vocab_size * args.dim  # the shared output, again
    tied_output = args.vocab_size * args.dim if args.tie_embeddings else 0
    return 6 * (_counts(args)[1] + tied_output) + attention + mtp_heads


# -- checks ---------------------------------------------------------------------------------------


def _problem(field: str, message: str) -> UsageError:
    return UsageError(f"model.overrides.{field}: {message}")


def check_args(args: MoEArgs) -> None:
    """The arguments' own consistency; one :class:`UsageError` naming the field to change."""
    for name, choices in _CHOICES.items():
        if getattr(args, name) not in choices:
            options = ", ".join(repr(c) for c in choices)
            raise _problem(name, f"expected one of {options}, got {getattr(args, name)!r}")
    # Each attention reads its own fields only: one meant for the other was dropped silently (a
    # DeepSeek flavor with qk_norm = True trained without q/k norm).
    if args.attention == "mla":
        if args.qk_norm:
            raise _problem(
                "qk_norm",
                "q/k norm belongs to attention='gqa' (Qwen3); attention='mla' normalises its "
                "low-rank latents (q_norm, kv_norm) instead; set qk_norm = False",
            )
        if args.n_kv_heads and args.n_kv_heads != args.n_heads:
            raise _problem(
                "n_kv_heads",
                f"attention='mla' has one key/value head per query head (n_heads={args.n_heads}), "
                f"got n_kv_heads={args.n_kv_heads}; leave n_kv_heads unset, or use attention='gqa'",
            )
        if args.head_dim is not None:
            raise _problem(
                "head_dim",
                "attention='mla' sets its head widths with qk_nope_head_dim, qk_rope_head_dim and "
                f"v_head_dim, got head_dim={args.head_dim}; leave head_dim unset, or use attention='gqa'",
            )
    elif args.q_lora_rank:
        raise _problem(
            "q_lora_rank",
            f"attention='gqa' has no low-rank query projection, got q_lora_rank={args.q_lora_rank}; "
            "set q_lora_rank = 0, or use attention='mla'",
        )
    if args.experts_impl not in ("auto", "grouped_mm", "loop"):
        raise _problem("experts_impl", f"expected 'auto', 'grouped_mm' or 'loop', got {args.experts_impl!r}")
    unaligned = [f"{n}={getattr(args, n)}" for n in ("dim", "expert_hidden_dim") if getattr(args, n) % 8]
    if args.experts_impl == "grouped_mm" and unaligned:
        raise _problem(
            "experts_impl",
            f"'grouped_mm' needs 16-byte aligned rows in bf16 (dim and expert_hidden_dim multiples "
            f"of 8), got {', '.join(unaligned)}; use 'auto' or 'loop', or change the widths",
        )
    positive = ["dim", "n_layers", "n_heads", "vocab_size", "n_experts", "top_k", "expert_hidden_dim"]
    positive += ["n_expert_groups", "n_limited_groups", "max_seq_len", "multiple_of"]
    if args.rope_scaling != "none":
        positive.append("rope_original_max_len")
    # None (or 0) picks the default for these two; a negative one is no width.
    positive += [name for name in ("n_kv_heads", "head_dim") if getattr(args, name)]
    if args.attention == "mla":
        # The rotated part of an MLA head carries the positions: without it the model has none.
        positive += ["kv_lora_rank", "v_head_dim", "qk_rope_head_dim"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise _problem(name, f"must be positive, got {getattr(args, name)}")
    # 0 turns these off (or, for dense_hidden_dim, picks Llama's rounding); below is meaningless,
    # and a negative n_dense_layers would make more MoE layers than blocks in the counts.
    at_least_0 = ["n_dense_layers", "dense_hidden_dim", "shared_expert_hidden_dim", "q_lora_rank"]
    if args.attention == "mla":
        at_least_0.append("qk_nope_head_dim")
    for name in at_least_0:
        if getattr(args, name) < 0:
            raise _problem(name, f"must be >= 0, got {getattr(args, name)}")
    if args.n_dense_layers >= args.n_layers:
        # Every block dense: no router, expert or balancing loss, so the MoE settings do nothing.
        raise _problem(
            "n_dense_layers",
            f"{args.n_dense_layers} of the {args.n_layers} blocks dense leaves no MoE block (no router, "
            "no experts, no load balancing); lower n_dense_layers below n_layers, or train a dense "
            "model (the llama3 plugin)",
        )
    # RoPE's frequencies and the dense FFN's width are computed from these: zero, negative, inf or
    # NaN gave NaN at step 1 (a "divergence") or a ZeroDivisionError / math domain error.
    numbers = ["rope_theta"] + ["ffn_dim_multiplier"] * (args.ffn_dim_multiplier is not None)
    if args.rope_scaling != "none":
        numbers.append("rope_scaling_factor")
    if args.rope_scaling == "llama3":
        numbers += ["rope_low_freq_factor", "rope_high_freq_factor"]
    if args.rope_scaling == "yarn":
        numbers += ["yarn_beta_fast", "yarn_beta_slow"]
    for name in numbers:
        if not 0 < getattr(args, name) < math.inf:
            raise _problem(name, f"must be a positive number, got {getattr(args, name)}")
    if args.rope_scaling == "llama3" and args.rope_high_freq_factor <= args.rope_low_freq_factor:
        # Llama 3.1 interpolates between the two wavelengths: equal factors divide by zero there,
        # swapped ones invert which frequencies are kept (Hugging Face refuses both too).
        raise _problem(
            "rope_high_freq_factor",
            f"must be more than rope_low_freq_factor, got {args.rope_high_freq_factor} <= "
            f"{args.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)",
        )
    # YaRN's temperature factors (0: unset): a NaN counted as set and made every logit NaN.
    for name in ["yarn_mscale", "yarn_mscale_all_dim"] * (args.rope_scaling == "yarn"):
        if not 0 <= getattr(args, name) < math.inf:
            raise _problem(name, f"must be a number >= 0 (0: unset), got {getattr(args, name)}")
    if not 0 < args.norm_eps < 1:
        # RMSNorm divides by sqrt(mean(x^2) + eps): eps <= 0 divides by zero on a zero vector.
        raise _problem("norm_eps", f"must be a small positive number (1e-5, 1e-6), got {args.norm_eps}")
    if not args.route_scale > 0 or args.route_scale == float("inf"):
        raise _problem(
            "route_scale", f"must be a positive number (the routed weights' factor), got {args.route_scale}"
        )
    if args.top_k > args.n_experts:
        raise _problem("top_k", f"top_k={args.top_k} exceeds n_experts={args.n_experts}; lower top_k")
    if args.attention == "gqa":
        if args.head_dim is None and args.dim % args.n_heads:
            raise _problem(
                "n_heads",
                f"dim={args.dim} must be a multiple of n_heads={args.n_heads} (head_dim = dim / n_heads); "
                "change dim or n_heads, or set head_dim",
            )
        if args.n_heads % args.kv_heads:
            raise _problem(
                "n_kv_heads",
                f"n_heads={args.n_heads} must be a multiple of n_kv_heads={args.kv_heads} (each K/V "
                "head is shared by n_heads / n_kv_heads query heads); change n_kv_heads",
            )
    if args.rope_dim % 2:
        raise _problem(
            "qk_rope_head_dim" if args.attention == "mla" else "head_dim",
            f"RoPE rotates pairs of dimensions; the rotated width {args.rope_dim} is odd",
        )
    if args.n_experts % args.n_expert_groups:
        raise _problem(
            "n_expert_groups",
            f"n_expert_groups={args.n_expert_groups} must divide n_experts={args.n_experts} (groups "
            "of equal size); pick a divisor of n_experts (1: no group-limited routing)",
        )
    if args.n_limited_groups > args.n_expert_groups:
        raise _problem(
            "n_limited_groups",
            f"n_limited_groups={args.n_limited_groups} exceeds n_expert_groups={args.n_expert_groups} "
            "(the groups a token may use); lower n_limited_groups or raise n_expert_groups",
        )
    per_group = args.n_experts // args.n_expert_groups
    if args.n_expert_groups > 1 and args.top_k > args.n_limited_groups * per_group:
        raise _problem(
            "top_k",
            f"top_k={args.top_k} exceeds the {args.n_limited_groups} x {per_group} experts of the "
            "groups a token may use; raise n_limited_groups or lower top_k",
        )
    if args.n_mtp_layers < 0:
        raise _problem("n_mtp_layers", f"must be >= 0, got {args.n_mtp_layers}")
    if not 0 <= args.mtp_loss_weight < math.inf:
        # NaN passed a "< 0" check and switched the MTP term off (the modules trained nothing).
        raise _problem("mtp_loss_weight", f"must be a number >= 0, got {args.mtp_loss_weight}")
    if args.document_mask and args.bos_id is None:
        raise _problem(
            "bos_id",
            "document_mask=True needs the id of the token that starts a document (the tokenizer's "
            "BOS); set model.overrides.bos_id, or document_mask = False",
        )


def check_tp(args: MoEArgs, tp: int) -> None:
    """Every dimension the TP plan splits must divide by ``tp`` (experts are not split by TP)."""
    sizes: dict[str, int] = {"n_heads": args.n_heads, "vocab_size": args.vocab_size}
    if args.attention == "gqa":
        sizes["n_kv_heads"] = args.kv_heads
    if args.n_moe_layers < args.n_layers:
        sizes["dense ffn hidden dim"] = args.ffn_hidden_dim
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp]
    if bad:
        raise UsageError(
            f"parallelism.tp={tp} must divide the model's {', '.join(bad)} (each TP rank holds an "
            "equal slice); pick a tp that divides them, or change the model (model.overrides)"
        )


def validate(args: MoEArgs, parallel_dims: Any) -> None:
    """``ModelSpec.validate``: refuse what this model cannot do under ``parallel_dims``, before
    anything is built."""
    check_args(args)
    if parallel_dims.tp > 1:
        check_tp(args, parallel_dims.tp)
    if parallel_dims.ep > 1 and args.n_experts % parallel_dims.ep:
        raise UsageError(
            f"parallelism.ep={parallel_dims.ep} must divide the number of experts per layer "
            f"({args.n_experts}); pick an ep that divides it"
        )
    if args.tie_embeddings and parallel_dims.pp > 1:
        raise UsageError(
            "model.overrides.tie_embeddings: the tied embedding and output live on the first and last "
            f"pipeline stages, so they cannot be one parameter with parallelism.pp={parallel_dims.pp}; "
            "set tie_embeddings = False or pp = 1"
        )
    if args.n_mtp_layers:
        used = {d: getattr(parallel_dims, d) for d in ("pp", "tp", "cp") if getattr(parallel_dims, d) > 1}
        if used:
            layout = ", ".join(f"parallelism.{d}={v}" for d, v in used.items())
            raise UsageError(
                f"model.overrides.n_mtp_layers={args.n_mtp_layers}: multi-token prediction needs the "
                f"tokens, the embedding and the output projection in one process, which {layout} "
                "splits; set n_mtp_layers = 0 or those degrees to 1 (FSDP and EP work)"
            )
