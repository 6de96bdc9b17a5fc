"""The ``float8`` strategy: torchao's ``convert_to_float8_training`` on the meta model.

Every ``nn.Linear`` of each part becomes a ``Float8Linear`` unless ``float8.filter_fqns`` or the
model (``ModelSpec.high_precision_modules``: an MoE router's gate) names it, or a width is not a
multiple of 16 (``torch._scaled_mm`` needs that). A ``Float8Linear``
keeps its weight a plain high-precision parameter (same name, same shape, so checkpoints, FSDP
and the optimizer are unchanged) and casts input, weight and output gradient to float8 with a
dynamic scale at each matmul (``tensorwise``: one scale per tensor; ``rowwise``: per row).

The run is refused, before anything is materialised, when torchao cannot be imported or the
device has no float8 matmul (CUDA below compute capability 8.9, or not CUDA) and
``float8.emulate`` is off.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from titan_core.errors import UsageError
from titan_core.log import get_logger
from titan_plugins_float8.config import filter_names

if TYPE_CHECKING:
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext

log = get_logger("titan.float8")

#: ``torch._scaled_mm`` multiplies matrices whose dimensions are multiples of 16.
_ALIGN = 16


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    return config.float8.enable


def _torchao_float8() -> tuple[Any, type]:
    """``torchao.float8`` and its ``Float8Linear``, or one usage error saying how to get them.

    torchao's import tries to load its own CUDA extensions and logs a warning per library that a
    CPU or another CUDA build of torch cannot load; float8 training does not use them (it calls
    ``torch._scaled_mm``), so those warnings are held back while importing. So is torch's (2.13+)
    deprecation warning about torchao registering an enum as a pytree constant: it named no
    setting of the run and came before titan's first line of every float8 run.
    """
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
    except Exception as exc:  # missing, or built for another torch: the same remedy
        raise UsageError(
            f"float8.enable: torchao's float8 training could not be imported ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); install torchao 0.17 "
            "(pip install 'titan-plugins-float8[torchao]'), or set float8.enable = False"
        ) from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return float8, Float8Linear


def _device_problem(device: Any, emulate: bool) -> str | None:
    if emulate:
        return None
    import torch

    if device.type != "cuda":
        return (
            f"float8.enable: the run computes on {device.type}, which has no float8 matmul; train on "
            "a CUDA GPU of compute capability 8.9+ (H100, H200), set float8.emulate = True (float8 "
            "numerics in high precision, no speed-up), or set float8.enable = False"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (
            f"float8.enable: {torch.cuda.get_device_name(device)} (compute capability "
            f"{capability[0]}.{capability[1]}) has no float8 tensor cores (8.9+ needed: H100, H200); "
            "set float8.emulate = True or float8.enable = False"
        )
    return None


def _check_device(device: Any, emulate: bool) -> None:
    if (problem := _device_problem(device, emulate)) is not None:
        raise UsageError(problem)


def _launch_device(config: TrainerConfig) -> Any:
    """The kind of device the run will compute on (``training.device``, ``auto`` resolved), known
    before any process group exists; ``None`` for ``cuda`` on a host without one, which the core
    refuses itself (``training.device is 'cuda' but no CUDA device is available``)."""
    import torch

    if config.training.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return None if config.training.device == "cuda" else torch.device("cpu")


def _rowwise_problem(config: TrainerConfig) -> str | None:
    cfg = config.float8
    if cfg.recipe == "rowwise" and not cfg.emulate and config.training.dtype != "bfloat16":
        return (
            'float8.recipe: "rowwise" scaling multiplies bf16 inputs only (torch._scaled_mm); set '
            'training.dtype = "bfloat16" or float8.recipe = "tensorwise"'
        )
    return None


def _nothing_converted(given: str) -> str:
    return (
        f"float8.filter_fqns: no linear layer of the model was converted (each is named by "
        f"{given!r} or has a width that is not a multiple of {_ALIGN}); narrow "
        "float8.filter_fqns or set float8.enable = False"
    )


def check(config: TrainerConfig, parallel_dims: ParallelDims, spec: Any, model_args: Any) -> list[str]:
    """``Strategy.check``: every refusal of :func:`apply` that the config and the model's
    arguments show, before anything is built. ``run_train.sh`` runs it once before torchrun
    starts; refused only in ``apply``, each torchrun worker stopped on its own and the run ended
    with torchrun's report (exit 1) instead of one line (exit 2)."""
    try:
        _torchao_float8()
    except UsageError as exc:
        return [str(exc)]
    cfg = config.float8
    device = _launch_device(config)
    on_device = None if device is None else _device_problem(device, cfg.emulate)
    problems = [p for p in (on_device, _rowwise_problem(config)) if p is not None]
    import torch
    from torch import nn

    with torch.device("meta"):
        whole = spec.build(model_args)
    linears = [(n, m) for n, m in whole.named_modules() if isinstance(m, nn.Linear)]
    keep = filter_names(cfg.filter_fqns)
    problem = _unmatched_filter_problem(keep, [n for n, _ in linears])
    # The default (``output``) only warns, in apply: a model may name its head otherwise.
    if problem is not None and cfg.filter_fqns != attrs.fields(type(cfg)).filter_fqns.default:
        problems.append(problem + "; correct the name, or leave it out")
    converts = module_filter([*keep, *getattr(spec, "high_precision_modules", ())])
    if not any(converts(m, n) for n, m in linears):
        problems.append(_nothing_converted(cfg.filter_fqns))
    return problems


def module_filter(names: list[str]) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: convert a linear unless a name matches or it is unaligned."""
    from torch import nn

    def convert(module: nn.Module, fqn: str) -> bool:
        if any(name in fqn for name in names):
            return False
        if isinstance(module, nn.Linear):
            return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0
        return True  # containers: torchao asks about them too; their linears are asked again

    return convert


def _check_filter_names(keep: list[str], given: str, ctx: ParallelContext) -> None:
    """Refuse a ``float8.filter_fqns`` name that is part of no linear layer's name in the whole
    model (every stage's, built on meta): a typo (``outptu``) converted the layer it meant to
    keep, without a word. The default (``output``) only warns: a model may name its head else."""
    import torch
    from torch import nn

    with torch.device("meta"):
        whole = ctx.spec.build(ctx.model_args)
    linears = [n for n, m in whole.named_modules() if isinstance(m, nn.Linear)]
    problem = _unmatched_filter_problem(keep, linears)
    if problem is None:
        return
    if given == attrs.fields(type(ctx.config.float8)).filter_fqns.default:
        log.warning(problem + "; every linear is converted")
        return
    raise UsageError(problem + "; correct the name, or leave it out")


def _unmatched_filter_problem(keep: list[str], linears: list[str]) -> str | None:
    """The names of ``keep`` that are part of no name of ``linears``, as a problem, or ``None``."""
    unmatched = [name for name in keep if not any(name in fqn for fqn in linears)]
    if not unmatched:
        return None
    shown = ", ".join(linears[:6]) + (f", ... ({len(linears)} in all)" if len(linears) > 6 else "")
    return (
        f"float8.filter_fqns: {', '.join(map(repr, unmatched))} is part of no linear layer's name "
        f"(the model's linears: {shown})"
    )


def _warn_final_projection_converted(converted: list[str], given: str, ctx: ParallelContext) -> None:
    """Name the final projection (the spec's ``last_stage_modules``) when it was converted: a
    ``filter_fqns`` written to add a name (``feed_forward``) replaces the default ``output``, and
    the projection to the vocabulary then ran in float8 while the log only counted it."""
    ends = set(getattr(ctx.spec, "last_stage_modules", ("output",)))
    final = [name for name in converted if name.split(".")[0] in ends]
    if not final:
        return
    log.warning(
        "float8 converts the final projection",
        converted=final,
        reason=(
            f"float8.filter_fqns = {given!r} names none of {', '.join(final)}, so the projection to "
            "the vocabulary computes in float8 (torchtitan and titan's default keep it in high "
            f"precision: its outputs are the logits); add {final[0].split('.')[-1]!r} to "
            "float8.filter_fqns to keep it"
        ),
    )


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    from torch import nn

    cfg = ctx.config.float8
    float8, float8_linear = _torchao_float8()
    # check() refused these before launch; the device is checked again as the run chose it.
    _check_device(ctx.topology.device, cfg.emulate)
    if (problem := _rowwise_problem(ctx.config)) is not None:
        raise UsageError(problem)
    recipe = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    recipe = dataclasses.replace(recipe, emulate=cfg.emulate)
    keep = filter_names(cfg.filter_fqns)
    _check_filter_names(keep, cfg.filter_fqns, ctx)
    # The model's own (ModelSpec.high_precision_modules): kept whatever filter_fqns says.
    model_keeps = list(getattr(ctx.spec, "high_precision_modules", ()))
    converted: list[str] = []
    kept: list[str] = []
    for part in parts:
        float8.convert_to_float8_training(
            part, config=recipe, module_filter_fn=module_filter([*keep, *model_keeps])
        )
        converted += [n for n, m in part.named_modules() if isinstance(m, float8_linear)]
        kept += [n for n, m in part.named_modules() if type(m) is nn.Linear]
    if not converted:
        raise UsageError(_nothing_converted(cfg.filter_fqns))
    _warn_final_projection_converted(converted, cfg.filter_fqns, ctx)
    ctx.state["float8"] = {"converted": converted}
    log.info(
        "float8 linear layers",
        recipe=cfg.recipe,
        converted=len(converted),
        kept=kept[:8] + ([f"... {len(kept) - 8} more"] if len(kept) > 8 else []),  # the layers left bf16
        emulate=cfg.emulate,
        # Named apart: a model's choice, not float8.filter_fqns (ModelSpec.high_precision_modules).
        **({"kept_by_the_model": model_keeps} if model_keeps else {}),
    )
    if not ctx.config.compile.enable and not cfg.emulate:
        log.warning(
            "float8 without compile.enable: the scaling casts run as separate kernels and eat the "
            "float8 speed-up; set compile.enable = True"
        )
    return parts
