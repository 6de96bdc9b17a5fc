"""Context parallelism: each ``cp`` rank holds a slice of every sequence; attention sees all of it.

Load balancing for causal attention: the sequence is cut into ``2 * cp`` equal chunks and CP rank
``i`` holds chunks ``i`` and ``2*cp - 1 - i``, so every rank has the same amount of work under the
causal mask (an early chunk attends to little, its partner at the end to almost everything).

Attention gathers K and V from all CP ranks with an autograd-aware functional all-gather
(backward: reduce-scatter of the K/V gradients back to their owners; grouped-query K/V with
their own, fewer heads) and masks by *global* position: a query at position ``p`` sees keys at
positions ``<= p`` (of its own document, with a document mask). This is exact against attention
without CP (the same scores, summed in another order), runs on gloo and NCCL, and costs
``O(seq)`` K/V memory per rank; on CUDA the mask is a flex-attention block mask, so a shard skips
the key blocks above its queries. PyTorch's own ``context_parallel`` (ring attention) needs CUDA
and is not used so that CPU runs work too.

The model supplies the hooks (titan's decoder protocol): attention modules call
``self.attention_fn(q, k, v)`` on ``(batch, heads, seq, head_dim)`` tensors, and the model's
forward names a ``positions`` parameter (the global position of each local token, for RoPE;
``**kwargs`` alone is refused, since it can take them unread).

Gradients: each rank's loss is the mean over its own tokens; FSDP reduces gradients over
``dp_shard_cp`` with an average, and the all-gather's backward sums every rank's contribution
to each K/V, so the result is the gradient of the mean loss over all tokens (the loss-match
tests against a one-process run check this).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from titan_core.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext
    from titan_core.records import ModelSpec


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    """Whenever the context-parallel degree is above 1."""
    return parallel_dims.cp > 1


def check(config: TrainerConfig, parallel_dims: ParallelDims, spec: ModelSpec, model_args: Any) -> list[str]:
    """``Strategy.check``: every sequence must cut into ``2 * cp`` equal chunks."""
    cp, seq_len = parallel_dims.cp, config.training.seq_len
    if seq_len % (2 * cp):
        return [
            f"context parallel with cp={cp} cuts each sequence into 2*cp = {2 * cp} equal chunks, "
            f"but training.seq_len={seq_len} is not a multiple of {2 * cp}; change seq_len or cp"
        ]
    return []


def chunk_positions(cp_rank: int, cp: int, seq_len: int) -> list[int]:
    """Global positions held by ``cp_rank``: chunks ``cp_rank`` and ``2*cp - 1 - cp_rank``."""
    size = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return [*range(first * size, (first + 1) * size), *range(second * size, (second + 1) * size)]


def _all_gather_seq(x: torch.Tensor, group: Any, order: torch.Tensor) -> torch.Tensor:
    """All-gather ``(batch, heads, seq, dim)`` along ``seq`` with autograd, the gathered rows
    (rank-major) taken in ``order``."""
    import torch.distributed._functional_collectives as funcol

    # all_gather_single_autograd (newer torch) and all_gather_tensor_autograd (2.11) gather
    # along dim 0; gathering there and moving seq back keeps both paths the same. The rows are
    # reordered before seq moves back, so that the gradient reaching the gather is contiguous:
    # torch 2.11's reduce-scatter backward refuses a strided one.
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    gathered = gather(x.movedim(2, 0).contiguous(), gather_dim=0, group=group)
    return gathered.index_select(0, order).movedim(0, 2)


class GatheredKVAttention:
    """Causal attention for a load-balanced sequence shard (replaces ``attention_fn``).

    The gathered K/V are put in sequence order, and the shard's queries attend to them through
    ``titan_core.blocks.attention`` with this shard's rows of the mask: causal by global position
    (``blocks.causal_mask_rows``), or the rows a model with a document mask passes
    (``blocks.document_mask_rows``). On CUDA both are flex-attention block masks, so a shard
    computes the scores at or below the diagonal only, as attention without CP does; elsewhere
    they are boolean tensors for SDPA. K/V keep their own heads (``grouped_kv``): grouped-query
    attention gathers ``n_kv_heads``, not ``n_heads``."""

    #: K/V may arrive with fewer heads than Q (titan_core.blocks' attention-function contract).
    grouped_kv = True

    def __init__(self, local_positions: torch.Tensor, all_positions: torch.Tensor, group: Any) -> None:
        from titan_core import blocks

        self.group = group
        self.local_len = local_positions.numel()
        #: Gathered (rank-major) K/V rows -> sequence order.
        self.order = all_positions.argsort()
        self.causal = blocks.causal_mask_rows(local_positions, all_positions.numel())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        from titan_core import blocks

        if q.shape[2] != self.local_len:
            raise UsageError(
                f"context parallel expected {self.local_len} local tokens per sequence, got "
                f"{q.shape[2]}; every batch must have training.seq_len tokens"
            )
        k_all = _all_gather_seq(k, self.group, self.order)
        v_all = _all_gather_seq(v, self.group, self.order)
        return blocks.attention(q, k_all, v_all, mask=self.causal if mask is None else mask)


class BatchSharder:
    """A batch transform: this rank's positions of every sequence, and ``positions`` for RoPE.

    ``whole_tokens``: the model's forward also gets the whole sequences' token ids as
    ``input_tokens`` (a document mask needs them: a document may start on another rank's
    shard). Under pipeline parallelism the schedule takes them from there and hands every stage
    its microbatch's rows."""

    def __init__(self, positions: torch.Tensor, whole_tokens: bool = False) -> None:
        self.positions = positions
        self.whole_tokens = whole_tokens

    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any]]:
        idx = self.positions.to(inputs.device)
        extra = {"input_tokens": inputs} if self.whole_tokens else {}
        return inputs[:, idx], labels[:, idx], {**kwargs, "positions": idx, **extra}


def forward_takes_positions(model: nn.Module) -> bool:
    """Whether ``model``'s forward names a ``positions`` parameter that takes a keyword.

    ``**kwargs`` alone does not count: it accepts the keyword and may never read it, and RoPE
    would then use each shard's local positions, silently wrong. Positional-only does not count
    either: the batch transform passes ``positions`` as a keyword."""
    param = inspect.signature(model.forward).parameters.get("positions")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    """Shard every batch and replace attention (:func:`check` passed before anything was built;
    only a model without a replaceable ``attention_fn`` is refused here, by its modules)."""
    import torch

    # The trainer ran check first; a direct caller may not have, and a seq_len the chunks do not
    # divide would train on fewer positions than the batch holds, without a word.
    if problems := check(ctx.config, ctx.parallel_dims, ctx.spec, ctx.model_args):
        raise UsageError("; ".join(problems))
    if not all(forward_takes_positions(part) for part in parts):
        raise UsageError(
            f"model {ctx.spec.name!r}: its forward does not take a named `positions` argument "
            "(`**kwargs` alone does not count: it can swallow them unread): context parallel "
            "shards the sequence, so each rank's RoPE or position table needs the global "
            "positions of the tokens it holds, passed as `positions=` (docs/plugins.md, the "
            "decoder protocol); add a `positions` parameter and use it, or set parallelism.cp = 1"
        )
    cp = ctx.parallel_dims.cp
    seq_len = ctx.config.training.seq_len
    cp_rank = ctx.parallel_dims.coordinates(ctx.topology.rank)["cp"]
    device = ctx.topology.device
    local = torch.tensor(chunk_positions(cp_rank, cp, seq_len), device=device)
    everyone = torch.tensor([p for r in range(cp) for p in chunk_positions(r, cp, seq_len)], device=device)
    attention = GatheredKVAttention(local, everyone, ctx.mesh["cp"].get_group())
    replaced = 0
    for part in parts:
        for module in part.modules():
            if hasattr(module, "attention_fn"):
                module.attention_fn = attention
                replaced += 1
    if not replaced:
        raise UsageError(
            f"model {ctx.spec.name!r} has no attention module with an `attention_fn` to replace, "
            "so it cannot run with context parallel; set parallelism.cp = 1"
        )
    takes_tokens = all("input_tokens" in inspect.signature(part.forward).parameters for part in parts)
    ctx.batch_transforms.append(BatchSharder(local, whole_tokens=takes_tokens))
    return parts
