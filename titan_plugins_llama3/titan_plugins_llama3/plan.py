"""Llama 3's tensor-parallel plan: Megatron-style TP with sequence parallelism (DTensor).

Per block, attention's ``wq/wk/wv`` and the feed-forward's ``w1/w3`` are split by output columns
(each rank holds a slice of the heads / hidden units) and ``wo``/``w2`` by input rows, so each
sub-layer needs one reduction. Between sub-layers the activations are sharded along the
sequence (``Shard(1)``): the RMSNorms run on sequence shards, the input of attention and
feed-forward is all-gathered, and the row-split outputs are reduce-scattered back to sequence
shards. The embedding is split by vocabulary rows and produces sequence shards; the output
projection is split by vocabulary columns and either keeps its logits sharded on the vocabulary
(``loss_parallel``, the loss is computed on the shards) or gathers them.

Pipeline stages may lack ``tok_embeddings``, ``norm`` or ``output`` (``None``); their entries are
left out of the plan. Attention reshapes with ``view(bs, seq, -1, head_dim)``, so it works on the
local slice of heads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_plugins_llama3.flavors import check_tp

__all__ = ["apply_tp", "check_tp"]


def apply_tp(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    """Apply the plan to ``model`` (a whole model or a pipeline stage) in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from titan_core.blocks import tp_plan_ends

    check_tp(model.args, tp_mesh.size())
    tp_plan_ends(model, tp_mesh, loss_parallel)

    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
