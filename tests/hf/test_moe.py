"""The MoE plugin's architectures through the same import and export paths as Llama 3.

Its adapter converts whole models only (it checks that every tensor is there), so the loader
converts the folder at once (``_whole_model``); these tests pin that this path is as strict as the
tensor-by-tensor one, and that ``titan export`` of a trained MoE checkpoint loads in
``transformers`` with titan's logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.hf.conftest import randomize, titan_model, transformers
from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.cli import main
from titan_core.errors import UsageError
from titan_core.initial_weights import load_initial_weights
from titan_core.trainer import Trainer, train

FLAVORS = ["qwen3_debugmodel", "deepseek_v3_debugmodel"]
_SMALL = {"n_layers": 2}


def _moe(flavor: str) -> tuple[Any, Any]:
    spec = get_registry().get("models", "moe")
    return spec, spec.flavor(flavor, _SMALL)


def _model(spec: Any, args: Any, seed: int, path: Path | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if path is not None:
        load_initial_weights([model], str(path), spec, args)
    return model.eval()


@pytest.fixture(scope="module", params=FLAVORS)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 2-step checkpointed run of the flavor; returns (flavor, step-2 folder)."""
    flavor = request.param
    folder = tmp_path_factory.mktemp(flavor)
    config = tiny_config(
        **{
            "job.dump_folder": str(folder),
            "model.name": "moe",
            "model.flavor": flavor,
            "model.overrides": _SMALL,
            "checkpoint.enable": True,
            "training.steps": 2,
            "training.lr": 0.01,
        }
    )
    train(config, get_registry())
    return flavor, folder / "checkpoint" / "step-2"


def test_export_of_a_trained_moe_loads_in_transformers(
    trained: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TITAN_LOG_FORMAT", raising=False)
    flavor, step = trained
    out = tmp_path / "hf"
    assert main(["export", str(step), "--to", "hf", str(out)]) == 0
    spec, args = _moe(flavor)
    ours = _model(spec, args, 0, step)  # the checkpoint's weights, through the DCP loader
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = torch.randint(3, 2048, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids), theirs(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4
        )
        # And back into titan from the exported folder: the same tensors.
        back = _model(spec, args, 5, out)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_damaged_moe_folder_is_refused(flavor: str, tmp_path: Path) -> None:
    spec, args = _moe(flavor)
    adapter = spec.state_dict_adapter
    source = _model(spec, args, 1)
    exported = adapter.to_hf(source.state_dict(), args)
    file = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in exported.items()}, str(file), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    loaded = _model(spec, args, 2, tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())

    weights = load_file(file)
    expert = next(k for k in weights if ".mlp.experts.1." in k)
    del weights[expert]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(
        UsageError, match=rf"checkpoint.initial_load_path: the safetensors of .*{re.escape(expert)}"
    ):
        _model(spec, args, 2, tmp_path)
    weights[expert] = exported[expert].contiguous()
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"1 unexpected \(model.layers.0.mlp.extra.weight\)"):
        _model(spec, args, 2, tmp_path)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_save_pretrained_model_gives_the_same_logits_and_first_loss(flavor: str, tmp_path: Path) -> None:
    spec, args = _moe(flavor)
    config = spec.state_dict_adapter.hf_config(args)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config), attn_implementation="eager"
    )
    randomize(reference).eval()
    reference.save_pretrained(tmp_path / "hf")
    run = tiny_config(
        **{
            "job.dump_folder": str(tmp_path / "run"),
            "model.name": "moe",
            "model.flavor": flavor,
            "model.overrides": _SMALL,
            "checkpoint.initial_load_path": str(tmp_path / "hf"),
            "training.steps": 1,
        }
    )
    trainer = Trainer(run, get_registry())
    model = trainer.parts[0].eval()
    ids = torch.randint(3, 2048, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids), reference(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4
        )
        inputs, labels = next(iter(trainer.batches))
        logits = reference(input_ids=inputs, use_cache=False).logits
    model.train()
    expected = float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    history = trainer.train()
    trainer.close(completed=True)
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("flavor", ["qwen3_debugmodel", "deepseek_v3_debugmodel"])
@pytest.mark.parametrize("head", ["the embedding", "another matrix"])
def test_a_tied_folder_holding_an_lm_head_loads_as_transformers_reads_it(
    head: str, flavor: str, tmp_path: Path
) -> None:
    """A tied folder that also stores ``lm_head.weight`` (some tools write it): transformers ties
    the two when they are equal, and unties them (the lm_head computes the logits) when they
    differ. titan refused both as "1 unexpected (lm_head.weight)"; a tied model cannot hold two
    matrices, so the second is refused naming why, the first loads. DeepSeek's adapter converts
    the model as one group (Qwen3-MoE's whole models only): the two load paths."""
    spec, base = _moe(flavor)
    args = attrs.evolve(base, tie_embeddings=True)
    adapter = spec.state_dict_adapter
    torch.manual_seed(1)
    source = titan_model(spec, args)  # tied: one matrix (``_model`` leaves to_empty's two)
    weights = {k: v.contiguous() for k, v in adapter.to_hf(source.state_dict(), args).items()}
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone() if head == "the embedding" else embedding.flip(0)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    if head == "the embedding":
        torch.manual_seed(2)
        loaded = titan_model(spec, args, tmp_path)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())
        return
    with pytest.raises(UsageError) as refused:
        titan_model(spec, args, tmp_path)
    message = str(refused.value)
    assert "tie_word_embeddings" in message
    assert re.search(r"lm_head\.weight,? (which )?differs from model\.embed_tokens\.weight", message), message
    assert "tie_embeddings = False" in message


def test_a_tensor_deepseeks_adapter_does_not_read_stays_unexpected(tmp_path: Path) -> None:
    """The one-group adapter's dropped tensors are those it looks up (a tied lm_head.weight);
    another one of the embedding's shape is still refused as not this model's."""
    spec, base = _moe("deepseek_v3_debugmodel")
    args = attrs.evolve(base, tie_embeddings=True)
    adapter = spec.state_dict_adapter
    hf_state = adapter.to_hf(titan_model(spec, args).state_dict(), args)
    weights = {k: v.contiguous() for k, v in hf_state.items()}
    weights["model.stray.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    with pytest.raises(UsageError, match=r"1 unexpected \(model\.stray\.weight\)"):
        titan_model(spec, args, tmp_path)
