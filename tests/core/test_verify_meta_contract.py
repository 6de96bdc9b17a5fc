"""``Checkpointer.verify``'s optional ``check_meta`` keyword, for a third party's checkpointer: a
folder it wrote records the model it was saved from, and ``checkpoint.initial_load_path`` naming
it under another model of the same shapes (another ``rope_theta``) loaded without a word. A
``verify`` that takes ``check_meta`` calls it with the folder's meta; the trainer compares the
recorded model with the run's (``resume.model_changes``) and names what differs in one warning.
A ``verify`` without the keyword (written before it) works as before."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import LogWarnings, plugin_module, record_warnings
from tests.parallel_harness import tiny_config, write_seed_checkpoint
from titan_core import Checkpointer
from titan_core import trainer as trainer_module
from titan_core._registry import Registry
from titan_core.errors import UsageError
from titan_core.resume import resume_record
from titan_core.trainer import train

_RECORD = "own-record.json"


def _no_build(config: Any, topology: Any) -> Any:
    raise AssertionError("checkpointing is off in these tests: nothing builds the checkpointer")


def _verify_with_meta(path: str, rank: int, world_size: int, *, check_meta: Any) -> str | None:
    """Reads its own record of the folder and hands the trainer the meta saved with it."""
    with open(os.path.join(path, _RECORD), encoding="utf-8") as file:
        record = json.load(file)
    if record.get("bad"):
        return "its own record says so"
    check_meta(record["step"], record["meta"])
    return None


def _verify_without_meta(path: str, rank: int, world_size: int) -> str | None:
    return None


def _registry(verify: Any) -> Registry:
    registry = Registry().load_entry_points()
    record = Checkpointer("own", _no_build, verify=verify, outputs=("own-*",))
    registry.register(plugin_module("own_ckpt", titan_checkpointers=[record]), "own_ckpt")
    return registry


def _folder(tmp_path: Path, **saved_overrides: Any) -> Path:
    """A DCP folder of the tiny model's weights with the checkpointer's record of the model it
    was saved from (``saved_overrides`` on the tiny model's)."""
    weights = torch.load(write_seed_checkpoint(tmp_path / "weights.pt"), weights_only=True)
    folder = tmp_path / "own-step-3"
    dcp.save({"model": weights}, checkpoint_id=str(folder), no_dist=True)
    saved = tiny_config()
    saved.model.overrides = {**saved.model.overrides, **saved_overrides}
    meta = {"model": resume_record(saved, 0)["model"]}
    (folder / _RECORD).write_text(json.dumps({"step": 3, "meta": meta}), encoding="utf-8")
    return folder


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> LogWarnings:
    return record_warnings(monkeypatch, trainer_module)


def _run(tmp_path: Path, folder: Path, registry: Registry) -> list[int]:
    config = tiny_config(
        **{
            "job.dump_folder": str(tmp_path / "run"),
            "checkpoint.backend": "own",
            "checkpoint.initial_load_path": str(folder),
            "debug.max_steps": 1,
        }
    )
    return [int(row["step"]) for row in train(config, registry)]


def _model_warnings(warnings: LogWarnings) -> list[str]:
    return [w for w in warnings.seen if "saved by another model" in w]


def test_a_third_party_verify_handing_the_meta_names_another_model(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    folder = _folder(tmp_path, rope_theta=10_000.0)
    assert _run(tmp_path, folder, _registry(_verify_with_meta)) == [1]  # a warning, not a refusal
    (message,) = _model_warnings(warnings)
    assert message.startswith(f"checkpoint.initial_load_path: {str(folder)!r} was saved by another model")
    assert re.search(r"arguments that differ: rope_theta: 10000(\.0)? -> 500000\b", message)


def test_a_third_party_verify_handing_the_meta_of_the_same_model_draws_no_warning(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    assert _run(tmp_path, _folder(tmp_path), _registry(_verify_with_meta)) == [1]
    assert _model_warnings(warnings) == []


def test_a_third_party_verify_without_check_meta_works_as_before(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    folder = _folder(tmp_path, rope_theta=10_000.0)
    assert _run(tmp_path, folder, _registry(_verify_without_meta)) == [1]  # it cannot tell: no word
    assert _model_warnings(warnings) == []


def test_a_reason_from_a_verify_taking_check_meta_still_refuses(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    record = json.loads((folder / _RECORD).read_text(encoding="utf-8"))
    (folder / _RECORD).write_text(json.dumps({**record, "bad": True}), encoding="utf-8")
    with pytest.raises(UsageError, match="cannot be loaded: its own record says so"):
        _run(tmp_path, folder, _registry(_verify_with_meta))
