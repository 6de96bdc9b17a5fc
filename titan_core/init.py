"""Initialising this rank's parameter shards: correct, reproducible, and independent of the layout.

``init_weights`` run on sharded parameters draws random numbers shard by shard. On CUDA meshes
DTensor's RNG tracker makes the shards differ, but the values still depend on the layout; on
CPU meshes (gloo) torch has no such tracker, so every rank draws the same numbers and every
shard of a matrix comes out EQUAL — a model that trains, wrongly, without a word.

So whenever the whole model fits in host memory (``debug.init_full_model_max_gib``), each rank
initialises one full, unsharded copy of the model on the CPU with the run's seed — exactly what a
one-process run does — and copies its own shard of every parameter out of it
(``distribute_tensor`` with ``src_data_rank=None``: no communication). The result equals the
one-process initialisation for every layout (FSDP, HSDP, TP, PP, CP, EP and their products), so
a seed checkpoint is only needed for models too large for host memory. Larger models on CUDA
keep DTensor's RNG (distinct shards, layout-dependent values); under simulated peers (the fake
backends) values are meaningless by design and the plain path is taken.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_core.errors import PluginError
from titan_core.tied import retie, shared_parameters
from titan_core.wrapped_names import find_unwrapped

#: Name pieces torch's wrappers insert (activation checkpointing, torch.compile, FSDP1): stripped
#: first, as the fast path; any other wrapper's names are found by ``find_unwrapped``.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

GiB = 1024**3

#: ``call(fn, *args)``: how the model's own ``init_weights`` is called. The trainer passes its guard
#: for plugin code, so an exception there is one error naming the model and its plugin (with the
#: traceback kept in a file), not a bare traceback from inside the trainer.
PluginCall = Callable[..., Any]


def _direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def canonical_name(name: str) -> str:
    for piece in _WRAPPER_PREFIXES:
        name = name.replace(piece, "")
    return name


def full_model_bytes(spec: Any, model_args: Any) -> int:
    """fp32 bytes of the whole model (analytic: nothing is built)."""
    return 4 * spec.num_params(model_args, True)


def init_like_one_process(
    parts: list[nn.Module],
    spec: Any,
    model_args: Any,
    seed: int,
    *,
    label: str | None = None,
    call: PluginCall = _direct,
) -> None:
    """Overwrite every parameter of ``parts`` with its shard of the one-process initialisation."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.device("meta"):
        full = spec.build(model_args)
    tied = shared_parameters(full)  # before to_empty, which makes a tied parameter two
    full.to_empty(device="cpu")
    retie([full], tied)
    # Marked like the parts: what the model's init_weights misses would otherwise be copied into
    # every shard from to_empty's memory (finite, often zeros), where no NaN is left to find.
    mark_uninitialised([full])
    torch.manual_seed(seed)
    with torch.no_grad():
        call(functools.partial(full.init_weights, buffer_device=torch.device("cpu")))
    if names := uninitialised(full):
        raise not_initialised(full, names, spec, model_args, label=label)
    source = dict(full.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for part in parts:
            unmatched = []
            for name, param in part.named_parameters(remove_duplicate=False):
                plain = canonical_name(name)
                if plain not in source:
                    plain = find_unwrapped(name, source) or plain
                if plain not in source:
                    unmatched.append(name)
                    continue
                values = source[plain]
                if isinstance(param, DTensor):
                    values = values.to(device=param.device, dtype=param.dtype)
                    shard = distribute_tensor(values, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(values.to(device=param.device, dtype=param.dtype))
            if unmatched:
                # A name no wrapper explains: a parameter a strategy added (an adapter), or one it
                # renamed. The former is the likely one; the message says both.
                raise not_initialised(part, unmatched, spec, model_args, renamed=True, label=label)
    del full, source


def mark_uninitialised(parts: list[nn.Module]) -> None:
    """Fill every floating-point parameter of ``parts`` (this rank's shard of it) with NaN, which no
    initialisation writes: :func:`uninitialised` then finds the ones nothing initialised."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for part in parts:
            for param in part.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.is_floating_point():
                    local.fill_(float("nan"))


def uninitialised(part: nn.Module) -> list[str]:
    """Names of the parameters of ``part`` whose local values still hold NaN (one device sync)."""
    from torch.distributed.tensor import DTensor

    named = [
        (name, param.to_local() if isinstance(param, DTensor) else param)
        for name, param in part.named_parameters()
    ]
    named = [(name, local) for name, local in named if local.is_floating_point() and local.numel()]
    if not named:
        return []
    with torch.no_grad():
        # Stacked on the device, read once: a read per parameter would sync per parameter.
        flags = torch.stack([local.isnan().any() for _, local in named]).tolist()
    return [name for (name, _), nan in zip(named, flags, strict=True) if nan]


def not_initialised(
    part: nn.Module,
    names: list[str],
    spec: Any,
    model_args: Any,
    *,
    renamed: bool = False,
    label: str | None = None,
) -> PluginError:
    """The error for parameters of ``part`` no initialisation reached: they are named with the
    classes of the modules holding them (a strategy's adapter class names its plugin's package).

    A parameter the model itself has (its name, wrappers' pieces aside, is one of the freshly built
    model's) is the model's ``init_weights``' fault, not a strategy's: the message says which, so a
    model author is not sent looking for a strategy that never ran. ``label`` names the model and
    its plugin (``model 'x' (plugin p, dist 1.0)``)."""
    label = label or f"model {spec.name!r}"
    own = [] if renamed else _own_parameters(names, spec, model_args)
    if own:
        return PluginError(
            f"{label}: init_weights left {len(own)} parameters uninitialised: {_shown(part, own)}; "
            "initialise every parameter and buffer in place there (docs/plugins.md, the decoder "
            "protocol): titan materialises the model with to_empty, whose memory holds no values"
        )
    also = (
        " (a parameter a strategy renamed has no counterpart either: wrappers may add pieces to a "
        "name, not remove or rename them)"
        if renamed
        else ""
    )
    return PluginError(
        f"{len(names)} parameters of the model were not initialised: {_shown(part, names)}; "
        f"model {spec.name!r}'s init_weights does not reach "
        "them, so a strategy added them, and titan initialises parameters only through the "
        "model's init_weights (docs/plugins.md): a strategy may wrap or replace the model's "
        f"modules, not add parameters of its own{also}"
    )


def _shown(part: nn.Module, names: list[str]) -> str:
    """The first names, and the classes of the modules holding them all."""
    holders = []
    for name in names:
        owner = type(part.get_submodule(name.rpartition(".")[0]))
        holders.append(f"{owner.__module__}.{owner.__qualname__}")
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} (held by {', '.join(dict.fromkeys(holders))})"


def _own_parameters(names: list[str], spec: Any, model_args: Any) -> list[str]:
    """Those of ``names`` (a transformed part's) that the model as built has. Built again on the
    meta device (no memory, and only on this error's path) since the strategies have changed the
    parts since."""
    with torch.device("meta"):
        built = spec.build(model_args)
    plain = {name for name, _ in built.named_parameters(remove_duplicate=False)}
    return [n for n in names if canonical_name(n) in plain or find_unwrapped(n, plain) is not None]


def dropped_ends(part: nn.Module, spec: Any) -> list[str]:
    """The spec's first- and last-stage modules that ``part`` (a pipeline stage) holds as ``None``."""
    ends = (*getattr(spec, "first_stage_modules", ()), *getattr(spec, "last_stage_modules", ()))
    return [n for n in ends if n in part._modules and part._modules[n] is None]


def init_part(part: nn.Module, spec: Any, device: torch.device, call: PluginCall = _direct) -> None:
    """``part.init_weights(buffer_device=device)``, with a stage's dropped modules named.

    A pipeline stage holds ``None`` for the end modules of other stages. An ``init_weights`` that
    reads one of them (``self.wpe.weight``) raised a bare ``AttributeError`` from here on that
    stage's rank alone, its peers ending with a lost connection: the contract is named instead.
    ``call`` runs it as plugin code (:data:`PluginCall`); the contract's error passes through it.
    """
    call(_init_stage, part, spec, device)


def _init_stage(part: nn.Module, spec: Any, device: torch.device) -> None:
    try:
        part.init_weights(buffer_device=device)
    except (TypeError, AttributeError) as exc:
        dropped = dropped_ends(part, spec)
        if not dropped or "'NoneType' object" not in str(exc):
            raise
        one = len(dropped) == 1
        raise PluginError(
            f"model {spec.name!r}: init_weights failed on a pipeline stage that does not hold "
            f"{', '.join(dropped)} ({type(exc).__name__}: {exc}); there {'it is' if one else 'they are'} "
            f"None, and init_weights must skip {'it' if one else 'them'} as the forward does "
            "(docs/plugins.md, the decoder protocol); or set parallelism.pp = 1"
        ) from exc


def initialise(
    parts: list[nn.Module],
    spec: Any,
    model_args: Any,
    seed: int,
    *,
    device: torch.device,
    simulated: bool,
    max_full_gib: float,
    pp_coordinate: int,
    world_size: int,
    label: str | None = None,
    call: PluginCall = _direct,
) -> str:
    """Initialise ``parts`` (buffers included); returns how (``one_process`` or ``per_shard``).
    ``label`` names the model and its plugin in errors (``model 'x' (plugin p, dist 1.0)``);
    ``call`` runs the model's ``init_weights`` (:data:`PluginCall`)."""
    # Buffers (and, on the per-shard path, parameters) come from the model's own init_weights.
    # Parameters it does not reach (a strategy's adapter) kept to_empty's memory: NaN stopped
    # the run at step 1 blaming training.lr, finite garbage trained on without a word. Marked
    # NaN first, so that what no path initialises is named below.
    mark_uninitialised(parts)
    # Wrapped to 64 bits: the largest seed the config allows plus a stage's coordinate would
    # overflow torch.manual_seed on that stage's rank only.
    torch.manual_seed((seed + pp_coordinate) % 2**64)
    fits = full_model_bytes(spec, model_args) <= max_full_gib * GiB
    if world_size == 1:  # the model is whole here: init_weights already did what one process does
        how = "one_process"
    elif simulated or not (fits or device.type == "cpu"):
        how = "per_shard"
    else:
        how = "copied"  # from a one-process build, below
    with warnings.catch_warnings():
        if how == "copied":
            # torch warns that its DTensor RNG does not cover CPU meshes; these draws are
            # replaced by the one-process values below, so the warning would be a false alarm
            # on every multi-process CPU run.
            warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        for part in parts:
            with torch.no_grad():
                init_part(part, spec, device, call)
    if how == "copied":
        init_like_one_process(parts, spec, model_args, seed, label=label, call=call)
        how = "one_process"
    for part in parts:
        if names := uninitialised(part):
            raise not_initialised(part, names, spec, model_args, label=label)
    torch.manual_seed(seed)
    return how
