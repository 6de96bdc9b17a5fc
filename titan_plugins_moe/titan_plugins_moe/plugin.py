"""titan hook implementations of the MoE plugin. Nothing here imports torch: the model module
is imported inside ``_build``, only when a run builds the model."""

from __future__ import annotations

from typing import Any

from titan_core import ModelSpec, Recipe, hookimpl
from titan_plugins_moe import flavors, recipes


def _build(args: flavors.MoEArgs) -> Any:
    from titan_plugins_moe.model import build

    return build(args)


@hookimpl
def titan_models() -> list[ModelSpec]:
    return [
        ModelSpec(
            name="moe",
            flavors=flavors.FLAVORS,
            build=_build,
            num_params=flavors.num_params,
            flops_per_token=flavors.flops_per_token,
            description="Llama-style decoder with top-k routed grouped experts (expert parallel ready)",
        )
    ]


@hookimpl
def titan_recipes() -> list[Recipe]:
    fns = [recipes.moe_debugmodel]
    return [Recipe(fn.__name__, fn, (fn.__doc__ or "").strip().split("\n")[0]) for fn in fns]
