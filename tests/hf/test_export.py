"""``titan export CHECKPOINT_DIR --to hf OUT_DIR``: a trained checkpoint, read by ``transformers``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import error_line
from tests.hf.conftest import TITAN_OVERRIDES, llama3, max_diff, titan_model, tokens, transformers
from tests.parallel_harness import tiny_config, write_recipe_module
from titan_core import hookimpl
from titan_core._registry import Registry, get_registry
from titan_core.cli import main
from titan_core.data.loader import load_tokenizer
from titan_core.trainer import train


def _train(folder: Path, **overrides: Any) -> Path:
    """A 2-step run with checkpoints at steps 1 and 2; returns its dump folder."""
    config = tiny_config(
        **{
            "job.dump_folder": str(folder),
            "checkpoint.enable": True,
            "checkpoint.interval": 1,
            "training.steps": 2,
            "training.lr": 0.01,  # a visible step: the checkpoints differ from the initial weights
            "model.overrides": TITAN_OVERRIDES,
            **overrides,
        }
    )
    train(config, get_registry())
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("run"))


def export(*args: str | Path) -> int:
    return main(["export", *map(str, args)])


@pytest.fixture(autouse=True)
def _console_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TITAN_LOG_FORMAT", raising=False)  # errors as the one plain line users see


def test_exported_checkpoint_gives_titans_logits_in_transformers(run: Path, tmp_path: Path) -> None:
    step = run / "checkpoint" / "step-2"
    out = tmp_path / "hf"
    assert export(step, "--to", "hf", out) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    spec, args = llama3()
    trained = titan_model(spec, args, step)
    with torch.no_grad():  # the checkpoint is not the initial weights
        assert (trained(tokens()) - titan_model(spec, args)(tokens())).abs().max() > 1e-2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert max_diff(trained, hf, tokens()) < 1e-4
    # And back: the exported folder as initial weights of titan.
    with torch.no_grad():
        assert torch.allclose(titan_model(spec, args, out)(tokens()), trained(tokens()), atol=1e-6)
    # The tokenizer travels with the model, with titan's BOS/EOS.
    ours = load_tokenizer(None)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "The quick brown fox jumps over the lazy dog."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode_batch([text])[0]
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_sharded_bfloat16_export(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert (
        export(run / "checkpoint", "--to", "hf", out, "--max-shard-size", "100KB", "--dtype", "bfloat16") == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / shards[0]).values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    transformers.AutoModelForCausalLM.from_pretrained(out)
    # The newest checkpoint (step-2) of the folder, rounded to bfloat16, is what was written.
    spec, args = llama3()
    rounded = titan_model(spec, args, run / "checkpoint" / "step-2")
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in rounded.state_dict().items()})
    with torch.no_grad():
        assert torch.allclose(titan_model(spec, args, out)(tokens()), rounded(tokens()), atol=1e-5)


def test_tied_embeddings_export(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", **{"model.overrides": {**TITAN_OVERRIDES, "tie_embeddings": True}})
    out = tmp_path / "hf"
    assert export(run / "checkpoint" / "step-2", "--to", "hf", out) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    spec, args = llama3({**TITAN_OVERRIDES, "tie_embeddings": True})
    assert max_diff(titan_model(spec, args, run / "checkpoint" / "step-2"), hf, tokens()) < 1e-4


def test_model_from_a_recipe_module(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = tmp_path / "elsewhere" / "step-2"
    shutil.copytree(run / "checkpoint" / "step-2", step)  # no config.toml above it
    out = tmp_path / "hf"
    capsys.readouterr()
    assert export(step, "--to", "hf", out) == 2
    assert "no config.toml in the folders above" in error_line(capsys)
    module = write_recipe_module(
        tmp_path / "recipes", {"model.overrides": TITAN_OVERRIDES}, name="hf_export_recipes"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "recipes"))
    assert export(step, "--to", "hf", out, "--recipe", "layout", "--module", module) == 0
    spec, args = llama3()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert max_diff(titan_model(spec, args, step), hf, tokens()) < 1e-4


def test_non_empty_out_dir_is_refused_unless_overwrite(run: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "hf"
    assert export(run / "checkpoint", "--to", "hf", out, "--max-shard-size", "100KB") == 0
    (out / "README.md").write_text("my notes")
    capsys.readouterr()
    assert export(run / "checkpoint", "--to", "hf", out) == 2
    assert error_line(capsys) == (
        f"titan: error: export: OUT_DIR {str(out)!r} exists and is not empty; choose a new folder, or "
        "pass --overwrite to replace an earlier export there"
    )
    assert export(run / "checkpoint", "--to", "hf", out, "--overwrite") == 0
    # The earlier shards are gone (no mix of two exports); other files stay.
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "export: no checkpoint folder at"),
        ("not_a_checkpoint", "is not a DCP checkpoint (no .metadata) and holds no step-N checkpoint"),
        ("module_only", "export: --module needs --recipe NAME"),
        ("bad_size", "export: --max-shard-size 'lots': expected a size such as 5GB or 500MB"),
        ("other_model", "does not hold the model llama3/debugmodel with overrides"),
    ],
)
def test_bad_input_is_one_error_line(run: Path, tmp_path: Path, capsys: Any, case: str, message: str) -> None:
    step = run / "checkpoint" / "step-2"
    args: list[Any] = [step, "--to", "hf", tmp_path / "out"]
    if case == "missing":
        args[0] = tmp_path / "nowhere"
    elif case == "not_a_checkpoint":
        args[0] = tmp_path
        (tmp_path / "notes.txt").write_text("x")
    elif case == "module_only":
        args += ["--module", "some_module"]
    elif case == "bad_size":
        args += ["--max-shard-size", "lots"]
    elif case == "other_model":
        dump = tmp_path / "dump"
        shutil.copytree(run / "checkpoint", dump / "checkpoint")
        config = (run / "config.toml").read_text().replace('"n_layers" = 2', '"n_layers" = 4')
        assert config != (run / "config.toml").read_text()
        (dump / "config.toml").write_text(config)
        args[0] = dump / "checkpoint" / "step-2"
    capsys.readouterr()
    assert export(*args) == 2
    line = error_line(capsys)
    assert line.startswith("titan: error: ") and message in line
    if case == "other_model":
        assert "tensors of the model missing (layers.2." in line
    assert not (tmp_path / "out").exists()


def test_model_without_adapter(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama = get_registry().get("models", "llama3")

    class Plain:
        @hookimpl
        def titan_models(self) -> list[Any]:
            return [attrs.evolve(llama, name="plain", state_dict_adapter=None)]

    registry = Registry().load_entry_points()
    registry.register(Plain(), "plain")
    monkeypatch.setattr("titan_core._registry.get_registry", lambda disabled=None: registry)
    dump = tmp_path / "dump"
    shutil.copytree(run / "checkpoint", dump / "checkpoint")
    (dump / "config.toml").write_text(
        (run / "config.toml").read_text().replace('name = "llama3"', 'name = "plain"')
    )
    capsys.readouterr()
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "out") == 2
    assert "export: model 'plain' has no Hugging Face adapter" in error_line(capsys)


def test_a_checkpoint_a_resume_would_skip_is_not_exported(run: Path, tmp_path: Path, capsys: Any) -> None:
    """Damaged data is refused when named; a run's folder exports its newest sound checkpoint."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    step = copy / "checkpoint" / "step-2"
    data = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert export(step, "--to", "hf", tmp_path / "named") == 2
    line = error_line(capsys)
    assert "cannot be exported" in line and "CRC-32 mismatch" in line
    assert not (tmp_path / "named").exists()
    assert export(copy / "checkpoint", "--to", "hf", tmp_path / "newest") == 0
    captured = capsys.readouterr()
    assert (
        "skipped step-2" in captured.err and "exported " + str(copy / "checkpoint" / "step-1") in captured.out
    )


def test_a_recipe_of_another_model_of_the_same_shapes_is_refused(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json would carry the recipe's rope_theta over weights trained with another."""
    other = {**TITAN_OVERRIDES, "rope_theta": 1234.0}
    module = write_recipe_module(tmp_path / "recipes", {"model.overrides": other}, name="hf_other_theta")
    monkeypatch.syspath_prepend(str(tmp_path / "recipes"))
    capsys.readouterr()
    step = run / "checkpoint" / "step-2"
    assert export(step, "--to", "hf", tmp_path / "hf", "--recipe", "layout", "--module", module) == 2
    line = error_line(capsys)
    assert "was saved by another model than recipe 'layout' describes (model.overrides:" in line
    assert "1234.0" in line and not (tmp_path / "hf").exists()


def test_a_recipe_with_another_tokenizer_is_refused(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export writes the recipe's tokenizer beside weights trained on another one."""
    from titan_core.data.loader import BUNDLED_TOKENIZER
    from titan_core.data.make_tokenizer import train_tokenizer

    moved = tmp_path / "same.json"
    moved.write_bytes(BUNDLED_TOKENIZER.read_bytes())  # the same tokenizer elsewhere: fine
    other = tmp_path / "other.json"
    other.write_text(train_tokenizer(vocab_size=300).to_str())
    monkeypatch.syspath_prepend(str(tmp_path / "recipes"))
    step = run / "checkpoint" / "step-2"
    for name, path, code in (("tok_same", moved, 0), ("tok_other", other, 2)):
        overrides = {"model.overrides": TITAN_OVERRIDES, "data.tokenizer_path": str(path)}
        module = write_recipe_module(tmp_path / "recipes", overrides, name=name)
        capsys.readouterr()
        assert export(step, "--to", "hf", tmp_path / name, "--recipe", "layout", "--module", module) == code
    line = error_line(capsys)
    assert "was trained with data.tokenizer_path None, but recipe 'layout' gives" in line
    assert not (tmp_path / "tok_other").exists()


def test_a_document_masked_run_exports(tmp_path: Path) -> None:
    """The model asks for the BOS id (document_mask): export fills it in from the run's tokenizer,
    as training does; it said "the tokenizer has none"."""
    dump = _train(tmp_path / "dm", **{"model.overrides": {**TITAN_OVERRIDES, "document_mask": True}})
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "hf") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 0


def test_an_override_at_its_default_is_the_same_model(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume accepts it (the built arguments are equal); export did not."""
    same = {**TITAN_OVERRIDES, "rope_theta": 500000}  # the flavor's default, as an int
    module = write_recipe_module(tmp_path / "recipes", {"model.overrides": same}, name="hf_same_theta")
    monkeypatch.syspath_prepend(str(tmp_path / "recipes"))
    step = run / "checkpoint" / "step-2"
    assert export(step, "--to", "hf", tmp_path / "hf", "--recipe", "layout", "--module", module) == 0


def test_a_step_linking_out_of_the_checkpoint_folder_is_skipped(
    run: Path, tmp_path: Path, capsys: Any
) -> None:
    """A resume loads only from the checkpoint folder; export of the run's folder skips such a
    link as a resume does, and exports the newest step inside."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    outside = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoint" / "step-2", outside)
    meta = json.loads((outside / "meta.json").read_text())
    (outside / "meta.json").write_text(json.dumps({**meta, "step": 9}))
    (copy / "checkpoint" / "step-9").symlink_to(outside)
    capsys.readouterr()
    assert export(copy / "checkpoint", "--to", "hf", tmp_path / "hf") == 0
    captured = capsys.readouterr()
    assert "skipped step-9: it links to" in captured.err and "outside" in captured.err
    # What to do is export's own: a training field would not help here.
    assert "initial_load_path" not in captured.err and "export that folder by its path" in captured.err
    assert "exported " + str(copy / "checkpoint" / "step-2") in captured.out


@pytest.mark.parametrize(
    ("line", "new", "message"),
    [
        (r"^flavor = .*$", "flavor = 3", "model.flavor: expected a string, got int 3"),
        (r"^# tokenizer_path = .*$", 'tokenizer_path = ["x"]', "data.tokenizer_path: expected a string"),
        (r"^overrides = .*$", 'overrides = "n_layers=2"', "model.overrides: expected a table"),
    ],
)
def test_a_config_toml_field_of_the_wrong_type_is_one_error_naming_it(
    run: Path, tmp_path: Path, capsys: Any, line: str, new: str, message: str
) -> None:
    """export read config.toml raw: a string where overrides go was a ValueError traceback, a
    list for tokenizer_path a TypeError."""
    import re

    dump = tmp_path / "dump"
    shutil.copytree(run / "checkpoint", dump / "checkpoint")
    text, n = re.subn(line, new, (run / "config.toml").read_text(), count=1, flags=re.M)
    assert n == 1
    (dump / "config.toml").write_text(text)
    capsys.readouterr()
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "hf") == 2
    error = error_line(capsys)
    assert error.startswith(f"titan: error: export: {dump / 'config.toml'}: ") and message in error


def test_a_document_masked_run_whose_tokenizer_is_gone_says_the_tokenizer_is_missing(
    tmp_path: Path, capsys: Any
) -> None:
    """The model needs the BOS id, which only the run's tokenizer holds: the one error names the
    missing tokenizer file, not the model's bos_id check."""
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_bytes(load_tokenizer(None).backend.to_str().encode())
    dump = _train(
        tmp_path / "dm",
        **{
            "model.overrides": {**TITAN_OVERRIDES, "document_mask": True},
            "data.tokenizer_path": str(tokenizer),
        },
    )
    tokenizer.unlink()
    capsys.readouterr()
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "hf") == 2
    line = error_line(capsys)
    assert line.startswith("titan: error: export:"), line
    assert "tokenizer" in line and str(tokenizer) in line and "data.tokenizer_path" in line
    assert not (tmp_path / "hf").exists()


def test_exported_weights_get_the_permissions_of_the_other_files(run: Path, tmp_path: Path) -> None:
    """safetensors writes its files readable by their owner alone; a model folder shared with a
    team (or served by another user) must be readable as config.json is."""
    import os

    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert export(run / "checkpoint" / "step-2", "--to", "hf", out, "--max-shard-size", "100KB") == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert set(modes.values()) == {0o644}, modes


def _swap_two_ids(path: Path) -> None:
    """Rewrite a tokenizer.json in place with ids 300 and 301 exchanged: the same vocabulary
    size and file size, but each id now stands for the other's text."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))


def test_a_tokenizer_rewritten_since_training_is_not_exported_with_the_weights(
    tmp_path: Path, capsys: Any
) -> None:
    """The checkpoint records the tokenizer's digest; export compared paths only, so a file
    rewritten at the same path went into the Hugging Face folder beside weights that learnt the
    old ids (AutoTokenizer then encodes text to ids the model reads as other text)."""
    from titan_core.data.loader import BUNDLED_TOKENIZER

    tokenizer = tmp_path / "tokenizer.json"
    original = json.loads(BUNDLED_TOKENIZER.read_text())
    tokenizer.write_text(json.dumps(original))
    dump = _train(tmp_path / "run", **{"data.tokenizer_path": str(tokenizer)})
    _swap_two_ids(tokenizer)
    capsys.readouterr()
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "hf") == 2
    line = error_line(capsys)
    assert line.startswith("titan: error: export: ") and "another tokenizer" in line, line
    assert f"data.tokenizer_path {str(tokenizer)!r}" in line and "rewritten since" in line, line
    assert not (tmp_path / "hf").exists()
    # The same tokenizer again, its JSON laid out otherwise: the one the weights learnt.
    tokenizer.write_text(json.dumps(original, indent=2, sort_keys=True))
    assert export(dump / "checkpoint", "--to", "hf", tmp_path / "hf") == 0
    written = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert written["model"]["vocab"] == original["model"]["vocab"]


def test_an_overwrite_that_fails_keeps_the_earlier_export(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overwrite deleted the earlier export's files before writing the new ones: a full disk
    in the middle left neither (a half-written folder, the earlier model gone)."""
    import errno

    import safetensors.torch

    out = tmp_path / "hf"
    assert export(run / "checkpoint" / "step-1", "--to", "hf", out, "--max-shard-size", "100KB") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = safetensors.torch.save_file, []

    def full_disk(tensors: Any, filename: str, metadata: Any = None) -> None:
        calls.append(filename)
        if len(calls) == 2:  # the second shard: the disk fills up
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    capsys.readouterr()
    again = [run / "checkpoint" / "step-2", "--to", "hf", out, "--overwrite", "--max-shard-size", "100KB"]
    assert export(*again) == 2
    line = error_line(capsys)
    assert line.startswith(f"titan: error: export: cannot write {str(out)!r}: ") and "No space left" in line
    assert "the earlier export there is kept" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched, nothing left over
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert export(run / "checkpoint" / "step-2", "--to", "hf", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    state = load_file(out / "model.safetensors")
    assert not torch.equal(state["model.norm.weight"], load_file_of(before, "model.norm.weight"))


def test_a_ctrl_c_while_an_overwrite_moves_its_files_in_never_mixes_two_exports(
    run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overwrite moves the new files over the earlier export's one by one, then deletes the
    earlier shards it does not replace: a Ctrl-C in between left shards of both."""
    import signal

    from titan_plugins_dcp import export as export_module

    out = tmp_path / "hf"
    assert export(run / "checkpoint" / "step-1", "--to", "hf", out, "--max-shard-size", "100KB") == 0
    real, moved = os.replace, []

    def interrupted(src: Any, dst: Any) -> None:
        moved.append(dst)
        if len(moved) == 1:
            signal.raise_signal(signal.SIGINT)  # the Python handler runs at the next bytecode
        real(src, dst)

    monkeypatch.setattr(export_module.os, "replace", interrupted)
    capsys.readouterr()
    assert export(run / "checkpoint" / "step-2", "--to", "hf", out, "--overwrite") == 130
    monkeypatch.undo()
    # The whole new export (one file), nothing of the earlier one's shards.
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def load_file_of(files: dict[str, bytes], name: str) -> torch.Tensor:
    """Tensor ``name`` from the safetensors files given as bytes (an earlier export's)."""
    from safetensors.torch import load

    for file, data in files.items():
        if file.endswith(".safetensors") and name in (state := load(data)):
            return state[name]
    raise KeyError(name)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_killed_exports_staging_folder_neither_blocks_nor_survives_the_next_export(
    run: Path, tmp_path: Path, overwrite: bool
) -> None:
    """A killed ``titan export`` leaves its hidden staging folder in OUT_DIR; the next export
    into that folder refused it as "not empty" (a folder the user never saw), and --overwrite
    left the half-written shards there beside the new export."""
    out = tmp_path / "hf"
    stage = out / ".titan-export-k1ll3d.tmp"
    stage.mkdir(parents=True)
    (stage / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    assert export(run / "checkpoint", "--to", "hf", out, *["--overwrite"] * overwrite) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    transformers.AutoModelForCausalLM.from_pretrained(out)
