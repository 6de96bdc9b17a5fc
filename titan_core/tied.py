"""Parameter sharing (tied weights) that survives meta build, strategies and ``to_empty``.

A model ties two modules' weights by registering one ``nn.Parameter`` under two names (the
output projection and the token embedding, say). Strategies that replace parameters module by
module (TP's ``parallelize_module`` makes a new DTensor parameter per module) and a
materialisation that makes new parameters would leave two independent copies, one of them never
initialised. The trainer records the sharing on the meta model and restores it after every
strategy and after ``to_empty``: every name of a group points at the parameter of the first name.
A strategy that wraps modules changes the names; each recorded name is found again under any
wrapper (:mod:`titan_core.wrapped_names`).
"""

from __future__ import annotations

from torch import nn

from titan_core.errors import UsageError
from titan_core.wrapped_names import find_wrapped


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one parameter (only groups of two or more)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _owner(part: nn.Module, name: str, names: list[str]) -> tuple[nn.Module, str] | None:
    """The module and attribute holding the parameter recorded as ``name`` (``names``: the part's
    current parameter names, wrappers included)."""
    found = find_wrapped(name, names)
    if found is None:  # e.g. a pipeline stage without it
        return None
    module_path, _, leaf = found.rpartition(".")
    try:
        module = part.get_submodule(module_path) if module_path else part
    except AttributeError:
        return None
    if module is None or leaf not in module._parameters:  # e.g. a pipeline stage dropped it
        return None
    return module, leaf


def retie(parts: list[nn.Module], groups: list[list[str]]) -> None:
    """Point every name of each group at one parameter.

    A group must be held whole by one part of this rank, or not at all (a middle pipeline
    stage): split over parts or ranks, each holder's copy would train on its own, so that is
    refused rather than trained.
    """
    currents = [[n for n, _ in part.named_parameters(remove_duplicate=False)] for part in parts]
    for names in groups:
        held = [
            [(n, o) for n in names if (o := _owner(part, n, current)) is not None]
            for part, current in zip(parts, currents, strict=True)
        ]
        holders = [owners for owners in held if owners]
        if not holders:
            continue
        if len(holders) > 1 or len(holders[0]) < len(names):
            here = [n for owners in holders for n, _ in owners]
            where = f"{len(holders)} model parts hold" if len(holders) > 1 else "this rank's model part holds"
            raise UsageError(
                f"tied parameters {' and '.join(names)} would be split: {where} "
                f"{', '.join(here)}{' only' if len(holders) == 1 else ' apart'}, so each copy would "
                "train on its own. Pipeline parallelism puts the embedding and the output on "
                "different stages: untie them in the model (model.overrides; titan's Llama 3 and MoE "
                "models: tie_embeddings = False) or set parallelism.pp = 1"
            )
        first_name, (module, leaf) = holders[0][0]
        keep = module._parameters[leaf]
        for name, (other, other_leaf) in holders[0][1:]:
            param = other._parameters[other_leaf]
            if param is keep:
                continue
            if _layout(param) != _layout(keep):
                raise UsageError(
                    f"tied parameters {first_name} and {name} were laid out differently "
                    f"({_layout(keep)} vs {_layout(param)}) by a strategy; they cannot stay "
                    "tied: untie them in the model (e.g. tie_embeddings=False) or change the plan"
                )
            other._parameters[other_leaf] = keep


def _layout(param: nn.Parameter) -> tuple[object, ...]:
    placements = getattr(param, "placements", None)
    return (tuple(param.shape), param.dtype, None if placements is None else tuple(placements))
