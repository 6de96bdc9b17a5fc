"""A decoder whose feed-forward is a top-k routed mixture of experts, in three styles.

Each block is ``h = x + attention(norm(x)); out = h + ffn(norm(h))`` with RMSNorm, where
attention is grouped-query (optionally with q/k norm and an explicit head width: Qwen3-MoE) or
multi-head latent attention (DeepSeek-V2/V3), see :mod:`titan_plugins_moe.attention`, and the FFN
is a dense SwiGLU for the first ``n_dense_layers`` blocks and a :class:`~titan_plugins_moe.moe.MoE`
after them. Norms, RoPE, the attention call and the SwiGLU come from :mod:`titan_core.blocks`.

The model follows titan's decoder protocol (``docs/plugins.md``): built on meta, ``init_weights``
in place, blocks in ``layers`` (a ``ModuleDict`` keyed by block index), ``None`` ends on pipeline
stages, ``attention_fn`` replaceable for context parallel, ``positions`` for sequence shards.
With ``document_mask=True`` attention is block-causal over the packed documents.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_core import blocks
from titan_core.errors import UsageError
from titan_plugins_moe.attention import Attention, MLAttention, rope_frequencies
from titan_plugins_moe.flavors import MoEArgs, check_args
from titan_plugins_moe.moe import MoE

__all__ = ["MoE", "MoEBlock", "MoETransformer", "build"]


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__()
        self.attention: nn.Module = MLAttention(args) if args.attention == "mla" else Attention(args)
        self.is_moe = layer_id >= args.n_dense_layers
        self.feed_forward: nn.Module = (
            MoE(args) if self.is_moe else blocks.FeedForward(args.dim, args.ffn_hidden_dim)
        )
        self.attention_norm = blocks.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = blocks.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the residual projections, as in torchtitan.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        # mask as a keyword: the TP plan's input layouts describe (x, freqs_cis) only.
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class MoETransformer(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        check_args(args)
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = blocks.RMSNorm(args.dim, eps=args.norm_eps)
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
            if self.tok_embeddings is not None and not self.args.tie_embeddings:
                nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                block.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:
                cutoff = 3 / self.args.dim**0.5
                nn.init.trunc_normal_(
                    self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-cutoff, b=cutoff
                )

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens (batch, seq)`` -> logits ``(batch, seq, vocab)``; on a middle pipeline stage
        the input and output are hidden states ``(batch, seq, dim)``. ``positions (seq,)`` gives
        each token's position when the sequence is a shard (context parallel)."""
        mask = None
        if self.args.document_mask:
            if self.tok_embeddings is None:
                raise UsageError(
                    "model.overrides.document_mask: a pipeline stage without the embedding cannot "
                    "see the tokens the mask comes from; set parallelism.pp = 1 or document_mask = False"
                )
            mask = blocks.document_mask(tokens, self.args.bos_id)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Attention takes the rows it needs (apply_rope slices to its sequence length).
        freqs_cis = self.freqs_cis[positions] if positions is not None else self.freqs_cis
        for block in self.layers.values():
            h = block(h, freqs_cis, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build(args: MoEArgs) -> MoETransformer:
    return MoETransformer(args)
