"""Hook implementation of the parallelism plugin: one ``Strategy`` record per strategy module.

Each record names its module; the module is imported only when the trainer asks whether the
strategy applies, checks it or applies it, so ``titan plugins list`` stays free of torch. Every
module provides ``applies(config, parallel_dims) -> bool`` and ``apply(parts, ctx) -> parts``;
those that refuse layouts from the config, the degrees and the model's arguments alone also
provide ``check(config, parallel_dims, spec, model_args) -> list[str]`` (``Strategy.check``: run
before torchrun starts and before anything is built). The order slots are
``titan_core.parallelize.ORDER``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from titan_core import ConfigSection, Strategy, hookimpl
from titan_core.parallelize import ORDER


def _lazy(module: str, function: str) -> Callable[..., Any]:
    """``titan_plugins_parallel.<module>.<function>``, imported on first call."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"titan_plugins_parallel.{module}"), function)(*args)

    call.__name__ = f"{module}.{function}"
    return call


def _strategy(name: str, module: str, handles: tuple[str, ...], checks: bool, description: str) -> Strategy:
    check = _lazy(module, "check") if checks else None
    return Strategy(
        name, ORDER[name], _lazy(module, "applies"), _lazy(module, "apply"), description, handles, check
    )


#: (strategy name = ORDER slot, module, parallel dims handled, whether the module has a ``check``,
#: description). Add a line to add one.
STRATEGIES = [
    (
        "tp",
        "tensor_parallel",
        ("tp",),
        True,
        "tensor + sequence parallel (+ loss parallel) from the model's TP plan",
    ),
    (
        "activation_checkpoint",
        "activation_checkpoint",
        (),
        False,
        "recompute blocks in backward (full/selective)",
    ),
    ("compile", "compile", (), False, "torch.compile each transformer block"),
    (
        "fsdp",
        "fsdp",
        ("dp_shard", "dp_replicate"),
        False,
        "FSDP2 fully_shard per block and at the root; HSDP when dp_replicate > 1",
    ),
    (
        "pp",
        "pipeline",
        ("pp",),
        True,
        "pipeline stages from the model's blocks, torch.distributed.pipelining schedules",
    ),
    (
        "ep",
        "expert_parallel",
        ("ep",),
        True,
        "experts sharded over ep ranks, tokens moved by all_to_all_single",
    ),
    (
        "cp",
        "context_parallel",
        ("cp",),
        True,
        "load-balanced sequence shards, K/V all-gathered for attention",
    ),
]


@hookimpl
def titan_strategies() -> list[Strategy]:
    return [_strategy(*row) for row in STRATEGIES]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    from titan_plugins_parallel.config import ActivationCheckpoint, Compile, check

    return [
        ConfigSection(
            "activation_checkpoint", ActivationCheckpoint, "recompute activations in backward", check
        ),
        ConfigSection("compile", Compile, "torch.compile of the transformer blocks"),
    ]
