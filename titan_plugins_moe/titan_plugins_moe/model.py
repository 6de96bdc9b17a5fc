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

Multi-token prediction (``n_mtp_layers > 0``, DeepSeek-V3) adds modules after the last block
(``mtp``, outside ``layers``): module ``k`` combines the previous depth's hidden state at position
``i`` with the embedding of token ``i + k`` (RMSNorm each, concatenate, project ``2*dim -> dim``),
runs one MoE block, and predicts token ``i + k + 1`` through its own RMSNorm and the shared
output projection. The targets are the input tokens themselves, so the last ``k + 1`` positions
of depth ``k`` have none. The mean of the depths' cross-entropies times ``mtp_loss_weight``
enters the objective through its gradient (as the MoE balance loss does); the logits returned
are the main model's, and ``mtp_stats`` collects the values for the router callback's logs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_core import blocks
from titan_plugins_moe.attention import Attention, MLAttention, rope_frequencies
from titan_plugins_moe.flavors import MoEArgs, check_args
from titan_plugins_moe.moe import MoE, _AddAuxLoss, _records_this_forward

__all__ = ["MTPModule", "MoE", "MoEBlock", "MoETransformer", "build"]


class MoEBlock(blocks.DecoderBlock):
    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        attention: nn.Module = MLAttention(args) if args.attention == "mla" else Attention(args)
        is_moe = layer_id >= args.n_dense_layers
        feed_forward: nn.Module = (
            MoE(args) if is_moe else blocks.FeedForward(args.dim, args.ffn_hidden_dim, fuse_w13=args.fuse_w13)
        )
        super().__init__(layer_id, args.dim, args.norm_eps, attention, feed_forward)
        self.is_moe = is_moe


class MTPModule(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3; DeepSeek's checkpoint names in comments)."""

    def __init__(self, depth: int, args: MoEArgs) -> None:
        super().__init__()
        self.enorm = blocks.RMSNorm(args.dim, eps=args.norm_eps)  # on the token embedding
        self.hnorm = blocks.RMSNorm(args.dim, eps=args.norm_eps)  # on the previous hidden state
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = MoEBlock(args.n_layers + depth, args)
        self.norm = blocks.RMSNorm(args.dim, eps=args.norm_eps)  # before the shared output

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, freqs_cis: torch.Tensor, mask: Any
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(x, freqs_cis, mask=mask)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()


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
        self.mtp: nn.ModuleList | None = None
        if args.n_mtp_layers:
            self.mtp = nn.ModuleList([MTPModule(k, args) for k in range(args.n_mtp_layers)])
        #: Per training forward, the multi-token-prediction term added (``None``: not recorded).
        self.mtp_stats: list[torch.Tensor] | None = None
        #: The share of the step's objective one forward's MTP term is: ``1 / microbatches`` under
        #: gradient accumulation, as the trainer scales the language-model loss (router callback).
        self.mtp_loss_scale = 1.0
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
            for module in self.mtp or []:
                module.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:
                cutoff = 3 / self.args.dim**0.5
                nn.init.trunc_normal_(
                    self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-cutoff, b=cutoff
                )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        input_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens (batch, seq)`` -> logits ``(batch, seq, vocab)``; on a middle pipeline stage
        the input and output are hidden states ``(batch, seq, dim)``. ``positions (seq,)`` gives
        each token's position when the sequence is a shard (context parallel).
        ``input_tokens (batch, seq)``: on a pipeline stage after the first, the token ids of its
        microbatch, which the document mask comes from."""
        h, freqs_cis, mask = blocks.stage_inputs(self, tokens, positions, input_tokens)
        for block in self.layers.values():
            h = block(h, freqs_cis, mask=mask)
        if self.norm is None or self.output is None:
            return h
        logits = self.output(self.norm(h))
        if self.mtp is not None and self.args.mtp_loss_weight > 0 and torch.is_grad_enabled():
            logits = _AddAuxLoss.apply(logits, self._mtp_loss(tokens, h, freqs_cis))
        return logits

    def _mtp_loss(self, tokens: torch.Tensor, hidden: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """``mtp_loss_weight`` x the mean over depths of each depth's token cross-entropy."""
        import torch.nn.functional as F

        assert self.mtp is not None and self.tok_embeddings is not None and self.output is not None
        seq = tokens.shape[1]
        losses = []
        for k, module in enumerate(self.mtp, start=1):
            n = seq - k - 1  # positions i < n have a target t[i + k + 1] among the inputs
            if n <= 0:
                break
            mask = blocks.document_mask(tokens[:, :n], self.args.bos_id) if self.args.document_mask else None
            hidden = module(hidden[:, :n], self.tok_embeddings(tokens[:, k : k + n]), freqs_cis, mask)
            logits = self.output(module.norm(hidden))
            target = tokens[:, k + 1 : k + 1 + n]
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()))
        if not losses:  # sequences too short to have a target at any depth
            return hidden.new_zeros((), dtype=torch.float32)
        # The mean over the depths that have a target: a sequence shorter than n_mtp_layers + 2
        # leaves the deepest ones out, and counting them shrank the term.
        loss = torch.stack(losses).sum() * (self.args.mtp_loss_weight * self.mtp_loss_scale / len(losses))
        if self.mtp_stats is not None:
            _record_mtp(self, loss)
        return loss


@torch.compiler.disable
def _record_mtp(model: MoETransformer, loss: torch.Tensor) -> None:
    if model.mtp_stats is not None and _records_this_forward():
        model.mtp_stats.append(loss.detach())


def build(args: MoEArgs) -> MoETransformer:
    return MoETransformer(args)
