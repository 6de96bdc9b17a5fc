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

On a 1-device mesh the fp32 gradients are allocated from the compute stream's memory
(:class:`ComputeStreamGradients`), not from FSDP2's reduce-scatter stream: the caching allocator
keeps one pool per stream, and gradients freed by ``zero_grad`` in the reduce-scatter stream's
pool could not hold the next forward's activations, so on one GPU that pool's memory (all the
gradients) stayed reserved beside the activations' peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from titan_plugins_parallel.model_blocks import model_blocks

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


class ComputeStreamGradients:
    """FSDP2's reduce-scatter buffers taken from the compute stream's pool, for a 1-device mesh.

    ``fully_shard`` allocates the reduce-scatter output, which becomes the sharded gradients the
    optimizer reads, inside its reduce-scatter stream, so the allocator files it under that
    stream; memory freed there serves only later allocations on that stream. On a 1-device mesh
    the reduce-scatter is a copy (FSDP2 skips the collective), so nothing overlaps with compute
    and the separate pool only costs memory. This allocates the buffers on the compute stream
    captured at construction and marks them as used by the reduce-scatter stream
    (``record_stream``), so that a buffer freed while that stream may still read it (gradient
    accumulation adds into ``.grad`` there) is not handed out before it is done.

    An object for ``FSDPModule.set_custom_reduce_scatter``; it follows the interface of
    ``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter`` (``allocate`` and
    ``__call__``; private, pinned by ``tests/plugins/parallel/test_fsdp.py``) without
    inheriting it, so this module imports no torch at import time.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self._streams = torch.get_device_module(device)
        self._compute = self._streams.current_stream()

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        import torch

        comm = self._streams.current_stream()
        with self._streams.stream(self._compute):
            out = torch.empty(*size, dtype=dtype, device=device)
        if comm != self._compute and out.device.type != "cpu":
            out.record_stream(comm)
        return out

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def use_compute_stream_gradients(parts: list[nn.Module], device: Any) -> None:
    """Every ``fully_shard`` unit of ``parts`` (on a 1-device mesh) allocates its gradients
    through :class:`ComputeStreamGradients`."""
    from torch.distributed.fsdp import FSDPModule

    comm = ComputeStreamGradients(device)
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)


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
    # The blocks AC and compile find (an nn.ModuleDict, nn.ModuleList or nn.Sequential).
    blocks = [part.layers[key] for key, _ in model_blocks(part) or []]
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **kwargs)
    fully_shard(part, reshard_after_forward=False, **kwargs)


def reshard_after_forward(ctx: ParallelContext) -> bool:
    """``parallelism.fsdp_reshard_after_forward`` for the blocks' FSDP units (and the experts')."""
    policy = ctx.config.parallelism.fsdp_reshard_after_forward
    if policy == "default":
        # Under pipeline parallelism each stage runs forward and backward for several
        # microbatches; resharding after every forward would re-gather the same parameters per
        # microbatch.
        return ctx.parallel_dims.pp == 1
    return policy == "always"


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    mp_policy = mixed_precision(ctx)
    reshard = reshard_after_forward(ctx)
    mesh = dp_mesh(ctx)
    for part in parts:
        shard_part(part, mesh, mp_policy, reshard)
    if mesh.size() == 1:
        use_compute_stream_gradients(parts, ctx.topology.device)
    if mp_policy is not None:
        ctx.mixed_precision_applied = True
    return parts
