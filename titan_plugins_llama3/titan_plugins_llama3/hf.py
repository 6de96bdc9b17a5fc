"""Llama 3 <-> Hugging Face ``transformers`` (``LlamaForCausalLM``): names, rotary layout, config.

The two implementations hold the same weights under different names, and order the rows of the
query and key projections differently. titan's RoPE (``titan_core.blocks.apply_rope``, Meta's
original layout) rotates *adjacent* pairs of a head's features, ``(x[2i], x[2i+1])``, as one complex
number; ``transformers`` rotates ``(x[i], x[i + head_dim/2])`` (``rotate_half``). Both compute the
same attention when the rows of ``wq``/``wk`` of every head are reordered: even rows first, then odd
rows, going to Hugging Face (:func:`_to_half_split`), and back (:func:`_to_interleaved`). This is the
permutation of Meta's ``convert_llama_weights_to_hf.py``; ``wv``/``wo`` are not rotated.

Tied embeddings: the output projection *is* the token embedding, so ``output.weight`` maps to
``model.embed_tokens.weight`` (a tied ``save_pretrained`` folder stores no ``lm_head.weight``).

The functions work on plain ``{name: tensor}`` dicts of full tensors, any subset of the model
(one layer, one tensor): titan's loader converts a big checkpoint a few tensors at a time. A name
neither side knows raises ``KeyError``; Hugging Face tensors that carry no weight of titan's model
(``rotary_emb.inv_freq`` of old checkpoints, a tied ``lm_head.weight``) are dropped.
"""

from __future__ import annotations

import math
import re
from typing import Any

from titan_plugins_llama3.flavors import Llama3Args

#: titan block-relative name -> Hugging Face block-relative name.
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_FROM_HF = {hf: titan for titan, hf in _BLOCK.items()}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP_FROM_HF = {hf: titan for titan, hf in _TOP.items()}
_TITAN_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _to_half_split(w: Any, n_heads: int) -> Any:
    """Rows of each head from titan's interleaved pairs to ``rotate_half``'s two halves."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_interleaved(w: Any, n_heads: int) -> Any:
    """Inverse of :func:`_to_half_split`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(state_dict: dict[str, Any], args: Llama3Args) -> dict[str, Any]:
    """titan names and rotary layout -> ``LlamaForCausalLM``'s."""
    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        if name in _TOP:
            out[_TOP[name]] = tensor
        elif name == "output.weight":
            out["model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"] = tensor
        elif (m := _TITAN_BLOCK.match(name)) and m.group(2) in _BLOCK:
            rest = m.group(2)
            if rest == "attention.wq.weight":
                tensor = _to_half_split(tensor, args.n_heads)
            elif rest == "attention.wk.weight":
                tensor = _to_half_split(tensor, args.kv_heads)
            out[f"model.layers.{m.group(1)}.{_BLOCK[rest]}"] = tensor
        else:
            raise KeyError(f"{name!r} is not a tensor of titan's Llama 3 model")
    return out


def from_hf(state_dict: dict[str, Any], args: Llama3Args) -> dict[str, Any]:
    """``LlamaForCausalLM`` names and rotary layout -> titan's."""
    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        if name in _TOP_FROM_HF:
            out[_TOP_FROM_HF[name]] = tensor
            if name == "model.embed_tokens.weight" and args.tie_embeddings:
                out["output.weight"] = tensor
        elif name == "lm_head.weight":
            if not args.tie_embeddings:  # tied: the embedding is the output projection
                out["output.weight"] = tensor
        elif (m := _HF_BLOCK.match(name)) and m.group(2) in _BLOCK_FROM_HF:
            rest = _BLOCK_FROM_HF[m.group(2)]
            if rest == "attention.wq.weight":
                tensor = _to_interleaved(tensor, args.n_heads)
            elif rest == "attention.wk.weight":
                tensor = _to_interleaved(tensor, args.kv_heads)
            out[f"layers.{m.group(1)}.{rest}"] = tensor
        elif not (m and m.group(2) == "self_attn.rotary_emb.inv_freq"):  # a buffer, recomputed
            raise KeyError(f"{name!r} is not a tensor of Hugging Face's LlamaForCausalLM")
    return out


def hf_config(args: Llama3Args) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` with ``args``' architecture.

    RoPE is written as ``rope_theta`` + ``rope_scaling`` (``rope_type: llama3``), the form both
    ``transformers`` 4.x and 5.x read (5.x turns it into ``rope_parameters``).
    """
    rope_scaling = (
        {
            "rope_type": "llama3",
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": int(args.rope_original_max_len),
        }
        if args.rope_scaling
        else None
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": float(args.norm_eps),
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": bool(args.tie_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def args_from_hf(config: dict[str, Any]) -> Llama3Args:
    """titan's Llama 3 arguments of the model a Hugging Face ``config.json`` describes.

    Raises ``ValueError`` naming the field for a config titan's Llama 3 cannot represent (another
    architecture, biases, another activation, a head size other than ``hidden_size / heads``, a
    RoPE scaling other than Llama 3.1's).
    """
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"model_type is {model_type!r}, not 'llama'")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{flag} is true; titan's Llama 3 has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act is {config['hidden_act']!r}; titan's Llama 3 uses silu")
    quantization = config.get("quantization_config")
    if quantization is not None:
        # Quantized tensors read as plain numbers would be other weights (their scales are
        # separate tensors): refused before a tensor is read.
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(
            f"quantization_config (quant_method {method!r}) is not supported: titan loads unquantized "
            "weights (float32, bfloat16 or float16); dequantize the checkpoint first and drop "
            "quantization_config from config.json"
        )
    dim, n_heads = _count(config, "hidden_size"), _count(config, "num_attention_heads")
    n_layers, vocab = _count(config, "num_hidden_layers"), _count(config, "vocab_size")
    intermediate = _count(config, "intermediate_size")
    kv_heads = n_heads  # null or absent: as many KV heads as heads (transformers' rule)
    if config.get("num_key_value_heads") is not None:
        kv_heads = _count(config, "num_key_value_heads")
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"head_dim is {head_dim}, not hidden_size / num_attention_heads = {dim // n_heads}; "
            "titan's Llama 3 derives the head size from dim and n_heads"
        )
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (theta inside).
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} is {rope!r}; expected an object ({{'rope_type': 'llama3', ...}}) or null")
    theta = _number(rope, "rope_theta", key) if "rope_theta" in rope else _number(config, "rope_theta", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; titan's Llama 3 has Llama 3.1's")
    scaling: dict[str, Any] = {"rope_scaling": rope_type == "llama3"}
    if rope_type == "llama3":
        for field in _LLAMA3_ROPE:
            if field not in rope:
                raise ValueError(f"{key} of rope_type 'llama3' has no {field!r}")
        scaling.update(
            rope_scaling_factor=_number(rope, "factor", key),
            rope_low_freq_factor=_number(rope, "low_freq_factor", key),
            rope_high_freq_factor=_number(rope, "high_freq_factor", key),
            rope_original_max_len=int(_number(rope, "original_max_position_embeddings", key)),
        )
    args = Llama3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv_heads if kv_heads != n_heads else None,
        vocab_size=vocab,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **_ffn_args(dim, intermediate),
        **scaling,
    )
    if args.ffn_hidden_dim != intermediate:  # _ffn_args guarantees it; a cheap guard
        raise ValueError(f"intermediate_size {intermediate} cannot be expressed by titan's Llama 3")
    return args


#: The fields of Llama 3.1's RoPE scaling in ``rope_scaling`` / ``rope_parameters``.
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _count(config: dict[str, Any], name: str) -> int:
    """``config[name]`` as a positive integer, or ``ValueError`` naming the field."""
    if name not in config:
        raise ValueError(f"config.json has no {name!r}")
    value = config[name]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # a number written as a string reads as transformers reads it
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and number == int(number) and number >= 1):
        raise ValueError(f"{name} is {config[name]!r}; expected a positive integer")
    return int(number)


def _number(section: dict[str, Any], name: str, where: str | None) -> float:
    """``section[name]`` (default rope_theta 10000) as a positive finite number, or ``ValueError``."""
    value = section.get(name, 10000.0)
    label = f"{where}'s {name}" if where else name
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not 0 < number < math.inf:
        raise ValueError(f"{label} is {value!r}; expected a positive number")
    return number


def _ffn_args(dim: int, intermediate: int) -> dict[str, Any]:
    """``multiple_of`` / ``ffn_dim_multiplier`` that make titan's SwiGLU width ``intermediate``.

    titan rounds ``ffn_dim_multiplier * int(8 * dim / 3)`` up to a multiple of ``multiple_of``;
    with ``multiple_of = intermediate`` any product in ``(0, intermediate]`` rounds to it, so the
    multiplier only has to bring a larger base width down (float rounding of the product stays in
    that range).
    """
    base = int(2 * (4 * dim) / 3)
    multiplier = None if base <= intermediate else intermediate / base
    return {"multiple_of": intermediate, "ffn_dim_multiplier": multiplier}
