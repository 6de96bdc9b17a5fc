"""``titan export CHECKPOINT_DIR --to hf OUT_DIR``: a DCP checkpoint as a Hugging Face model folder.

The command needs the model the checkpoint was trained with: by default it reads the
``config.toml`` that training writes into ``job.dump_folder`` (the checkpoint folder is
``<dump_folder>/<checkpoint.folder>/step-N``; the nearest ``config.toml`` above it is used), or
``--recipe NAME [--module M]`` names it. It builds that model on the CPU in this one process, loads
the checkpoint's ``model`` entry into it (DCP reassembles the shards of any parallel layout),
converts the state dict with the model plugin's :class:`~titan_core.records.StateDictAdapter` and
writes what ``transformers.AutoModelForCausalLM.from_pretrained`` reads: ``config.json`` and
``model.safetensors`` (``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``
above ``--max-shard-size``). The run's tokenizer is copied beside them (``tokenizer.json`` and a
``tokenizer_config.json`` naming its BOS/EOS tokens) so that ``AutoTokenizer`` loads it too.

This module does not import torch at import time: ``titan --help`` builds the command's parser.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.errors import UsageError
from titan_core.stop_signals import stops_held

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig

#: Files this command writes; ``--overwrite`` removes these (and only these) from OUT_DIR first.
_OUTPUTS = re.compile(
    r"^(config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer\.json|tokenizer_config\.json)$"
)
#: ``5GB`` (10^9 bytes, as transformers counts) or ``5GiB`` (2^30 bytes).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_DTYPES = ("float32", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a DCP checkpoint of a titan run as a Hugging Face model folder (config.json + "
        "safetensors + tokenizer) that transformers' AutoModelForCausalLM.from_pretrained loads. The "
        "model comes from the config.toml training wrote into the dump folder, or from --recipe."
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a checkpoint folder (<dump_folder>/checkpoint/step-N), or the folder of step-N "
        "folders (its newest is exported)",
    )
    parser.add_argument("--to", required=True, choices=("hf",), help="output format: hf (Hugging Face)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (new or empty)")
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        help="recipe the checkpoint was trained with (default: config.toml of its dump folder)",
    )
    parser.add_argument("--module", metavar="MOD", help="with --recipe: import the recipe from module MOD")
    parser.add_argument(
        "--dtype", choices=_DTYPES, default="float32", help="dtype of the written tensors (default float32)"
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB or 500MB (default 5GB); larger models are sharded",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export in a non-empty OUT_DIR"
    )


def run(args: argparse.Namespace) -> int:
    checkpoint = _checkpoint_folder(Path(args.checkpoint))
    max_shard = _parse_size(args.max_shard_size)
    out = Path(args.out_dir)
    _check_not_a_checkpoint_name(out, checkpoint)
    _check_out_dir(out, args.overwrite)
    from titan_core import get_registry
    from titan_core.layout import model_arg, model_arguments

    registry = get_registry(set(getattr(args, "disable_plugin", None) or []))
    run_config, source = _run_config(checkpoint, args, registry)
    model = run_config.model
    spec = registry.get("models", model.name, what="model")
    tokenizer, missing = _tokenizer(run_config.data.tokenizer_path)
    try:  # the BOS id filled in from the tokenizer, as training does (document_mask)
        model_args = model_arguments(spec, run_config, tokenizer)
    except UsageError as exc:
        raise UsageError(f"export: the model of {source}: {exc}") from None
    if missing is not None and model_arg(model_args, "bos_id", 0) is None:
        # The model's BOS id came from the tokenizer in training: without it, another model.
        raise UsageError(
            f"export: the model of {source} takes its BOS id from the run's tokenizer "
            f"(document_mask), which cannot be read ({str(missing).split('; ')[0]}); put the "
            "tokenizer the run trained with back at that path"
        )
    if missing is not None:
        print(f"titan: warning: export: the run's tokenizer is not copied: {missing}", file=sys.stderr)
    adapter = spec.state_dict_adapter
    if adapter is None:
        raise UsageError(
            f"export: model {spec.name!r} has no Hugging Face adapter (ModelSpec.state_dict_adapter), "
            "so it cannot be written as a Hugging Face model"
        )
    described = f"{spec.name}/{model.flavor}" + (
        f" with overrides {model.overrides}" if model.overrides else ""
    )
    state = _load_model(checkpoint, spec, model_args, f"{described} (from {source})")
    # Same shapes: the same model, too? And the tokenizer its weights learnt?
    _check_saved_model(checkpoint, spec, run_config, source, tokenizer)
    hf_state = adapter.to_hf(state, model_args)
    config = dict(adapter.hf_config(model_args))
    config["torch_dtype"] = args.dtype
    if tokenizer is not None:
        config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)

    files = _write_export(out, hf_state, config, tokenizer, args.dtype, max_shard)
    print(
        f"exported {checkpoint} ({described}) to {out}: config.json, {len(files)} safetensors file(s)"
        + (", tokenizer" if tokenizer is not None else "")
    )
    return 0


# -- inputs ----------------------------------------------------------------------------------------


def _checkpoint_folder(path: Path) -> Path:
    """The step folder to export: ``path`` itself, or the newest sound ``step-N`` inside it.

    A folder the checkpointer would not resume from (damaged data, an unfinished save, a save
    after a non-finite loss: :func:`~titan_plugins_dcp.checkpointer.verify_folder`) is refused
    when named, and passed over (with a warning) when a newer one of a run's folder is it."""
    from titan_plugins_dcp._folder import inspect, scan
    from titan_plugins_dcp.checkpointer import verify_folder

    if not path.is_dir():
        raise UsageError(f"export: no checkpoint folder at {str(path)!r}")
    if (path / ".metadata").is_file():
        if (why := verify_folder(str(path))) is not None:
            raise UsageError(f"export: {str(path)!r} cannot be exported: {why}")
        return path
    steps = [(n, Path(p)) for n, p in scan(str(path))[0] if os.path.isfile(os.path.join(p, ".metadata"))]
    skipped = []
    for number, step in steps:  # newest first; what a resume skips (a link out of the folder, too)
        found = inspect(number, str(step), str(path), elsewhere="export that folder by its path")
        why = found if isinstance(found, str) else verify_folder(str(step))
        if why is None:
            for name, reason in skipped:
                print(f"titan: warning: export: skipped {name}: {reason}", file=sys.stderr)
            return step
        skipped.append((step.name, why))
    if skipped:
        raise UsageError(
            f"export: none of the checkpoints in {str(path)!r} can be exported ("
            + "; ".join(f"{name}: {why}" for name, why in skipped)
            + ")"
        )
    raise UsageError(
        f"export: {str(path)!r} is not a DCP checkpoint (no .metadata) and holds no step-N checkpoint; "
        "give a folder such as <dump_folder>/checkpoint/step-100"
    )


def _same_tokenizer(a: str | None, b: str | None) -> bool:
    """The same path, or files of the same content (a tokenizer moved or copied is the same)."""
    if a == b:
        return True
    from titan_core.data.loader import BUNDLED_TOKENIZER

    def content(path: str | None) -> bytes | None:
        file = Path(path) if path else BUNDLED_TOKENIZER
        file = file / "tokenizer.json" if file.is_dir() else file
        try:
            return file.read_bytes()
        except OSError:
            return None

    first = content(a)
    return first is not None and first == content(b)


def _check_saved_model(
    checkpoint: Path, spec: Any, config: TrainerConfig, source: str, tokenizer: Any = None
) -> None:
    """Refuse to describe the weights as another model than the one they were trained as: the
    run's record in ``meta.json`` (when there is one) must build the model ``source`` gives (a
    resume's rule: an override at its default is the same model), or config.json would say
    another ``rope_theta`` or ``norm_eps`` over the same shapes; and the tokenizer, or the export
    would pair the weights with another one: the checkpoint records the digest of the tokenizer
    it trained with (``tokenizer_fingerprint``), so a file rewritten at the same path since is
    seen, and a copy laid out otherwise is the same tokenizer."""
    from titan_core.data.loader import tokenizer_fingerprint
    from titan_core.resume import model_changes, resume_record

    try:
        meta = json.loads((checkpoint / "meta.json").read_text(encoding="utf-8"))["meta"]
        saved = meta["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record (another tool's checkpoint, an earlier titan's): shapes are checked
    given_tokenizer = config.data.tokenizer_path
    trained_with = (meta.get("data") or {}).get("data.tokenizer_path", given_tokenizer)
    if not _same_tokenizer(trained_with, given_tokenizer):
        raise UsageError(
            f"export: {checkpoint} was trained with data.tokenizer_path {trained_with!r}, but {source} "
            f"gives {given_tokenizer!r}: the export would pair the weights with another "
            "tokenizer; export with the recipe that trained them, or without --recipe"
        )
    recorded = meta.get("tokenizer")
    now = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    changed = isinstance(recorded, dict) and now is not None and recorded.get("digest") != now["digest"]
    if changed and "digest" in recorded:  # the same path (or bytes), rewritten since
        before, after = recorded.get("vocab_size"), now["vocab_size"]
        sizes = (
            f"the same vocabulary size ({after} tokens), other tokens, ids or merges"
            if before == after
            else f"a vocabulary of {before} -> {after} tokens"
        )
        named = "titan's bundled tokenizer" if given_tokenizer is None else repr(given_tokenizer)
        raise UsageError(
            f"export: {checkpoint} was trained with another tokenizer than data.tokenizer_path "
            f"{named} holds now (rewritten since: {sizes}): the export would pair the weights "
            "with token ids they did not learn; put back the tokenizer the run trained with"
        )
    if not isinstance(saved, dict):
        return
    changes = model_changes(spec, saved, resume_record(config, 0)["model"])
    if changes:
        raise UsageError(
            f"export: {checkpoint} was saved by another model than {source} describes "
            f"({'; '.join(changes)}), so config.json would describe the weights wrongly; export "
            "with the recipe that trained them (--recipe NAME [--module MOD]), or without --recipe "
            "to read the run's config.toml"
        )


def _parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"export: --max-shard-size {text!r}: expected a size such as 5GB or 500MB")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


#: The staging folder an export writes into before moving its files into OUT_DIR.
_STAGE_PREFIX, _STAGE_SUFFIX = ".titan-export-", ".tmp"


def _stale_stages(out: Path) -> list[Path]:
    """Staging folders a killed export left in ``out`` (never the user's own files)."""
    return [
        e
        for e in out.iterdir()
        if e.is_dir() and e.name.startswith(_STAGE_PREFIX) and e.name.endswith(_STAGE_SUFFIX)
    ]


def _check_not_a_checkpoint_name(out: Path, checkpoint: Path) -> None:
    """Refuse an OUT_DIR that a checkpoint folder would take for one of its own: named as the
    checkpointer names its folders (``step-N``, ``step-N.tmp``, ``step-N.old``) inside a folder
    of checkpoints, or inside such a ``step-N``. A resume would read the export as step N (or it
    would fill a checkpoint with safetensors files), the next run's start would delete a
    ``step-N.tmp`` as a killed save's leftover, and ``checkpoint.keep_latest_k`` deletes a
    ``step-N`` with whatever was put in it. A folder of checkpoints is the exported checkpoint's
    (``checkpoint`` is a ``step-N`` folder in it) or one holding any ``step-N`` entry."""
    from titan_plugins_dcp._folder import _LEFTOVER, _STEP, scan

    exported_from = os.path.realpath(checkpoint.parent)
    real = Path(os.path.realpath(out))
    for folder in (real, *real.parents):
        if folder.parent == folder or not (_STEP.match(folder.name) or _LEFTOVER.match(folder.name)):
            continue
        holder = folder.parent
        steps, ignored = scan(str(holder))
        if str(holder) != exported_from and not steps and not ignored:
            continue
        if folder != real:
            raise UsageError(
                f"export: OUT_DIR {str(out)!r} lies inside {folder.name!r} of the checkpoint folder "
                f"{str(holder)!r}, which checkpoint.keep_latest_k deletes with everything in it; choose a "
                f"folder outside {str(holder)!r}"
            )
        raise UsageError(
            f"export: OUT_DIR {str(out)!r} is named like a checkpoint (step-N) in the checkpoint folder "
            f"{str(holder)!r}, where a resume would take it for a checkpoint and a later run could "
            "delete it (as a killed save's leftover, or by checkpoint.keep_latest_k); choose another "
            f"name (such as {folder.name.split('.')[0] + '-hf'!r}) or a folder outside {str(holder)!r}"
        )


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"export: OUT_DIR {str(out)!r} is a file; give a folder")
    stale = _stale_stages(out) if out.is_dir() else []
    if out.is_dir() and any(e not in stale for e in out.iterdir()) and not overwrite:
        raise UsageError(
            f"export: OUT_DIR {str(out)!r} exists and is not empty; choose a new folder, or pass "
            "--overwrite to replace an earlier export there"
        )


def _run_config(checkpoint: Path, args: argparse.Namespace, registry: Any) -> tuple[TrainerConfig, str]:
    """The run's config (its ``model`` and ``data``, what export reads) and where it came from:
    the recipe given, or the run's ``config.toml`` read by the recipe's rules (a field of the
    wrong type is one error naming it, as in a recipe)."""
    from titan_core.config import ConfigError, from_dict

    if args.module and not args.recipe:
        raise UsageError("export: --module needs --recipe NAME (the recipe to take from the module)")
    if args.recipe:
        from titan_core.recipes import call_recipe, find_recipe

        if args.module and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `titan run --module` does
        return call_recipe(find_recipe(registry, args.recipe, args.module)), f"recipe {args.recipe!r}"
    found = next((p / "config.toml" for p in checkpoint.parents if (p / "config.toml").is_file()), None)
    if found is None:
        raise UsageError(
            f"export: no config.toml in the folders above {str(checkpoint)!r} (training writes it into "
            "job.dump_folder); name the model with --recipe NAME [--module MOD]"
        )
    data = _read_toml(found)
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        raise UsageError(f"export: {found} has no [model] section with a name; is it titan's config.toml?")
    # Only the sections export reads: another section's field (a plugin's not installed here)
    # is not export's to judge.
    try:
        return from_dict({k: data[k] for k in ("model", "data") if k in data}), str(found)
    except ConfigError as exc:
        raise UsageError(f"export: {found}: " + "; ".join(exc.problems)) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"export: cannot read {path}: {exc}") from None


def _load_model(checkpoint: Path, spec: Any, model_args: Any, described: str) -> dict[str, Any]:
    """The checkpoint's ``model`` entry as full CPU tensors, checked against the model first."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_core.tied import retie, shared_parameters

    with torch.device("meta"):
        model = spec.build(model_args)
    tied = shared_parameters(model)
    model.to_empty(device="cpu")
    retie([model], tied)  # to_empty makes a tied parameter two
    state = model.state_dict()
    try:
        metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as exc:
        raise UsageError(f"export: cannot read the DCP metadata of {checkpoint}: {exc!r}") from None
    saved = {
        k[len("model.") :]: tuple(getattr(v, "size", ()) or ())
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    if not saved:
        raise UsageError(f"export: {checkpoint} holds no model weights (no 'model' entry)")
    wanted = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    reshaped = sorted(k for k in set(saved) & set(wanted) if saved[k] != wanted[k])
    if missing or unexpected or reshaped:
        problems = [
            f"{what} ({', '.join(keys[:3])})"
            for what, keys in (
                (f"{len(missing)} tensors of the model missing", missing),
                (f"{len(unexpected)} tensors the model lacks", unexpected),
                (f"{len(reshaped)} of other shapes", reshaped),
            )
            if keys
        ]
        shapes = "; ".join(f"{k}: checkpoint {list(saved[k])}, model {list(wanted[k])}" for k in reshaped[:3])
        raise UsageError(
            f"export: {checkpoint} does not hold the model {described}: {'; '.join(problems)}"
            + (f" [{shapes}]" if shapes else "")
            + "; give the recipe it was trained with (--recipe NAME [--module MOD])"
        )
    try:
        with warnings.catch_warnings():  # one process, as meant: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(checkpoint))
    except dcp.CheckpointException as exc:
        raise UsageError(
            f"export: reading {checkpoint} failed: {str(exc).strip().splitlines()[-1][:300]}"
        ) from None
    return state


def _tokenizer(tokenizer_path: str | None) -> tuple[Any, UsageError | None]:
    """The run's tokenizer (``data.tokenizer_path``, or titan's bundled one), or None and why."""
    from titan_core.data.loader import load_tokenizer

    try:
        return load_tokenizer(tokenizer_path), None
    except UsageError as exc:
        return None, exc


# -- outputs ---------------------------------------------------------------------------------------


def _write_export(
    out: Path, hf_state: dict[str, Any], config: dict[str, Any], tokenizer: Any, dtype: str, max_shard: int
) -> list[str]:
    """Write the export into ``out``; returns the safetensors files' names.

    Everything is written into a staging folder inside ``out`` first and moved in only once all
    of it is on disk: a failure (a full disk) leaves an earlier export there (``--overwrite``)
    as it was, not deleted for a new one that never finished. The earlier export's files that
    the new one does not replace (stale shards) are removed last, so two exports never mix."""
    import shutil
    import tempfile

    created = not out.exists()
    earlier = not created and any(_OUTPUTS.match(e.name) and e.is_file() for e in out.iterdir())
    stage: Path | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        for leftover in _stale_stages(out):  # a killed export's half-written files
            shutil.rmtree(leftover, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, suffix=_STAGE_SUFFIX, dir=out))
        files = _write_safetensors(hf_state, stage, dtype, max_shard)
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            _write_tokenizer(tokenizer, stage)
        written = sorted(entry.name for entry in stage.iterdir())
        with stops_held():  # a stop in between left files of two exports side by side
            for name in written:
                os.replace(stage / name, out / name)
            for entry in out.iterdir():  # --overwrite: no file of an earlier export may survive
                if _OUTPUTS.match(entry.name) and entry.is_file() and entry.name not in written:
                    entry.unlink()
    except OSError as exc:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
            stage = None
        if created:
            shutil.rmtree(out, ignore_errors=True)
        kept = "; the earlier export there is kept" if earlier else ""
        raise UsageError(
            f"export: cannot write {str(out)!r}: {exc}{kept}; free space or choose another folder"
        ) from None
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return files


def _write_safetensors(state: dict[str, Any], out: Path, dtype: str, max_shard: int) -> list[str]:
    """``model.safetensors``, or shards of at most ``max_shard`` bytes and their index."""
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(state, key=_natural):
        tensor = state[name].detach().to(target).contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    # safetensors creates its files readable by their owner alone; give them the mode any other
    # file of the folder gets (the umask's), so a shared model folder is readable as a whole.
    umask = os.umask(0)
    os.umask(umask)

    def save(shard: dict[str, torch.Tensor], file: str) -> None:
        save_file(shard, str(out / file), metadata={"format": "pt"})
        os.chmod(out / file, 0o666 & ~umask)

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map: dict[str, str] = {}
    for file, shard in zip(names, shards, strict=True):
        save(shard, file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_tokenizer(tokenizer: Any, out: Path) -> None:
    backend = tokenizer.backend
    (out / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    for role, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if token_id is not None:
            config[role] = backend.id_to_token(token_id)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _natural(key: str) -> list[Any]:
    """Sorted with numbers as numbers: layers.2 before layers.10."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", key)]


__all__ = ["configure", "run"]
