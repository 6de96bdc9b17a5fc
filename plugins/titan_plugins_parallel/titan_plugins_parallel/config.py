"""The config sections of the parallelism plugin: ``activation_checkpoint`` and ``compile``.

They are the plugin's own (``titan_config_sections``): without the plugin a recipe that sets them
fails with "no config section", instead of asking for work nobody would do. The field paths are
those of titan's first release.
"""

import importlib.util
from typing import Any, Literal

import attrs

from titan_core.config import field, in_range, section


def _selective_option(_inst: Any, _attr: Any, value: str) -> None:
    # ASCII digits only: ``str.isdigit`` also takes a superscript two (which ``int`` then
    # refuses with its own message) and other scripts' digits.
    if value != "op" and not (value.isascii() and value.isdigit() and int(value) > 0):
        raise ValueError(f"expected 'op' or a positive integer such as '2', got {value!r}")


@section
class ActivationCheckpoint:
    #: ``none``, ``full`` (recompute every block), ``selective`` (see ``selective_ac_option``) or
    #: ``memory_budget`` (the compiler chooses what to recompute; needs ``compile.enable``).
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    #: Under ``selective``: ``op`` recomputes cheap operators of every block but keeps the outputs
    #: of attention, every other matmul and collectives (reduce-scatter, all-to-all); an integer
    #: ``N`` (``"2"``) recomputes every N-th block whole.
    selective_ac_option: str = field(default="op", validator=_selective_option)
    #: Stash and restore the RNG state for recomputation (deterministic against no AC).
    preserve_rng_state: bool = False
    #: Determinism check of recomputation (``default`` or ``none``), as torch.utils.checkpoint.
    determinism_check: Literal["default", "none"] = "default"
    #: Capture debug information about recomputation (slower; not with the ``op`` policy).
    debug: bool = False
    #: Under ``memory_budget``: the share of each compiled block's activations kept for backward,
    #: 0 (recompute all it can) to 1 (keep what the compiler would keep without a budget).
    memory_budget: float = field(default=0.5, validator=in_range(0.0, 1.0))


@section
class Compile:
    #: ``torch.compile`` each transformer block.
    enable: bool = False
    #: ``torch.compile`` backend (``torch._dynamo.list_backends()``): ``inductor`` generates
    #: kernels; ``aot_eager`` traces and partitions without code generation (for debugging).
    backend: str = "inductor"
    #: On CUDA with ``inductor``: search the tile sizes of the blocks' generated Triton kernels
    #: (flex attention's forward and backward, the fused elementwise and reduction kernels) at
    #: the first step of each shape, instead of inductor's per-GPU defaults; matmuls stay
    #: cuBLAS. The first compilation takes longer (about 40 s more for a Llama 3 1B block on an
    #: H200); the choices are cached on disk for the next run. No effect on CPU.
    autotune: bool = True


#: The ``activation_checkpoint`` fields each mode reads; the others keep their defaults, or a
#: recipe would believe it changed a run it did not change (``memory_budget`` under ``selective``).
_READ_BY_MODE = {
    "none": set(),
    "full": {"preserve_rng_state", "determinism_check", "debug"},
    "selective": {"selective_ac_option", "preserve_rng_state", "determinism_check", "debug"},
    "memory_budget": {"memory_budget"},
}


def checkpoints_whole_blocks(ac: ActivationCheckpoint) -> bool:
    """Whether ``ac`` checkpoints whole blocks (``full``, or ``selective`` every N-th block), as
    opposed to none or the ``op`` policy's chosen operators."""
    return ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op")


def _unread_settings(ac: ActivationCheckpoint) -> list[str]:
    read = _READ_BY_MODE[ac.mode]
    return [
        f"activation_checkpoint.{f.name}: {getattr(ac, f.name)!r} does nothing with mode = {ac.mode!r}; "
        f"remove it from the recipe, or choose a mode that uses it"
        for f in attrs.fields(type(ac))
        if f.name != "mode" and f.name not in read and getattr(ac, f.name) != f.default
    ]


def _unread_pipeline_schedule(p: Any) -> list[str]:
    # The core refuses pp_microbatches and pp_stages_per_rank with pp = 1; a schedule asked for
    # there (the degree forgotten) trained with no pipeline at all and exit 0. Only this plugin's
    # pipeline reads it, so the plugin refuses it, naming the field as the core does the others.
    default = attrs.fields(type(p)).pp_schedule.default
    if p.pp != 1 or p.pp_schedule == default:
        return []
    return [
        f"parallelism.pp_schedule: {p.pp_schedule!r} does nothing with parallelism.pp = 1 (only "
        f"pipeline parallel reads it); set parallelism.pp > 1, or leave it {default!r}"
    ]


#: ``torch.compile`` backends that torch lists as available but that import a package of their own
#: when they compile the first graph: backend name -> (module imported, what to install).
_BACKEND_PACKAGES = {
    "tvm": ("tvm", "apache-tvm"),
    "openxla": ("torch_xla", "torch_xla"),
    "openxla_eval": ("torch_xla", "torch_xla"),
    "onnxrt": ("onnxruntime", "onnxruntime"),
}


def _missing_backend_package(backend: str) -> str | None:
    """Why ``compile.backend`` cannot compile here: the package it imports is not installed
    (found without importing it, or torch). Without this, the run built the model and stopped
    at step 1 with a ``BackendCompilerFailed: ... ImportError`` traceback."""
    if backend not in _BACKEND_PACKAGES:
        return None
    module, package = _BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(module) is not None:
        return None
    return (
        f"compile.backend: {backend!r} compiles through the package {package} (import {module}), "
        f"which is not installed; install it, or use 'inductor' (or 'aot_eager')"
    )


def check(config: Any) -> list[str]:
    """Checks across fields of the plugin's sections (run once after the recipe)."""
    ac = config.activation_checkpoint
    errors = _unread_settings(ac)
    if ac.debug and ac.mode == "selective" and ac.selective_ac_option == "op":
        errors.append(
            "activation_checkpoint.debug: torch.utils.checkpoint cannot debug the per-operator "
            "policy (selective_ac_option = 'op'); use mode 'full', an integer option, or debug = False"
        )
    if ac.mode == "memory_budget" and not config.compile.enable:
        errors.append(
            "activation_checkpoint.mode: 'memory_budget' is a compiler option (the compiler "
            "chooses what each compiled block recomputes); set compile.enable = true, or use "
            "mode 'selective' or 'full'"
        )
    errors += _unread_pipeline_schedule(config.parallelism)
    c = config.compile
    if not c.enable:  # as the AC fields a mode does not read: a recipe believing it set them
        errors += [
            f"compile.{f.name}: {getattr(c, f.name)!r} does nothing with compile.enable = False; remove it "
            "from the recipe, or set compile.enable = True"
            for f in attrs.fields(type(c))
            if f.name != "enable" and getattr(c, f.name) != f.default
        ]
    elif (problem := _missing_backend_package(c.backend)) is not None:
        errors.append(problem)
    elif ac.mode == "memory_budget" and c.backend != "inductor" and not c.backend.startswith("aot_"):
        errors.append(
            f"activation_checkpoint.mode: 'memory_budget' is applied by the AOT partitioner, which "
            f"compile.backend = {c.backend!r} does not run; use 'inductor' or 'aot_eager'"
        )
    return errors
