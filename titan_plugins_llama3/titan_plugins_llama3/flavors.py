"""Llama 3 hyper-parameters per flavor, and analytic parameter and FLOP counts.

Counts are computed from the arguments alone so that ``--print-config`` and MFU need no model.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Llama3Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    #: Llama 3.1 RoPE scaling (factor, low/high frequency factors, original context length);
    #: ``rope_scaling=False`` uses plain RoPE.
    rope_scaling: bool = True
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 131072
    #: Tie the output projection to the token embedding.
    tie_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Llama's SwiGLU width: 2/3 of 4*dim, times an optional multiplier, rounded up.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000),
    "8B": Llama3Args(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": Llama3Args(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": Llama3Args(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096
    ),
}


def num_params(args: Llama3Args, include_embedding: bool = True) -> int:
    dim, hd = args.dim, args.head_dim
    attention = dim * args.n_heads * hd * 2 + dim * args.kv_heads * hd * 2  # wq, wo, wk, wv
    ffn = 3 * dim * args.ffn_hidden_dim
    block = attention + ffn + 2 * dim  # two RMSNorm weights
    embedding = args.vocab_size * dim
    output = 0 if args.tie_embeddings else args.vocab_size * dim
    total = args.n_layers * block + dim + output  # final norm
    return total + embedding if include_embedding else total


def flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters + attention scores and values.

    The attention term is 12 x layers x heads x head_dim x seq_len (forward 2 matmuls of
    2 x seq x head_dim each, backward twice the forward), counting the full square although the
    mask is causal, as torchtitan and Megatron-LM do, so MFU figures compare directly.
    """
    return 6 * num_params(args, include_embedding=False) + 12 * args.n_layers * args.n_heads * (
        args.head_dim * seq_len
    )
