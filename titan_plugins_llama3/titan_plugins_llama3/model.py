"""The Llama 3 architecture: RMSNorm, RoPE with Llama 3.1 scaling, grouped-query attention
through ``scaled_dot_product_attention``, SwiGLU feed-forward.

The module follows titan's decoder protocol: it is built on the meta device, ``init_weights``
initialises every parameter and buffer in place, blocks live in ``layers`` (a ``ModuleDict``
keyed by block index, so pipeline stages keep the original names), and any of
``tok_embeddings``/``norm``/``output`` may be ``None`` on a pipeline stage that lacks them.
Attention goes through ``self.attention_fn`` so a context-parallel strategy can replace it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins_llama3.flavors import Llama3Args


def rope_frequencies(args: Llama3Args, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Complex rotations ``(seq_len, head_dim // 2)`` with Llama 3.1's frequency scaling."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    if args.rope_scaling:
        low_wavelen = args.rope_original_max_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        # Long wavelengths are slowed by the factor, short ones kept, the middle interpolated.
        smooth = (args.rope_original_max_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        scaled = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(
            wavelen > low_wavelen,
            freqs / args.rope_scaling_factor,
            torch.where(wavelen < high_wavelen, freqs, scaled),
        )
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by the first ``seq`` rows of
    ``freqs_cis (>= seq, head_dim/2)``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    # freqs_cis may cover more positions than x (the whole buffer): x's length is only known
    # here, after sequence-parallel activations were gathered for attention.
    rotated = xc * freqs_cis[: xc.shape[1]].view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, seq, head_dim)`` causal attention; K/V heads already expanded."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Replaced by context parallelism with an attention that sees the whole sequence.
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        repeats = q.shape[2] // k.shape[2]
        if repeats > 1:  # grouped-query attention: share each K/V head among `repeats` queries
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the residual projections, as in torchtitan.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_weights, never checkpointed.
        self.register_buffer("freqs_cis", rope_frequencies(args, args.max_seq_len), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise parameters and buffers in place (after ``to_empty`` on the real device)."""
        with torch.no_grad():
            device = buffer_device or self.freqs_cis.device
            self.freqs_cis = rope_frequencies(self.args, self.args.max_seq_len, device=device)
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                block.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None and not self.args.tie_embeddings:
                cutoff = 3 / self.args.dim**0.5
                nn.init.trunc_normal_(
                    self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-cutoff, b=cutoff
                )

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens (batch, seq)`` -> logits ``(batch, seq, vocab)``; on a middle pipeline stage
        the input and output are hidden states ``(batch, seq, dim)``. ``positions (seq,)`` gives
        each token's position when the sequence is a shard (context parallel)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Under sequence parallelism h holds a slice of the sequence: attention takes its rows.
        freqs_cis = self.freqs_cis[positions] if positions is not None else self.freqs_cis
        for block in self.layers.values():
            h = block(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build(args: Llama3Args) -> Llama3:
    return Llama3(args)
