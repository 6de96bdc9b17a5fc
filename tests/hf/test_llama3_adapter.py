"""The Llama 3 state-dict adapter: names, the q/k rotary permutation and the config, both ways."""

from __future__ import annotations

import pytest
import torch

from tests.hf.conftest import hf_config, llama3, max_diff, random_hf_model, titan_model, tokens
from titan_plugins_llama3 import flavors, hf


def test_to_hf_and_back_is_the_identity_and_permutes_only_q_and_k() -> None:
    spec, args = llama3()
    model = titan_model(spec, args)
    state = model.state_dict()
    converted = hf.to_hf(state, args)
    assert len(converted) == len(state)
    assert set(converted) == set(random_hf_model(hf_config()).state_dict())
    back = hf.from_hf(converted, args)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # q and k rows are reordered within each head; every other tensor is only renamed.
    q, hf_q = state["layers.0.attention.wq.weight"], converted["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, hf_q)
    assert torch.equal(hf_q[: args.head_dim // 2], q[0 : args.head_dim : 2])  # head 0: even rows first
    assert torch.equal(
        converted["model.layers.1.self_attn.v_proj.weight"], state["layers.1.attention.wv.weight"]
    )


def test_rotary_layouts_agree_only_with_the_permutation() -> None:
    """The permutation is what makes titan's RoPE (interleaved pairs) compute HF's (rotate_half)."""
    spec, args = llama3()
    reference = random_hf_model(hf_config())
    model = titan_model(spec, args)
    model.load_state_dict(hf.from_hf(reference.state_dict(), args))
    assert max_diff(model, reference, tokens()) < 1e-4
    plain = {k: v.clone() for k, v in hf.from_hf(reference.state_dict(), args).items()}
    for layer in ("0", "1"):  # undo the permutation: HF's row order straight into titan
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj")):
            plain[f"layers.{layer}.attention.{ours}.weight"] = reference.state_dict()[
                f"model.layers.{layer}.self_attn.{theirs}.weight"
            ]
    model.load_state_dict(plain)
    assert max_diff(model, reference, tokens()) > 1e-2


@pytest.mark.parametrize("flavor", sorted(flavors.FLAVORS))
def test_every_flavor_round_trips_through_its_hf_config(flavor: str) -> None:
    args = flavors.FLAVORS[flavor]
    config = hf.hf_config(args)
    again = hf.args_from_hf(config)
    assert hf.hf_config(again) == config
    assert again.ffn_hidden_dim == args.ffn_hidden_dim == config["intermediate_size"]
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"]["rope_type"] == "llama3"  # Llama 3.1 scaling is on in every flavor


def test_config_json_of_transformers_4_and_5_read_the_same() -> None:
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    }
    base |= {
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
    }
    v4 = {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **rope}}
    v5 = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **rope}}
    assert hf.args_from_hf(v4) == hf.args_from_hf(v5)
    ours = hf.hf_config(hf.args_from_hf(v5))
    assert ours == hf.hf_config(flavors.FLAVORS["8B"])  # Llama 3.1 8B's config is titan's 8B flavor
    # What transformers itself makes of the config titan writes: the same RoPE and shapes.
    config = hf_config().__class__.from_dict(ours)
    # transformers 5 keeps RoPE in rope_parameters, 4.x in rope_scaling and rope_theta.
    rope = getattr(config, "rope_parameters", None) or {
        **config.rope_scaling,
        "rope_theta": config.rope_theta,
    }
    assert rope["rope_type"] == "llama3"
    assert rope["rope_theta"] == 500000.0
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (8, 128, 14336)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "mistral"}, "model_type is 'mistral'"),
        ({"attention_bias": True}, "attention_bias is true"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"head_dim": 32}, "head_dim is 32"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        # Values that made a bare ZeroDivisionError / AttributeError / KeyError deep inside the load.
        ({"num_attention_heads": 0}, "num_attention_heads is 0; expected a positive integer"),
        ({"intermediate_size": 0}, "intermediate_size is 0; expected a positive integer"),
        ({"num_key_value_heads": -2}, "num_key_value_heads is -2; expected a positive integer"),
        ({"rope_scaling": "llama3"}, "rope_scaling is 'llama3'; expected an object"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling of rope_type 'llama3' has no 'low_freq_factor'",
        ),
        (
            {"rope_scaling": {**hf.hf_config(flavors.FLAVORS["8B"])["rope_scaling"], "factor": "x"}},
            "rope_scaling's factor is 'x'; expected a positive number",
        ),
        ({"hidden_size": 64.5}, "hidden_size is 64.5; expected a positive integer"),
        # A quantized release (FP8, GPTQ, AWQ): its weights read as plain numbers would be other
        # weights, their scales being separate tensors.
        (
            {"quantization_config": {"quant_method": "fbgemm_fp8"}},
            "quantization_config \\(quant_method 'fbgemm_fp8'\\) is not supported: .*dequantize",
        ),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
    ],
)
def test_configs_titan_cannot_represent_name_the_field(change: dict, named: str) -> None:
    config = {**hf.hf_config(flavors.FLAVORS["debugmodel"]), **change}
    with pytest.raises(ValueError, match=named):
        hf.args_from_hf(config)


def test_tied_embeddings_share_one_hf_tensor() -> None:
    spec, args = llama3({"dim": 64, "n_layers": 1, "n_heads": 4, "tie_embeddings": True})
    model = titan_model(spec, args)
    converted = hf.to_hf(model.state_dict(), args)
    assert "lm_head.weight" not in converted  # as save_pretrained writes a tied model
    back = hf.from_hf({**converted, "lm_head.weight": converted["model.embed_tokens.weight"]}, args)
    assert back["output.weight"] is back["tok_embeddings.weight"]
    assert hf.hf_config(args)["tie_word_embeddings"] is True
    with pytest.raises(KeyError, match="not a tensor of Hugging Face's LlamaForCausalLM"):
        hf.from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(4)}, args)
