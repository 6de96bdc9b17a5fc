"""``torch.compile`` of each transformer block (``compile.enable``).

Blocks are compiled one by one and in place (``nn.Module.compile``), as torchtitan does: all
blocks share one compiled graph (they have the same structure), compilation stays short, FSDP
still sees plain modules to shard, and state-dict keys gain no ``_orig_mod.`` prefix. Applied
after activation checkpointing so the recomputed region is the compiled block (under tensor
parallelism or ``activation_checkpoint.debug``, a whole-block checkpoint stays eager around it:
:func:`_compiled_region`). The blocks are
those of ``model.layers`` (:func:`titan_plugins_parallel.model_blocks.model_blocks`); a model
without ``layers`` is refused, as activation checkpointing refuses it, rather than listed as
compiled while it runs eager.

Nothing recompiles after the first step: dynamo inlines the blocks' modules (their parameters
are graph inputs, not guarded constants), so every block reuses the graph of the first, and a
block's inputs keep their shapes, dtypes and types from step to step. That includes a document
mask that is new each batch (a boolean tensor on CPU, a flex-attention ``BlockMask`` built from a
fresh closure on CUDA: dynamo guards on the closure's code, its tensors are inputs).
``tests/plugins/parallel/test_compile.py`` counts the graphs over several steps.

``activation_checkpoint.mode = "memory_budget"`` hands recomputation to the compiler: AOTAutograd's
min-cut partitioner, given ``torch._functorch.config.activation_memory_budget``, keeps the outputs
worth the most recompute time per byte until the share ``activation_checkpoint.memory_budget`` of
the block's activations is spent (torchtitan's mode of that name). The budget is read when a graph
is partitioned, so the blocks compile through a backend that sets it around its inner backend:
scoped to titan's blocks (other compiled code keeps its setting), and a backend object of its own
per build, because dynamo reuses a compiled graph only for the backend that compiled it; a
process-wide setting would let a second trainer in the process run the first one's graphs.

``compile.autotune`` (on CUDA) compiles the blocks with inductor's ``max_autotune`` and ATen
matmuls: inductor then benchmarks several tile sizes of each Triton kernel it generates and keeps
the fastest, where its defaults are one guess per GPU. On an H200 that is worth most for flex
attention (a Llama 3 1B block's document-masked attention, forward and backward, 3.79 ms
instead of 4.16 ms: ``bench/flex_tune.py``); matmuls stay cuBLAS, which the Triton matmul
templates rarely beat at training shapes and would take minutes to search. The eager path's
flex attention is compiled with autotuning already (``titan_core.blocks``); inside a compiled
block it is part of the block's graph and gets the block's settings.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_core.errors import UsageError
from titan_plugins_parallel.config import checkpoints_whole_blocks
from titan_plugins_parallel.model_blocks import model_blocks

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.compile.enable


#: The inductor settings of ``compile.autotune``.
AUTOTUNE = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}


def inductor_settings(config: TrainerConfig, device: Any) -> dict[str, Any]:
    """The inductor settings the blocks compile with on ``device`` (empty: inductor's defaults)."""
    on_cuda = torch.device(device).type == "cuda"
    if config.compile.autotune and on_cuda and config.compile.backend == "inductor":
        return dict(AUTOTUNE)
    return {}


def backend(config: TrainerConfig, settings: dict[str, Any] | None = None) -> Any:
    """What the blocks compile with: ``compile.backend``'s name, or a memory-budget wrapper of it
    (compiling with the inductor ``settings``, which torch.compile passes only to a backend named
    by its name)."""
    name = config.compile.backend
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        # The debug and experimental backends are accepted but not listed (a dozen testing ones).
        raise UsageError(
            f"compile.backend = {name!r} is not a torch.compile backend; use one of "
            f"{', '.join(sorted({*torch._dynamo.list_backends(), 'aot_eager', 'eager'}))}"
        )
    ac = config.activation_checkpoint
    if ac.mode != "memory_budget":
        return name
    inner = torch._dynamo.lookup_backend(name)
    if settings:  # the inductor backend hands its keywords to compile_fx, which applies these
        inner = functools.partial(inner, config_patches=settings)
    return _with_memory_budget(inner, ac.memory_budget)


def _with_memory_budget(inner: Any, budget: float) -> Any:
    from torch._functorch import config as functorch_config

    patches: dict[str, Any] = {"activation_memory_budget": budget}
    # Under tensor parallelism a block's graph takes the TP process group as an input (an opaque
    # script object, which the functional collectives name). The budget's partitioner sizes every
    # node it might save, cannot size a script object and stopped step 1 ("Cannot compute the
    # size of ... FakeScriptObject"). A process group holds no activation memory: zero is its
    # true size. (A torch without the setting has no such check.)
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        patches["unsafe_treat_script_objects_as_zero_size"] = True

    def compile_block(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with functorch_config.patch(**patches):
            return inner(graph, example_inputs)

    name = getattr(getattr(inner, "func", inner), "__name__", "backend")
    compile_block.__name__ = f"{name}_memory_budget_{budget}"
    return compile_block


def _compiled_region(block: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The module of ``block`` to compile: the block, its checkpointing included; under tensor
    parallelism or ``activation_checkpoint.debug``, inside a whole-block checkpoint (``full``, or
    ``selective`` every N-th block).

    Compiled around the checkpoint, a TP block's graph takes the device mesh of its DTensor
    parameters as an input, and torch 2.13's AOTAutograd saves that input for the recomputation
    like a tensor: step 1 stopped (``expected all tensors_saved_with_vc_check to be Tensors, got
    ... DeviceMesh``). Compiled inside it, the checkpoint stays eager around the compiled block
    and recomputes it whole, the same work and memory. The ``op`` policy and the other layouts
    compile around the checkpoint, as torchtitan does.

    ``debug`` records the recomputed operators through a ``context_fn`` of
    ``torch.utils.checkpoint``; traced into a compiled block, the checkpoint already has one and
    step 1 stopped (``debug=True is incompatible with non-default context_fn``). An eager
    checkpoint around the compiled block records them as it does without compile.
    """
    inner = getattr(block, "_checkpoint_wrapped_module", None)
    if not isinstance(inner, nn.Module):
        return block
    ac = ctx.config.activation_checkpoint
    whole = checkpoints_whole_blocks(ac)
    return inner if whole and (ctx.parallel_dims.tp > 1 or ac.debug) else block


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    settings = inductor_settings(ctx.config, ctx.topology.device)
    chosen = backend(ctx.config, settings)
    # The default is passed by omission, so a test's ``torch.compile`` replaced with another
    # default backend (``functools.partial``) still decides.
    options: dict[str, Any] = {"backend": chosen} if chosen != "inductor" else {}
    if chosen == "inductor" and settings:
        options["options"] = settings
    containers = 0
    for part in parts:
        found = model_blocks(part)
        if found is None:
            continue
        containers += 1
        for key, _ in found:
            _compiled_region(part.layers[key], ctx).compile(**options)
    if not containers:
        # Listed as applied, the model would run eager while the log said it was compiled.
        raise UsageError(
            f"compile.enable compiles each block of the model's `layers` (an nn.ModuleDict, "
            f"nn.ModuleList or nn.Sequential), and model {ctx.config.model.name!r} has no `layers`: "
            "nothing would be compiled. Keep the blocks in model.layers (docs/plugins.md, the "
            "decoder protocol), or set compile.enable = False"
        )
    return parts
