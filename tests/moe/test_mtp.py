"""Multi-token prediction (DeepSeek-V3): counts, the injected loss against a step-by-step
reference, unchanged main logits, layout checks, Hugging Face layout, training with it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch
import torch.nn.functional as F

from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import train
from titan_plugins_moe import hf, recipes
from titan_plugins_moe.flavors import FLAVORS, num_params, validate
from titan_plugins_moe.model import MoETransformer

ARGS = attrs.evolve(
    FLAVORS["deepseek_v3_debugmodel"],
    dim=64,
    n_heads=4,
    vocab_size=128,
    n_layers=3,
    n_mtp_layers=2,
    mtp_loss_weight=0.5,
)


def build(args=ARGS, seed: int = 0) -> MoETransformer:
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_counts_include_the_mtp_modules() -> None:
    with torch.device("meta"):
        model = MoETransformer(ARGS)
    assert sum(p.numel() for p in model.parameters()) == num_params(ARGS)
    assert num_params(ARGS) > num_params(attrs.evolve(ARGS, n_mtp_layers=0))


def reference_mtp_loss(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Depth by depth from the modules' parts, as DeepSeek-V3 describes it."""
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h = block(h, model.freqs_cis)
    seq, losses = tokens.shape[1], []
    for k, module in enumerate(model.mtp, start=1):
        n = seq - k - 1
        if n <= 0:  # no target this deep in a sequence this short: the mean is over the others
            break
        emb = model.tok_embeddings(tokens[:, k : k + n])
        x = module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h[:, :n])], dim=-1))
        h = module.block(x, model.freqs_cis)
        logits = model.output(module.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 : k + 1 + n].flatten()))
    return ARGS.mtp_loss_weight * sum(losses) / len(losses)


@pytest.mark.parametrize("seq", [12, 3])  # 3: the second depth has no target (it was counted)
def test_mtp_loss_gradient_and_unchanged_logits(seq: int) -> None:
    model = build()
    tokens = torch.randint(0, ARGS.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, ARGS.vocab_size, (2, seq), generator=torch.Generator().manual_seed(2))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    plain = build(attrs.evolve(ARGS, n_mtp_layers=0))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    with torch.no_grad():
        torch.testing.assert_close(logits, plain(tokens))  # the returned logits are the main model's
    model.args = attrs.evolve(ARGS, mtp_loss_weight=0.0)  # the same forward without the MTP term
    main = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    model.args = ARGS
    (main + reference_mtp_loss(model, tokens)).backward()
    for name, grad in injected.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, msg=name)
    assert injected["mtp.0.eh_proj.weight"].abs().sum() > 0
    assert ("mtp.1.eh_proj.weight" in injected) == (seq > 3)  # the second depth trains when it can


def test_mtp_is_refused_with_layouts_that_split_it() -> None:
    dims = SimpleNamespace(tp=1, pp=2, cp=1, ep=1)
    with pytest.raises(
        UsageError, match=r"n_mtp_layers=2: multi-token prediction .* parallelism.pp=2 splits"
    ):
        validate(ARGS, dims)
    validate(ARGS, SimpleNamespace(tp=1, pp=1, cp=1, ep=2))


def test_hf_layout_keeps_the_mtp_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    args = attrs.evolve(ARGS, n_mtp_layers=1)
    model = build(args).eval()
    exported = hf.to_hf(model.state_dict(), args)
    for key in (
        "enorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "mlp.gate.weight",
        "embed_tokens.weight",
    ):
        assert f"model.layers.3.{key}" in exported
    back = hf.from_hf(exported, args)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name
    config = hf.hf_config(args)
    assert config["num_nextn_predict_layers"] == 1
    save_file({k: v.contiguous() for k, v in exported.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(input_ids=tokens).logits, rtol=1e-4, atol=1e-4)


def _saved_hf_folder(folder: Path, args: object, state: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in hf.to_hf(state, args).items()}, str(folder / "model.safetensors")
    )
    (folder / "config.json").write_text(json.dumps(hf.hf_config(args)))
    return folder


def _loaded(folder: Path, args: object) -> MoETransformer:
    from titan_core.initial_weights import load_initial_weights

    model = build(args, seed=9)
    load_initial_weights([model], str(folder), get_registry().get("models", "moe"), args)
    return model


def test_a_folder_with_mtp_weights_loads_with_or_without_them(tmp_path: Path) -> None:
    """DeepSeek's checkpoints keep MTP modules at layer n_layers + k: a run with them loads them,
    a run without builds the main model and drops them (as transformers does)."""
    args = attrs.evolve(ARGS, n_mtp_layers=1)
    model = build(args)
    folder = _saved_hf_folder(tmp_path / "with_mtp", args, model.state_dict())
    with_mtp = _loaded(folder, args)
    for name, tensor in model.state_dict().items():
        assert torch.equal(with_mtp.state_dict()[name], tensor), name
    main_args = attrs.evolve(ARGS, n_mtp_layers=0)
    main = _loaded(folder, main_args)
    for name, tensor in main.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    tokens = torch.randint(0, args.vocab_size, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(main(tokens), model(tokens))


def test_a_run_with_mtp_from_a_folder_without_its_weights_names_them(tmp_path: Path) -> None:
    main_args = attrs.evolve(ARGS, n_mtp_layers=0)
    folder = _saved_hf_folder(tmp_path / "main_only", main_args, build(main_args).state_dict())
    with pytest.raises(UsageError, match=r"are not this model's tensors: \d+ missing \(model\.layers\.3\."):
        _loaded(folder, attrs.evolve(ARGS, n_mtp_layers=1))


def test_training_with_mtp_logs_its_term(tmp_path: Path) -> None:
    config = recipes.deepseek_v3_debugmodel()
    config.model.overrides = {"dim": 128, "n_layers": 3, "n_mtp_layers": 1}
    config.job.dump_folder = str(tmp_path)
    config.training.steps = 8
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.device = "cpu"
    config.data.bundled_documents = 300
    rows = train(config, get_registry())
    mtp = [r["moe/mtp_loss"] for r in rows]
    assert all(v > 0 for v in mtp) and mtp[-1] < mtp[0]
    assert "moe/layermtp0/imbalance" in rows[-1]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
