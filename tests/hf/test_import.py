"""``checkpoint.initial_load_path`` = a Hugging Face folder written by ``save_pretrained``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.hf.conftest import (
    TITAN_OVERRIDES,
    hf_config,
    llama3,
    max_diff,
    random_hf_model,
    save_hf,
    titan_model,
    tokens,
)
from tests.parallel_harness import child_env, tiny_config, write_recipe_module
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import Trainer

_FIELD = "checkpoint.initial_load_path"


def test_logits_and_first_step_loss_equal_transformers(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    reference = save_hf(folder)
    config = tiny_config(
        **{"job.dump_folder": str(tmp_path / "run"), _FIELD: str(folder), "model.overrides": TITAN_OVERRIDES}
    )
    config.training.steps = 2
    trainer = Trainer(config, get_registry())
    model = trainer.parts[0]
    model.eval()
    ids = tokens()
    assert max_diff(model, reference, ids) < 1e-4
    # The test sees RoPE scaling: without it transformers computes something else.
    unscaled = random_hf_model(hf_config(rope_scaling=None))
    unscaled.load_state_dict(reference.state_dict())
    assert max_diff(model, unscaled, ids) > 1e-3
    model.train()

    inputs, labels = next(iter(trainer.batches))  # the batch step 1 trains on
    with torch.no_grad():
        logits = reference(inputs).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    history = trainer.train()
    trainer.close(completed=True)
    assert history[0]["step"] == 1
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_sharded_folder_loads_file_by_file(tmp_path: Path) -> None:
    reference = save_hf(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    spec, args = llama3()
    assert max_diff(titan_model(spec, args, tmp_path), reference, tokens()) < 1e-4


def test_tied_embeddings(tmp_path: Path) -> None:
    reference = save_hf(tmp_path, hf_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    spec, args = llama3({**TITAN_OVERRIDES, "tie_embeddings": True})
    model = titan_model(spec, args, tmp_path)
    assert model.output.weight is model.tok_embeddings.weight
    assert max_diff(model, reference, tokens()) < 1e-4


def test_a_tied_folder_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    """A tied folder that also stores ``lm_head.weight`` unlike the embedding (a tool wrote it,
    or it was fine-tuned untied): transformers unties the two and computes the logits with
    ``lm_head``; titan dropped it and computed them with the embedding, without a word."""
    save_hf(tmp_path, hf_config(tie_word_embeddings=True))
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    spec, args = llama3({**TITAN_OVERRIDES, "tie_embeddings": True})
    with pytest.raises(UsageError) as info:
        titan_model(spec, args, tmp_path)
    message = str(info.value)
    assert message.startswith(f"{_FIELD}: {str(tmp_path)!r} holds lm_head.weight")
    assert "differs from model.embed_tokens.weight" in message and "tie_embeddings" in message
    # As the message says: untied in config.json and in the model, every tensor is used.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    spec, untied = llama3({**TITAN_OVERRIDES, "tie_embeddings": False})
    model = titan_model(spec, untied, tmp_path)
    assert torch.equal(model.output.weight, weights["lm_head.weight"])


def test_bfloat16_weights_load_into_float32_parameters(tmp_path: Path) -> None:
    stored = random_hf_model(hf_config()).to(torch.bfloat16)
    stored.save_pretrained(tmp_path)
    # The reference: the same rounded weights in float32 (the bf16 model's RoPE buffer is rounded too).
    reference = random_hf_model(hf_config())
    reference.load_state_dict({k: v.float() for k, v in stored.state_dict().items()})
    spec, args = llama3()
    model = titan_model(spec, args, tmp_path)
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert max_diff(model, reference, tokens()) < 1e-4


def test_config_of_another_shape_names_the_fields(tmp_path: Path) -> None:
    save_hf(tmp_path)
    spec, args = llama3({**TITAN_OVERRIDES, "n_layers": 4, "dim": 128})
    with pytest.raises(UsageError) as info:
        titan_model(spec, args, tmp_path)
    message = str(info.value)
    assert message.startswith(
        f"{_FIELD}: the Hugging Face model in {str(tmp_path)!r} is not the run's llama3 model"
    )
    assert "n_layers 2 vs 4" in message and "dim 64 vs 128" in message
    assert "{'dim': 64, 'n_layers': 2}" in message  # the overrides that would fit


def test_config_mismatch_in_derived_fields(tmp_path: Path) -> None:
    spec, args = llama3()  # norm_eps 1e-5, ffn width 192 from multiple_of 192
    save_hf(tmp_path / "eps", hf_config(rms_norm_eps=1e-6))
    with pytest.raises(UsageError, match=r"norm_eps 1e-06 vs 1e-05"):
        titan_model(spec, args, tmp_path / "eps")
    save_hf(tmp_path / "ffn", hf_config(intermediate_size=320))
    with pytest.raises(UsageError, match=r"multiple_of 320 vs 192"):
        titan_model(spec, args, tmp_path / "ffn")
    # No override value can say "as many KV heads as heads" (None): the Hugging Face names then.
    save_hf(tmp_path / "mha", hf_config(num_key_value_heads=4))
    with pytest.raises(UsageError, match=r"num_key_value_heads 4 vs 2 \(config.json vs the run\)"):
        titan_model(spec, args, tmp_path / "mha")


def test_config_of_another_architecture(tmp_path: Path) -> None:
    save_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    spec, args = llama3()
    with pytest.raises(
        UsageError, match=r"config.json does not describe a llama3 model: hidden_act is 'gelu'"
    ):
        titan_model(spec, args, tmp_path)
    # Values that once gave a bare ZeroDivisionError / AttributeError from inside the load.
    for change, named in (
        ({"num_attention_heads": 0}, "num_attention_heads is 0; expected a positive integer"),
        ({"rope_parameters": "llama3"}, "rope_parameters is 'llama3'; expected an object"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UsageError, match=rf"config.json does not describe a llama3 model: {named}"):
            titan_model(spec, args, tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"cannot read .*config.json"):
        titan_model(spec, args, tmp_path)


def test_missing_unexpected_and_reshaped_tensors_are_named(tmp_path: Path) -> None:
    save_hf(tmp_path)
    spec, args = llama3()
    file = tmp_path / "model.safetensors"
    full = load_file(file)
    drop = "model.layers.1.mlp.up_proj.weight"
    bad = {k: v for k, v in full.items() if k != drop}
    bad["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    bad["model.norm.weight"] = torch.ones(32)
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(UsageError) as info:
        titan_model(spec, args, tmp_path)
    message = str(info.value)
    assert f"1 missing ({drop})" in message
    assert "1 unexpected (model.layers.0.self_attn.q_proj.bias)" in message
    assert "model.norm.weight [32] in the files vs [64]" in message
    # A tied checkpoint that also stores lm_head.weight, and old rotary buffers, are fine.
    tied = tmp_path / "tied"
    save_hf(tied, hf_config(tie_word_embeddings=True))
    weights = load_file(tied / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    spec, tied_args = llama3({**TITAN_OVERRIDES, "tie_embeddings": True})
    titan_model(spec, tied_args, tied)


def test_missing_files(tmp_path: Path) -> None:
    spec, args = llama3()
    save_hf(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(UsageError, match=rf"names shards that are not there: {shard.name}; copy the whole"):
        titan_model(spec, args, tmp_path)
    for file in tmp_path.glob("model*"):
        file.unlink()
    with pytest.raises(UsageError, match=r"has no \*.safetensors files"):
        titan_model(spec, args, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UsageError, match=r"it has pytorch_model.bin: save it again with save_pretrained"):
        titan_model(spec, args, tmp_path)
    with pytest.raises(UsageError, match=r"no file or folder at"):
        titan_model(spec, args, tmp_path / "nowhere")


def test_model_without_adapter(tmp_path: Path) -> None:
    save_hf(tmp_path)
    spec, args = llama3()
    with pytest.raises(UsageError, match=r"model 'llama3' has no Hugging Face adapter"):
        titan_model(attrs.evolve(spec, state_dict_adapter=None), args, tmp_path)


def test_titan_run_fails_with_one_line(tmp_path: Path) -> None:
    save_hf(tmp_path / "hf")
    module = write_recipe_module(
        tmp_path, {_FIELD: str(tmp_path / "hf"), "model.overrides": {**TITAN_OVERRIDES, "n_layers": 4}}
    )
    env = child_env(tmp_path, TITAN_LOG_FORMAT="console")
    result = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert f"titan: error: {_FIELD}: the Hugging Face model in" in errors[0]
    assert "n_layers 2 vs 4" in errors[0]


def test_a_tied_twin_is_compared_with_its_own_source_only() -> None:
    """An adapter that converts the model as one group (DeepSeek's): every Hugging Face tensor
    is in the group of the tied name, so a dropped ``lm_head.weight`` equal to the embedding was
    compared with every tensor of its shape too (another [vocab, dim] matrix) and refused."""
    from titan_core.initial_weights import _refuse_dropped_untied

    embedding, other = torch.randn(8, 4), torch.randn(8, 4)
    tensors = {"embed": embedding, "other_head": other, "lm_head": embedding.clone()}

    class Handle:
        def get_tensor(self, name: str) -> torch.Tensor:
            return tensors[name]

    class WholeModelAdapter:  # renames, as a whole model only
        @staticmethod
        def from_hf(state: dict, args: object) -> dict:
            return {"tok_embeddings.weight": state["embed"], "head2.weight": state["other_head"]}

    group = {"embed": embedding.to("meta"), "other_head": other.to("meta")}
    groups = dict.fromkeys(["tok_embeddings.weight", "head2.weight"], group)
    where = {name: Path("model.safetensors") for name in tensors}
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    handles = {Path("model.safetensors"): Handle()}
    aliases = {"output.weight": "tok_embeddings.weight"}
    args = (groups, aliases, handles, where, shapes, "folder", WholeModelAdapter(), None)
    _refuse_dropped_untied(*args)  # equal to its own source: loads
    tensors["lm_head"] = torch.randn(8, 4)
    with pytest.raises(UsageError, match="holds lm_head, which differs from embed;"):
        _refuse_dropped_untied(*args)
