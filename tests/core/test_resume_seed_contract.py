"""A seed checkpoint beside ``checkpoint.initial_load_path``, for a third party's checkpointer of
another layout than dcp's ``step-0``: the trainer hard-coded dcp's ``<checkpoint.folder>/step-0``,
so an initial_load_path naming the third party's own seed was refused as "other weights", and the
refusal named a ``step-0`` that did not exist. The checkpointer says which seed ``load`` restored
(``loaded_seed()``, a contract any checkpointer can implement)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import plugin_module
from tests.parallel_harness import tiny_config, write_seed_checkpoint
from titan_core import Checkpointer
from titan_core._registry import Registry
from titan_core.errors import UsageError
from titan_core.trainer import train


class FlatCheckpointer:
    """A checkpointer of its own layout: ``initial.pt`` (the seed, a full model state dict that
    ``checkpoint.initial_load_path`` can name) and ``ckpt-<N>.pt`` inside ``checkpoint.folder``."""

    def __init__(self, config: Any, topology: Any) -> None:
        self.folder = os.path.join(config.job.dump_folder, config.checkpoint.folder)
        self.interval = config.checkpoint.interval
        self.seed: str | None = None

    @property
    def seed_file(self) -> str:
        return os.path.join(self.folder, "initial.pt")

    def load(self, parts: list[Any], optimizer: Any, scheduler: Any) -> tuple[int, dict[str, Any]]:
        self.seed = None
        if not os.path.isfile(self.seed_file):
            return 0, {}
        (part,) = parts
        part.load_state_dict(torch.load(self.seed_file, weights_only=True))
        self.seed = self.seed_file
        with open(self.seed_file + ".json", encoding="utf-8") as file:
            return 0, json.load(file)

    def should_save(self, step: int, last: bool) -> bool:
        return False

    def save(self, step: int, parts: list[Any], optimizer: Any, scheduler: Any, **_: Any) -> None:
        raise AssertionError("no step is saved in these tests")

    def save_seed(self, parts: list[Any], *, meta: dict[str, Any] | None = None) -> str:
        os.makedirs(self.folder, exist_ok=True)
        (part,) = parts
        torch.save(part.state_dict(), self.seed_file)
        with open(self.seed_file + ".json", "w", encoding="utf-8") as file:
            json.dump(meta or {}, file)
        return self.seed_file


class SaysItsSeed(FlatCheckpointer):
    def loaded_seed(self) -> str | None:
        return self.seed


def _registry(cls: type) -> Registry:
    registry = Registry().load_entry_points()
    record = Checkpointer("flat", cls, outputs=("initial.pt*", "ckpt-*"))
    registry.register(plugin_module("flat_ckpt", titan_checkpointers=[record]), "flat_ckpt")
    return registry


def _config(folder: Path, **overrides: Any) -> Any:
    return tiny_config(
        **{
            "job.dump_folder": str(folder),
            "training.steps": 2,
            "checkpoint.backend": "flat",
            **overrides,
        }
    )


def _seeded(tmp_path: Path, cls: type) -> tuple[Registry, Path]:
    registry = _registry(cls)
    train(_config(tmp_path, **{"checkpoint.create_seed_checkpoint": True}), registry)
    seed = tmp_path / "checkpoint" / "initial.pt"
    assert seed.is_file() and not (tmp_path / "checkpoint" / "step-0").exists()
    return registry, seed


def test_an_initial_load_path_naming_a_third_partys_own_seed_is_no_conflict(tmp_path: Path) -> None:
    registry, seed = _seeded(tmp_path, SaysItsSeed)
    same = _config(tmp_path, **{"checkpoint.enable": True, "checkpoint.initial_load_path": str(seed)})
    assert sorted(int(r["step"]) for r in train(same, registry)) == [1, 2]


def test_a_third_partys_seed_and_other_initial_weights_are_refused_naming_its_seed(tmp_path: Path) -> None:
    registry, seed = _seeded(tmp_path, SaysItsSeed)
    other = write_seed_checkpoint(tmp_path / "other.pt")
    both = _config(tmp_path, **{"checkpoint.enable": True, "checkpoint.initial_load_path": str(other)})
    with pytest.raises(UsageError) as info:
        train(both, registry)
    message = str(info.value)
    assert f"holds a seed checkpoint ({seed})" in message
    assert "step-0" not in message  # dcp's layout, not this checkpointer's
    assert "checkpoint.initial_load_path" in message and str(other) in message


def test_a_checkpointer_that_does_not_say_which_seed_it_loaded_is_refused_without_guessing(
    tmp_path: Path,
) -> None:
    """Without ``loaded_seed`` the trainer knows only that ``load`` restored weights at step 0
    (a meta): it refuses both sources, naming no folder layout of its own invention."""
    registry, seed = _seeded(tmp_path, FlatCheckpointer)
    both = _config(tmp_path, **{"checkpoint.enable": True, "checkpoint.initial_load_path": str(seed)})
    with pytest.raises(UsageError) as info:
        train(both, registry)
    message = str(info.value)
    assert "holds a seed checkpoint, which checkpoint.backend 'flat' loaded" in message
    assert "step-0" not in message
    # The seed alone starts the run.
    alone = _config(tmp_path, **{"checkpoint.enable": True})
    assert sorted(int(r["step"]) for r in train(alone, registry)) == [1, 2]
