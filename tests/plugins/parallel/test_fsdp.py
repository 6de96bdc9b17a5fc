"""FSDP2 and HSDP on CPU/gloo: same per-step losses as one process on the same global batch; the
single-process (1-device mesh) path and when it applies."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_layout, tiny_config
from titan_core.parallel_dims import ParallelDims
from titan_plugins_parallel import fsdp


@pytest.mark.slow
def test_fsdp_two_ranks_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2}
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_hsdp_two_by_two_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {
        "parallelism.dp_replicate": 2,
        "parallelism.dp_shard": 2,
        "training.local_batch_size": GLOBAL_BATCH // 4,
    }
    assert_losses_close(run_layout(tmp_path, 4, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_fsdp_with_full_activation_checkpointing_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    """The usual large-model combination: checkpoint wrappers inside FSDP units."""
    layout = {
        "parallelism.dp_shard": 2,
        "training.local_batch_size": GLOBAL_BATCH // 2,
        "activation_checkpoint.mode": "full",
    }
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)


def _ctx(dtype: str = "float32", device: str = "cpu", precision: str = "fsdp") -> SimpleNamespace:
    config = tiny_config(
        **{
            "training.dtype": dtype,
            "training.device": device,
            "training.single_device_mixed_precision": precision,
        }
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    topology = SimpleNamespace(device=torch.device("cpu"))
    return SimpleNamespace(
        config=config, parallel_dims=dims, mesh=None, topology=topology, mixed_precision_applied=False
    )


@pytest.mark.parametrize(
    ("dtype", "device", "cuda", "precision", "expected"),
    [
        ("bfloat16", "auto", True, "fsdp", True),  # one CUDA process in bf16: FSDP2 on a 1-device mesh
        ("bfloat16", "cuda", True, "fsdp", True),
        ("bfloat16", "cuda", True, "autocast", False),  # asked for autocast over fp32 weights
        ("bfloat16", "auto", False, "fsdp", False),  # CPU: unchanged (autocast)
        ("bfloat16", "cpu", True, "fsdp", False),
        ("float32", "auto", True, "fsdp", False),  # fp32 on one GPU: nothing to cast, nothing to reduce
    ],
)
def test_one_process_applies_only_for_bf16_on_cuda(
    monkeypatch: pytest.MonkeyPatch, dtype: str, device: str, cuda: bool, precision: str, expected: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    ctx = _ctx(dtype, device, precision)
    assert fsdp.applies(ctx.config, ctx.parallel_dims) is expected


def _tiny_llama3_args() -> Any:
    from titan_plugins_llama3.flavors import Llama3Args

    return Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)


def _reduce_scatter_comms(model: torch.nn.Module) -> list[list[Any]]:
    """Per ``fully_shard`` unit of ``model``, the reduce-scatter objects of its parameter groups
    (private: ``_fsdp_param_groups[*]._reduce_scatter_comm`` in newer torch, one
    ``_fsdp_param_group`` in torch 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    def groups(state: Any) -> list[Any]:
        if hasattr(state, "_fsdp_param_groups"):
            return list(state._fsdp_param_groups)
        return [state._fsdp_param_group] if state._fsdp_param_group is not None else []

    return [
        [group._reduce_scatter_comm for group in groups(unit._get_fsdp_state())]
        for unit in model.modules()
        if isinstance(unit, FSDPModule)
    ]


def test_one_process_mesh_shards_nothing_and_trains_like_the_plain_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 1-device path on CPU/gloo (the CUDA run differs only in NCCL and the bf16 policy):
    a process group and mesh are made for this process, every parameter is a DTensor holding
    the whole tensor, and AdamW steps give the plain model's losses. Every FSDP unit reduces
    through ``ComputeStreamGradients``, and FSDP2 allocates the gradients through it (pins
    ``set_custom_reduce_scatter`` and the ``allocate`` call of FSDP2's 1-device reduction, a
    private contract: ``_reduce_scatter_comm`` on the parameter groups)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    allocated: list[tuple[int, torch.dtype]] = []
    allocate = fsdp.ComputeStreamGradients.allocate

    def counting(
        self: fsdp.ComputeStreamGradients, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        allocated.append((int(torch.Size(size).numel()), dtype))
        return allocate(self, size, dtype=dtype, device=device)

    monkeypatch.setattr(fsdp.ComputeStreamGradients, "allocate", counting)

    from titan_plugins_llama3.model import Llama3

    args = _tiny_llama3_args()
    torch.manual_seed(0)
    plain = Llama3(args)
    plain.init_weights()
    sharded = Llama3(args)
    sharded.load_state_dict(plain.state_dict())
    assert not dist.is_initialized()
    ctx = _ctx()
    try:
        [sharded] = fsdp.apply([sharded], ctx)
        assert dist.is_initialized() and dist.get_world_size() == 1
        params = dict(sharded.named_parameters())
        assert params and all(isinstance(p, DTensor) and p.device_mesh.size() == 1 for p in params.values())
        assert all(p.to_local().shape == p.shape for p in params.values())
        assert ctx.mixed_precision_applied is False  # fp32 on CPU: no casting policy
        comms = _reduce_scatter_comms(sharded)
        assert len(comms) == args.n_layers + 1 and all(comms)  # each block and the root
        assert all(isinstance(c, fsdp.ComputeStreamGradients) for unit in comms for c in unit)
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        losses = {}
        for name, model in (("plain", plain), ("sharded", sharded)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses[name] = []
            for _ in range(3):
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses[name].append(loss.item())
        assert losses["sharded"] == pytest.approx(losses["plain"], rel=1e-5)
        assert losses["plain"][-1] < losses["plain"][0]
        # Each unit's reduction, every step, allocates its gradients through it: all parameters.
        n_params = sum(p.numel() for p in plain.parameters())
        assert sum(n for n, _ in allocated) == 3 * 2 * n_params  # the copy-in buffer and the output
        assert {dtype for _, dtype in allocated} == {torch.float32}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_sharded_mesh_keeps_fsdp2s_own_reduce_scatter() -> None:
    """Gradients come from the compute stream only on a 1-device mesh: with 2 ranks the
    reduce-scatter is a real collective that overlaps with backward, so FSDP2 keeps its own
    stream's buffers (a fake 2-rank group, one process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_plugins_llama3.model import Llama3

    args = _tiny_llama3_args()
    model = Llama3(args)
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ctx = _ctx()
        ctx.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
        ctx.mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard_cp",))
        [model] = fsdp.apply([model], ctx)
        comms = _reduce_scatter_comms(model)
        assert len(comms) == args.n_layers + 1 and all(comms)
        assert not any(isinstance(c, fsdp.ComputeStreamGradients) for unit in comms for c in unit)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("policy", "pp", "expected"),
    [("default", 1, True), ("default", 2, False), ("always", 2, True), ("never", 1, False)],
)
def test_reshard_after_forward_follows_the_config(policy: str, pp: int, expected: bool) -> None:
    ctx = _ctx()
    ctx.config.parallelism.fsdp_reshard_after_forward = policy
    ctx.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=pp, ep=1, world_size=pp)
    assert fsdp.reshard_after_forward(ctx) is expected


@pytest.mark.parametrize(
    ("policy", "gathered_after_forward"), [("always", [False, True]), ("never", [True, True])]
)
def test_blocks_keep_their_gathered_parameters_after_forward_only_when_asked(
    policy: str, gathered_after_forward: list[bool]
) -> None:
    """Between forward and backward a resharded block holds its DTensor shards again and a kept
    one its gathered parameters (plain tensors); the last block is kept in every mode. The
    losses do not depend on it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from titan_plugins_llama3.model import Llama3

    args = _tiny_llama3_args()
    torch.manual_seed(0)
    model = Llama3(args)
    model.init_weights()
    ctx = _ctx()
    ctx.config.parallelism.fsdp_reshard_after_forward = policy
    try:
        [model] = fsdp.apply([model], ctx)
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        logits = model(tokens)
        gathered = [not isinstance(block.attention.wq.weight, DTensor) for block in model.layers.values()]
        assert gathered == gathered_after_forward
        logits.float().pow(2).mean().backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("container", [torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict])
def test_each_block_of_a_list_or_sequential_is_its_own_unit(container: type) -> None:
    """A plugin model's ``layers`` may be an ``nn.ModuleList`` or ``nn.Sequential`` (as AC and
    compile take them): FSDP called ``layers.values()``, which a ModuleList has not, and left a
    Sequential's blocks in the root unit (the whole model gathered at once, no word)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            made = [torch.nn.Linear(8, 8) for _ in range(3)]
            if container is torch.nn.ModuleDict:
                self.layers = container({str(i): m for i, m in enumerate(made)})
            else:
                self.layers = container(*made) if container is torch.nn.Sequential else container(made)
            self.output = torch.nn.Linear(8, 2)

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Blocks()
        fsdp.shard_part(model, init_device_mesh("cpu", (2,)), None, reshard_after_forward=True)
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", "layers.0", "layers.1", "layers.2"]
    finally:
        dist.destroy_process_group()
