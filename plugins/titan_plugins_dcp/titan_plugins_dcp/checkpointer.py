"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, seed checkpoints.

Every checkpoint is a folder ``job.dump_folder/checkpoint.folder/step-<N>``: DCP's ``.metadata``
file, one data file per rank, and titan's ``meta.json`` (the step, the kind, and the ``meta`` dict
the trainer passed to ``save``: the LR schedule's parameters, whether the loss was finite). DCP
stores each tensor with its global shape and the shard each rank holds, so a checkpoint written
by one parallel layout loads into another: loading reshards it to the placements of the run that
reads it. Saves are atomic (written as ``step-N.tmp`` and renamed, :mod:`._folder`); resume skips
damaged or partial folders for the newest complete one, and refuses a checkpoint of another model
shape (:mod:`._fit`) or one saved after a non-finite loss.

What a checkpoint ``step-N`` (N >= 1) holds, under these top-level keys:

``model``
    The state dict of every model part this rank holds
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict``), keyed by the FQNs of the
    unsplit model, so pipeline stages and FSDP/TP shards all name tensors the same way.
``optimizer``
    AdamW's state and hyper-parameters, flattened per parameter FQN
    (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``), hence reshardable too.
``lr_scheduler``
    The LR schedule's state (``LambdaLR.state_dict()``: the step it is at and the last LRs).
``train``
    ``step`` (the last finished step) and the data geometry of the run that saved it.

Resuming restores all of them. The data loader keeps no state of its own: its order depends only
on the data config, the seed and the DP rank, so the trainer resumes it by skipping the ``step``
batches each rank already consumed. Data resumes exactly when the data config, ``debug.seed``,
``training.local_batch_size``, ``training.seq_len`` and the DP degree are unchanged; with
``data.shuffle_buffer = 0`` only the global batch size (DP degree x local batch size) matters. A
warning names what changed. RNG states are not saved: titan's models draw no random numbers after
initialisation.

The seed checkpoint ``step-0`` holds ``model`` only, written by a one-process run right after
initialisation; loading it restores the weights and starts at step 1.

Checkpoint folders are trusted input: DCP unpickles ``.metadata``. Only the configured folder is
searched; any other checkpoint is loaded only when the user names it (``initial_load_path``).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_core.errors import TitanError, UsageError, describe
from titan_core.log import get_logger
from titan_core.stop_signals import STOPS
from titan_plugins_dcp._fit import check_fit, saved_shapes
from titan_plugins_dcp._folder import (
    CHUNK_BYTES,
    DISK_FULL,
    META_FILE,
    Usable,
    commit,
    crc32,
    data_files,
    inspect,
    meta_text,
    os_error,
    pieces,
    read_metadata,
    remove,
    scan,
    step_name,
    tidy,
)
from titan_plugins_dcp._peers import Peers
from titan_plugins_dcp.launch import check_seed_launch

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology

log = get_logger("titan.checkpoint")

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# -- the pieces of a checkpoint, as DCP Stateful objects ------------------------------------------


class ModelState(Stateful):
    """All model parts of this rank as one state dict (their FQNs are disjoint)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part)}
            set_model_state_dict(part, own)


class OptimizerState(Stateful):
    """The one optimizer over all parts, flattened per parameter FQN so that it reshards."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self.module = one_module(parts)
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer, options=_OPTIM_OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=_OPTIM_OPTIONS)


class SchedulerState(Stateful):
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class TrainState(Stateful):
    """The last finished step and the data geometry that decides which batches come next."""

    def __init__(self, step: int, data: dict[str, int]) -> None:
        self.step = step
        self.data = data
        self.saved_data: dict[str, int] = dict(data)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, **{f"data.{k}": v for k, v in self.data.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.saved_data = {k[len("data.") :]: v for k, v in state_dict.items() if k.startswith("data.")}


def one_module(parts: list[nn.Module]) -> nn.Module:
    """The parts as one module with the unsplit model's FQNs, for the optimizer's state dict.

    With several pipeline stages on a rank, one optimizer spans all of them; DCP's optimizer
    state-dict helpers need one module that owns every parameter under its original FQN. Each
    stage keeps its blocks in ``layers`` (a ModuleDict keyed by global block index) and its own
    top-level modules, so merging the children gives exactly that module.
    """
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    for part in parts:
        if next(part.parameters(recurse=False), None) is not None:
            raise UsageError("checkpointing: a pipeline stage holds parameters outside its submodules")
        for name, child in part.named_children():
            if child is None:
                continue
            have = getattr(merged, name, None)
            if have is None:
                merged.add_module(name, type(child)() if isinstance(child, nn.ModuleDict) else child)
                have = getattr(merged, name)
            if isinstance(child, nn.ModuleDict) and isinstance(have, nn.ModuleDict):
                for key, block in child.items():
                    have[key] = block
            elif have is not child:
                raise UsageError(f"checkpointing: two pipeline stages on one rank both hold {name!r}")
    return merged


def damaged_file(found: Usable, rank: int, peers: Peers) -> str | None:
    """Why a checkpoint's data differs from what was saved (a piece of a data file whose
    CRC-32 is not the one in ``meta.json``, or that cannot be read; a data file of another
    number of pieces than saved, or with none saved), or ``None``; the ranks share the pieces.

    The pieces are :func:`pieces` of the files DCP's index points into, at their sizes on
    disk: what :meth:`_checksums` computed at the save, so the two cannot disagree on which
    pieces there are (a check rebuilt from the saved list alone would pass a file that grew,
    or one the list leaves out, without comparing it)."""
    if not found.checksums:  # written by an earlier titan (or its record edited)
        if rank == 0:
            log.warning(
                "checkpoint data not checked: its meta.json records no CRC-32 checksums (a save of "
                "an earlier titan, or an edited record), so damage on disk would go unseen",
                path=found.path,
            )
        return None
    files = found.checksums.get("files") or {}
    chunk = int(found.checksums.get("chunk_bytes", CHUNK_BYTES))
    own: list[tuple[str, str]] = []  # (file, why), this rank's share
    sizes: dict[str, int] = {}
    for name in data_files(found.metadata):
        try:
            sizes[name] = os.path.getsize(os.path.join(found.path, name))
        except OSError as exc:
            own.append((name, f"cannot be read: {exc.strerror or exc}"))
    every = pieces(sizes, chunk)
    counts = Counter(name for name, _ in every)
    own += [(name, "no CRC-32 saved for it") for name in sizes if name not in files]
    own += [
        (name, "not of the saved size")
        for name in files
        if name in sizes and counts[name] != len(files[name])
    ]
    damaged = {name for name, _ in own}  # already: its pieces need no comparing
    for name, index in every[rank :: peers.world_size]:
        if name in damaged:
            continue
        try:
            if crc32(os.path.join(found.path, name), index, chunk) != files[name][index]:
                own.append((name, "CRC-32 mismatch"))
        except OSError as exc:
            own.append((name, f"cannot be read: {exc.strerror or exc}"))
    bad = sorted(set(pair for pairs in peers.all_gather(own) for pair in pairs))
    if not bad:
        return None
    first, why = bad[0]
    others = len({name for name, _ in bad}) - 1
    more = f" (and {others} more)" if others else ""
    return f"its data file {first}{more} differs from what was saved ({why}): damaged on disk"


def verify_folder(
    path: str,
    rank: int = 0,
    world_size: int = 1,
    *,
    check_meta: Callable[[int, dict[str, Any]], None] | None = None,
) -> str | None:
    """Why a checkpoint folder titan wrote cannot be trusted, or ``None`` (``Checkpointer.verify``):
    an unfinished save (``step-N.tmp``), a ``meta.json`` that is not titan's record, data that
    differs from what was saved (CRC-32; the ranks share the pieces), a save after a non-finite
    loss. A DCP folder without ``meta.json`` (another tool's) is not titan's to judge: ``None``.
    A sound folder's step and meta (the trainer's record of the model it was saved from) go to
    ``check_meta`` when given: the trainer compares that model with its own."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None  # no DCP checkpoint (a Hugging Face folder, say): its loader judges it
    name = os.path.basename(os.path.realpath(path))  # a link's target: latest -> step-4.tmp
    if name.endswith(".tmp"):
        return (
            "it is an unfinished save (titan renames step-N.tmp to step-N once every rank has "
            "written it); give a finished step-N folder"
        )
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as file:
            step = json.load(file).get("step")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        return f"its {META_FILE} cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(step, int):
        return f"its {META_FILE} names no step"
    real = os.path.realpath(path)
    found = inspect(step, real, os.path.dirname(real))
    if isinstance(found, str):
        return found
    if found.meta.get("loss_finite") is False:
        return (
            f"it was saved after a non-finite loss (its {META_FILE} says loss_finite: false), so its "
            "weights cannot be trusted; give an earlier step"
        )
    why = damaged_file(found, rank, Peers(world_size))
    if why is None and check_meta is not None:
        check_meta(step, found.meta)
    return why


# -- the checkpointer --------------------------------------------------------------------------------


class DCPCheckpointer:
    """Built once per run: ``load`` before step 1; ``should_save``/``save`` after each step;
    ``save_seed`` for ``checkpoint.create_seed_checkpoint``."""

    #: Bytes per checksummed piece of a data file (saves record it; a load reads it back).
    chunk_bytes = CHUNK_BYTES

    def __init__(self, config: TrainerConfig, topology: Topology) -> None:
        c = config.checkpoint
        self.peers = Peers(topology.world_size)
        if c.create_seed_checkpoint:  # first: the launch is wrong whatever else the run would do
            # Launched processes were checked before any process group (Checkpointer.launch_check);
            # this sees a simulating backend's logical world size too.
            check_seed_launch(config.parallelism, topology.world_size)
        if topology.simulates_peers:
            raise UsageError(
                f"checkpoint: the {topology.backend!r} comm backend simulates its peers, so a "
                "checkpoint would hold one simulated rank's shards and garbage; set "
                "checkpoint.enable = False and checkpoint.create_seed_checkpoint = False for fake runs "
                "(a real run writes and reads checkpoints)"
            )
        self.folder = os.path.join(config.job.dump_folder, c.folder)
        self.dump_folder = config.job.dump_folder
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise UsageError(
                f"checkpoint.folder: {self.folder} is a file, not a folder; remove it or set "
                "checkpoint.folder (or job.dump_folder) to another path"
            )
        self.interval = c.interval
        self.load_only = c.load_only
        self.keep_latest_k = c.keep_latest_k
        self.load_step = c.load_step
        self.rank = topology.rank
        #: The newest checkpoint known complete (loaded or saved by this run), named on a failure.
        self.kept: int | None = None
        #: The seed checkpoint (``step-0``) the last :meth:`load` restored, for :meth:`loaded_seed`.
        self.seed: str | None = None
        t = config.training
        self.data_geometry = {
            "dp_degree": _dp_degree(config, topology.world_size),
            "local_batch_size": t.local_batch_size,
            "seq_len": t.seq_len,
            "seed": config.debug.seed if config.debug.seed is not None else 0,
            "shuffle_buffer": config.data.shuffle_buffer,
        }

    def path(self, step: int) -> str:
        return os.path.join(self.folder, step_name(step))

    # -- resume ------------------------------------------------------------------------------------

    def load(
        self,
        parts: list[nn.Module],
        optimizer: Any,
        scheduler: Any,
        *,
        check_meta: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore the newest complete checkpoint; return its step and the meta saved with it.

        ``(0, {})`` when the folder holds no checkpoint; a seed checkpoint gives step 0 too. A
        damaged or partial newer folder is skipped with a warning naming it and why; refused
        (:class:`UsageError`): a checkpoint of another model shape, one that ``check_meta(step,
        meta)`` refuses (the trainer's check that it holds this model, called before its tensors
        are read), one saved after a non-finite loss, and a folder whose checkpoints are all unusable
        (starting afresh would overwrite them).
        """
        self.seed = None
        if not self.load_only:  # a replay only reads the folder; its run may be saving there now
            self._tidy()
        steps, ignored = scan(self.folder)
        for path, why in ignored:
            log.warning("ignoring a folder among the checkpoints", path=path, reason=why)
        names = [step_name(s) for s, _ in steps]
        if len(set(map(tuple, self.peers.all_gather(names)))) > 1:
            raise TitanError(
                f"checkpoint: the ranks see different checkpoints in {self.folder}; it must be one "
                "folder every rank shares (a shared filesystem), not a local path on each host"
            )
        if self.load_step is not None:
            steps = self._the_load_step(steps)
        if not steps:
            log.info("no checkpoint to resume from", folder=self.folder)
            return 0, {}
        wanted = self._model_shapes(parts)
        skipped: list[str] = []
        for step, path in steps:
            found = inspect(step, path, self.folder)
            verdicts = self.peers.all_gather(isinstance(found, Usable))
            if isinstance(found, str) or not all(verdicts):
                why = found if isinstance(found, str) else "another rank cannot read it"
                self._skip(path, why, skipped)
                continue
            if (damaged := self._damaged_file(found)) is not None:
                self._skip(path, damaged, skipped)
                continue
            check_fit(path, saved_shapes(found.metadata, "model."), wanted)
            if check_meta is not None:  # same shapes: the same model? (seeds record it too)
                check_meta(found.step, found.meta)
            if found.meta.get("loss_finite") is False:
                earlier = [step_name(s) for s, _ in steps if s < step]
                raise UsageError(
                    f"checkpoint {path} was saved after a non-finite loss (its meta.json says "
                    "loss_finite: false), so its weights cannot be trusted; move that folder out of "
                    f"{self.folder} to resume from {earlier[0] if earlier else 'scratch'}"
                )
            start = time.perf_counter()
            try:
                loaded = self._restore(found, parts, optimizer, scheduler)
            except dcp.CheckpointException as exc:
                self._skip(path, f"reading its data failed ({_first_failure(exc)})", skipped)
                continue
            event = "seed checkpoint loaded" if found.kind == "seed" else "checkpoint loaded"
            self.seed = found.path if found.kind == "seed" else None
            self.kept = found.step
            extra = {"skipped": skipped} if skipped else {}
            log.info(event, path=path, step=loaded, seconds=_since(start), **extra)
            return loaded, found.meta
        raise UsageError(
            f"checkpoint: none of the {len(steps)} checkpoints in {self.folder} can be loaded "
            f"({'; '.join(skipped)}); starting afresh would overwrite them, so move them out of the "
            "folder (or restore them from a copy), then run again"
        )

    def loaded_seed(self) -> str | None:
        """The seed checkpoint's folder (``step-0``) that the last :meth:`load` restored, or
        ``None`` (``Checkpointer``'s contract: the trainer refuses a ``checkpoint.initial_load_path``
        naming other weights, which it would read over the seed's). Whatever its meta holds: a
        seed of an earlier titan records no model."""
        return self.seed

    def _tidy(self) -> None:
        """Rank 0 finishes or removes the leftovers of killed saves (:func:`tidy`), the other ranks
        waiting for it (their scan must see the folder it leaves, or they would resume from
        different steps). Safe here: every rank of this run is starting up, before its first
        save, and a run that saves holds the checkpoint folder's lock (``.titan.lock``), so no
        other run writes there; a leftover is dead. Without it a ``step-N.tmp`` of a killed save
        stayed forever, a warning at every start and its size on the disk."""
        done: list[tuple[str, str]] = []
        if self.rank == 0:
            try:
                done = tidy(self.folder)
            except OSError as exc:  # best effort: the scan below skips whatever is left
                log.warning("could not tidy the checkpoint folder", path=self.folder, reason=str(exc))
        self.peers.broadcast(None)  # no rank scans before rank 0 is done
        if self.rank != 0:
            return
        for path, what in done:
            if what == "finished":
                log.warning(
                    "finished an interrupted save",
                    path=path,
                    reason="the save was complete (its meta.json written) but killed before its "
                    "rename; renamed as the save would have",
                )
            elif what.startswith("could not"):
                log.warning("could not tidy a leftover of an interrupted save", path=path, reason=what)
            else:
                log.warning("removed the leftover of an interrupted save", path=path, reason=what)

    def _restore(self, found: Usable, parts: list[nn.Module], optimizer: Any, scheduler: Any) -> int:
        if found.kind == "seed":  # initial weights only: optimizer and schedule start fresh
            _dcp(dcp.load, {"model": ModelState(parts)}, checkpoint_id=found.path)
            return 0
        train = TrainState(found.step, self.data_geometry)
        _dcp(dcp.load, self._state(parts, optimizer, scheduler, train), checkpoint_id=found.path)
        changed = _data_changes(train.saved_data, self.data_geometry)
        if "seq_len" in found.meta:  # the trainer's record: it continues after the tokens consumed
            changed.pop("seq_len", None)
        if changed:
            log.warning(
                "data geometry changed since the checkpoint; the data will not resume where it stopped",
                changed=changed,
            )
        return train.step

    def _checksums(self, path: str) -> tuple[dict[str, Any], str | None]:
        """CRC-32 of every data file of a finished save, piece by piece, the ranks sharing the
        pieces; and a problem (one rank's read failed: every rank gets it) or ``None``."""
        metadata = read_metadata(path)
        names = data_files(metadata) if not isinstance(metadata, str) else []
        problem: str | None = None
        own: dict[tuple[str, int], int] = {}
        try:
            sizes = {name: os.path.getsize(os.path.join(path, name)) for name in names}
            for name, index in pieces(sizes, self.chunk_bytes)[self.rank :: self.peers.world_size]:
                own[(name, index)] = crc32(os.path.join(path, name), index, self.chunk_bytes)
        except OSError as exc:
            problem = f"checkpoint: reading back {path} for its checksums failed on rank {self.rank}: {exc}"
        gathered = self.peers.all_gather((own, problem))
        problem = next((p for _, p in gathered if p is not None), None)
        files: dict[str, list[int]] = {name: [] for name in names}
        for (name, _index), value in sorted(pair for sums, _ in gathered for pair in sums.items()):
            files[name].append(value)
        return {"chunk_bytes": self.chunk_bytes, "files": files}, problem

    def _damaged_file(self, found: Usable) -> str | None:
        """:func:`damaged_file`, the ranks sharing the pieces."""
        return damaged_file(found, self.rank, self.peers)

    def _model_shapes(self, parts: list[nn.Module]) -> dict[str, tuple[int, ...] | None]:
        """Every rank's model keys under ``model.`` with global shapes (pipeline stages together)."""
        own = {
            f"model.{k}": (tuple(v.shape) if isinstance(v, torch.Tensor) else None)
            for k, v in ModelState(parts).state_dict().items()
        }
        merged: dict[str, tuple[int, ...] | None] = {}
        for shapes in self.peers.all_gather(own):
            merged.update(shapes)
        return merged

    def _skip(self, path: str, why: str, skipped: list[str]) -> None:
        """Fall back past an unusable checkpoint, saying why; the one ``load_step`` names is an
        error instead (another step would not be the one asked for)."""
        if self.load_step is not None:
            raise UsageError(
                f"checkpoint.load_step = {self.load_step}: {path} cannot be loaded: {why}; set "
                "load_step to another step, or None to resume from the newest that loads"
            )
        log.warning("skipping a checkpoint that cannot be loaded", path=path, reason=why)
        skipped.append(f"{os.path.basename(path)}: {why}")

    def _the_load_step(self, steps: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """``steps`` (newest first) narrowed to the one ``checkpoint.load_step`` names."""
        n = self.load_step
        chosen = [(s, p) for s, p in steps if s == n]
        if not chosen:
            held = ", ".join(step_name(s) for s, _ in reversed(steps)) or "no checkpoint"
            raise UsageError(
                f"checkpoint.load_step = {n}: {self.folder} holds {held}; set load_step to one of "
                "them, or None to resume from the newest"
            )
        newer = [step_name(s) for s, _ in reversed(steps) if s > n]
        root, dump = os.path.realpath(self.folder), os.path.realpath(self.dump_folder)
        if newer and (not self.load_only or os.path.commonpath([root, dump]) == dump):
            # Saves would replace some of them and leave the others, and the next resume would
            # take the newest, of the abandoned run, without a word; a replay in the run's own
            # dump folder would replace the metrics.jsonl rows of the steps after n.
            raise UsageError(
                f"checkpoint.load_step = {n}: {self.folder} holds newer checkpoints "
                f"({', '.join(newer)}). To train on from {step_name(n)}, move them out of that folder "
                "first (this run's checkpoints and metrics.jsonl rows would mix with theirs); to "
                "replay from it without saving, set checkpoint.load_only = True and give the run a "
                f"job.dump_folder of its own, with checkpoint.folder = {root!r}"
            )
        return chosen

    # -- save --------------------------------------------------------------------------------------

    def should_save(self, step: int, last: bool) -> bool:
        """Every ``checkpoint.interval`` steps and at the last step; never with ``load_only``."""
        return not self.load_only and (last or step % self.interval == 0)

    def save(
        self,
        step: int,
        parts: list[nn.Module],
        optimizer: Any,
        scheduler: Any,
        *,
        last: bool,
        meta: dict[str, Any],
    ) -> None:
        """Write ``step-N`` with ``meta`` beside it (the trainer asked :meth:`should_save`; a save
        outside the interval, e.g. on SIGTERM, is written too). Nothing with ``load_only``.

        A failure (a full disk, a permission error) deletes the partial save, leaves every earlier
        checkpoint as it was, and raises one :class:`TitanError` on every rank.
        """
        if self.load_only:
            return
        start = time.perf_counter()
        state = self._state(parts, optimizer, scheduler, TrainState(step, self.data_geometry))
        self._write(step, state, "train", meta)
        log.info("checkpoint saved", path=self.path(step), step=step, last=last, seconds=_since(start))

    def save_seed(self, parts: list[nn.Module], *, meta: dict[str, Any] | None = None) -> str:
        """Write ``step-0`` with the freshly initialised weights only (and the trainer's ``meta``:
        the model they are of)."""
        self._write(0, {"model": ModelState(parts)}, "seed", meta or {})
        log.info("seed checkpoint saved", path=self.path(0))
        return self.path(0)

    def _write(self, step: int, state: dict[str, Any], kind: str, meta: dict[str, Any]) -> None:
        """Every rank writes into ``step-N.tmp``; rank 0 adds meta.json and renames it ``step-N``."""
        text = meta_text(step, kind, meta)
        final = self.path(step)
        tmp = final + ".tmp"
        problem: str | None = None
        if self.rank == 0:
            try:
                os.makedirs(self.folder, exist_ok=True)
                remove(tmp)  # the leftover of an interrupted save of this step
            except OSError as exc:
                problem = self._save_problem(step, exc, 0)
        problem = self.peers.broadcast(problem)  # no rank writes before the folder is ready
        if problem is None:
            try:
                _dcp(dcp.save, state, checkpoint_id=tmp)
            except dcp.CheckpointException as exc:  # DCP raises it on every rank
                own = exc.failures.get(self.rank, (None,))[0]
                if isinstance(own, STOPS):  # a second Ctrl-C, a SIGTERM before the loop: no failure
                    if self.rank == 0:
                        remove(tmp)
                    raise own from None
                rank, cause = _failure(exc)
                problem = self._save_problem(step, cause, rank)
            if problem is None:
                checksums, problem = self._checksums(tmp)
                text = meta_text(step, kind, meta, checksums)
            if problem is None and self.rank == 0:
                try:
                    if commit(tmp, final, text):
                        log.warning("replaced an existing checkpoint folder", path=final)
                except OSError as exc:
                    problem = self._save_problem(step, exc, 0)
            problem = self.peers.broadcast(problem)
        if problem is not None:
            if self.rank == 0:
                remove(tmp)  # frees the space a full disk needs back
            raise TitanError(problem)
        self.kept = step
        if kind == "train" and self.rank == 0 and self.keep_latest_k:
            self._remove_old(step)

    def _remove_old(self, saved: int) -> None:
        """Remove the training checkpoints older than the newest ``keep_latest_k`` up to ``saved``
        (just committed): not a seed, not a newer folder (a damaged one a resume skipped, which a
        later save replaces), not a leftover or another name. Each is renamed ``step-N.old``
        first, so one cut short is never read as a checkpoint; one that cannot be removed is a
        warning (the save stands)."""
        steps, _ = scan(self.folder)
        older = [(s, p) for s, p in steps if 0 < s <= saved][self.keep_latest_k :]
        removed = []
        for step, path in sorted(older):
            aside = path + ".old"
            try:
                remove(aside)
                os.rename(path, aside)
            except OSError as exc:
                log.warning(
                    "could not remove an old checkpoint",
                    path=path,
                    reason=f"{exc}; it stays beside the newest checkpoint.keep_latest_k = "
                    f"{self.keep_latest_k} (remove it by hand, or fix the folder's permissions)",
                )
                continue
            remove(aside)
            removed.append(step)
        if removed:
            log.info("removed old checkpoints", steps=removed, keep_latest_k=self.keep_latest_k)

    def _save_problem(self, step: int, exc: BaseException, rank: int | None) -> str:
        kept, again = "this run has no earlier checkpoint", "then run again"
        if self.kept is not None:
            kept = f"{step_name(self.kept)} is intact, so a resume repeats only the steps after it"
            again = "then run again to resume"
        where = f"{step_name(step)} into {self.folder}" + (f" (rank {rank})" if rank is not None else "")
        error = os_error(exc)
        if error is not None and error.errno in DISK_FULL:
            return (
                f"checkpoint: the disk is full ({error.strerror}) saving {where}; the partial save "
                f"was deleted and {kept}. Free space on that disk, or point job.dump_folder (or an "
                f"absolute checkpoint.folder) at one with room, {again}"
            )
        if error is not None:
            return (
                f"checkpoint: cannot save {where}: {error}; the partial save was deleted and {kept}. "
                f"Fix the folder (permissions, mount), {again}"
            )
        return f"checkpoint: saving {where} failed: {describe(exc)}; {kept}"

    @staticmethod
    def _state(parts: list[nn.Module], optimizer: Any, scheduler: Any, train: TrainState) -> dict[str, Any]:
        return {
            "model": ModelState(parts),
            "optimizer": OptimizerState(parts, optimizer),
            "lr_scheduler": SchedulerState(scheduler),
            "train": train,
        }


def _failure(exc: dcp.CheckpointException) -> tuple[int | None, BaseException]:
    """The rank and exception of DCP's failure, a full disk first (it explains the others)."""
    failures = [(rank, pair[0]) for rank, pair in sorted(exc.failures.items())]
    for rank, error in failures:
        if (found := os_error(error)) is not None and found.errno in DISK_FULL:
            return rank, error
    return failures[0] if failures else (None, exc)


def _first_failure(exc: dcp.CheckpointException) -> str:
    rank, error = _failure(exc)
    return f"rank {rank}: {type(error).__name__}: {str(error).strip()[:300]}"


def _dcp(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``dcp.save``/``dcp.load``; one process without a process group needs no collectives, and
    DCP's warning that it assumes exactly that is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return call(*args, **kwargs)


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def _data_changes(saved: dict[str, int], now: dict[str, int]) -> dict[str, str]:
    """What differs between two data geometries in a way that changes the batches after resume.

    Without shuffling (``shuffle_buffer = 0``) the sequences come in one order whatever the
    layout, and the trainer skips the ones the saved steps consumed (over all ranks), so another
    DP degree, local batch size or accumulation continues where the data stopped. With it, each
    DP rank shuffles its own share (seeded by its rank) in an order its batch size only cuts:
    another DP degree changes the shares, another local batch size nothing.
    """
    keys = ["seq_len", "seed", "shuffle_buffer"]
    if not saved.get("shuffle_buffer") == now["shuffle_buffer"] == 0:
        keys += ["dp_degree"]
    return {k: f"{saved.get(k)} -> {now[k]}" for k in keys if saved.get(k) != now[k]}


def _dp_degree(config: TrainerConfig, world_size: int) -> int:
    p = config.parallelism
    dp_shard = p.dp_shard if p.dp_shard != -1 else world_size // (p.dp_replicate * p.cp * p.tp * p.pp)
    return p.dp_replicate * dp_shard
