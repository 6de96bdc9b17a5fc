"""``checkpoint.initial_load_path``: load initial weights into this rank's model parts, whatever their
layout, from one of three sources.

- A ``.pt`` file holding one full (unsharded) state dict (``torch.save(model.state_dict())`` of a
  one-process run): every rank loads the file and ``set_model_state_dict`` shards each tensor to
  the parameter's FSDP/TP placement. Pipeline stages load only the keys they own.
- A DCP checkpoint folder (one with a ``.metadata`` file, e.g. a seed checkpoint
  ``.../checkpoint/step-0`` written by the dcp plugin): its ``model`` entry is loaded with
  ``torch.distributed.checkpoint.load``, which reshards it to this run's layout.
- A Hugging Face model folder (``config.json`` and ``*.safetensors``, sharded or not, as
  ``save_pretrained`` writes it), through the model's :class:`~titan_core.records.StateDictAdapter`.
  The folder's config must describe the run's model (``model.name``/``flavor``/``overrides``), and
  its tensors must be exactly the model's: both are checked before anything is loaded, with one
  error naming what differs. The tensors are read lazily (``safetensors.safe_open``), a few at a
  time: each rank reads only the tensors of its own parts, converts them to titan's names and
  layout, and hands them to ``set_model_state_dict`` in batches of about :data:`_BATCH_BYTES`, so
  no rank ever holds the whole model in host memory.

Why not DCP's ``HuggingFaceStorageReader``: it reads into tensors named and shaped as on disk,
so the adapter would have to run on this rank's sharded DTensors (the q/k row permutation across
heads, stacking a mixture-of-experts model's per-expert tensors); reading full tensors and letting
``set_model_state_dict`` shard them works for every adapter and layout.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titan_core.errors import PluginError, UsageError
from titan_core.records import ModelSpec, StateDictAdapter

_FIELD = "checkpoint.initial_load_path"
#: Converted tensors handed to ``set_model_state_dict`` at once; each call also copies every
#: parameter of the part onto itself, so batches should not be tiny.
_BATCH_BYTES = 2 << 30
#: Hugging Face config keys that do not change the weights or the function the model computes
#: (``max_position_embeddings`` bounds positions only; titan's is ``max_seq_len``).
_NOT_ARCHITECTURE = frozenset(
    {
        "architectures",
        "max_position_embeddings",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_dropout",
    }
)
_FULL = StateDictOptions(full_state_dict=True, strict=False)


def load_initial_weights(
    parts: list[nn.Module], path: str, spec: ModelSpec, model_args: Any, *, collectives: bool = True
) -> None:
    """Load ``path`` (a Hugging Face folder, a DCP folder or a ``.pt`` file) into ``parts``.

    ``collectives=False`` when the default process group simulates peers: DCP then plans each
    process's reads alone (its planning collectives over a simulated group return nothing).
    """
    if _is_hf_folder(path):
        _load_hf_folder(parts, path, spec, model_args)
    else:
        _refuse_safetensors_file(path)
        meta = _meta_state(spec, model_args)
        _check_fits(path, meta)
        load_full_state_dict(parts, path, collectives=collectives, tied=_aliases(meta))
    _refuse_non_finite(parts, path, collectives=collectives)


def _refuse_non_finite(parts: list[nn.Module], path: str, *, collectives: bool) -> None:
    """Refuse loaded parameters holding NaN or inf (an fp16 export that overflowed, weights saved
    after a divergence by another tool): step 1 would stop as a divergence that blames
    ``training.lr`` and the data. Parameters only: a buffer may hold ``-inf`` on purpose (a
    mask). Each rank checks its own shards, one host sync for all of them; the ranks then agree
    (a NaN in one rank's shard stops every rank, not one while the others wait in step 1)."""
    named = [(name, _local(p)) for part in parts for name, p in part.named_parameters()]
    named = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    bad: list[str] = []
    if named:  # a rank may hold no elements (uneven shards): it still joins the gather below
        # A float32 sum per tensor (no temporary the size of the tensor; NaN and inf survive
        # it; float32 holds the sum of any sane weights, fp16 ones too).
        sums = torch.stack([torch.sum(t, dtype=torch.float32) for _, t in named])
        bad = [name for (name, _), ok in zip(named, torch.isfinite(sums).tolist(), strict=True) if not ok]
    import torch.distributed as dist

    if collectives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, bad)
        bad = sorted({name for names in every for name in names})
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(
            f"{_FIELD}: {path!r} holds non-finite values (NaN or inf) in {bad[0]}{more}: training from "
            "it would diverge at step 1. Give weights saved before they went bad (an earlier checkpoint, "
            "an export in float32 or bfloat16)"
        )


def _refuse_safetensors_file(path: str) -> None:
    """A Hugging Face weights file given for its folder, or a file of a DCP checkpoint for its
    folder: torch.load's own error ("device meta is invalid") said neither what the file is nor
    what to give instead."""
    piece = Path(path).name in (".metadata", "meta.json") or Path(path).suffix == ".distcp"
    if piece and Path(path).is_file() and is_dcp_folder(Path(path).parent):
        # A piece of a DCP checkpoint (its .metadata, a data file): torch.load's error named
        # neither what the file is nor the folder to give.
        raise UsageError(
            f"{_FIELD}: {path!r} is a file of the DCP checkpoint {str(Path(path).parent)!r}; give that folder"
        )
    if not (Path(path).is_file() and path.lower().endswith(".safetensors")):
        return
    folder = Path(path).parent
    if (folder / "config.json").is_file():
        fix = f"give its folder, {str(folder)!r}, which titan reads as a Hugging Face model folder"
    else:
        fix = (
            "give the Hugging Face model folder holding it with its config.json (titan reads the "
            "architecture from there)"
        )
    raise UsageError(f"{_FIELD}: {path!r} is a safetensors file; {fix}")


def _read_state_dict(path: str, device: str) -> dict[str, torch.Tensor]:
    """A ``torch.save``d state dict of tensors, or one :class:`UsageError` saying what the file is not."""
    try:
        full = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # not a torch file, truncated, or objects beyond tensors
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UsageError(
            f"{_FIELD}: {path!r} cannot be read as a torch.save file of tensors ({first[:200]}); give a "
            ".pt state dict, a DCP checkpoint folder or a Hugging Face model folder"
        ) from None
    if not isinstance(full, dict) or not all(isinstance(v, torch.Tensor) for v in full.values()):
        raise UsageError(
            f"{_FIELD}: {path!r} holds a {type(full).__name__}, not a state dict of tensors (name -> "
            "tensor); save it with torch.save(model.state_dict(), path)"
        )
    return full


def _check_fits(path: str, meta: dict[str, torch.Tensor]) -> None:
    """Strict: the file's tensors are exactly the whole model's, with the same shapes.

    Checked against the model built on meta (every pipeline stage's names), before reading
    any tensor data: a 6-layer checkpoint must not load into a 3-layer model without a word.
    """
    source = Path(path)
    if source.is_dir():
        if not is_dcp_folder(source):
            return  # load_dcp_model says what is wrong with the folder
        from torch.distributed.checkpoint import FileSystemReader

        try:
            stored = FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception as exc:  # a truncated pickle: EOFError, UnpicklingError, ValueError, ...
            raise UsageError(
                f"{_FIELD}: {path!r} is a DCP checkpoint whose .metadata cannot be read, truncated or "
                f"damaged ({type(exc).__name__}: {str(exc)[:200]}); give an intact checkpoint"
            ) from None
        shapes = {
            k.removeprefix("model."): tuple(getattr(v, "size", ()))
            for k, v in stored.items()
            if k.startswith("model.")
        }
    elif source.is_file():
        full = _read_state_dict(path, "meta")
        shapes = {k: tuple(v.shape) for k, v in full.items()}
    else:
        return
    expected = {k: tuple(v.shape) for k, v in meta.items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in expected if k in shapes and shapes[k] != expected[k])
    problems = _mismatches(
        missing,
        unexpected,
        wrong,
        shapes,
        expected,
        ("tensors of the model missing", "tensors the model lacks", "in the file"),
    )
    if problems:
        raise UsageError(
            f"{_FIELD}: {path!r} does not fit the model: {'; '.join(problems)}; was it saved from "
            "the same model and flavor (model.flavor, model.overrides)?"
        )


def is_dcp_folder(path: str | Path) -> bool:
    """A folder with a DCP ``.metadata``: a checkpoint, which a checkpointer may have written
    (the trainer has it checked by ``Checkpointer.verify`` before loading it)."""
    return (Path(path) / ".metadata").is_file()


def _is_hf_folder(path: str) -> bool:
    """A folder with a ``config.json`` and no DCP ``.metadata``."""
    folder = Path(path)
    return folder.is_dir() and (folder / "config.json").is_file() and not (folder / ".metadata").exists()


def load_full_state_dict(
    parts: list[nn.Module], path: str, *, collectives: bool = True, tied: dict[str, str] | None = None
) -> None:
    """Load a ``.pt`` full state dict, or a DCP folder (:func:`load_dcp_model`), into ``parts``.

    ``tied``: names the model ties to another (``output.weight`` -> ``tok_embeddings.weight``,
    :func:`_aliases`). A source holding different tensors under two tied names is refused: loaded,
    the one shared matrix would keep the last of them and drop the other without a word."""
    tied = tied or {}
    if Path(path).is_dir():
        load_dcp_model(parts, path, collectives=collectives, tied=tied)
        return
    if not Path(path).is_file():
        raise UsageError(
            f"{_FIELD}: no file or folder at {path!r}; give a .pt state dict, a DCP checkpoint folder "
            "or a Hugging Face model folder"
        )
    full = _read_state_dict(path, "cpu")
    _refuse_untied(
        path,
        [(a, b) for a, b in tied.items() if a in full and b in full and not torch.equal(full[a], full[b])],
    )
    for part in parts:
        own = {k: v for k, v in full.items() if k in part.state_dict()}
        missing = set(part.state_dict()) - set(own)
        if missing:
            raise UsageError(
                f"{_FIELD}: {path!r} lacks {len(missing)} tensors of the model, "
                f"e.g. {sorted(missing)[:3]}; was it saved from the same model and flavor?"
            )
        set_model_state_dict(part, own, options=_FULL)


def load_dcp_model(
    parts: list[nn.Module], path: str, *, collectives: bool = True, tied: dict[str, str] | None = None
) -> None:
    """Load the ``model`` entry of a DCP checkpoint folder into this rank's parts (resharding;
    ``collectives=False``: every process plans its own reads, see :func:`load_initial_weights`).
    ``tied``: as for :func:`load_full_state_dict`; each tied name is read into a buffer of its
    own and compared with its first name's (on this rank's shard)."""
    tied = tied or {}
    import torch.distributed.checkpoint as dcp

    if not is_dcp_folder(path):
        # A run's checkpoint folder (the one holding step-N): name its steps to choose from.
        steps = sorted(
            (p for p in Path(path).iterdir() if p.is_dir() and is_dcp_folder(p)),
            key=lambda p: (len(p.name), p.name),
        )
        if steps:
            names = ", ".join(p.name for p in steps)
            hint = f"; it holds the checkpoints {names}: name one, e.g. {str(steps[-1])!r}"
        else:
            hint = (
                "; give a checkpoint folder such as <dump_folder>/checkpoint/step-0, a Hugging Face "
                "model folder, or a .pt file"
            )
        raise UsageError(
            f"{_FIELD}: {path!r} is a folder without .metadata or config.json, so neither a DCP "
            "checkpoint nor a Hugging Face model" + hint
        )
    own = [get_model_state_dict(part) for part in parts]
    merged = {k: v for state in own for k, v in state.items()}
    pairs = [(a, b) for a, b in tied.items() if a in merged and b in merged]
    for name, _ in pairs:  # its own buffer: read into the shared one, the last name would win
        merged[name] = torch.empty_like(merged[name])
    try:
        with warnings.catch_warnings():  # one process: DCP warns it assumes one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": merged}, checkpoint_id=path, no_dist=not collectives)
    except dcp.CheckpointException as exc:
        # Its tensors' names and shapes are the model's (_check_fits): the data is what failed.
        raise UsageError(
            f"{_FIELD}: {path!r}: reading its tensors failed ({_first_failure(exc)}): a data file "
            "of the checkpoint is truncated or damaged; give an intact checkpoint"
        ) from None
    _refuse_untied(path, [(a, b) for a, b in pairs if not torch.equal(_local(merged[a]), _local(merged[b]))])
    for part, state in zip(parts, own, strict=True):
        set_model_state_dict(part, {k: merged[k] for k in state})


def _first_failure(exc: Any) -> str:
    """The first rank's exception of a DCP ``CheckpointException``, as ``Type: message``."""
    failures = getattr(exc, "failures", None) or {}
    for _rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}" + (f": {text[-1][:200]}" if text else "")
    return str(exc).strip().splitlines()[-1][:300]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _refuse_untied(path: str, differ: list[tuple[str, str]]) -> None:
    """One error for tied names whose tensors in the source differ (``(tied name, its first)``)."""
    if not differ:
        return
    pairs = ", ".join(f"{a} and {b}" for a, b in differ)
    raise UsageError(
        f"{_FIELD}: {path!r} holds different tensors for {pairs}, which this model ties (one shared "
        "matrix): loading it would keep one of them and drop the other without a word. Load it into "
        "the model it was saved from (the same model.overrides, untied), or tie them before saving"
    )


# -- Hugging Face folders ---------------------------------------------------------------------------


def _load_hf_folder(parts: list[nn.Module], path: str, spec: ModelSpec, model_args: Any) -> None:
    """Load a Hugging Face model folder into this rank's parts (see the module docstring)."""
    adapter = spec.state_dict_adapter
    if adapter is None:
        raise UsageError(
            f"{_FIELD}: {path!r} is a Hugging Face model folder, but model {spec.name!r} has no "
            "Hugging Face adapter (ModelSpec.state_dict_adapter); start from a DCP checkpoint or a "
            ".pt state dict instead"
        )
    try:
        from safetensors import safe_open
    except ImportError:
        raise UsageError(
            f"{_FIELD}: loading a Hugging Face folder needs the safetensors package; pip install safetensors"
        ) from None
    folder = Path(path)
    _check_hf_config(_read_config(folder), spec, adapter, model_args, path)
    files = _safetensors_files(folder)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files}
        where = _tensor_locations(handles, folder)
        shapes = {name: tuple(handles[f].get_slice(name).get_shape()) for name, f in where.items()}
        meta = _meta_state(spec, model_args)
        aliases = _aliases(meta)
        # Lists, not sets: every rank must hand the tensors over in one order (FSDP and TP scatter
        # each one over the mesh).
        own = [list(get_model_state_dict(part)) for part in parts]
        groups = _hf_groups(meta, adapter, model_args)
        if groups is None:  # the adapter converts whole models only: one conversion
            full = _whole_model(handles, where, shapes, meta, aliases, adapter, model_args, path)
            for part, keys in zip(parts, own, strict=True):
                set_model_state_dict(part, {k: full[aliases.get(k, k)] for k in keys}, options=_FULL)
            return
        _check_tensors(groups, shapes, adapter, model_args, path)
        _refuse_dropped_untied(groups, aliases, handles, where, shapes, path, adapter, model_args)
        # This rank's tensors (tied names read once), in file order, converted in batches.
        to_read = sorted(
            {aliases.get(k, k) for keys in own for k in keys},
            key=lambda k: (min((str(where[h]) for h in groups[k]), default=""), k),
        )
        for batch in _converted_batches(to_read, groups, handles, where, adapter, model_args, spec.name):
            for part, keys in zip(parts, own, strict=True):
                subset = {k: batch[aliases.get(k, k)] for k in keys if aliases.get(k, k) in batch}
                if subset:
                    set_model_state_dict(part, subset, options=_FULL)


def _converted_batches(
    keys: list[str],
    groups: dict[str, dict[str, Any]],
    handles: dict[Path, Any],
    where: dict[str, Path],
    adapter: StateDictAdapter,
    model_args: Any,
    model: str,
) -> Iterator[dict[str, torch.Tensor]]:
    """titan tensors ``keys`` read and converted group by group, about ``_BATCH_BYTES`` at a time."""
    batch: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    size = 0
    for key in keys:
        if key in done:
            continue
        hf = {name: handles[where[name]].get_tensor(name) for name in groups[key]}
        converted = adapter.from_hf(hf, model_args)
        if key not in converted:
            raise PluginError(
                f"model {model!r}: the state-dict adapter's from_hf turned {sorted(hf)[:3]} into "
                f"{sorted(converted)[:3]}, not {key!r}"
            )
        for name, tensor in converted.items():
            if name not in done:
                done.add(name)
                batch[name] = tensor
                size += tensor.numel() * tensor.element_size()
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def _check_hf_config(
    config: dict[str, Any], spec: ModelSpec, adapter: StateDictAdapter, model_args: Any, path: str
) -> None:
    """One error naming every architecture field where ``config`` differs from ``model_args``.

    Both sides go through the adapter's ``hf_config`` so that equal models compare equal however
    their configs are spelled (e.g. a SwiGLU width from ``multiple_of`` or given directly). Fields
    are named as titan's model arguments when changing those arguments alone reconciles the two,
    with the ``model.overrides`` that would; otherwise by their Hugging Face names.
    """
    run = _architecture(adapter.hf_config(model_args))
    if adapter.args_from_hf is not None:
        try:
            hf_args = adapter.args_from_hf(config)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(
                f"{_FIELD}: {path}/config.json does not describe a {spec.name} model: {exc}"
            ) from None
        if adapter.for_run is not None:
            hf_args = adapter.for_run(hf_args, model_args)
        theirs = _architecture(adapter.hf_config(hf_args))
    else:
        hf_args = None
        theirs = {k: config.get(k) for k in run}
    if theirs == run:
        return
    where = f"{_FIELD}: the Hugging Face model in {path!r} is not the run's {spec.name} model"
    titan_names = _differing_args(adapter, model_args, hf_args, run, theirs) if hf_args is not None else None
    if titan_names:
        diffs = ", ".join(f"{k} {v!r} vs {_arg(model_args, k)!r}" for k, v in titan_names.items())
        raise UsageError(
            f"{where}: {diffs} (config.json vs the run); set model.flavor / model.overrides to match, "
            f"e.g. model.overrides entries {titan_names}"
        )
    diffs = ", ".join(
        f"{k} {theirs.get(k)!r} vs {run.get(k)!r}"
        for k in sorted(set(run) | set(theirs))
        if run.get(k) != theirs.get(k)
    )
    raise UsageError(
        f"{where}: {diffs} (config.json vs the run); set model.flavor / model.overrides to match"
    )


def _architecture(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hf_config.items() if k not in _NOT_ARCHITECTURE}


def _differing_args(
    adapter: StateDictAdapter, run_args: Any, hf_args: Any, run: dict[str, Any], theirs: dict[str, Any]
) -> dict[str, Any] | None:
    """titan arguments whose values in ``hf_args`` turn the run's config into the folder's, or None."""
    run_fields, hf_fields = _fields(run_args), _fields(hf_args)
    if run_fields is None or hf_fields is None:
        return None
    changes: dict[str, Any] = {}
    for name, value in hf_fields.items():
        if name not in run_fields or run_fields[name] == value:
            continue
        try:
            changed = _architecture(adapter.hf_config(_replace(run_args, {name: value})))
        except Exception:  # an argument combination the model rejects: cannot tell
            return None
        if changed != run:  # this argument matters for the architecture
            changes[name] = value
    try:
        fixed = _architecture(adapter.hf_config(_replace(run_args, changes)))
    except Exception:
        return None
    return changes if changes and fixed == theirs and None not in changes.values() else None


def _fields(args: Any) -> dict[str, Any] | None:
    if isinstance(args, dict):
        return dict(args)
    if attrs.has(type(args)):
        return {a.name: getattr(args, a.name) for a in attrs.fields(type(args))}
    if dataclasses.is_dataclass(args):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return None


def _replace(args: Any, changes: dict[str, Any]) -> Any:
    if isinstance(args, dict):
        return {**args, **changes}
    if attrs.has(type(args)):
        return attrs.evolve(args, **changes)
    return dataclasses.replace(args, **changes)


def _arg(args: Any, name: str) -> Any:
    return args[name] if isinstance(args, dict) else getattr(args, name)


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{_FIELD}: cannot read {folder / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{_FIELD}: {folder / 'config.json'} is not a JSON object")
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{_FIELD}: cannot read the weight map of {index}: {exc!r}") from None
        files = sorted({folder / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UsageError(
                f"{_FIELD}: {index.name} in {str(folder)!r} names shards that are not there: "
                f"{', '.join(absent[:3])}; copy the whole model folder"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin"))
        hint = (
            f" (it has {', '.join(other[:2])}: save it again with save_pretrained(..., "
            "safe_serialization=True))"
            if other
            else ""
        )
        raise UsageError(
            f"{_FIELD}: the Hugging Face folder {str(folder)!r} has no *.safetensors files{hint}"
        )
    return files


def _tensor_locations(handles: dict[Path, Any], folder: Path) -> dict[str, Path]:
    where: dict[str, Path] = {}
    for file, handle in handles.items():
        for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if name in where:
                raise UsageError(
                    f"{_FIELD}: tensor {name!r} is in both {where[name].name} and {file.name} of "
                    f"{str(folder)!r}; remove the stale file"
                )
            where[name] = file
    return where


def _meta_state(spec: ModelSpec, model_args: Any) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the meta device: names and global shapes, no memory. Its
    values are the parameters themselves (``keep_vars``), so tied names hold one object
    (:func:`_aliases`): ``state_dict()`` detaches each entry into a new tensor."""
    with torch.device("meta"):
        model = spec.build(model_args)
    return model.state_dict(keep_vars=True)


def _aliases(meta: dict[str, torch.Tensor]) -> dict[str, str]:
    """Names of tied tensors -> the first name of the same tensor (``output.weight`` ->
    ``tok_embeddings.weight`` when the embeddings are tied)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in meta.items():
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _hf_groups(
    meta: dict[str, torch.Tensor], adapter: StateDictAdapter, model_args: Any
) -> dict[str, dict[str, Any]] | None:
    """Each titan tensor -> the Hugging Face tensors (meta, with their shapes) it is made from.

    Found by converting one meta tensor at a time with ``to_hf``; an adapter that needs several
    titan tensors at once gets them all in one group. ``None`` when ``to_hf`` cannot convert meta
    tensors at all (it reads values, or checks for the whole model): :func:`_whole_model` then.
    """
    try:
        return {name: adapter.to_hf({name: tensor}, model_args) for name, tensor in meta.items()}
    except Exception:
        try:
            whole = adapter.to_hf(dict(meta), model_args)
        except Exception:
            return None
        return dict.fromkeys(meta, whole)


class _Reads(dict):
    """A dict that records which keys a converter read (so unread tensors can be named)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)

    def items(self) -> Any:
        self.read.update(self.keys())
        return super().items()

    def values(self) -> Any:
        self.read.update(self.keys())
        return super().values()

    def __iter__(self) -> Any:
        self.read.update(self.keys())
        return super().__iter__()


class _Lookups(_Reads):
    """:class:`_Reads` counting only the keys looked up by name: an adapter that goes over every
    tensor (``items()``) and skips those it does not know has not read an unknown one."""

    def items(self) -> Any:
        return dict.items(self)

    def values(self) -> Any:
        return dict.values(self)

    def __iter__(self) -> Any:
        return dict.__iter__(self)


def _whole_model(
    handles: dict[Path, Any],
    where: dict[str, Path],
    shapes: dict[str, tuple[int, ...]],
    meta: dict[str, torch.Tensor],
    aliases: dict[str, str],
    adapter: StateDictAdapter,
    model_args: Any,
    path: str,
) -> dict[str, torch.Tensor]:
    """The whole model converted at once, for adapters that only convert whole models.

    The folder is checked first by converting meta tensors with ``from_hf``: the titan tensors it
    makes must be the model's, and every Hugging Face tensor must have been read. Each rank then
    holds the whole model in host memory once; adapters that convert any subset (and meta tensors)
    with ``to_hf`` are loaded a few tensors at a time instead.
    """
    probe = _Reads({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    try:
        converted = adapter.from_hf(probe, model_args)
    except (KeyError, ValueError, UsageError) as exc:
        raise UsageError(
            f"{_FIELD}: the safetensors of {path!r} are not this model's tensors: {exc}"
        ) from None
    expected = {k: tuple(v.shape) for k, v in meta.items() if k not in aliases}
    made = {k: tuple(v.shape) for k, v in converted.items()}
    missing = sorted(set(expected) - set(made))
    extra = sorted(set(made) - set(meta))
    wrong = sorted(k for k in set(expected) & set(made) if made[k] != expected[k])
    unread = sorted(set(shapes) - probe.read)
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model not made from them ({', '.join(missing[:3])})")
    if unread or extra:
        names = unread + extra
        problems.append(f"{len(names)} unexpected ({', '.join(names[:3])})")
    if wrong:
        shown = ", ".join(f"{k} {list(made[k])} from the files vs {list(expected[k])}" for k in wrong[:3])
        problems.append(f"{len(wrong)} with another shape ({shown})")
    if problems:
        raise UsageError(
            f"{_FIELD}: the safetensors of {path!r} are not this model's tensors: "
            f"{'; '.join(problems)}; was the folder saved from a model with this config.json?"
        )
    tensors = {name: handles[where[name]].get_tensor(name) for name in sorted(probe.read)}
    return adapter.from_hf(tensors, model_args)


def _check_tensors(
    groups: dict[str, dict[str, Any]],
    shapes: dict[str, tuple[int, ...]],
    adapter: StateDictAdapter,
    model_args: Any,
    path: str,
) -> None:
    """One error for missing, unexpected and mis-shaped tensors (the first few of each)."""
    expected = {name: tuple(t.shape) for group in groups.values() for name, t in group.items()}
    missing = sorted(n for n in expected if n not in shapes)
    wrong = sorted(n for n in expected if n in shapes and shapes[n] != expected[n])
    unexpected = []
    for name in sorted(set(shapes) - set(expected)):
        try:  # tensors the adapter drops (e.g. a tied lm_head.weight) are fine
            dropped = not adapter.from_hf({name: torch.empty(shapes[name], device="meta")}, model_args)
        except Exception:
            dropped = _dropped_with_its_group(name, shapes, expected, groups, adapter, model_args)
        if not dropped:
            unexpected.append(name)
    problems = _mismatches(
        missing, unexpected, wrong, shapes, expected, ("missing", "unexpected", "in the files")
    )
    if problems:
        raise UsageError(
            f"{_FIELD}: the safetensors of {path!r} are not this model's tensors: "
            f"{'; '.join(problems)}; was the folder saved from a model with this config.json?"
        )


def _dropped_with_its_group(
    name: str,
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    groups: dict[str, dict[str, Any]],
    adapter: StateDictAdapter,
    model_args: Any,
) -> bool:
    """Whether an adapter that converts the model as one group (it cannot convert ``name`` alone)
    looks ``name`` up beside the group and makes nothing more of it: a tied ``lm_head.weight`` it
    looks at and drops (DeepSeek's), refused as "unexpected" when tried alone. A name it does not
    look up stays unexpected; :func:`_refuse_dropped_untied` then compares a dropped one's values."""
    first = next(iter(groups.values()), None)
    if first is None or any(group is not first for group in groups.values()):
        return False  # groups of their own: the tensor alone was the adapter's answer
    whole = {n: torch.empty(shape, device="meta") for n, shape in expected.items()}
    probe = _Lookups({**whole, name: torch.empty(shapes[name], device="meta")})
    try:
        made, without = adapter.from_hf(probe, model_args), adapter.from_hf(dict(whole), model_args)
    except Exception:
        return False
    return name in probe.read and set(made) == set(without)


def _refuse_dropped_untied(
    groups: dict[str, dict[str, Any]],
    aliases: dict[str, str],
    handles: dict[Path, Any],
    where: dict[str, Path],
    shapes: dict[str, tuple[int, ...]],
    path: str,
    adapter: StateDictAdapter,
    model_args: Any,
) -> None:
    """Refuse a folder tensor the adapter drops that differs from the one its tied twin is made of.

    A tied model reads one tensor for two names (``output.weight`` is ``tok_embeddings.weight``),
    and its adapter drops the second one's Hugging Face tensor (a tied ``lm_head.weight``). When
    the folder holds that tensor with other values, transformers unties the two and computes with
    it; loaded tied, the model would compute with the other one, silently. Candidates are the
    unread tensors of the shape of a tied name's source; equal values load as before."""
    read = {name for group in groups.values() for name in group}
    unread = [name for name in shapes if name not in read]
    for tied, first in aliases.items():
        for source in _sources(first, groups, adapter, model_args):
            for name in unread:
                if shapes[name] != shapes.get(source) or source not in where:
                    continue
                value, kept = (handles[where[n]].get_tensor(n) for n in (name, source))
                if not torch.equal(value, kept):
                    raise UsageError(
                        f"{_FIELD}: {path!r} holds {name}, which differs from {source}; this model "
                        f"ties {tied} to {first} (one tensor) and would compute with {source} where "
                        f"transformers unties them and computes with {name}; set "
                        "tie_word_embeddings = false in its config.json and load it into a model that "
                        "does not tie them (model.overrides, e.g. tie_embeddings = False), or remove "
                        f"{name} from the folder to load it tied"
                    )


def _sources(
    first: str, groups: dict[str, dict[str, Any]], adapter: StateDictAdapter, model_args: Any
) -> list[str]:
    """The Hugging Face tensors titan's ``first`` is made of. A group of its own names them; an
    adapter that converts the model as one group (every name shares it) returns, for a renamed
    tensor, the very object it was given: that one (none when the tensor is transformed)."""
    group = groups.get(first, {})
    if not any(other is group for key, other in groups.items() if key != first):
        return list(group)
    probe = {name: torch.empty(t.shape, device="meta") for name, t in group.items()}
    made = adapter.from_hf(probe, model_args).get(first)
    return [name for name, t in probe.items() if t is made]


def _mismatches(
    missing: list[str],
    unexpected: list[str],
    wrong: list[str],
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    words: tuple[str, str, str],
) -> list[str]:
    """The problems of a load that does not fit, the first few names of each kind.

    ``words``: how to call missing and unexpected tensors, and where ``shapes`` came from.
    """
    missing_word, unexpected_word, source = words
    problems = []
    if missing:
        problems.append(f"{len(missing)} {missing_word} ({', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} {unexpected_word} ({', '.join(unexpected[:3])})")
    if wrong:
        shown = ", ".join(f"{n} {list(shapes[n])} {source} vs {list(expected[n])}" for n in wrong[:3])
        problems.append(f"{len(wrong)} with another shape ({shown})")
    return problems
