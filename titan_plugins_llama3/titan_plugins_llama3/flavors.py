"""Llama 3 hyper-parameters per flavor, analytic parameter and FLOP counts, and the checks of a
flavor against a parallel layout (:func:`validate`, the ``ModelSpec.validate`` of the plugin).

Everything here works from the arguments alone, without torch, so that ``--print-config``, MFU
and the checks run before (and without) building a model.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from titan_core.errors import UsageError


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
    #: Tie the output projection to the token embedding (one parameter).
    tie_embeddings: bool = False
    #: Block-causal attention over packed documents: a token attends only to earlier tokens of
    #: its own document (a ``bos_id`` token starts one). Flex attention on CUDA.
    document_mask: bool = False
    #: The token that starts a document; set by the trainer from the tokenizer's BOS id.
    bos_id: int | None = None
    #: Compute Q, K and V with one matmul over the concatenated ``wq``/``wk``/``wv`` weights
    #: (parameters and checkpoints keep the three names; ``titan_core.blocks.Attention``).
    fuse_qkv: bool = True
    #: Compute the SwiGLU gate and up projections with one matmul over the concatenated
    #: ``w1``/``w3`` weights (parameters and checkpoints keep both names;
    #: ``titan_core.blocks.FeedForward``). Under selective AC's ``op`` policy a block then
    #: recomputes one matmul less (``w3``) and keeps one ``ffn_hidden_dim``-wide activation
    #: more: faster where memory allows (8B shape on one H100: 1.054x for 5 GiB more).
    fuse_w13: bool = False

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


def resolve_args(args: Llama3Args) -> Llama3Args:
    """The arguments as the model reads them (``ModelSpec.resolve_args``): ``n_kv_heads = None``
    is ``n_heads``, so a checkpoint saved under either spelling resumes under the other."""
    return attrs.evolve(args, n_kv_heads=args.kv_heads)


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
    mask is causal, as torchtitan and Megatron-LM do, so MFU figures compare directly. A tied
    output projection shares the embedding's weight but still runs its matmul, so it is counted.
    """
    tied_output = args.vocab_size * args.dim if args.tie_embeddings else 0
    return 6 * (
        num_params(args, include_embedding=False) + tied_output
    ) + 12 * args.n_layers * args.n_heads * (args.head_dim * seq_len)


def check_tp(args: Llama3Args, tp: int) -> None:
    """One error naming every dimension that ``tp`` does not divide (the TP plan splits heads,
    KV heads and FFN units over the ranks, and the embedding and output over the vocabulary)."""
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "ffn hidden dim": args.ffn_hidden_dim,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp]
    if bad:
        raise UsageError(
            f"parallelism.tp={tp} must divide the model's {', '.join(bad)} (each TP rank holds an "
            "equal slice); pick a tp that divides them, or change the model (model.overrides)"
        )


def validate(args: Llama3Args, parallel_dims: Any) -> None:
    """``ModelSpec.validate``: refuse what this model cannot do under ``parallel_dims``, before
    anything is built. One :class:`UsageError` per problem, naming what to change."""
    positive = ["n_layers", "dim", "n_heads", "vocab_size", "multiple_of", "max_seq_len"]
    if args.n_kv_heads is not None:  # None: as many as n_heads
        positive.append("n_kv_heads")
    if args.rope_scaling:  # 0 made every wavelength "long": all frequencies slowed, silently
        positive.append("rope_original_max_len")
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(
                f"model.overrides.{name}: expected a positive integer, got {getattr(args, name)}"
            )
    numbers = ["rope_theta"]
    if args.rope_scaling:  # the factors divide the original length (ZeroDivisionError at build)
        numbers += ["rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"]
    numbers += ["ffn_dim_multiplier"] * (args.ffn_dim_multiplier is not None)
    for name in numbers:
        value = getattr(args, name)
        if not 0 < value < math.inf:  # NaN too: RoPE's frequencies or the FFN width from it
            raise UsageError(f"model.overrides.{name}: expected a positive number, got {value}")
    if args.rope_scaling and args.rope_high_freq_factor <= args.rope_low_freq_factor:
        # Llama 3.1 interpolates frequencies between the two wavelengths: equal factors divide
        # by zero there, swapped ones invert which frequencies are kept (as HF refuses too).
        raise UsageError(
            f"model.overrides.rope_high_freq_factor: expected more than rope_low_freq_factor, got "
            f"{args.rope_high_freq_factor} <= {args.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)"
        )
    if not 0 < args.norm_eps < 1:
        # RMSNorm divides by sqrt(mean(x^2) + eps): eps <= 0 gives NaN at the first step.
        raise UsageError(
            f"model.overrides.norm_eps: expected a small positive number (such as 1e-5), got {args.norm_eps}"
        )
    if args.dim % args.n_heads:
        raise UsageError(
            f"model.overrides: dim={args.dim} must be a multiple of n_heads={args.n_heads} "
            "(head_dim = dim / n_heads); change dim or n_heads"
        )
    if args.head_dim % 2:
        # RoPE rotates pairs of features: an odd head_dim built and failed at step 1 inside attention.
        raise UsageError(
            f"model.overrides: head_dim = dim / n_heads = {args.dim} / {args.n_heads} = {args.head_dim} "
            "is odd; rotary embeddings rotate pairs of a head's features: change dim or n_heads"
        )
    if args.n_heads % args.kv_heads:
        raise UsageError(
            f"model.overrides: n_heads={args.n_heads} must be a multiple of n_kv_heads={args.kv_heads} "
            "(each K/V head is shared by n_heads / n_kv_heads query heads); change n_kv_heads"
        )
    if parallel_dims.tp > 1:
        check_tp(args, parallel_dims.tp)
    if args.tie_embeddings and parallel_dims.pp > 1:
        raise UsageError(
            f"model.overrides.tie_embeddings: the tied embedding and output live on the first and "
            f"last pipeline stages, so they cannot be one parameter with parallelism.pp={parallel_dims.pp}; "
            "set tie_embeddings = False or pp = 1"
        )
