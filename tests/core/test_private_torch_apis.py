"""Every private torch API titan relies on, in one place: a rename upstream fails here, loudly.

Each entry says where titan uses it and why no public API does. For methods titan overrides in a
subclass, the base class must still have them, or the override would silently stop applying.
"""

from __future__ import annotations

import importlib

import pytest
import torch

# (module, attribute path, where titan uses it and why)
PRIVATE_APIS = [
    (
        "torch.utils.checkpoint",
        "SAC_IGNORED_OPS",
        "activation checkpointing: the profiler annotations FSDP's hooks issue are let through selective "
        "checkpointing uncounted (expert parallel's units annotate their recomputation more often)",
    ),
    (
        "torch",
        "ops.profiler._record_function_enter_new",
        "activation checkpointing: one of the annotation operators added to SAC_IGNORED_OPS",
    ),
    (
        "torch._dynamo",
        "list_backends",
        "compile plugin: checks compile.backend (torch.compiler has no backend registry)",
    ),
    (
        "torch._dynamo",
        "lookup_backend",
        "compile plugin: the backend that activation_checkpoint.mode = 'memory_budget' wraps",
    ),
    (
        "torch._inductor.config",
        "max_autotune_gemm_backends",
        "compile plugin: compile.autotune keeps matmuls on cuBLAS while Triton tiles are searched",
    ),
    (
        "torch._functorch.config",
        "activation_memory_budget",
        "compile plugin: the min-cut partitioner's budget under 'memory_budget' (a compiler knob only)",
    ),
    (
        "torch.distributed.device_mesh",
        "DeviceMesh._flatten",
        "parallel_dims.build_mesh: flattened dp_shard_cp / dp_cp views (no public API in 2.11-2.14)",
    ),
    (
        "torch.distributed.distributed_c10d",
        "_set_pg_timeout",
        "comm.shorten_timeouts: comm.train_timeout_seconds after step 1 (no public setter)",
    ),
    (
        "torch.distributed._functional_collectives",
        "all_gather_tensor_autograd",
        "context_parallel: autograd-aware K/V all-gather (torch 2.11; newer adds *_single_autograd)",
    ),
    (
        "torch.testing._internal.distributed.fake_pg",
        "FakeStore",
        "comm plugin fake backend: registers the 'fake' process group and its store",
    ),
    (
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "memory plugin tracker: follows every storage an operator allocates on CPU",
    ),
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator._propagate_tensor_meta_non_cached",
        "memory plugin tracker: paused while DTensor infers global shapes on fake tensors of the "
        "run's own FakeTensorMode (they stand for no memory; counted, a 405B rank 'peaked' at TBs)",
    ),
    (
        "torch._subclasses.fake_tensor",
        "FakeTensorMode",
        "titan_core.fake_tensors: shape-only steps under simulated peers (debug.fake_tensors)",
    ),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "activation checkpointing: wraps blocks (what torchtitan uses; no public wrapper)",
    ),
    ("torch.utils._pytree", "tree_leaves", "memory plugin tracker: tensors among an operator's outputs"),
    (
        "torch.cuda.memory",
        "_record_memory_history",
        "profiler plugin: CUDA memory snapshots (what torch's memory_viz documents; no public name)",
    ),
    ("torch.cuda.memory", "_snapshot", "profiler/memory plugins: the allocator's snapshot"),
    ("torch.cuda.memory", "_dump_snapshot", "profiler plugin: writes the snapshot pickle"),
    (
        "torch.cuda",
        "_memory_viz",
        "memory plugin's tests and bench/gpu_debug.py read snapshot pickles with it",
    ),
    (
        "torch._subclasses.fake_tensor",
        "FakeTensor",
        "memory plugin tracker: fake tensors stand for real memory",
    ),
    (
        "torch._C._distributed_c10d",
        "_dump_fr_trace",
        "comm plugin: dumps the gloo flight recorder (no public API)",
    ),
    (
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "comm plugin: peers ask each other to dump; topology.post_failure: a failed rank tells its peers why",
    ),
    (
        "torch.distributed.distributed_c10d",
        "_world",
        "comm plugin: process-group names for the dumps (pg_names)",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage.get_local_bwd_output",
        "pipeline plugin: a V schedule's forward-only eval (validation) hands no input gradients "
        "between a rank's two stages (torch's asserts a backward; no public hook)",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage.set_local_bwd_input",
        "pipeline plugin: the other half of that handoff",
    ),
    (
        "torch._functorch.config",
        "unsafe_treat_script_objects_as_zero_size",
        "compile plugin: 'memory_budget' under TP sizes the TP process group (a graph input) as "
        "zero bytes (torch >= 2.13; 2.11's partitioner does not size it)",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._warmup_forward_vote",
        "fake_pipeline.SimulatedPeerStage overrides it (torch >= 2.13) so simulated peers never vote",
    ),
    (
        "torch.distributed.pipelining.stage",
        "PipelineStage._warmup_backward_result",
        "fake_pipeline.SimulatedPeerStage overrides it (torch >= 2.13)",
    ),
]


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path", "why"), PRIVATE_APIS, ids=[p for _, p, _ in PRIVATE_APIS])
def test_private_api_exists(module: str, path: str, why: str) -> None:
    import torch

    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if path.startswith("PipelineStage._warmup") and major_minor < (2, 13):
        pytest.skip("the warm-up vote exists from torch 2.13 on; older versions never call it")
    if path == "unsafe_treat_script_objects_as_zero_size" and major_minor < (2, 13):
        pytest.skip("2.11's partitioner does not size script objects; titan sets it where it exists")
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"torch {torch.__version__} lacks {module}.{path} ({exc}); used by {why}")


def test_sac_ignored_ops_is_the_set_selective_checkpointing_reads() -> None:
    """The activation-checkpoint plugin adds to it in place: it must stay a set the policy reads."""
    from torch.utils import checkpoint

    assert isinstance(checkpoint.SAC_IGNORED_OPS, set)
    assert torch.ops.aten.detach.default in checkpoint.SAC_IGNORED_OPS  # what it holds upstream


def test_grouped_mm_has_a_public_or_private_entry() -> None:
    """The MoE plugin's grouped GEMM: torch.nn.functional.grouped_mm, or torch._grouped_mm before it."""
    import torch
    import torch.nn.functional as F

    assert hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm"), "no grouped GEMM in this torch"


def test_inductor_backend_takes_config_patches() -> None:
    """compile.autotune under memory_budget passes its inductor settings as ``config_patches``
    through the registered inductor backend (a custom backend gets no ``torch.compile`` options)."""
    import inspect

    import torch
    from torch._inductor.compile_fx import compile_fx

    assert "config_patches" in inspect.signature(compile_fx).parameters
    inductor = inspect.signature(torch._dynamo.lookup_backend("inductor"))
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inductor.parameters.values())
    assert hasattr(torch._inductor.config, "max_autotune")


def test_storage_info_fields_the_dcp_plugin_reads() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    fields = set(getattr(_StorageInfo, "__dataclass_fields__", {}))
    assert {"relative_path", "offset", "length"} <= fields, fields


def test_overrides_still_override_a_base_method() -> None:
    """The fake pipeline stage's overrides must shadow methods the base class really calls."""
    from torch.distributed.pipelining.stage import PipelineStage

    from titan_plugins_parallel.fake_pipeline import SimulatedPeerStage

    for name in ("_warmup_forward_vote", "_warmup_backward_result", "forward_one_chunk"):
        if (
            name in vars(SimulatedPeerStage)
            and name.startswith("_warmup")
            and not hasattr(PipelineStage, name)
        ):
            pytest.skip(f"{name} not in this torch (older than 2.13)")
        assert hasattr(PipelineStage, name), (
            f"PipelineStage.{name} is gone: SimulatedPeerStage's override is dead"
        )


def test_storage_cdata_names_one_storage_across_views_and_wrappers() -> None:
    """The memory plugin names storages without an address (fake tensors' meta storages) by
    ``UntypedStorage._cdata``: one value per storage, whichever view or Python wrapper asks."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert a.untyped_storage().device.type == "meta"
    assert a.untyped_storage()._cdata == a[1:].untyped_storage()._cdata
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata
