"""MoE hyper-parameters per flavor, and analytic parameter and FLOP counts.

The attention and RoPE fields have the names Llama 3's modules read, so the MoE model reuses
them unchanged; the FFN of every block past the first ``n_dense_layers`` is a routed MoE.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class MoEArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    #: Routed experts per MoE layer and experts each token is sent to.
    n_experts: int = 8
    top_k: int = 2
    #: Hidden width of one routed expert (SwiGLU).
    expert_hidden_dim: int = 256
    #: Hidden width of the always-on shared expert; 0 disables it.
    shared_expert_hidden_dim: int = 256
    #: Renormalise the top-k router probabilities of a token to sum to 1.
    route_norm: bool = True
    #: Leading blocks with a dense SwiGLU FFN instead of a MoE (as DeepSeek-V3 does).
    n_dense_layers: int = 1
    #: Dense FFN width (Llama's rounding: a multiple of ``multiple_of``).
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


FLAVORS: dict[str, MoEArgs] = {
    "debugmodel": MoEArgs(),
    # Same shape, no shared expert and top-1 routing: the plainest MoE, for tests.
    "debugmodel_top1": MoEArgs(top_k=1, shared_expert_hidden_dim=0),
}


def _counts(args: MoEArgs) -> tuple[int, int]:
    """(all non-embedding parameters, those active for one token)."""
    dim, hd = args.dim, args.head_dim
    attention = dim * args.n_heads * hd * 2 + dim * args.kv_heads * hd * 2
    norms = 2 * dim
    dense = 3 * dim * args.ffn_hidden_dim
    expert = 3 * dim * args.expert_hidden_dim
    shared = 3 * dim * args.shared_expert_hidden_dim
    router = dim * args.n_experts
    n_moe = args.n_layers - min(args.n_dense_layers, args.n_layers)
    n_dense = args.n_layers - n_moe
    base = args.n_layers * (attention + norms) + n_dense * dense + n_moe * (router + shared) + dim
    output = 0 if args.tie_embeddings else args.vocab_size * dim
    total = base + n_moe * args.n_experts * expert + output
    active = base + n_moe * args.top_k * expert + output
    return total, active


def num_params(args: MoEArgs, include_embedding: bool = True) -> int:
    total, _ = _counts(args)
    return total + args.vocab_size * args.dim if include_embedding else total


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """6 x parameters active per token (top-k experts, not all) + attention, as for Llama 3."""
    _, active = _counts(args)
    return 6 * active + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
