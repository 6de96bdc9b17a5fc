"""titan: pre-train language models on PyTorch, with models and parallelism as plugins.

The public surface: the hook markers, the records hooks return, the config, and ``main``.
Importing titan_core does not import torch.
"""

from titan_core.config import TrainerConfig
from titan_core.errors import TitanError
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
    "__version__",
    "hookimpl",
    "hookspec",
    "main",
]
