"""Attention of the MoE architectures and their rotary embeddings.

* :class:`Attention`: grouped-query attention with an explicit ``head_dim`` and optional q/k
  RMSNorm over each head before RoPE (Qwen3); :class:`titan_core.blocks.Attention` has neither.
* :class:`MLAttention`: DeepSeek's multi-head latent attention. Queries come from a low-rank
  projection (``wq_a`` -> RMSNorm -> ``wq_b``; a full ``wq`` when ``q_lora_rank = 0``), keys and
  values from a compressed latent (``wkv_a`` -> RMSNorm -> ``wkv_b``). Position enters through a
  decoupled part: each query head has ``qk_rope_head_dim`` rotated dimensions, and one rotated key
  of that width (from ``wkv_a``) is shared by every head.
* :func:`rope_frequencies`: the ``freqs_cis`` table for ``rope_scaling`` ``none``, ``llama3``
  (:func:`titan_core.blocks.rope_frequencies`) or ``yarn`` (as Hugging Face computes it for
  DeepSeek and Qwen: ramped interpolation, and an attention factor folded into the table's
  magnitude; MLA also scales its logits by ``mscale_all_dim``'s factor squared).

RoPE rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (:func:`titan_core.blocks.apply_rope`),
the layout of Meta's and DeepSeek's checkpoints; Qwen3's Hugging Face weights rotate halves, and
the state-dict adapter permutes their query/key rows (see ``hf``). Both modules call
``self.attention_fn`` (replaceable by context parallel) through
:func:`titan_core.blocks.call_attention`, and reshape heads with ``-1`` so that they work on a
tensor-parallel slice of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from titan_core import blocks
from titan_plugins_moe.flavors import MoEArgs, _yarn_mscale, yarn_attention_factor

#: RMSNorm epsilon of MLA's latent norms: fixed in DeepSeek's code and Hugging Face's.
LATENT_NORM_EPS = 1e-6


def _yarn_inv_freq(args: MoEArgs, dim: int, device: Any) -> torch.Tensor:
    base, factor, original = args.rope_theta, args.rope_scaling_factor, args.rope_original_max_len

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it by the factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_frequencies(args: MoEArgs, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Complex rotations ``(seq_len, rope_dim // 2)`` for ``args.rope_scaling``."""
    dim = args.rope_dim
    if args.rope_scaling == "yarn":
        inv_freq = _yarn_inv_freq(args, dim, device)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        return torch.polar(torch.full_like(angles, yarn_attention_factor(args)), angles)
    scaling = None
    if args.rope_scaling == "llama3":
        scaling = blocks.RopeScaling(
            factor=args.rope_scaling_factor,
            low_freq_factor=args.rope_low_freq_factor,
            high_freq_factor=args.rope_high_freq_factor,
            original_max_len=args.rope_original_max_len,
        )
    return blocks.rope_frequencies(dim, seq_len, args.rope_theta, scaling, device=device)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, an explicit head width and optional q/k RMSNorm; Q, K
    and V from one matmul where the projections allow it (``blocks.project_qkv``, ``fuse_qkv``)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.head_dim = hd = args.attn_head_dim
        self.fuse_qkv = args.fuse_qkv
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = blocks.RMSNorm(hd, eps=args.norm_eps)
            self.k_norm = blocks.RMSNorm(hd, eps=args.norm_eps)
        self.attention_fn: Any = blocks.attention

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = blocks.project_qkv(self.wq, self.wk, self.wv, x, fuse=self.fuse_qkv)
        q = q.view(bs, seq, -1, self.head_dim)
        k = k.view(bs, seq, -1, self.head_dim)
        v = v.view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # The norms save their inputs: copies, not views that keep the fused QKV output alive.
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = blocks.apply_rope(q, freqs_cis), blocks.apply_rope(k, freqs_cis)
        out = blocks.call_attention(
            self.attention_fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group (Megatron's "f").

    Under tensor parallelism MLA's rotated key is computed whole on every rank but used by this
    rank's heads only, so each rank holds part of its gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_lora_rank = args.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        heads = args.n_heads
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: nn.RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = blocks.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = blocks.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # Attention's default scale is 1/sqrt(qk); YaRN multiplies it by mscale**2, folded into q.
        self.q_scale = 1.0
        if args.rope_scaling == "yarn" and args.yarn_mscale_all_dim:
            self.q_scale = _yarn_mscale(args.rope_scaling_factor, args.yarn_mscale_all_dim) ** 2
        self.attention_fn: Any = blocks.attention
        #: Set by the TP plan: the group over which the shared rotated key's gradient is summed.
        self.tp_group: Any = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))  # type: ignore[misc]
        q = q.view(bs, seq, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = blocks.apply_rope(q_rope, freqs_cis)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = blocks.apply_rope(k_rope.unsqueeze(2), freqs_cis)  # (bs, seq, 1, rope_dim)
        if self.tp_group is not None:
            k_rope = _SumGradOver.apply(k_rope, self.tp_group)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = blocks.call_attention(
            self.attention_fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
