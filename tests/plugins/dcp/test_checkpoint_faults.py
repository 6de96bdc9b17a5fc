"""The checkpointer's contract and its faults, in one process without the trainer: meta saved and
returned, atomic saves, fallback over damaged checkpoints, strict loads, a full disk."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

import titan_plugins_dcp._folder as folder_module
from tests.plugins.dcp.checkpoint_kit import META, Events, Run, checkpointer, same
from titan_core.errors import TitanError, UsageError
from titan_core.topology import Topology


def listing(dump: Path) -> list[str]:
    root = dump / "checkpoint"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def train(run: Run, steps: range, ck: Any = None, meta: dict | None = None) -> dict[int, float]:
    """Steps of ``run``, saving whenever ``ck.should_save`` says so (last = the range's end)."""
    losses = {}
    for i in steps:
        losses[i] = run.step(i)
        last = i == steps[-1]
        if ck is not None and ck.should_save(i, last):
            ck.save(
                i,
                run.parts,
                run.optimizer,
                run.scheduler,
                last=last,
                meta={**META, "step": i, **(meta or {})},
            )
    return losses


def saved_at(tmp_path: Path, *steps: int, **kw: Any) -> tuple[Any, dict[int, dict[str, torch.Tensor]]]:
    """A checkpointer whose folder holds ``steps`` (saved in order), and the weights of each."""
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 1000})
    run = Run(**kw)
    weights = {}
    done = 0
    for step in steps:
        train(run, range(done + 1, step + 1))
        ck.save(step, run.parts, run.optimizer, run.scheduler, last=False, meta={**META, "step": step})
        weights[step] = run.weights()
        done = step
    return ck, weights


# -- the contract: should_save, save with meta, load returning (step, meta) --------------------------


def test_should_save_follows_interval_last_step_and_load_only(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 3})
    assert [s for s in range(1, 8) if ck.should_save(s, s == 7)] == [3, 6, 7]
    frozen = checkpointer(tmp_path, **{"checkpoint.interval": 3, "checkpoint.load_only": True})
    assert not any(frozen.should_save(s, True) for s in range(1, 8))
    run = Run()
    frozen.save(3, run.parts, run.optimizer, run.scheduler, last=True, meta=META)
    assert listing(tmp_path) == []


def test_save_writes_meta_beside_the_checkpoint_and_load_returns_it(tmp_path: Path, events: Events) -> None:
    ck, weights = saved_at(tmp_path, 2)
    step2 = tmp_path / "checkpoint" / "step-2"
    assert listing(tmp_path) == ["step-2"]  # no step-2.tmp left behind
    assert sorted(p.name for p in step2.iterdir()) == [".metadata", "__0_0.distcp", "meta.json"]
    record = json.loads((step2 / "meta.json").read_text())
    assert record["step"] == 2 and record["kind"] == "train" and record["meta"] == {**META, "step": 2}

    fresh = Run(seed=5)
    assert not same(fresh.weights(), weights[2])
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler) == (2, {**META, "step": 2})
    assert same(fresh.weights(), weights[2])
    assert fresh.scheduler.last_epoch == 2
    assert [e["step"] for e in events.of("checkpoint loaded")] == [2]


def test_empty_folder_loads_nothing(tmp_path: Path) -> None:
    run = Run()
    assert checkpointer(tmp_path).load(run.parts, run.optimizer, run.scheduler) == (0, {})


def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = train(Run(), range(1, 7))
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 2})
    assert train(Run(), range(1, 5), ck) == {i: whole[i] for i in (1, 2, 3, 4)}
    assert listing(tmp_path) == ["step-2", "step-4"]
    resumed = Run(seed=9)
    assert ck.load(resumed.parts, resumed.optimizer, resumed.scheduler)[0] == 4
    assert train(resumed, range(5, 7)) == {5: whole[5], 6: whole[6]}


def test_meta_that_is_not_json_fails_before_anything_is_written(tmp_path: Path) -> None:
    ck, run = checkpointer(tmp_path), Run()
    with pytest.raises(TypeError, match="checkpoint meta must be a JSON-able dict"):
        ck.save(1, run.parts, run.optimizer, run.scheduler, last=True, meta={"when": object()})
    assert listing(tmp_path) == []


def test_seed_checkpoint_is_step_0_with_meta_and_loads_weights_only(tmp_path: Path, events: Events) -> None:
    ck, run = checkpointer(tmp_path), Run(seed=3)
    ck.save_seed(run.parts)
    step0 = tmp_path / "checkpoint" / "step-0"
    assert json.loads((step0 / "meta.json").read_text())["kind"] == "seed"
    fresh = Run()
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler) == (0, {})
    assert same(fresh.weights(), run.weights())
    assert events.of("seed checkpoint loaded") and fresh.scheduler.last_epoch == 0


# -- refusals: non-finite loss, another model ----------------------------------------------------------


def test_checkpoint_saved_after_a_non_finite_loss_is_refused(tmp_path: Path) -> None:
    ck, _ = saved_at(tmp_path, 2)
    run = Run()
    train(run, range(1, 5))
    ck.save(4, run.parts, run.optimizer, run.scheduler, last=True, meta={**META, "loss_finite": False})
    fresh = Run(seed=4)
    before = fresh.weights()
    with pytest.raises(UsageError, match=r"step-4 was saved after a non-finite loss.*resume from step-2"):
        ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)
    assert same(fresh.weights(), before)  # refused before reading anything


@pytest.mark.parametrize(
    ("saved", "loaded", "expected"),
    [
        (
            {"layers": 6},
            {"layers": 3},
            "6 tensors in it that the model lacks (model.layers.3.bias, model.layers.3.weight, "
            "model.layers.4.bias, and 3 more)",
        ),
        (
            {"layers": 3},
            {"layers": 6},
            "6 tensors of the model missing from it (model.layers.3.bias, model.layers.3.weight, "
            "model.layers.4.bias, and 3 more)",
        ),
        (
            {"width": 4},
            {"width": 8},
            "6 tensors with other shapes (model.layers.0.bias: checkpoint [4], model [8]; "
            "model.layers.0.weight: checkpoint [4, 4], model [8, 8]; model.layers.1.bias: checkpoint "
            "[4], model [8]; and 3 more)",
        ),
    ],
)
def test_a_checkpoint_of_another_model_shape_is_one_error_naming_keys_and_shapes(
    tmp_path: Path, saved: dict, loaded: dict, expected: str
) -> None:
    ck, _ = saved_at(tmp_path, 2, **saved)
    other = Run(seed=1, **loaded)
    before = other.weights()
    with pytest.raises(UsageError) as info:
        ck.load(other.parts, other.optimizer, other.scheduler)
    message = str(info.value)
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoint' / 'step-2'} does not fit the model: ")
    assert expected in message
    assert "model.flavor" in message and "\n" not in message
    assert same(other.weights(), before)


# -- damaged and partial checkpoints: fall back to the newest complete one ---------------------------


def _cut(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _zero_head(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[:64] = bytes(64)
    file.write_bytes(bytes(data))


def _flip_middle(file: Path) -> None:
    """Bytes inside a tensor's data changed, the size kept: DCP itself reads them without error."""
    data = bytearray(file.read_bytes())
    start = len(data) // 3
    data[start : start + 256] = bytes(b ^ 0xFF for b in data[start : start + 256])
    file.write_bytes(bytes(data))


DAMAGE = {
    "truncated .metadata": (lambda d: _cut(d / ".metadata", 0.5), "its .metadata cannot be read"),
    "empty .metadata": (lambda d: _cut(d / ".metadata", 0), "its .metadata is empty (0 bytes)"),
    "no .metadata": (lambda d: (d / ".metadata").unlink(), "it has no .metadata"),
    "truncated .distcp": (lambda d: _cut(d / "__0_0.distcp", 0.5), "its data file __0_0.distcp is truncated"),
    "no .distcp": (lambda d: (d / "__0_0.distcp").unlink(), "its data file __0_0.distcp is missing"),
    "no meta.json": (lambda d: (d / "meta.json").unlink(), "it has no meta.json"),
    "cut meta.json": (lambda d: _cut(d / "meta.json", 0.5), "its meta.json cannot be read"),
    "damaged .distcp header": (
        lambda d: _zero_head(d / "__0_0.distcp"),
        "__0_0.distcp differs from what was saved",
    ),
    "damaged .distcp bytes": (
        lambda d: _flip_middle(d / "__0_0.distcp"),
        "__0_0.distcp differs from what was saved",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, events: Events, kind: str
) -> None:
    ck, weights = saved_at(tmp_path, 2, 4)
    damage, reason = DAMAGE[kind]
    damage(tmp_path / "checkpoint" / "step-4")
    fresh = Run(seed=7)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler) == (2, {**META, "step": 2})
    assert same(fresh.weights(), weights[2])
    ((path, why),) = events.warnings()
    assert path.endswith("step-4") and reason in why
    assert events.of("checkpoint loaded")[0]["skipped"][0].startswith("step-4: ")


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ck, _ = saved_at(tmp_path, 2, 4)
    for step in (2, 4):
        (tmp_path / "checkpoint" / f"step-{step}" / "meta.json").unlink()
    run = Run()
    with pytest.raises(
        UsageError, match=r"none of the 2 checkpoints in .* can be loaded \(step-4: it has no meta"
    ):
        ck.load(run.parts, run.optimizer, run.scheduler)


def test_only_canonical_step_names_count(tmp_path: Path, events: Events) -> None:
    ck, weights = saved_at(tmp_path, 4, 9, 10)
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-4", root / "step-006")  # would be step 6 if misread
    shutil.copytree(root / "step-4", root / "step-12.tmp")  # an interrupted save
    (root / "notes.txt").write_text("not a checkpoint")
    (root / "step-11").write_text("a file of a step's name")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 10  # numeric order: 10 > 9
    assert same(fresh.weights(), weights[10])
    reasons = dict(events.warnings())
    assert "not a name titan writes" in reasons[str(root / "step-006")]
    assert "did not finish" in reasons[str(root / "step-12.tmp")]
    assert not (root / "step-12.tmp").exists()  # removed at start-up, not kept forever
    assert "a file, not a checkpoint folder" in reasons[str(root / "step-11")]
    assert len(reasons) == 3  # other files are not the checkpointer's business


def test_leading_zeros_never_win_over_the_real_latest(tmp_path: Path, events: Events) -> None:
    ck, _ = saved_at(tmp_path, 2)
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-2", root / "step-007")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2


def test_step_folder_linking_outside_the_checkpoint_folder_is_not_loaded(
    tmp_path: Path, events: Events
) -> None:
    saved_at(tmp_path / "elsewhere", 8)
    ck, _ = saved_at(tmp_path / "run", 2)
    os.symlink(tmp_path / "elsewhere" / "checkpoint" / "step-8", tmp_path / "run" / "checkpoint" / "step-8")
    fresh = Run(seed=2)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
    ((path, why),) = events.warnings()
    assert path.endswith("step-8") and "outside" in why and "checkpoint.initial_load_path" in why


# -- saves: atomic, a full disk, leftovers ------------------------------------------------------------


@contextlib.contextmanager
def _full_disk_for_data(self: FileSystem, path: Any, mode: str):
    """FileSystem.create_stream, except that shard files are written to /dev/full (ENOSPC)."""
    if str(path).endswith(".distcp") and "w" in mode:
        with open("/dev/full", "wb", buffering=0) as stream:
            yield stream
    else:
        with _REAL_CREATE_STREAM(self, path, mode) as stream:
            yield stream


_REAL_CREATE_STREAM = FileSystem.create_stream


def _dev_full(*args: Any, **kwargs: Any) -> Any:
    """``open`` for the checkpointer's own files (meta.json): every write lands on /dev/full."""
    return builtins.open("/dev/full", "w")  # the caller closes it


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@needs_dev_full
@pytest.mark.parametrize("where", ["shards", "meta.json"])
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_loses_nothing_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    whole = train(Run(), range(1, 7))
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 2})
    run = Run()
    train(run, range(1, 3), ck)
    if where == "shards":
        monkeypatch.setattr(FileSystem, "create_stream", _full_disk_for_data)
    else:
        monkeypatch.setattr(folder_module, "open", _dev_full, raising=False)
    with pytest.raises(TitanError) as info:
        train(run, range(3, 5), ck)
    monkeypatch.undo()
    message = str(info.value)
    assert not isinstance(info.value, UsageError)  # a run-time failure: exit status 1
    assert message.startswith("checkpoint: the disk is full (No space left on device) saving step-4")
    assert "step-2 is intact" in message and "\n" not in message
    assert listing(tmp_path) == ["step-2"]  # the partial step-4.tmp is gone

    resumed = Run(seed=3)
    assert ck.load(resumed.parts, resumed.optimizer, resumed.scheduler)[0] == 2
    assert train(resumed, range(3, 7), ck) == {i: whole[i] for i in (3, 4, 5, 6)}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "sigterm"], ids=["ctrl-c", "sigterm"])
def test_a_stop_inside_a_save_stays_a_stop_and_leaves_no_partial_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: Any
) -> None:
    """A second Ctrl-C (or SIGTERM before the loop: a seed save) while DCP wrote the shards was
    wrapped by DCP and reported as `checkpoint: saving step-4 ... failed: KeyboardInterrupt`,
    exit 1, instead of the stop's own line and exit code."""
    from titan_core.stop_signals import SigtermStop

    raised = KeyboardInterrupt if stop is KeyboardInterrupt else SigtermStop

    @contextlib.contextmanager
    def interrupted(self: FileSystem, path: Any, mode: str):
        if str(path).endswith(".distcp") and "w" in mode:
            raise raised()
        with _REAL_CREATE_STREAM(self, path, mode) as stream:
            yield stream

    ck = checkpointer(tmp_path, **{"checkpoint.interval": 2})
    run = Run()
    train(run, range(1, 3), ck)
    monkeypatch.setattr(FileSystem, "create_stream", interrupted)
    with pytest.raises(raised):
        train(run, range(3, 5), ck)
    assert listing(tmp_path) == ["step-2"]  # step-4.tmp removed


def test_full_disk_on_a_real_small_filesystem(tmp_path: Path) -> None:
    """A tmpfs with room for about one and a half checkpoints (needs mount rights, else skipped)."""
    saved_at(tmp_path / "probe", 2, width=64)
    size = sum(f.stat().st_size for f in (tmp_path / "probe" / "checkpoint" / "step-2").iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    limit = (size * 3 // 2) // 4096 * 4096 + 3 * 4096  # pages: a few for folders and small files
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        ck = checkpointer(disk, **{"checkpoint.interval": 2})
        run = Run(width=64)
        train(run, range(1, 3), ck)
        kept = run.weights()
        with pytest.raises(TitanError, match=r"the disk is full .* saving step-4 .* step-2 is intact"):
            train(run, range(3, 5), ck)
        assert listing(disk) == ["step-2"]
        fresh = Run(width=64, seed=4)
        assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
        assert same(fresh.weights(), kept)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_save_replaces_a_leftover_and_a_skipped_damaged_folder(tmp_path: Path, events: Events) -> None:
    ck, _ = saved_at(tmp_path, 2, 4)
    root = tmp_path / "checkpoint"
    (root / "step-4" / "meta.json").unlink()  # damaged: resume skips it
    (root / "step-6.tmp").mkdir()
    (root / "step-6.tmp" / "junk").write_text("from a killed save")
    run = Run()
    assert ck.load(run.parts, run.optimizer, run.scheduler)[0] == 2
    train(run, range(3, 7), checkpointer(tmp_path, **{"checkpoint.interval": 2}))
    assert listing(tmp_path) == ["step-2", "step-4", "step-6"]
    assert "junk" not in os.listdir(root / "step-6")
    assert (root / "step-4" / "meta.json").is_file()
    assert [Path(e["path"]).name for e in events.of("replaced an existing checkpoint folder")] == ["step-4"]
    assert not list(root.glob("*.old"))
    fresh = Run(seed=1)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 6


def test_checkpoint_folder_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("oops")
    with pytest.raises(UsageError, match=r"checkpoint.folder: .*checkpoint is a file, not a folder"):
        checkpointer(tmp_path)


def test_fake_comm_backends_refuse_checkpoints(tmp_path: Path) -> None:
    from tests.parallel_harness import tiny_config
    from titan_plugins_dcp.checkpointer import DCPCheckpointer

    config = tiny_config(**{"job.dump_folder": str(tmp_path), "checkpoint.enable": True})
    topology = Topology(4, 2, 0, torch.device("cpu"), backend="fake", simulated=frozenset({"dp_shard"}))
    with pytest.raises(UsageError, match="the 'fake' comm backend simulates its peers"):
        DCPCheckpointer(config, topology)


def test_checksums_cover_every_piece_of_a_file(tmp_path: Path, events: Events) -> None:
    """A data file is checksummed in pieces (the ranks share them, so one large seed file is
    not read by one rank alone); a byte changed in a later piece is found like one in the first."""
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 2})
    ck.chunk_bytes = 1024
    run = Run()
    train(run, range(1, 5), ck)
    meta = json.loads((tmp_path / "checkpoint" / "step-4" / "meta.json").read_text())
    (crcs,) = meta["checksums"]["files"].values()
    data = tmp_path / "checkpoint" / "step-4" / "__0_0.distcp"
    assert meta["checksums"]["chunk_bytes"] == 1024 and len(crcs) == -(-data.stat().st_size // 1024) > 2
    damaged = bytearray(data.read_bytes())
    damaged[-10] ^= 0xFF  # inside the last piece
    data.write_bytes(bytes(damaged))
    fresh = Run(seed=7)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
    ((path, why),) = events.warnings()
    assert path.endswith("step-4") and "__0_0.distcp differs from what was saved" in why


def _saved_in_pieces(tmp_path: Path, chunk: int = 1024) -> tuple[Any, Path]:
    """A checkpointer of ``chunk``-byte pieces whose folder holds steps 2 and 4, and step 4's data file."""
    ck = checkpointer(tmp_path, **{"checkpoint.interval": 2})
    ck.chunk_bytes = chunk
    train(Run(), range(1, 5), ck)
    return ck, tmp_path / "checkpoint" / "step-4" / "__0_0.distcp"


def test_a_data_file_grown_past_its_saved_pieces_is_damaged(tmp_path: Path, events: Events) -> None:
    """The check takes its pieces from the files as the save did (_folder.pieces of their sizes):
    rebuilt from the saved CRC list alone, it compared only the saved pieces, and passed a file
    with a piece more after them (bytes added inside the last piece change its CRC: found
    either way)."""
    _, probe = _saved_in_pieces(tmp_path / "probe")
    size = probe.stat().st_size  # the same run saves the same bytes: pieces that end with the file
    ck, data = _saved_in_pieces(tmp_path / "run", chunk=size)
    assert data.stat().st_size == size
    assert len(json.loads((data.parent / "meta.json").read_text())["checksums"]["files"][data.name]) == 1
    with data.open("ab") as file:
        file.write(b"\0" * 2048)
    fresh = Run(seed=7)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
    ((path, why),) = events.warnings()
    assert (
        path.endswith("step-4") and "__0_0.distcp differs from what was saved (not of the saved size)" in why
    )


def test_a_checkpoint_recording_no_checksums_loads_with_a_warning(tmp_path: Path, events: Events) -> None:
    """An earlier titan's save (or an edited record) has no CRC-32s: it loads, but not silently
    as if its data had been checked."""
    ck, data = _saved_in_pieces(tmp_path)
    meta_path = data.parent / "meta.json"
    record = json.loads(meta_path.read_text())
    del record["checksums"]
    meta_path.write_text(json.dumps(record))
    fresh = Run(seed=7)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 4
    (unchecked,) = [f for level, e, f in events.lines if level == "warning" and "not checked" in e]
    assert unchecked["path"].endswith("step-4")


def test_a_data_file_without_a_saved_checksum_is_damaged(tmp_path: Path, events: Events) -> None:
    """Every data file DCP's index points into is compared, as every one was checksummed at the
    save: one the saved record leaves out was not compared at all (a check comparing nothing)."""
    ck, data = _saved_in_pieces(tmp_path)
    meta_path = data.parent / "meta.json"
    record = json.loads(meta_path.read_text())
    assert list(record["checksums"]["files"]) == [data.name]
    record["checksums"]["files"] = {}
    meta_path.write_text(json.dumps(record))
    fresh = Run(seed=7)
    assert ck.load(fresh.parts, fresh.optimizer, fresh.scheduler)[0] == 2
    ((path, why),) = events.warnings()
    assert (
        path.endswith("step-4") and "__0_0.distcp differs from what was saved (no CRC-32 saved for it)" in why
    )
