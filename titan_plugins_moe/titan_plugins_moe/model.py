"""A Llama-style decoder whose feed-forward is a top-k routed mixture of experts.

Attention, RoPE and the dense SwiGLU come from the Llama 3 plugin. A MoE layer is:

* ``Router``: a linear gate, softmax over experts, the ``top_k`` experts of each token (scores
  renormalised to sum to 1 when ``route_norm``);
* ``GroupedExperts``: all experts' SwiGLU weights stacked on a leading expert dimension
  (``w1, w3: (experts, hidden, dim)``, ``w2: (experts, dim, hidden)``), applied to tokens sorted
  by expert;
* an optional always-on shared expert.

What expert parallelism relies on (``titan_plugins_parallel.expert_parallel``): a module with
``grouped_experts = True`` keeps its expert weights on dim 0 and is called as
``experts(tokens_sorted_by_expert, num_tokens_per_expert)``; it may hold a slice of the experts
as DTensor shards (it computes with the local shard), and EP wraps its call with the token
dispatch and combine.

The model follows titan's decoder protocol (see ``titan_plugins_llama3.model``): built on meta,
``init_weights`` in place, blocks in ``layers``, ``None`` ends on pipeline stages,
``attention_fn`` replaceable for context parallel, ``positions`` for sequence shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins_llama3.model import Attention, FeedForward, rope_frequencies
from titan_plugins_moe.flavors import MoEArgs


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel DTensor weight (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class Router(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.route_norm = args.route_norm
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (tokens, dim)`` -> scores and expert indices, both ``(tokens, top_k)``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        scores, experts = probs.topk(self.top_k, dim=-1)
        if self.route_norm and self.top_k > 1:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores, experts

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std)


class GroupedExperts(nn.Module):
    """All routed experts of one layer; see the module docstring for the EP contract."""

    grouped_experts = True

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.n_experts
        hidden = args.expert_hidden_dim
        self.w1 = nn.Parameter(torch.empty(args.n_experts, hidden, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, hidden))
        self.w3 = nn.Parameter(torch.empty(args.n_experts, hidden, args.dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x (tokens, dim)`` sorted by expert; ``num_tokens_per_expert`` for the local experts."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        counts = num_tokens_per_expert.tolist()
        outs = [
            (F.silu(chunk @ w1[i].T) * (chunk @ w3[i].T)) @ w2[i].T
            for i, chunk in enumerate(torch.split(x, counts))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=std)


class MoE(nn.Module):
    """Top-k routed experts plus an optional shared expert, on ``(batch, seq, dim)``."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = Router(args)
        self.experts = GroupedExperts(args)
        self.shared_expert: FeedForward | None = None
        if args.shared_expert_hidden_dim:
            self.shared_expert = FeedForward(_SharedWidth(args.dim, args.shared_expert_hidden_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, experts = self.router(x)
        flat = experts.reshape(-1)  # (tokens * top_k,) token-major
        order = flat.argsort(stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        routed = self.experts(x[order // self.top_k], counts)
        # Back to token-major slots (a gather, deterministic), weight by score, sum the top_k.
        routed = routed[order.argsort()] * scores.reshape(-1, 1).to(routed.dtype)
        out = routed.view(-1, self.top_k, shape[-1]).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)

    def init_weights(self, std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std)


class _SharedWidth:
    """The two fields Llama 3's FeedForward reads, for the shared expert's width."""

    def __init__(self, dim: int, hidden: int) -> None:
        self.dim = dim
        self.ffn_hidden_dim = hidden


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__()
        self.attention = Attention(args)  # type: ignore[arg-type]  # same field names
        self.is_moe = layer_id >= args.n_dense_layers
        self.feed_forward: nn.Module = MoE(args) if self.is_moe else FeedForward(args)  # type: ignore[arg-type]
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class MoETransformer(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        if args.top_k > args.n_experts:
            raise ValueError(f"top_k={args.top_k} exceeds n_experts={args.n_experts}")
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", rope_frequencies(args, args.max_seq_len), persistent=False)  # type: ignore[arg-type]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        with torch.no_grad():
            device = buffer_device or self.freqs_cis.device
            self.freqs_cis = rope_frequencies(self.args, self.args.max_seq_len, device=device)  # type: ignore[arg-type]
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
        """As ``Llama3.forward``: tokens (or hidden states on a later pipeline stage) -> logits."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Attention takes the rows it needs (Llama 3's apply_rope slices to its sequence length).
        freqs_cis = self.freqs_cis[positions] if positions is not None else self.freqs_cis
        for block in self.layers.values():
            h = block(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build(args: MoEArgs) -> MoETransformer:
    return MoETransformer(args)
