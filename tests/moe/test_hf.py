"""Reference numerics: tiny random Hugging Face Qwen3-MoE / DeepSeek-V3 / DeepSeek-V2 models and
titan's MoE give the same logits (CPU, fp32) with weights mapped through the plugin's adapter,
in both directions; the exported config and Hub-layout weights load with ``from_pretrained``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from titan_core.errors import UsageError
from titan_plugins_moe import hf
from titan_plugins_moe.flavors import FLAVORS, MoEArgs
from titan_plugins_moe.model import MoETransformer

transformers = pytest.importorskip("transformers")

QWEN3 = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # not hidden_size / heads: Qwen3's explicit head width
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],
    "decoder_sparse_step": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 64,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "rope_interleave": True,
}
DEEPSEEK_V2 = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_interleave", "n_group", "topk_group")},
    "model_type": "deepseek_v2",
    "q_lora_rank": None,
    "n_shared_experts": 2,
    "num_experts_per_tok": 3,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "topk_method": "greedy",
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
CASES = {
    "qwen3_moe": QWEN3,
    "qwen3_moe_top1": {**QWEN3, "num_experts_per_tok": 1},
    "qwen3_moe_yarn": {**QWEN3, "rope_scaling": YARN},
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3_yarn": {**DEEPSEEK_V3, "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "deepseek_v2_yarn": {**DEEPSEEK_V2, "rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
    # The output projection is the embedding: the tied checkpoint has no lm_head of its own.
    "qwen3_moe_tied": {**QWEN3, "tie_word_embeddings": True},
    "deepseek_v3_tied": {**DEEPSEEK_V3, "tie_word_embeddings": True},
    # DeepSeek-V2 multiplies its greedy top-k weights by routed_scaling_factor too.
    "deepseek_v2_scaled": {**DEEPSEEK_V2, "routed_scaling_factor": 2.0},
    # mscale != mscale_all_dim: Hugging Face scales the rotated part and the logits differently.
    "deepseek_v3_yarn_mscales": {
        **DEEPSEEK_V3,
        "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    },
    # Other routing and shapes than the flavors': group-limited routing with more groups and
    # experts (or none), unnormalised weights at another scale, top-1, no or two dense layers, a
    # full-rank query, head widths with the rotated part wider than the rest.
    "deepseek_v3_8_groups_of_2": {
        **DEEPSEEK_V3,
        "n_routed_experts": 16,
        "n_group": 8,
        "topk_group": 3,
        "num_experts_per_tok": 4,
    },
    "deepseek_v3_one_group": {**DEEPSEEK_V3, "n_group": 1, "topk_group": 1},
    "deepseek_v3_unnormalised": {**DEEPSEEK_V3, "norm_topk_prob": False, "routed_scaling_factor": 0.7},
    "deepseek_v3_top1": {**DEEPSEEK_V3, "num_experts_per_tok": 1, "routed_scaling_factor": 1.0},
    "deepseek_v3_no_dense": {**DEEPSEEK_V3, "first_k_dense_replace": 0},
    "deepseek_v3_two_dense": {**DEEPSEEK_V3, "first_k_dense_replace": 2},
    "deepseek_v3_full_rank_query": {**DEEPSEEK_V3, "q_lora_rank": None},
    "deepseek_v3_head_dims": {**DEEPSEEK_V3, "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 24},
    "qwen3_moe_unnormalised": {**QWEN3, "norm_topk_prob": False},
    "qwen3_moe_no_dense_wide_heads": {
        **QWEN3,
        "mlp_only_layers": [],
        "head_dim": 32,
        "num_key_value_heads": 4,
    },
    "qwen3_moe_two_dense_top3": {**QWEN3, "mlp_only_layers": [1, 0], "num_experts_per_tok": 3},
}


def hf_model(config: dict[str, Any], seed: int = 0) -> Any:
    """A random Hugging Face model with weights large enough that routing depends on them."""
    cfg = transformers.AutoConfig.for_model(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))  # the selection bias must matter
    return model


def titan_model(args: MoEArgs) -> MoETransformer:
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.eval()


def hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_weights_give_the_reference_logits(case: str) -> None:
    config = CASES[case]
    reference = hf_model(config)
    args = hf.args_from_hf(reference.config.to_dict())
    model = titan_model(args)
    state = hf.from_hf(dict(reference.state_dict()), args)
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, config["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, hf_logits(reference, tokens), rtol=1e-4, atol=1e-4)


#: Flavors and argument variants (routing, dense layers, query rank, head widths) to export.
EXPORTS = {
    "qwen3": ("qwen3_debugmodel", {}),
    "deepseek_v3": ("deepseek_v3_debugmodel", {}),
    "qwen3_unnormalised_top3_two_dense": (
        "qwen3_debugmodel",
        {"route_norm": False, "top_k": 3, "n_dense_layers": 2, "dense_hidden_dim": 192},
    ),
    "deepseek_v3_one_group_unnormalised": (
        "deepseek_v3_debugmodel",
        {"n_expert_groups": 1, "n_limited_groups": 1, "route_norm": False, "route_scale": 1.0},
    ),
    "deepseek_v3_no_dense_full_rank_query": (
        "deepseek_v3_debugmodel",
        {"n_dense_layers": 0, "q_lora_rank": 0},
    ),
    "deepseek_v3_two_dense_head_dims": (
        "deepseek_v3_debugmodel",
        {
            "n_dense_layers": 2,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 32,
            "v_head_dim": 48,
            "route_scale": 1.7,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(EXPORTS))
def test_export_loads_in_transformers_with_the_same_logits(case: str, tmp_path: Path) -> None:
    """titan -> Hub-layout safetensors + config.json -> from_pretrained: the same logits."""
    from safetensors.torch import save_file

    flavor, overrides = EXPORTS[case]
    args = attrs.evolve(FLAVORS[flavor], vocab_size=256, max_seq_len=64, **overrides)
    torch.manual_seed(3)
    model = titan_model(args)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "expert_bias"):
                # Routing that depends on the gate's weights, not an initialisation's near ties.
                module.gate.weight.normal_(0.0, 0.3)
                if args.score_func == "sigmoid":  # a trained selection bias: DeepSeek-V3 exports it
                    module.expert_bias.normal_(0.0, 0.05)
    exported = hf.to_hf(model.state_dict(), args)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in exported)  # the Hub layout
    save_file({k: v.contiguous() for k, v in exported.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(args)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, hf_logits(reference, tokens), rtol=1e-4, atol=1e-4)
    # And back: the config gives the same arguments, the weights the same tensors.
    assert hf.args_from_hf(hf.hf_config(args)) == attrs.evolve(args, dense_hidden_dim=args.ffn_hidden_dim)
    back = hf.from_hf(exported, args)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0, msg=name)


def test_top1_routing_weight_is_one_like_the_references() -> None:
    """With route_norm (norm_topk_prob) and top_k = 1 the expert output is not scaled by its
    probability, as in Hugging Face's Qwen3-MoE (and Mixtral, torchtitan)."""
    args = hf.args_from_hf({**QWEN3, "num_experts_per_tok": 1})
    moe = titan_model(args).layers["1"].feed_forward
    x = torch.randn(7, args.dim)
    weights, experts, scores = moe.router(x)
    torch.testing.assert_close(weights, torch.ones(7, 1))
    off = attrs.evolve(args, route_norm=False)
    router = titan_model(off).layers["1"].feed_forward.router
    router.load_state_dict(moe.router.state_dict())
    weights, experts, scores = router(x)
    torch.testing.assert_close(weights, scores.gather(1, experts))  # Switch-style: the probability


def test_args_without_a_counterpart_are_refused_with_the_fields() -> None:
    with pytest.raises(
        UsageError, match=r"Qwen3MoeForCausalLM counterpart: qk_norm=False .*shared_expert_hidden_dim=256"
    ):
        hf.hf_config(FLAVORS["debugmodel"])
    with pytest.raises(UsageError, match=r"model_type 'llama' has no titan counterpart"):
        hf.args_from_hf({"model_type": "llama"})


def test_groups_of_one_expert_are_refused_on_export() -> None:
    """titan scores a group of one expert by that expert; transformers' DeepSeek-V3 sums each
    group's two best and fails on the first forward (``selected index k out of range``): the
    export would write a folder that loads but cannot run."""
    args = attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], n_expert_groups=8, n_limited_groups=4)
    MoETransformer(args)  # titan computes it
    with pytest.raises(UsageError, match=r"DeepseekV3ForCausalLM counterpart: .*n_expert_groups=8"):
        hf.hf_config(args)
    # Two experts per group, or no group-limited routing, export.
    for groups in (4, 1):
        hf.hf_config(attrs.evolve(args, n_expert_groups=groups, n_limited_groups=min(groups, 2)))


def test_a_missing_tensor_is_named() -> None:
    args = FLAVORS["qwen3_debugmodel"]
    state = titan_model(args).state_dict()
    del state["layers.2.attention.wk.weight"]
    with pytest.raises(UsageError, match=r"lacks: layers\.2\.attention\.wk\.weight"):
        hf.to_hf(state, args)


def test_a_trained_bias_is_not_dropped_silently_by_a_qwen3_export() -> None:
    args = FLAVORS["qwen3_debugmodel"]
    state = titan_model(args).state_dict()
    state["layers.1.feed_forward.router.expert_bias"][0] = 0.5
    with pytest.raises(UsageError, match="layer 1 has a non-zero expert selection bias"):
        hf.to_hf(state, args)


@pytest.mark.parametrize("flavor", ["qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v2_lite"])
def test_real_flavors_have_a_counterpart(flavor: str) -> None:
    config = hf.hf_config(FLAVORS[flavor])
    assert hf.args_from_hf(config) == FLAVORS[flavor]


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [
        ("qwen3", "hidden_act", "gelu"),
        ("qwen3", "use_sliding_window", True),
        ("qwen3", "attention_bias", True),
        ("deepseek_v3", "hidden_act", "gelu"),
        ("deepseek_v3", "scoring_func", "softmax"),
        ("deepseek_v3", "topk_method", "greedy"),
    ],
)
def test_settings_titan_does_not_compute_are_refused_not_dropped(base: str, field: str, value: Any) -> None:
    """transformers builds these models (other logits); a silent import would train another model."""
    config = {
        "qwen3": hf.hf_config(FLAVORS["qwen3_debugmodel"]),
        "deepseek_v3": hf.hf_config(FLAVORS["deepseek_v3_debugmodel"]),
    }[base]
    hf.args_from_hf(config)  # as exported: imports
    with pytest.raises(UsageError, match=rf"Hugging Face config: {field} = {value!r} is not supported"):
        hf.args_from_hf({**config, field: value})


#: DeepSeek-V3's published config.json: block-wise FP8 weights, each with a ``weight_scale_inv``.
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("flavor", ["qwen3_debugmodel", "deepseek_v3_debugmodel", "deepseek_v2_lite"])
def test_a_quantized_checkpoint_is_refused_naming_the_fix(flavor: str) -> None:
    """Quantized weights read as plain numbers would be other weights (no scales applied); the
    loader named the scale tensors as unexpected, asking whether the folder was another model's."""
    config = hf.hf_config(FLAVORS[flavor])
    assert hf.args_from_hf({**config, "quantization_config": None}) == hf.args_from_hf(config)
    with pytest.raises(
        UsageError, match=r"Hugging Face config: quantization_config \(quant_method 'fp8'\) .*dequantize"
    ):
        hf.args_from_hf({**config, "quantization_config": FP8})


def test_a_quantized_folder_is_refused_before_its_tensors_are_read(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from titan_core._registry import get_registry
    from titan_core.initial_weights import load_initial_weights

    spec = get_registry().get("models", "moe")
    args = attrs.evolve(FLAVORS["deepseek_v3_debugmodel"], n_layers=2, vocab_size=256)
    weights = {}
    for name, tensor in hf.to_hf(titan_model(args).state_dict(), args).items():
        if name.endswith("proj.weight") and ".layers." in name:  # as DeepSeek publishes them
            weights[name] = tensor.to(torch.float8_e4m3fn)
            weights[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
        else:
            weights[name] = tensor.contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**hf.hf_config(args), "quantization_config": FP8}))
    model = titan_model(args)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match=r"quantization_config .*dequantize"):
        load_initial_weights([model], str(tmp_path), spec, args)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    "raw",
    [
        # Hugging Face takes the pre-training context from max_position_embeddings when the YaRN
        # dict does not give it (Qwen's model cards show the dict without it).
        {**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {**DEEPSEEK_V3, "rope_scaling": {"type": "yarn", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 1}},
        # MLA's key/value heads default to the query heads.
        {**DEEPSEEK_V3, "num_key_value_heads": None},
        # Plain RoPE spelt as a scaling dict.
        {**QWEN3, "rope_scaling": {"type": "default"}},
        # transformers 5's layout: the base in rope_parameters wins over a stale top-level one.
        {**QWEN3, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
        # Fields a hand-written config leaves out take transformers' defaults (DeepSeek-V3's routed
        # scaling 2.5 and 8 expert groups, not 1.0 and no groups), which no tensor shows.
        {
            **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("routed_scaling_factor", "n_group")},
            "n_routed_experts": 16,
        },
        {k: v for k, v in DEEPSEEK_V2.items() if k not in ("n_shared_experts", "routed_scaling_factor")},
        {k: v for k, v in QWEN3.items() if k not in ("norm_topk_prob", "decoder_sparse_step")},
        # Leading dense layers however the file spells them: transformers makes layer i dense when
        # i is in mlp_only_layers (any order, repeats, indices past the last layer ignored) or
        # (i + 1) is not a multiple of decoder_sparse_step.
        {**QWEN3, "num_hidden_layers": 4, "mlp_only_layers": [1, 0, 1]},
        {**QWEN3, "mlp_only_layers": [0, 9]},
        {**QWEN3, "mlp_only_layers": [], "decoder_sparse_step": 3},
    ],
    ids=[
        "qwen3_yarn_no_original",
        "deepseek_v3_yarn_no_original",
        "mla_kv_heads_none",
        "default",
        "params",
        "deepseek_v3_defaults",
        "deepseek_v2_defaults",
        "qwen3_defaults",
        "qwen3_mlp_only_unordered",
        "qwen3_mlp_only_past_the_end",
        "qwen3_sparse_step_last_layer",
    ],
)
def test_a_config_json_imports_as_transformers_reads_it(raw: dict[str, Any]) -> None:
    """The file's config and the one transformers makes of it give the same arguments, and the
    model the same logits (not a KeyError, nor a refusal of what transformers accepts)."""
    import copy

    args = hf.args_from_hf(copy.deepcopy(raw))  # transformers fills in the dicts it is given
    reference = hf_model(copy.deepcopy(raw))
    assert args == hf.args_from_hf(reference.config.to_dict())
    model = titan_model(args)
    model.load_state_dict(hf.from_hf(dict(reference.state_dict()), args), strict=True)
    tokens = torch.randint(0, raw["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_logits(reference, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("field", "value"),
    [("attention_factor", 0.8), ("truncate", False)],
)
def test_yarn_settings_titan_does_not_compute_are_refused_not_dropped(field: str, value: Any) -> None:
    """transformers scales cos/sin by an explicit attention_factor and leaves YaRN's ramp bounds
    fractional without truncate: dropping them gave logits off by several units."""
    for base in (QWEN3, DEEPSEEK_V3):
        config = {**base, "rope_scaling": {**YARN, field: value}}
        with pytest.raises(
            UsageError, match=rf"Hugging Face config: rope_scaling\.{field} = {value!r} is not supported"
        ):
            hf.args_from_hf(config)
    # The value titan computes anyway is no reason to refuse.
    args = hf.args_from_hf({**QWEN3, "rope_scaling": YARN})
    from titan_plugins_moe.attention import yarn_attention_factor

    computed = yarn_attention_factor(args)
    same = {**QWEN3, "rope_scaling": {**YARN, "attention_factor": computed, "truncate": True}}
    assert hf.args_from_hf(same) == args


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "deepseek_v2"])
def test_a_config_json_without_shape_fields_imports_transformers_defaults(kind: str) -> None:
    """transformers fills every field a config.json leaves out (Qwen3-MoE: 4 key/value heads,
    128 experts, top-8, not the query heads and a KeyError); titan reads the same model."""
    sparse = {"model_type": kind, "num_experts_per_tok": 6} if kind == "deepseek_v2" else {"model_type": kind}
    defaults = transformers.AutoConfig.for_model(**sparse).to_dict()
    assert hf.args_from_hf(dict(sparse)) == hf.args_from_hf(defaults)
    if kind == "qwen3_moe":
        assert hf.args_from_hf(dict(sparse)).kv_heads == 4


def test_a_config_json_without_a_field_transformers_has_no_default_for_is_refused() -> None:
    """DeepSeek-V2's num_experts_per_tok has no default (transformers cannot build the model)."""
    with pytest.raises(UsageError, match=r"Hugging Face config: num_experts_per_tok is not set"):
        hf.args_from_hf({k: v for k, v in DEEPSEEK_V2.items() if k != "num_experts_per_tok"})


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "noaux_tc"])
def test_deepseek_v2_routing_titan_does_not_compute_is_refused_naming_it(topk_method: str) -> None:
    """Group-limited greedy scores a group by its best expert (titan: its best two); transformers'
    DeepSeek-V2 has no noaux_tc. The error names the value the file has."""
    with pytest.raises(UsageError, match=rf"topk_method = '{topk_method}' is not supported"):
        hf.args_from_hf({**DEEPSEEK_V2, "topk_method": topk_method, "n_group": 4, "topk_group": 2})


@pytest.mark.parametrize(
    ("changes", "dense"),
    [
        ({"decoder_sparse_step": 2, "mlp_only_layers": []}, [0, 2]),
        ({"mlp_only_layers": [1]}, [1]),
        ({"num_experts": 0}, [0, 1, 2]),
    ],
    ids=["sparse_step_2", "middle_layer", "no_experts"],
)
def test_dense_layers_titan_cannot_place_are_refused_naming_them(
    changes: dict[str, Any], dense: list[int]
) -> None:
    """titan's dense blocks lead the model; transformers' other layouts are one clear refusal."""
    with pytest.raises(UsageError, match=re.escape(f"transformers builds dense layers {dense} of 3")):
        hf.args_from_hf({**QWEN3, **changes})


def test_deepseek_v2_without_shared_experts_imports() -> None:
    """Older DeepSeek-V2 configs write ``n_shared_experts: null`` for none."""
    args = hf.args_from_hf({**DEEPSEEK_V2, "n_shared_experts": None})
    assert args.shared_expert_hidden_dim == 0


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [
        ("deepseek_v3", "n_routed_experts", None),
        ("deepseek_v3", "n_routed_experts", "8"),
        ("deepseek_v3", "kv_lora_rank", None),
        ("deepseek_v3", "first_k_dense_replace", None),
        ("deepseek_v3", "routed_scaling_factor", None),
        ("deepseek_v3", "rms_norm_eps", None),
        ("deepseek_v3", "rope_theta", None),
        ("deepseek_v3", "max_position_embeddings", None),
        ("deepseek_v3", "intermediate_size", None),
        ("qwen3_moe", "num_experts", None),
        ("qwen3_moe", "num_experts_per_tok", 2.0),
        ("qwen3_moe", "head_dim", "24"),
        ("qwen3_moe", "num_hidden_layers", True),
        ("qwen3_moe", "rope_scaling", "yarn"),
    ],
)
def test_a_config_json_field_of_the_wrong_type_is_one_error_naming_it(
    base: str, field: str, value: Any
) -> None:
    """A ``null`` or a string where transformers' config wants a number (its strict config
    refuses them too): a ``TypeError``/``AttributeError`` traceback from titan's import, or, for
    Qwen3's ``num_experts: null``, a refusal blaming its dense layers."""
    config = {**(QWEN3 if base == "qwen3_moe" else DEEPSEEK_V3), field: value}
    with pytest.raises(
        UsageError, match=rf"^Hugging Face config: {field} = {re.escape(repr(value))} is not "
    ):
        hf.args_from_hf(config)
