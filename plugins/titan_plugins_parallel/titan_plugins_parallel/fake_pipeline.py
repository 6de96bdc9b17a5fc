"""Pipeline stages whose peers are simulated: the PP strategy under the pure ``fake`` backend.

Under ``--comm-backend fake`` one process stands for one PP rank and no peer exists: every
send is dropped and every receive leaves its buffer as it was. ``PipelineStage`` cannot learn
from such a group what its neighbours would tell it: the shapes of the activations it receives
(dynamic metadata inference sends them as pickled objects) and, in torch >= 2.13, the result of
the warm-up vote by which all stages agree on static metadata. So these stages are built with
static metadata, and the vote is answered locally with what every stage would vote (static).

The metadata follows titan's decoder protocol (``docs/plugins.md``): the hidden states passed
between stages are what the token embedding produces on this rank's layout. They are found by
running a copy of the model without blocks (only its first-stage modules) on the meta device, with
the model's tensor-parallel plan applied when TP is on, so sequence sharding shows up exactly as
the real first stage produces it; FSDP mixed precision makes them bfloat16. Nothing is allocated.

``real_pp_fake_spmd`` does not use this module: its PP group is real and the stages talk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch import nn

    from titan_core.parallelize import ParallelContext


def peers_simulated(ctx: ParallelContext) -> bool:
    """Whether the pipeline's peers exist only logically (the backend simulates ``pp``)."""
    return "pp" in ctx.topology.simulated


class SimulatedPeerStage(PipelineStage):
    """A ``PipelineStage`` with static metadata that does not vote over the (fake) group.

    The two overridden methods exist from torch 2.13 on (warm-up vote of
    ``PipelineStage``); on older versions they are never called and static metadata alone
    keeps the stage from asking its peers for shapes.
    """

    # ``torch.tensor`` of a Python value, not ``torch.ones``: under fake tensors (shape-only
    # steps) a lifted one-element constant keeps its value, and the schedule reads it (.item()).
    def _warmup_forward_vote(self, has_backward: bool, received_acc: Any = None) -> torch.Tensor:
        return torch.tensor([1], dtype=torch.int32, device=self.device)  # every stage is static

    def _warmup_backward_result(self, received_result: Any = None) -> torch.Tensor:
        return torch.tensor([1], dtype=torch.int32, device=self.device)

    def forward_one_chunk(self, fwd_chunk_id: int, args: Any, *rest: Any, **kwargs: Any) -> Any:
        # Static metadata has default strides, and torch < 2.13 compares the first stage's input
        # strides: a batch sliced from a longer buffer is copied (tokens only, a few KiB).
        if self.is_first and isinstance(args, (tuple, list)):
            args = type(args)(
                a.clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a
                for a in args
            )
        return super().forward_one_chunk(fwd_chunk_id, args, *rest, **kwargs)


def hidden_states_meta(ctx: ParallelContext, microbatch: int) -> torch.Tensor:
    """The activation one stage sends the next, as a meta tensor of this rank's local shape."""
    from titan_plugins_parallel.pipeline import name_contract_breaks, stage_ends

    with torch.device("meta"):
        shadow = ctx.spec.build(ctx.model_args)
    for name in list(shadow.layers.keys()):
        del shadow.layers[name]
    drop = stage_ends(shadow, ctx.spec)[1]  # the first stage, without its blocks
    for name in drop:
        setattr(shadow, name, None)
    name_contract_breaks(shadow, ctx.spec.name, 0, ctx.state["pp"].num_stages, drop)
    if ctx.parallel_dims.tp > 1 and ctx.spec.tp_plan is not None:
        ctx.spec.tp_plan(shadow, ctx.mesh["tp"], False)
    seq = ctx.config.training.seq_len // ctx.parallel_dims.cp
    tokens = torch.zeros(microbatch, seq, dtype=torch.long, device="meta")
    with torch.no_grad():
        hidden = shadow(tokens)
    if isinstance(hidden, DTensor):
        hidden = hidden.to_local()
    dtype = torch.bfloat16 if ctx.mixed_precision_applied else hidden.dtype
    return torch.empty(hidden.shape, dtype=dtype, device="meta", requires_grad=True)


def simulated_peer_stages(
    parts: list[nn.Module], ctx: ParallelContext, plan: Any, n_microbatches: int, group: Any
) -> list[PipelineStage]:
    """This rank's stages with static input/output metadata (see the module docstring)."""
    microbatch = ctx.config.training.local_batch_size // n_microbatches
    hidden = hidden_states_meta(ctx, microbatch)
    seq = ctx.config.training.seq_len // ctx.parallel_dims.cp
    tokens = torch.empty(microbatch, seq, dtype=torch.long, device="meta")
    # The last stage's logits go to the loss, not to a peer; torch < 2.13 still checks their
    # shape and dtype: the full vocabulary (loss parallel is off under PP), bfloat16 when the
    # run computes in bfloat16 (FSDP mixed precision or autocast).
    vocab = getattr(ctx.model_args, "vocab_size", 1)
    logits_dtype = torch.bfloat16 if ctx.config.training.dtype == "bfloat16" else torch.float32
    logits = torch.empty(microbatch, seq, vocab, dtype=logits_dtype, device="meta", requires_grad=True)
    stages = []
    num_stages = plan.num_stages
    for part, sid in zip(parts, plan.ids, strict=True):
        inputs = tokens if sid == 0 else hidden
        outputs = logits if sid == num_stages - 1 else hidden
        stages.append(
            SimulatedPeerStage(
                part,
                sid,
                num_stages,
                ctx.topology.device,
                input_args=inputs,
                output_args=outputs,
                group=group,
            )
        )
    return stages
