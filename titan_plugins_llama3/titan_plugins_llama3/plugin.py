"""titan hook implementations of the Llama 3 plugin. Nothing here imports torch: the model
module is imported inside ``_build``, only when a run builds the model."""

from __future__ import annotations

from typing import Any

from titan_core import ModelSpec, Recipe, StateDictAdapter, hookimpl
from titan_plugins_llama3 import flavors, hf, recipes


def _build(args: flavors.Llama3Args) -> Any:
    from titan_plugins_llama3.model import build

    return build(args)


def _tp_plan(model: Any, tp_mesh: Any, loss_parallel: bool) -> None:
    from titan_plugins_llama3.plan import apply_tp

    apply_tp(model, tp_mesh, loss_parallel)


@hookimpl
def titan_models() -> list[ModelSpec]:
    return [
        ModelSpec(
            name="llama3",
            flavors=flavors.FLAVORS,
            build=_build,
            num_params=flavors.num_params,
            flops_per_token=flavors.flops_per_token,
            tp_plan=_tp_plan,
            validate=flavors.validate,
            state_dict_adapter=StateDictAdapter(hf.to_hf, hf.from_hf, hf.hf_config, hf.args_from_hf),
            description="Llama 3 / 3.1 decoder (GQA, RoPE with scaling, SwiGLU)",
            # One Q/K/V matmul or three; RoPE's table length (positions below it are unchanged).
            compute_only_args=("fuse_qkv", "fuse_w13", "max_seq_len"),
            resolve_args=flavors.resolve_args,
        )
    ]


@hookimpl
def titan_recipes() -> list[Recipe]:
    fns = [recipes.llama3_debugmodel, recipes.llama3_8b, recipes.llama3_70b, recipes.llama3_405b]
    return [Recipe(fn.__name__, fn, (fn.__doc__ or "").strip().split("\n")[0]) for fn in fns]
