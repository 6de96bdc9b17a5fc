"""FSDP2 and HSDP: ``torch.distributed.fsdp.fully_shard`` on each transformer block and the root.

Parameters are sharded over the ``dp_shard_cp`` mesh axis (data-sharding and context ranks
together, so context-parallel ranks also share parameter shards and reduce gradients). With
``dp_replicate > 1`` the mesh is 2-D ``(dp_replicate, dp_shard_cp)``: HSDP, sharded within a
group and replicated across groups. Each block is its own FSDP unit so only one block's full
parameters live at a time; the root unit holds what remains (embeddings, final norm, output).

On CUDA with ``training.dtype = "bfloat16"`` parameters are cast to bf16 for compute and
gradients reduced in fp32 (``MixedPrecisionPolicy``); the trainer then skips autocast. This is
also why the strategy applies to a single CUDA process with bf16 (as torchtitan does): on a
1-device mesh FSDP2 keeps the fp32 master weights and the optimizer state in fp32, casts each
block's parameters to bf16 once per forward (and once more for backward) into its own buffers,
and hands the optimizer fp32 gradients. Autocast instead would cast the fp32 weights at every
use, again in every recomputation, and keep fp32 activations at its boundaries. The 1-device
mesh needs a process group: one is created (NCCL, world size 1, an in-memory store) when the
run has none; the comm backend's shutdown destroys it with the others. On CPU nothing changes:
one process trains unsharded in fp32 (or under autocast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    """Whenever gradients must be reduced over data or context ranks, and for bf16 mixed
    precision on a single CUDA process (``training.single_device_mixed_precision = "fsdp"``)."""
    return parallel_dims.dp > 1 or parallel_dims.cp > 1 or _one_cuda_process_bf16(config, parallel_dims)


def _one_cuda_process_bf16(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    t = config.training
    if parallel_dims.world_size != 1 or t.dtype != "bfloat16" or t.single_device_mixed_precision != "fsdp":
        return False
    if config.training.device == "cpu":
        return False
    import torch

    # The default comm backend computes on CUDA whenever it is available and not refused.
    return torch.cuda.is_available()


def one_device_mesh(device: Any) -> Any:
    """A 1-D mesh ``("dp_shard_cp",)`` of this process alone, creating a world-size-1 process
    group (NCCL on CUDA, gloo on CPU) when there is none."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if cuda else None,
        )
    return init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard_cp",))


def dp_mesh(ctx: ParallelContext) -> Any:
    """``dp_shard_cp`` for FSDP, ``(dp_replicate, dp_shard_cp)`` for HSDP; a 1-device mesh on a
    single process."""
    if ctx.mesh is None:
        return one_device_mesh(ctx.topology.device)
    if ctx.parallel_dims.dp_replicate == 1:
        return ctx.mesh["dp_shard_cp"]
    if ctx.parallel_dims.cp == 1:  # dp_shard_cp is dp_shard: slice the world mesh's own dims
        return ctx.mesh["dp_replicate", "dp_shard"]
    # HSDP with CP needs the flattened dim beside a world one (torch >= 2.11 warns it is deprecated).
    return ctx.mesh.world["dp_replicate", "dp_shard_cp"]


def mixed_precision(ctx: ParallelContext) -> Any:
    """bf16 compute with fp32 gradient reduction on CUDA; ``None`` (fp32 throughout) otherwise."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if ctx.config.training.dtype == "bfloat16" and ctx.topology.device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_part(part: nn.Module, mesh: Any, mp_policy: Any, reshard_after_forward: bool) -> None:
    """``fully_shard`` each block of ``part.layers`` (when present), then ``part`` itself.

    The last block is not resharded after forward: backward starts with it, so freeing its
    parameters only to gather them again at once would be wasted communication. The root unit
    is never resharded after forward either (FSDP2 keeps the root's parameters for backward).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    layers = getattr(part, "layers", None)
    blocks = list(layers.values()) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else []
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **kwargs)
    fully_shard(part, reshard_after_forward=False, **kwargs)


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    mp_policy = mixed_precision(ctx)
    # Under pipeline parallelism each stage runs forward and backward for several microbatches;
    # resharding after every forward would re-gather the same parameters per microbatch.
    reshard_after_forward = ctx.parallel_dims.pp == 1
    mesh = dp_mesh(ctx)
    for part in parts:
        shard_part(part, mesh, mp_policy, reshard_after_forward)
    if mp_policy is not None:
        ctx.mixed_precision_applied = True
    return parts
