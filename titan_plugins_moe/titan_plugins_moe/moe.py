"""The mixture-of-experts layer: router, grouped experts, optional shared expert, balancing.

* :class:`Router`: a linear gate scores every expert (``softmax`` over experts, or a per-expert
  ``sigmoid`` as DeepSeek-V3); the experts of a token are the ``top_k`` of ``score + expert_bias``
  (the bias is DeepSeek-V3's auxiliary-loss-free balancing term: it steers the choice only, never
  the weights), optionally limited to the best ``n_limited_groups`` of ``n_expert_groups`` groups
  (a group's score is the sum of its two best experts). A token's weights are the scores of its
  experts, renormalised to sum to 1 with ``route_norm`` (top-1: weight 1) and multiplied by
  ``route_scale``.
* :class:`GroupedExperts`: all experts' SwiGLU weights stacked on a leading expert dimension
  (``w1, w3 (experts, hidden, dim)``, ``w2 (experts, dim, hidden)``), applied to the tokens sorted
  by expert (``grouped_mm``). Dropless: every token reaches its experts, there is no capacity.
* :class:`MoE`: sorts token slots by expert, runs the experts, puts the outputs back in token
  order with a gather (no atomics: deterministic on CUDA), weights and sums them, adds the shared
  expert.

Expert parallelism (``titan_plugins_parallel.expert_parallel``) relies on this contract: a module
with ``grouped_experts = True`` and ``num_experts`` keeps its weights on dim 0 and is called as
``experts(tokens_sorted_by_expert, num_tokens_per_expert)``; its weights may be DTensor shards
(it computes with the local ones), and EP wraps its call with the token dispatch and combine.

Balancing and statistics, without a host sync:

* when the plugin's router callback sets ``stats`` to a list, every forward that builds a graph
  (not a recomputation under activation checkpointing) appends its token count, per-expert
  counts and balance loss (device tensors); the callback takes them after each optimizer step
  (bias update, statistics). A list, not a running sum, because torch's pipeline schedules run
  an extra forward on placeholder tensors in their first step (metadata inference): the callback
  knows how many tokens a step routes and drops the surplus forwards, which come first;
* with ``aux_loss_weight > 0`` the layer adds DeepSeek's sequence-wise balance loss
  ``weight * mean over sequences of sum_i f_i * P_i`` to the training objective by injecting its
  gradient during backward (:class:`_AddAuxLoss`): nothing has to reach the loss function, so it
  works on every pipeline stage; the value goes to ``stats`` for the logs. Under context
  parallelism (``aux_cp_group``, set by the router callback) a sequence's expert counts are summed
  over its shards with a functional all-reduce (:func:`sequence_balance_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import blocks
from titan_core.fake_tensors import even_split, is_fake
from titan_plugins_moe.flavors import MoEArgs
from titan_plugins_moe.grouped_mm import swiglu_grouped_mm, swiglu_loop, use_grouped_mm


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor weight (expert parallel), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class Router(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.n_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.n_groups = args.n_expert_groups
        self.n_limited_groups = args.n_limited_groups
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        # Persistent: the auxiliary-loss-free bias is learnt (by the router callback) and saved.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (tokens, dim)`` -> ``(weights, experts)`` both ``(tokens, top_k)``, and the scores
        of every expert ``(tokens, experts)`` (float32)."""
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores.detach() + self.expert_bias
        if self.n_groups > 1:
            grouped = choice.view(-1, self.n_groups, self.num_experts // self.n_groups)
            best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = best_two.topk(self.n_limited_groups, dim=-1).indices
            allowed = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights, experts, scores

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std)
        self.expert_bias.zero_()


class GroupedExperts(nn.Module):
    """All routed experts of one layer; see the module docstring for the EP contract."""

    grouped_experts = True

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.n_experts
        #: ``auto``, ``grouped_mm`` or ``loop`` (see :mod:`titan_plugins_moe.grouped_mm`).
        self.impl = args.experts_impl
        hidden = args.expert_hidden_dim
        self.w1 = nn.Parameter(torch.empty(args.n_experts, hidden, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, hidden))
        self.w3 = nn.Parameter(torch.empty(args.n_experts, hidden, args.dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x (tokens, dim)`` sorted by expert; ``num_tokens_per_expert`` for the local experts."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        grouped = self.impl == "grouped_mm" or (self.impl == "auto" and use_grouped_mm(x, w1, w2))
        run = swiglu_grouped_mm if grouped else swiglu_loop
        return run(x, num_tokens_per_expert, w1, w2, w3)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=std)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets gradient 1, as if it were added to the loss.

    The auxiliary loss then shapes the router's gradient wherever the layer runs (any pipeline
    stage, under activation checkpointing or compile) without travelling to the loss function.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor, aux: torch.Tensor
    ) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)  # type: ignore[attr-defined]
        return out.view_as(out)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_meta  # type: ignore[attr-defined]
        return grad, torch.ones(shape, dtype=dtype, device=device)


def tokens_per_expert(sorted_slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many token slots each expert gets (int64, ``(num_experts,)``), from the slots sorted by
    expert: where each expert's run starts. Unlike ``torch.bincount``, whose output is sized by
    the largest value (on CUDA it reads that back to the host: a sync in every MoE layer's
    forward), the shape is fixed and nothing is read back, so a compiled block keeps it in its
    graph."""
    bounds = torch.arange(num_experts + 1, device=sorted_slots.device, dtype=sorted_slots.dtype)
    return torch.searchsorted(sorted_slots, bounds).diff()


def _records_this_forward() -> bool:
    """Whether this forward is one whose statistics count: it builds a graph (training) and is
    not a recomputation during backward (activation checkpointing re-runs forwards inside the
    autograd engine, where the current graph task id is set)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


@torch.compiler.disable
def _record(moe: MoE, tokens: int, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
    if moe.stats is not None and _records_this_forward():
        moe.stats.append((tokens, counts.detach(), None if aux is None else aux.detach()))


def _sum_over(load: torch.Tensor, group: Any) -> torch.Tensor:
    """``load`` summed over the ranks of ``group``: a functional all-reduce (no host sync; traced
    as a collective under compile). Counts carry no gradient, so no autograd variant is needed."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(load, "sum", group)


def sequence_balance_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    batch: int,
    top_k: int,
    cp_group: Any = None,
    cp: int = 1,
) -> torch.Tensor:
    """Per sequence ``sum_i f_i * P_i`` (DeepSeek-V2/V3), ``(batch,)``; 1 when perfectly balanced.

    ``f_i``: the fraction of the sequence's tokens routed to expert ``i``, times ``experts /
    top_k`` (equally: the fraction of its ``tokens x top_k`` slots, times ``experts``);
    ``P_i``: the mean over the sequence of the expert's normalised score.

    Context parallel (``cp_group`` of ``cp`` ranks, each holding an equal shard of every
    sequence): ``f_i`` is the whole sequence's (the shards' counts summed over the group) and
    ``P_i`` the mean over this rank's shard, so the mean of the ranks' terms is the whole
    sequence's ``sum_i f_i * P_i``, and its gradient, which the data-parallel gradient average over
    the ``cp`` ranks takes, is the whole sequence's too (``f`` is a constant of the gradient).
    """
    n_experts = scores.shape[-1]
    probs = scores / scores.sum(dim=-1, keepdim=True)  # softmax scores are normalised already
    mean_probs = probs.reshape(batch, -1, n_experts).mean(dim=1)
    slots = experts.reshape(batch, -1)
    load = torch.zeros(batch, n_experts, device=scores.device, dtype=scores.dtype)
    load.scatter_add_(1, slots, torch.ones_like(slots, dtype=scores.dtype))
    if cp_group is not None:
        load = _sum_over(load, cp_group)
    load = load * (n_experts / (slots.shape[1] * cp))
    return (load * mean_probs).sum(dim=-1)


class MoE(nn.Module):
    """Top-k routed experts plus an optional shared expert, on ``(batch, seq, dim)``."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.num_experts = args.n_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args)
        self.shared_expert: blocks.FeedForward | None = None
        if args.shared_expert_hidden_dim:
            self.shared_expert = blocks.FeedForward(
                args.dim, args.shared_expert_hidden_dim, fuse_w13=args.fuse_w13
            )
        #: Weight of the sequence-wise balance loss (0: off) and the number of sequences its
        #: per-sequence terms are averaged over (``None``: this forward's batch; the router
        #: callback sets the sequences of a step, so pipeline and gradient-accumulation microbatches
        #: add up to the step's mean).
        self.aux_loss_weight = 0.0
        self.aux_batch_size: int | None = None
        #: Context parallel: the process group over which each sequence is sharded and its size
        #: (the router callback sets them; ``None``: every sequence is whole on this rank).
        self.aux_cp_group: Any = None
        self.aux_cp = 1
        #: ``(tokens, tokens per expert, balance loss)`` of each forward since the router
        #: callback last took them; ``None``: not recorded (no callback).
        self.stats: list[tuple[int, torch.Tensor, torch.Tensor | None]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, experts, scores = self.router(flat)
        slots = experts.reshape(-1)  # (tokens * top_k,) token-major
        order = slots.argsort(stable=True)  # token slots grouped by expert
        if is_fake(slots):  # no values to count: an even split (titan_core.fake_tensors)
            counts = torch.tensor(even_split(slots.numel(), self.num_experts), device=slots.device)
        else:
            counts = tokens_per_expert(slots[order], self.num_experts)
        routed = self.experts(flat[order // self.top_k], counts)
        # Back to token-major slots (a gather), weight in float32, sum over the top_k choices.
        routed = routed[order.argsort()].float() * weights.reshape(-1, 1)
        out = routed.view(-1, self.top_k, dim).sum(dim=1).to(x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        aux = None
        if self.aux_loss_weight > 0 and torch.is_grad_enabled():
            per_sequence = sequence_balance_loss(
                scores, experts, batch, self.top_k, self.aux_cp_group, self.aux_cp
            )
            aux = per_sequence.sum() * (self.aux_loss_weight / (self.aux_batch_size or batch))
            out = _AddAuxLoss.apply(out, aux)
        if self.stats is not None:
            _record(self, flat.shape[0], counts, aux)
        return out.view_as(x)

    def init_weights(self, std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std)
