"""titan hook implementations of the MoE plugin. Nothing here imports torch: the model, the TP
plan and the router callback are imported inside the callables, only when a run uses them."""

from __future__ import annotations

from typing import Any

from titan_core import Callback, ConfigSection, ModelSpec, Recipe, StateDictAdapter, hookimpl
from titan_plugins_moe import config, flavors, hf, recipes


def _build(args: flavors.MoEArgs) -> Any:
    from titan_plugins_moe.model import build

    return build(args)


def _tp_plan(model: Any, tp_mesh: Any, loss_parallel: bool) -> None:
    from titan_plugins_moe.plan import apply_tp

    apply_tp(model, tp_mesh, loss_parallel)


def _router_callback(trainer: Any) -> Any:
    from titan_plugins_moe.balance import build

    return build(trainer)


@hookimpl
def titan_models() -> list[ModelSpec]:
    return [
        ModelSpec(
            name="moe",
            flavors=flavors.FLAVORS,
            build=_build,
            num_params=flavors.num_params,
            flops_per_token=flavors.flops_per_token,
            tp_plan=_tp_plan,
            description="MoE decoders: Llama-style, Qwen3-MoE and DeepSeek-V2/V3 (MLA), grouped experts",
            validate=flavors.validate,
            num_active_params=flavors.num_active_params,
            # Top-k expert choices from float8-rounded scores would move tokens between experts.
            high_precision_modules=("router.gate",),
            # One Q/K/V matmul or three, grouped GEMM or a loop over experts, RoPE's table length.
            compute_only_args=("fuse_qkv", "fuse_w13", "experts_impl", "max_seq_len"),
            resolve_args=flavors.resolve_args,
            state_dict_adapter=StateDictAdapter(
                hf.to_hf, hf.from_hf, hf.hf_config, hf.args_from_hf, hf.for_run
            ),
        )
    ]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            "moe",
            config.MoEConfig,
            "MoE load balancing and router statistics",
            check=config.check,
            results=("bias_update_rate", "aux_loss_weight"),
        )
    ]


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback(
            "moe_router",
            _router_callback,
            order=40,
            description="MoE expert-bias update after each optimizer step; router statistics in the metrics",
        )
    ]


@hookimpl
def titan_recipes() -> list[Recipe]:
    return [Recipe(fn.__name__, fn, (fn.__doc__ or "").strip().split("\n")[0]) for fn in recipes.RECIPES]
