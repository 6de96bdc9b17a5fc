"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, seed checkpoints.

Every checkpoint is a DCP folder ``job.dump_folder/checkpoint.folder/step-<N>`` (a ``.metadata``
file plus one data file per rank). DCP stores each tensor with its global shape and the shard
each rank holds, so a checkpoint written by one parallel layout loads into another: loading
reshards it to the placements of the run that reads it.

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
"""

from __future__ import annotations

import os
import re
import time
import warnings
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

from titan_core.errors import UsageError
from titan_core.log import get_logger

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology

log = get_logger("titan.checkpoint")

_STEP_DIR = re.compile(r"^step-(\d+)$")
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


# -- the checkpointer --------------------------------------------------------------------------------


class DCPCheckpointer:
    """Built once per run: ``load`` before step 1, ``save`` after every step, ``save_seed``."""

    def __init__(self, config: TrainerConfig, topology: Topology) -> None:
        c = config.checkpoint
        self.folder = os.path.join(config.job.dump_folder, c.folder)
        self.interval = c.interval
        self.load_only = c.load_only
        self.rank = topology.rank
        t = config.training
        self.data_geometry = {
            "dp_degree": _dp_degree(config, topology.world_size),
            "local_batch_size": t.local_batch_size,
            "seq_len": t.seq_len,
            "seed": config.debug.seed if config.debug.seed is not None else 0,
            "shuffle_buffer": config.data.shuffle_buffer,
        }
        if c.create_seed_checkpoint:
            _check_seed_layout(config, topology.world_size)

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def latest_step(self) -> int | None:
        """The highest step with a complete checkpoint (DCP writes ``.metadata`` last)."""
        if not os.path.isdir(self.folder):
            return None
        steps = [
            int(m.group(1))
            for name in os.listdir(self.folder)
            if (m := _STEP_DIR.match(name)) and os.path.isfile(os.path.join(self.folder, name, ".metadata"))
        ]
        return max(steps, default=None)

    def load(self, parts: list[nn.Module], optimizer: Any, scheduler: Any) -> int:
        """Restore the latest checkpoint, if any; return the step to continue after (0: start)."""
        step = self.latest_step()
        if step is None:
            log.info("no checkpoint to resume from", folder=self.folder)
            return 0
        start = time.perf_counter()
        if step == 0:  # a seed checkpoint: initial weights only
            _dcp(dcp.load, {"model": ModelState(parts)}, checkpoint_id=self.path(0))
            log.info("seed checkpoint loaded", path=self.path(0), seconds=_since(start))
            return 0
        train = TrainState(step, self.data_geometry)
        state = self._state(parts, optimizer, scheduler, train)
        _dcp(dcp.load, state, checkpoint_id=self.path(step))
        changed = _data_changes(train.saved_data, self.data_geometry)
        if changed:
            log.warning(
                "data geometry changed since the checkpoint; the data will not resume where it stopped",
                changed=changed,
            )
        log.info("checkpoint loaded", path=self.path(step), step=train.step, seconds=_since(start))
        return train.step

    def save(self, step: int, parts: list[nn.Module], optimizer: Any, scheduler: Any, *, last: bool) -> None:
        """Save every ``checkpoint.interval`` steps and at the last step (never with load_only)."""
        if self.load_only or (step % self.interval and not last):
            return
        start = time.perf_counter()
        state = self._state(parts, optimizer, scheduler, TrainState(step, self.data_geometry))
        _dcp(dcp.save, state, checkpoint_id=self.path(step))
        log.info("checkpoint saved", path=self.path(step), step=step, seconds=_since(start))

    def save_seed(self, parts: list[nn.Module]) -> str:
        """Write ``step-0`` with the freshly initialised weights only."""
        path = self.path(0)
        _dcp(dcp.save, {"model": ModelState(parts)}, checkpoint_id=path)
        log.info("seed checkpoint saved", path=path)
        return path

    @staticmethod
    def _state(parts: list[nn.Module], optimizer: Any, scheduler: Any, train: TrainState) -> dict[str, Any]:
        return {
            "model": ModelState(parts),
            "optimizer": OptimizerState(parts, optimizer),
            "lr_scheduler": SchedulerState(scheduler),
            "train": train,
        }


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

    Without shuffling (``shuffle_buffer = 0``) the global batches depend only on the global batch
    size, so a DP degree traded for a local batch size changes nothing.
    """
    keys = ["seq_len", "seed", "shuffle_buffer"]
    if saved.get("shuffle_buffer") == now["shuffle_buffer"] == 0:
        saved = {**saved, "global_batch": saved.get("dp_degree", 0) * saved.get("local_batch_size", 0)}
        now = {**now, "global_batch": now["dp_degree"] * now["local_batch_size"]}
        keys.append("global_batch")
    else:
        keys += ["dp_degree", "local_batch_size"]
    return {k: f"{saved.get(k)} -> {now[k]}" for k in keys if saved.get(k) != now[k]}


def _dp_degree(config: TrainerConfig, world_size: int) -> int:
    p = config.parallelism
    dp_shard = p.dp_shard if p.dp_shard != -1 else world_size // (p.dp_replicate * p.cp * p.tp * p.pp)
    return p.dp_replicate * dp_shard


def _check_seed_layout(config: TrainerConfig, world_size: int) -> None:
    p = config.parallelism
    degrees = {name: getattr(p, name) for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")}
    degrees["dp_shard"] = 1 if degrees["dp_shard"] == -1 else degrees["dp_shard"]  # -1: the rest, 1 here
    wrong = [f"parallelism.{k}={v}" for k, v in degrees.items() if v != 1]
    if world_size != 1:
        wrong.append(f"world size {world_size}")
    if wrong:
        raise UsageError(
            "checkpoint.create_seed_checkpoint needs every parallel degree 1 on one process, got "
            + ", ".join(wrong)
            + "; set the degrees to 1 in the recipe and run it as one process (no torchrun). Runs "
            "with other layouts then load the seed checkpoint through DCP resharding"
        )
