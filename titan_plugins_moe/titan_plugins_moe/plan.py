"""The MoE model's tensor-parallel plan (DTensor, with sequence parallelism), like Llama 3's.

Embedding, final norm and output projection, the block norms and the dense FFN blocks follow
Llama 3's plan: activations between sub-layers are sharded along the sequence (``Shard(1)``),
projections into heads / hidden units are split by output columns, the projections back by input
rows (one reduce-scatter per sub-layer).

* Grouped-query attention: ``wq/wk/wv`` by columns (heads), ``wo`` by rows; the q/k norms act on
  each head and run on the local heads as ``SequenceParallel(sequence_dim=2)`` (their weight's
  gradient is summed over the ranks' heads by DTensor).
* Multi-head latent attention: the low-rank projections ``wq_a`` and ``wkv_a`` and the latent
  norms are small and stay whole on every rank (the attention input is gathered once); ``wq`` /
  ``wq_b`` and ``wkv_b`` are split by heads and ``wo`` by rows. The rotated key shared by all
  heads is computed whole; its gradient is summed over the TP ranks (``tp_group``).
* MoE layers: the gathered sequence goes through the router and the experts whole on every TP
  rank (the experts are not split by TP: expert parallelism shards them), and each rank keeps its
  sequence shard of the output; every rank computes the same values, so the router and expert
  gradients are the same on every rank and need no reduction.

Weights that stay whole become replicated DTensors (:class:`_Replicated`, torchtitan's
``NoParallel``): every parameter of a TP model is then a DTensor on the TP mesh, which the
optimizer's multi-tensor kernels and gradient clipping need (they refuse to mix plain tensors with
DTensors).

Pipeline stages may lack ``tok_embeddings``, ``norm`` or ``output``; their entries are left out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_plugins_moe.attention import MLAttention
from titan_plugins_moe.flavors import check_tp
from titan_plugins_moe.moe import MoE


class _Replicated(ParallelStyle):
    """The module's weights replicated on the TP mesh, computing on whole (plain) inputs.

    Inputs that are plain tensors are taken as replicated (they are the same on every rank),
    outputs are handed back as plain tensors. ``io=False`` only replicates the weights: for
    modules that compute with ``to_local()`` weights themselves (:class:`GroupedExperts`).
    """

    def __init__(self, io: bool = True) -> None:
        super().__init__()
        self.io = io

    @staticmethod
    def _inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Replicate

        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor) else x
            for x in inputs
        )

    @staticmethod
    def _output(module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.to_local()

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        if not self.io:
            return distribute_module(module, device_mesh)
        return distribute_module(module, device_mesh, None, self._inputs, self._output)


def apply_tp(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    """Apply the plan to ``model`` (a whole model or a pipeline stage) in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from titan_core.blocks import tp_plan_ends

    check_tp(model.args, tp_mesh.size())
    tp_plan_ends(model, tp_mesh, loss_parallel)

    for block in model.layers.values():
        plan: dict[str, Any] = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        if isinstance(block.attention, MLAttention):
            attention = block.attention
            # The whole (gathered) input as a plain tensor: the unsplit low-rank projections take it.
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            )
            for name in ("wq", "wq_b", "wkv_b"):
                if getattr(attention, name) is not None:
                    plan[f"attention.{name}"] = ColwiseParallel()
            for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
                if getattr(attention, name) is not None:
                    plan[f"attention.{name}"] = _Replicated()
            attention.tp_group = tp_mesh.get_group()
        else:
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan.update({f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
            if block.attention.q_norm is not None:
                plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
                plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
            plan["feed_forward.router.gate"] = _Replicated()
            plan["feed_forward.experts"] = _Replicated(io=False)
            if block.feed_forward.shared_expert is not None:
                plan["feed_forward.shared_expert"] = _Replicated()
        else:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan.update(
                {
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
