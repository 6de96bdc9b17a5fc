"""Activation checkpointing: recompute transformer blocks in backward instead of storing them.

``activation_checkpoint.mode``: ``full`` wraps every block of ``model.layers``. ``selective``
follows ``selective_ac_option``: ``op`` wraps every block with a selective-checkpoint policy that
keeps the expensive outputs (attention, flex attention included; every other matmul, float8's
too; reduce-scatters, all-to-alls and all-reduces, whose recomputation would communicate again)
and recomputes the cheap elementwise rest; an integer ``N`` wraps every N-th block of the model
whole (``2``: blocks 1, 3, ...), counted by the block's model-wide index (its ``ModuleDict`` key,
which a pipeline stage keeps), so the same blocks are recomputed in every layout. ``memory_budget``
wraps nothing: the compiler decides (``compile.py``). The other fields go to
``torch.utils.checkpoint.checkpoint`` (non-reentrant): ``preserve_rng_state``,
``determinism_check`` and ``debug``. A block with dropout is refused without
``preserve_rng_state``: its recomputation would draw other masks than its forward.

Blocks are wrapped with ``checkpoint_wrapper`` from ``torch.distributed.algorithms._checkpoint``,
a private module path, because it is PyTorch's own wrapper for exactly this (torchtitan and FSDP
use it) and its state-dict hooks drop the wrapper's ``_checkpoint_wrapped_module.`` prefix: state
dict keys stay ``layers.0.attention.wq.weight``, so seed checkpoints and checkpoints load
whatever the mode. No public equivalent exists in torch 2.11-2.14. The wrapper replaces the
block under the same ``ModuleDict`` key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins_parallel.model_blocks import model_blocks

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.activation_checkpoint.mode in ("full", "selective")


def is_wrapped(mode: str, index: int, option: str = "op") -> bool:
    """Whether the model's block ``index`` (0-based, model-wide) is wrapped for recomputation."""
    if mode == "full" or (mode == "selective" and option == "op"):
        return True
    return mode == "selective" and (index + 1) % int(option) == 0


def wrapped_indices(mode: str, n_blocks: int, option: str = "op") -> list[int]:
    """Which blocks of a model of ``n_blocks`` blocks are wrapped for recomputation."""
    return [i for i in range(n_blocks) if is_wrapped(mode, i, option)]


def _model_block_count(ctx: ParallelContext, seen: int) -> int:
    """The number of blocks of the whole model: the model argument ``n_layers`` when it has one
    (a pipeline rank holds some of them), else the ``seen`` ones (every block is here)."""
    args = getattr(ctx, "model_args", None)
    n = args.get("n_layers") if isinstance(args, dict) else getattr(args, "n_layers", None)
    return n if isinstance(n, int) and n >= seen else seen


def _refuse_dropout_without_rng_state(name: str, block: nn.Module, ac: Any) -> None:
    """Recomputation draws its dropout masks afresh unless the RNG state is stashed and
    restored: backward would then differentiate another network than the forward ran, and the
    gradients would be wrong without a word (``determinism_check`` compares shapes, not values).
    Only ``nn.Dropout``-style modules are seen; dropout called as a function is not."""
    if ac.preserve_rng_state:
        return
    for sub, module in block.named_modules():
        # ``_DropoutNd``: the private base of every dropout module (Dropout, Dropout1d-3d,
        # AlphaDropout, ...), the same in torch 2.11-2.14; no public one exists.
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            from titan_core.errors import UsageError

            raise UsageError(
                f"activation_checkpoint.mode = {ac.mode!r} recomputes block layers.{name}, which has "
                f"dropout (layers.{name}.{sub}: {module}): without "
                "activation_checkpoint.preserve_rng_state = True its recomputation draws other "
                "dropout masks than its forward and the gradients are wrong; set "
                "activation_checkpoint.preserve_rng_state = True, or set the dropout to 0"
            )


def _ops(*names: str) -> frozenset[Any]:
    """The default overloads of ``namespace.op`` names this torch build has."""
    found = []
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


def _higher_order_ops(*names: str) -> frozenset[Any]:
    """The higher-order operators of these names this torch build has.

    A higher-order operator (``torch.ops.higher_order.NAME``) has no overloads: the selective
    checkpoint policy is called with the operator object itself. Looked up by name, because the
    set differs across torch 2.11-2.14 (``getattr`` on ``torch.ops.higher_order`` raises
    ``AttributeError`` for an unknown name).
    """
    found = []
    for name in names:
        try:
            found.append(getattr(torch.ops.higher_order, name))
        except AttributeError:
            continue
    return frozenset(found)


#: Outputs the ``op`` policy always keeps: attention (the costliest op to redo), collectives (a
#: block's all-reduce too: the MoE balance loss sums its expert counts over context-parallel
#: ranks; recomputing it would communicate again in backward), and
#: the maxima float8 scaling takes (``max``/``amax``; tiny outputs, the input of every scale).
#: Flex attention appears to the policy as its higher-order operator in eager blocks, and as
#: ``inductor_compiled_code`` when it runs through its own ``torch.compile`` with
#: ``wrap_inductor_compiled_regions`` (``titan_core.blocks``): both are kept, or backward would
#: run the attention forward a second time. In a compiled block the compiler decides from the
#: same policy, so the higher-order operator must be in the set there too.
_ALWAYS_SAVED = _ops(
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
    "_c10d_functional.all_reduce",
    "aten.max",
    "aten.amax",
) | _higher_order_ops("flex_attention", "inductor_compiled_code")

#: The matmuls of which the ``op`` policy keeps every other output: bf16/fp32 ``mm``, the
#: ``addmm`` of a linear layer with a bias (a plugin model's), and the float8 ``_scaled_mm`` of
#: torchao's ``Float8Linear`` (without either, such blocks would recompute every matmul).
_MATMULS = _ops("aten.mm", "aten.addmm", "aten._scaled_mm")


def op_policy() -> Any:
    """The ``op`` policy of one checkpointed call: ``policy(ctx, func, *args, **kwargs)``.

    Always-saved operators (:data:`_ALWAYS_SAVED`) are kept, the 1st, 3rd, ... matmul
    (:data:`_MATMULS`) of the forward are kept, the rest is recomputed. The forward and its
    recomputation count separately and therefore make the same choice for the same matmul.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _ALWAYS_SAVED:
            return CheckpointPolicy.MUST_SAVE
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


#: Profiler annotations (``torch.profiler.record_function``): they compute nothing, but FSDP's
#: hooks issue them, and a unit inside a checkpointed block (expert parallel's experts) annotates
#: its recomputation more often than its forward (it gathers its shard again). Selective
#: checkpointing numbers every operator's calls and refuses one its forward did not record
#: (``... invocation index 2 encountered during backward but not found in storage``), so they
#: join torch's own list of operators it lets through uncounted (``detach``).
_PROFILER_ANNOTATIONS = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")


def let_profiler_annotations_through() -> None:
    """Add the profiler's annotation operators to ``torch.utils.checkpoint.SAC_IGNORED_OPS``."""
    import torch
    from torch.utils import checkpoint

    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", None)
    if not isinstance(ignored, set):
        return
    for name in _PROFILER_ANNOTATIONS:
        packet = getattr(torch.ops.profiler, name, None)
        if packet is None:
            continue
        ignored.update(getattr(packet, overload) for overload in packet.overloads())


def op_policy_contexts() -> tuple[Any, Any]:
    """Forward and recompute contexts of one checkpointed call under the ``op`` policy.

    ``torch.utils.checkpoint`` calls this once per forward of a wrapped block, so the matmul
    counters start afresh for each call (:func:`op_policy`).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_policy())


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ac = ctx.config.activation_checkpoint
    kwargs: dict[str, Any] = {
        "preserve_rng_state": ac.preserve_rng_state,
        "determinism_check": ac.determinism_check,
        "debug": ac.debug,
    }
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        kwargs["context_fn"] = op_policy_contexts
        let_profiler_annotations_through()
    seen = wrapped = 0
    containers = 0
    for part in parts:
        found = model_blocks(part)
        if found is None:
            continue
        containers += 1
        layers = part.layers
        seen += len(found)
        for key, index in found:
            if is_wrapped(ac.mode, index, ac.selective_ac_option):
                _refuse_dropout_without_rng_state(str(key), layers[key], ac)
                layers[key] = checkpoint_wrapper(layers[key], **kwargs)
                wrapped += 1
    if not containers:
        # Listed as applied, it would recompute nothing: the run would take the memory of no
        # checkpointing while the log said otherwise.
        from titan_core.errors import UsageError

        raise UsageError(
            f"activation_checkpoint.mode = {ac.mode!r} wraps each block of the model's `layers` "
            f"(an nn.ModuleDict, nn.ModuleList or nn.Sequential), and model {ctx.config.model.name!r} has "
            "no `layers`: "
            "nothing would be recomputed. Keep the blocks in model.layers (docs/plugins.md, the "
            "decoder protocol), or set activation_checkpoint.mode = 'none'"
        )
    total = _model_block_count(ctx, seen)
    if seen and not wrapped and int(ac.selective_ac_option) > total:
        # Every N-th block with N above the model's block count: the strategy is listed as
        # applied, so say that it recomputes nothing. A pipeline rank whose stages hold none of
        # the N-th blocks is not warned: other stages recompute theirs.
        from titan_core.log import get_logger

        get_logger("titan.parallel").warning(
            "activation checkpointing wraps no block",
            reason=(
                f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r} wraps every "
                f"{ac.selective_ac_option}-th block, and the model's layers have {total}; nothing "
                "is recomputed: lower it, or set activation_checkpoint.mode = 'none'"
            ),
        )
    return parts
