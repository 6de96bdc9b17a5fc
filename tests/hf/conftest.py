"""Tiny random Hugging Face Llama models and the titan model of the same shape.

``transformers`` is a test dependency (requirements-dev.txt); models are built from a config,
never downloaded. Every parameter is drawn at random (norm weights around 1, not exactly 1), so a
swapped or missing tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

#: titan's ``model.overrides`` (on the llama3 debugmodel flavor) of :func:`hf_config`'s model.
#: ``rope_original_max_len = 16`` makes Llama 3.1's RoPE scaling change most frequencies, so a
#: scaling that differs between the two implementations shows in the logits of short sequences.
TITAN_OVERRIDES: dict[str, Any] = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "multiple_of": 192,
    "rope_original_max_len": 16,
}


def hf_config(**changes: Any) -> Any:
    """A 2-layer LlamaConfig with grouped-query attention (4 heads, 2 KV heads) and RoPE scaling."""
    values: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,  # titan's debugmodel vocabulary, above the bundled tokenizer's 615
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "tie_word_embeddings": False,
    }
    values.update(changes)
    return transformers.LlamaConfig(**values)


def random_hf_model(config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config).eval())


def randomize(model: Any) -> Any:
    """Draw every parameter: norm weights around 1, embeddings N(0, 1), the rest N(0, 0.08)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.08)
    return model


def save_hf(folder: Path, config: Any | None = None, seed: int = 0, **save: Any) -> Any:
    """``save_pretrained`` a random model into ``folder``; returns the model."""
    model = random_hf_model(config if config is not None else hf_config(), seed)
    model.save_pretrained(folder, **save)
    return model


def llama3(overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """titan's llama3 spec and the args of debugmodel + ``overrides`` (TITAN_OVERRIDES by default)."""
    from titan_core._registry import get_registry

    spec = get_registry().get("models", "llama3", what="model")
    return spec, spec.flavor("debugmodel", TITAN_OVERRIDES if overrides is None else overrides)


def titan_model(spec: Any, args: Any, path: str | Path | None = None) -> torch.nn.Module:
    """titan's model on the CPU, initialised, then loaded from ``path`` (initial_load_path)."""
    from titan_core.initial_weights import load_initial_weights
    from titan_core.tied import retie, shared_parameters

    with torch.device("meta"):
        model = spec.build(args)
    tied = shared_parameters(model)
    model.to_empty(device="cpu")
    retie([model], tied)  # as the trainer does: to_empty makes a tied parameter two
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if path is not None:
        load_initial_weights([model], str(path), spec, args)
    return model.eval()


def tokens(batch: int = 2, seq: int = 48, seed: int = 1) -> torch.Tensor:
    """Random ids above the bundled tokenizer's special tokens (one document per row)."""
    return torch.randint(3, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_diff(titan: torch.nn.Module, hf: Any, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((titan(ids) - hf(ids).logits).abs().max())
