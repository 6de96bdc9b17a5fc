"""The Llama 3 architecture from titan's shared blocks (:mod:`titan_core.blocks`): RMSNorm, RoPE
with Llama 3.1 scaling, grouped-query attention without K/V copies, SwiGLU feed-forward.

The module follows titan's decoder protocol: it is built on the meta device, ``init_weights``
initialises every parameter and buffer in place, blocks live in ``layers`` (a ``ModuleDict``
keyed by block index, so pipeline stages keep the original names), and any of
``tok_embeddings``/``norm``/``output`` may be ``None`` on a pipeline stage that lacks them.
Attention goes through ``self.attention_fn`` so a context-parallel strategy can replace it.

With ``document_mask=True`` a token attends only to earlier tokens of its own packed document
(block-causal attention): the mask is derived from the input tokens (a ``bos_id`` token starts
a document, as the data loader frames them), built once per forward and shared by all blocks.
With ``tie_embeddings=True`` the output projection and the token embedding are one parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_core import blocks
from titan_core.errors import UsageError
from titan_plugins_llama3.flavors import Llama3Args


def rope_scaling(args: Llama3Args) -> blocks.RopeScaling | None:
    if not args.rope_scaling:
        return None
    return blocks.RopeScaling(
        factor=args.rope_scaling_factor,
        low_freq_factor=args.rope_low_freq_factor,
        high_freq_factor=args.rope_high_freq_factor,
        original_max_len=args.rope_original_max_len,
    )


def rope_frequencies(args: Llama3Args, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Complex rotations ``(seq_len, head_dim // 2)`` with Llama 3.1's frequency scaling."""
    return blocks.rope_frequencies(args.head_dim, seq_len, args.rope_theta, rope_scaling(args), device=device)


class TransformerBlock(blocks.DecoderBlock):
    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        attention = blocks.Attention(args.dim, args.n_heads, args.n_kv_heads, fuse_qkv=args.fuse_qkv)
        feed_forward = blocks.FeedForward(args.dim, args.ffn_hidden_dim, fuse_w13=args.fuse_w13)
        super().__init__(layer_id, args.dim, args.norm_eps, attention, feed_forward)


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        if args.document_mask and args.bos_id is None:
            raise UsageError(
                "model.overrides.bos_id: document_mask=True needs the id of the token that starts a "
                "document (the tokenizer's BOS); the tokenizer has none: set model.overrides.bos_id, "
                "or model.overrides.document_mask = False"
            )
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = blocks.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            # One parameter (the core keeps the two names tied through meta build and to_empty).
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_weights, never checkpointed.
        self.register_buffer("freqs_cis", rope_frequencies(args, args.max_seq_len), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise parameters and buffers in place (after ``to_empty`` on the real device).

        A tied embedding/output weight is initialised once, as the output projection (std
        ``dim**-0.5``): the embedding's std 1 would give logits of std ``sqrt(dim)``.
        """
        with torch.no_grad():
            device = buffer_device or self.freqs_cis.device
            self.freqs_cis = rope_frequencies(self.args, self.args.max_seq_len, device=device)
            if self.tok_embeddings is not None and not self.args.tie_embeddings:
                nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                block.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:  # tied with PP > 1 is refused by flavors.validate
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
        # Under sequence parallelism h holds a slice of the sequence: attention takes its rows.
        h, freqs_cis, mask = blocks.stage_inputs(self, tokens, positions, input_tokens)
        for block in self.layers.values():
            h = block(h, freqs_cis) if mask is None else block(h, freqs_cis, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build(args: Llama3Args) -> Llama3:
    return Llama3(args)
