"""titan: pre-train language models on PyTorch, with models and parallelism as plugins.

The public surface: the hook markers, the records hooks return, the config, the errors plugins
raise, the registry (for a plugin's own ``Command``), and ``main``. Importing titan_core does not
import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_core.config import TrainerConfig
from titan_core.errors import TitanError, UsageError
from titan_core.hookspecs import hookimpl, hookspec
from titan_core.records import (
    Callback,
    Checkpointer,
    Command,
    CommBackend,
    ConfigSection,
    Dataset,
    ModelSpec,
    Recipe,
    RunOption,
    StateDictAdapter,
    Strategy,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from titan_core._registry import Registry


def get_registry(disabled: set[str] | None = None) -> Registry:
    """Every installed plugin's records (``registry.get("models", name)``, ...), as ``titan run``
    sees them; ``disabled``: plugin names to leave out (as ``--disable-plugin``). For a plugin's
    ``Command``, whose ``run(args)`` gets only its arguments."""
    from titan_core._registry import get_registry as registry

    return registry(disabled)


def main() -> int:
    from titan_core.cli import main as cli_main

    return cli_main()


__all__ = [
    "Callback",
    "Checkpointer",
    "CommBackend",
    "Command",
    "ConfigSection",
    "Dataset",
    "ModelSpec",
    "Recipe",
    "RunOption",
    "StateDictAdapter",
    "Strategy",
    "TitanError",
    "TrainerConfig",
    "UsageError",
    "__version__",
    "get_registry",
    "hookimpl",
    "hookspec",
    "main",
]
