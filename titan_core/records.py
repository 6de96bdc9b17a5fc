"""Typed records that plugins return from titan's hooks.

Each hook (see :mod:`titan_core.hookspecs`) returns a list of one of these records. A record
carries a ``name`` users select it by and the callables that build the thing it stands for.
The records never import torch: what they build is created only when a run asks for it, so
listing plugins stays fast.

The registry (:mod:`titan_core._registry`) gathers the records of one hook from all plugins,
normalises their names and fails on a name provided twice, naming both distributions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.topology import Topology


@attrs.frozen
class ModelSpec:
    """A model family: its flavors and what the trainer and strategies need from it.

    The built module follows titan's decoder protocol (``docs/plugins.md``): ``init_weights()``
    initialises every parameter and buffer in place, ``forward(tokens) -> logits``, and the
    transformer blocks live in ``model.layers`` (an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...)
    so that FSDP, activation checkpointing and pipeline splitting can find them.
    """

    name: str
    #: flavor name -> model arguments (any object; usually a frozen attrs/dataclass instance).
    flavors: Mapping[str, Any]
    #: ``build(args) -> nn.Module``; called under ``torch.device("meta")``.
    build: Callable[[Any], nn.Module]
    #: ``num_params(args, include_embedding) -> int`` computed analytically (no model built).
    num_params: Callable[[Any, bool], int]
    #: ``flops_per_token(args, seq_len) -> float`` for MFU (6N + attention, torchtitan's formula).
    flops_per_token: Callable[[Any, int], float]
    #: ``tp_plan(model, tp_mesh, loss_parallel) -> None`` applies the DTensor TP/SP plan in
    #: place; ``None`` when the model does not support tensor parallelism.
    tp_plan: Callable[..., None] | None = None
    description: str = ""

    def flavor(self, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """The flavor's arguments with ``overrides`` applied (attrs, dataclass or dict args)."""
        try:
            args = self.flavors[flavor]
        except KeyError:
            known = ", ".join(sorted(self.flavors))
            raise LookupError(
                f"model {self.name!r} has no flavor {flavor!r}; known flavors: {known}"
            ) from None
        if not overrides:
            return args
        if isinstance(args, dict):
            fields = set(args)
        elif attrs.has(type(args)):
            fields = {a.name for a in attrs.fields(type(args))}
        elif dataclasses.is_dataclass(args):
            fields = {f.name for f in dataclasses.fields(args)}
        else:
            raise LookupError(f"model {self.name!r} flavor arguments cannot be overridden")
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise LookupError(
                f"{self.name} arguments have no field {', '.join(map(repr, unknown))}; "
                f"fields: {', '.join(sorted(fields))}"
            )
        current = args if isinstance(args, dict) else {f: getattr(args, f) for f in fields}
        for key, value in overrides.items():
            old = current[key]
            numeric = isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool)
            if old is not None and type(value) is not type(old) and not numeric:
                raise LookupError(f"{self.name} argument {key!r} expects {type(old).__name__}, got {value!r}")
        if isinstance(args, dict):
            return {**args, **overrides}
        if attrs.has(type(args)):
            return attrs.evolve(args, **overrides)
        return dataclasses.replace(args, **overrides)


@attrs.frozen
class Recipe:
    """A named function that returns a fully populated :class:`~titan_core.config.TrainerConfig`."""

    name: str
    fn: Callable[[], TrainerConfig]
    description: str = ""


@attrs.frozen
class Strategy:
    """A parallelism or model transformation applied to each model part before training.

    Strategies run in ascending ``order`` (``titan_core.parallelize.ORDER`` names the slots):
    pipeline splitting happens first and produces model parts; the others transform each part.
    """

    name: str
    order: int
    #: ``applies(config, parallel_dims) -> bool``: whether this run needs the strategy.
    applies: Callable[[TrainerConfig, ParallelDims], bool]
    #: ``apply(parts, ctx) -> parts``: takes this rank's model parts (a list of ``nn.Module``)
    #: and a :class:`~titan_core.parallelize.ParallelContext`, returns the parts to train.
    apply: Callable[..., Any]
    description: str = ""


@attrs.frozen
class CommBackend:
    """How a run reaches its peers: builds the :class:`~titan_core.topology.Topology`."""

    name: str
    #: ``init(config) -> Topology``; initialises process groups (or fakes them).
    init: Callable[[TrainerConfig], Topology]
    description: str = ""


@attrs.frozen
class Dataset:
    """A source of text documents for the language-modelling data loader."""

    name: str
    #: ``documents(data_config) -> Iterable[str]``: yields documents in a fixed order; called
    #: with the ``data`` section once per epoch.
    documents: Callable[[Any], Any]
    description: str = ""


@attrs.frozen
class Profiler:
    """A profiler: ``build(config, topology) -> session``.

    The session is a context manager the trainer enters around the training loop (its
    ``__exit__`` sees an exception leaving the loop, e.g. ``torch.OutOfMemoryError``, and must not
    swallow it) with ``step()``, called once after every training step. The trainer sets its
    ``step_num`` attribute to the last finished step (0, or the step a checkpoint resumed from)
    before entering it.
    """

    name: str
    build: Callable[[TrainerConfig, Topology], Any]
    description: str = ""


@attrs.frozen
class Checkpointer:
    """A checkpointer: ``build(config, topology) -> checkpointer`` with three methods.

    ``load(parts, optimizer, scheduler) -> int`` restores the latest checkpoint before step 1
    and returns the last step it holds (0: start from scratch); ``save(step, parts, optimizer,
    scheduler, *, last)`` is called after every step and decides whether to write (interval, last
    step, ``load_only``); ``save_seed(parts)`` writes the initial weights
    (``checkpoint.create_seed_checkpoint``). ``parts`` is this rank's list of model parts.
    """

    name: str
    build: Callable[[TrainerConfig, Topology], Any]
    description: str = ""


#: Every record type, keyed by the registry key used in ``titan plugins list``.
RECORD_TYPES: dict[str, type] = {
    "models": ModelSpec,
    "recipes": Recipe,
    "strategies": Strategy,
    "comm_backends": CommBackend,
    "datasets": Dataset,
    "profilers": Profiler,
    "checkpointers": Checkpointer,
}

__all__ = [
    "RECORD_TYPES",
    "Checkpointer",
    "CommBackend",
    "Dataset",
    "ModelSpec",
    "Profiler",
    "Recipe",
    "Strategy",
]
