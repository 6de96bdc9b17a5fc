"""The DCP checkpointer through the trainer, in one process: interval saves, exact resume,
load_only, seed checkpoints, strict loads, fallback over a damaged checkpoint, a full disk."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from tests.parallel_harness import TINY_MODEL, child_env, tiny_config, write_recipe_module
from titan_core._registry import Registry, get_registry
from titan_core.config import TrainerConfig
from titan_core.errors import TitanError, UsageError
from titan_core.topology import Topology
from titan_core.trainer import Trainer, train
from titan_plugins_dcp.checkpointer import DCPCheckpointer

_INITIAL = "checkpoint.initial_load_path"


def config_in(folder: Path, **overrides: Any) -> TrainerConfig:
    return tiny_config(**{"job.dump_folder": str(folder), "checkpoint.enable": True, **overrides})


def run(config: TrainerConfig) -> dict[int, float]:
    return {int(row["step"]): row["loss"] for row in train(config, get_registry())}


def saved_steps(folder: Path) -> list[str]:
    root = folder / "checkpoint"
    return (
        sorted(p.name for p in root.iterdir() if p.name != ".titan.lock") if root.exists() else []
    )  # not the run lock


def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = run(config_in(tmp_path / "whole", **{"checkpoint.interval": 2}))
    assert list(whole) == [1, 2, 3, 4, 5, 6]
    assert saved_steps(tmp_path / "whole") == ["step-2", "step-4", "step-6"]

    stopped = run(config_in(tmp_path / "split", **{"checkpoint.interval": 3, "debug.max_steps": 4}))
    assert stopped == {k: whole[k] for k in (1, 2, 3, 4)}
    assert saved_steps(tmp_path / "split") == ["step-3", "step-4"]  # the interval and the last step
    resumed = run(config_in(tmp_path / "split", **{"checkpoint.interval": 3}))
    assert resumed == {5: whole[5], 6: whole[6]}  # same weights, optimizer, LR and data position


def test_resume_with_a_shuffle_buffer_larger_than_a_pass_continues_exactly(tmp_path: Path) -> None:
    """3 bundled documents make about 11 sequences a pass, and the buffer holds 1000: each pass is
    shuffled whole (drained before the next), and a resume in the second pass skips to exactly
    where the stopped run was, so its losses are the uninterrupted run's."""
    data = {"data.bundled_documents": 3, "data.shuffle_buffer": 1000}
    whole = run(config_in(tmp_path / "whole", **data))
    run(config_in(tmp_path / "split", **{**data, "debug.max_steps": 3}))
    resumed = run(config_in(tmp_path / "split", **data))
    assert resumed == {k: whole[k] for k in (4, 5, 6)}


def test_load_only_loads_but_writes_nothing(tmp_path: Path) -> None:
    run(config_in(tmp_path, **{"debug.max_steps": 2}))
    assert saved_steps(tmp_path) == ["step-2"]
    resumed = run(config_in(tmp_path, **{"checkpoint.load_only": True, "checkpoint.interval": 1}))
    assert list(resumed) == [3, 4, 5, 6]
    assert saved_steps(tmp_path) == ["step-2"]

    fresh = tmp_path / "fresh"
    assert list(run(config_in(fresh, **{"checkpoint.load_only": True, "checkpoint.interval": 1}))) == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert not (fresh / "checkpoint").exists()


@pytest.mark.parametrize(
    ("overrides", "world_size", "named"),
    [
        ({"parallelism.dp_shard": 2}, 2, ["parallelism.dp_shard=2", "world size 2"]),
        ({"parallelism.tp": 2, "parallelism.pp": 2}, 4, ["parallelism.tp=2", "parallelism.pp=2"]),
        ({}, 2, ["world size 2"]),  # dp_shard=-1 would fill two ranks
    ],
)
def test_seed_checkpoint_refuses_parallel_degrees(
    tmp_path: Path, overrides: dict[str, int], world_size: int, named: list[str]
) -> None:
    config = config_in(tmp_path, **{"checkpoint.create_seed_checkpoint": True, **overrides})
    with pytest.raises(UsageError, match="a seed checkpoint is written by one process") as info:
        DCPCheckpointer(config, Topology(world_size, 0, 0, torch.device("cpu")))
    for text in named:
        assert text in str(info.value)


def test_seed_checkpoint_holds_the_initial_weights_and_reproduces_them(tmp_path: Path) -> None:
    seed_run = tmp_path / "seed"
    seed = config_in(seed_run, **{"checkpoint.enable": False, "checkpoint.create_seed_checkpoint": True})
    seed.debug.seed = 7  # the seed's weights differ from what the later runs would initialise
    assert train(seed, get_registry()) == []  # writes step-0 and stops
    assert saved_steps(seed_run) == ["step-0"]
    keys = dcp.FileSystemReader(str(seed_run / "checkpoint" / "step-0")).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)  # weights only

    # The seed-checkpoint workflow: the same dump folder, load_only; and initial_load_path.
    two = {"debug.max_steps": 2}
    from_folder = run(config_in(seed_run, **{"checkpoint.load_only": True, **two}))
    path = str(seed_run / "checkpoint" / "step-0")
    from_path = run(tiny_config(**{"job.dump_folder": str(tmp_path / "b"), _INITIAL: path, **two}))
    own_init = run(tiny_config(**{"job.dump_folder": str(tmp_path / "c"), **two}))
    assert list(from_folder) == [1, 2]
    assert from_folder == from_path
    assert from_folder[1] != own_init[1]
    assert saved_steps(seed_run) == ["step-0"]


def test_initial_load_path_folder_that_is_no_checkpoint(tmp_path: Path) -> None:
    config = tiny_config(**{"job.dump_folder": str(tmp_path), _INITIAL: str(tmp_path)})
    with pytest.raises(UsageError, match=r"is a folder without \.metadata"):
        Trainer(config, get_registry())


def test_initial_load_path_of_a_runs_checkpoint_folder_names_its_steps(tmp_path: Path) -> None:
    run(config_in(tmp_path / "source", **{"checkpoint.interval": 5, "training.steps": 10}))
    folder = tmp_path / "source" / "checkpoint"
    config = config_in(tmp_path / "new", **{_INITIAL: str(folder), "checkpoint.enable": False})
    with pytest.raises(UsageError) as info:
        Trainer(config, get_registry())
    newest = str(folder / "step-10")
    assert f"it holds the checkpoints step-5, step-10: name one, e.g. {newest!r}" in str(info.value)


def test_missing_checkpointer_plugin_names_the_distribution(tmp_path: Path) -> None:
    registry = Registry(disabled={"dcp"}).load_entry_points()
    with pytest.raises(TitanError, match=r"(?s)unknown checkpoint\.backend 'dcp'.*docs/architecture\.md"):
        Trainer(config_in(tmp_path), registry)


def test_a_checkpoint_of_another_depth_is_refused_naming_keys(tmp_path: Path) -> None:
    """The issue's case: 6 layers saved, the recipe now builds 4; nothing trains."""
    deep = {"model.overrides": {**TINY_MODEL, "n_layers": 6}, "debug.max_steps": 1}
    run(config_in(tmp_path, **deep))
    with pytest.raises(UsageError) as info:
        run(config_in(tmp_path))
    message = str(info.value)
    assert "step-1 does not fit the model: " in message
    assert "tensors in it that the model lacks (model.layers.4." in message


def test_resume_skips_a_damaged_latest_checkpoint(tmp_path: Path) -> None:
    whole = run(config_in(tmp_path / "whole", **{"checkpoint.interval": 2}))
    run(config_in(tmp_path / "split", **{"checkpoint.interval": 2, "debug.max_steps": 4}))
    metadata = tmp_path / "split" / "checkpoint" / "step-4" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])  # truncated
    resumed = run(config_in(tmp_path / "split", **{"checkpoint.interval": 2}))
    assert resumed == {k: whole[k] for k in (3, 4, 5, 6)}  # from step-2, as the whole run did
    assert saved_steps(tmp_path / "split") == ["step-2", "step-4", "step-6"]  # step-4 rewritten


def test_full_disk_stops_the_run_and_a_resume_loses_only_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = run(config_in(tmp_path / "whole", **{"checkpoint.interval": 2}))
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def full_at_step_4(self: FileSystem, path: Any, mode: str):
        if "step-4" in str(path) and str(path).endswith(".distcp"):
            with open("/dev/full", "wb", buffering=0) as stream:
                yield stream
        else:
            with real(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full_at_step_4)
    with pytest.raises(TitanError, match=r"the disk is full .* saving step-4 .* step-2 is intact"):
        run(config_in(tmp_path / "full", **{"checkpoint.interval": 2}))
    monkeypatch.undo()
    assert saved_steps(tmp_path / "full") == ["step-2"]
    resumed = run(config_in(tmp_path / "full", **{"checkpoint.interval": 2}))
    assert resumed == {k: whole[k] for k in (3, 4, 5, 6)}


def test_full_real_disk_through_titan_run_is_one_line_exit_1(tmp_path: Path) -> None:
    """``titan run`` with the checkpoint folder on a tmpfs with room for about 1.5 checkpoints."""
    probe = tmp_path / "probe"
    run(config_in(probe, **{"debug.max_steps": 2}))
    size = sum(f.stat().st_size for f in (probe / "checkpoint" / "step-2").iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    limit = (size * 3 // 2) // 4096 * 4096 + 4 * 4096
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        overrides = {
            "checkpoint.enable": True,
            "checkpoint.interval": 2,
            "checkpoint.folder": str(disk / "ck"),
        }
        module = write_recipe_module(tmp_path, overrides)
        result = subprocess.run(
            [sys.executable, "-m", "titan_core.cli", "run", "--module", module, "--recipe", "layout"],
            cwd=tmp_path,
            env=child_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
        line = json.loads(lines[0])["message"] if lines[0].startswith("{") else lines[0]
        assert line.startswith(
            "titan: error: checkpoint: the disk is full (No space left on device) saving step-4"
        )
        assert "step-2 is intact" in line
        assert sorted(p.name for p in (disk / "ck").iterdir()) == [".titan.lock", "step-2"]  # the run's lock
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _flip_middle(step_folder: Path) -> None:
    data = max(step_folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    data.write_bytes(bytes(raw))


def _mark_non_finite(step_folder: Path) -> None:
    meta = step_folder / "meta.json"
    record = json.loads(meta.read_text())
    record["meta"]["loss_finite"] = False
    meta.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (_flip_middle, "differs from what was saved (CRC-32 mismatch)"),
        (_mark_non_finite, "saved after a non-finite loss"),
        (lambda step: step.rename(step.with_name("step-4.tmp")), "an unfinished save"),
    ],
)
def test_initial_load_path_refuses_a_checkpoint_a_resume_would_skip(
    tmp_path: Path, spoil: Any, reason: str
) -> None:
    """A resume skips a damaged checkpoint; starting a run from it must not train on it either."""
    run(config_in(tmp_path / "source", **{"checkpoint.interval": 2, "debug.max_steps": 4}))
    step = tmp_path / "source" / "checkpoint" / "step-4"
    spoil(step)
    given = step if step.exists() else step.with_name("step-4.tmp")
    started = config_in(tmp_path / "new", **{_INITIAL: str(given), "checkpoint.enable": False})
    with pytest.raises(UsageError) as info:
        run(started)
    assert f"checkpoint.initial_load_path: {str(given)!r} cannot be loaded: " in str(info.value)
    assert reason in str(info.value)
    intact = config_in(
        tmp_path / "other", **{_INITIAL: str(step.with_name("step-2")), "checkpoint.enable": False}
    )
    assert sorted(run(intact)) == [1, 2, 3, 4, 5, 6]  # a sound checkpoint of the same run loads
