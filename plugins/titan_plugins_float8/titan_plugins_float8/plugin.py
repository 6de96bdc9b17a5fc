"""Hook implementation of the float8 plugin (no torch import here: ``titan plugins list``).

One strategy, ``float8``, which swaps the model's ``nn.Linear`` layers for torchao's
``Float8Linear`` (:mod:`titan_plugins_float8.convert`), and its config section ``float8``.

Order 5, before every other strategy (PP split 10 ... FSDP 60), as torchtitan converts the model
before it parallelises it: the conversion is a module swap on the meta model, so TP's plan, the
activation-checkpoint wrappers, ``torch.compile`` and FSDP all see ``Float8Linear`` modules (TP
shards their weights, AC's ``op`` policy counts their ``_scaled_mm`` like ``mm``, compile fuses
the scaling casts into the block's graph, FSDP shards and casts their weights). Converting after
AC would have to reach through the checkpoint wrappers, and ``float8.filter_fqns`` would then see
``_checkpoint_wrapped_module`` in the names; after compile the swap would bypass the compiled
graph. Converting before the PP split converts once, not once per stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from titan_core import ConfigSection, Strategy, hookimpl

#: Before the PP split (10) and every other strategy: see the module docstring.
ORDER = 5


def _lazy(function: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module("titan_plugins_float8.convert"), function)(*args)

    call.__name__ = f"convert.{function}"
    return call


@hookimpl
def titan_strategies() -> list[Strategy]:
    return [
        Strategy(
            "float8",
            ORDER,
            _lazy("applies"),
            _lazy("apply"),
            "torchao Float8Linear in place of the linear layers (float8 matmuls, dynamic scaling)",
            (),
            # Before launch (run_train.sh) and before anything is built: one error line.
            _lazy("check"),
        )
    ]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    from titan_plugins_float8.config import Float8, check

    return [
        ConfigSection(
            "float8",
            Float8,
            "float8 training of linear layers (torchao)",
            check=check,
            results=("enable", "recipe", "filter_fqns", "emulate"),
        )
    ]
