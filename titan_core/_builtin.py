"""titan's own plugin: the ``default`` comm backend, the bundled datasets, the metric writers.

Registered through the ``titan`` entry-point group like any third-party plugin, so the core
trains on one device (or under torchrun) with nothing else installed but a model plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from titan_core.hookspecs import hookimpl
from titan_core.records import Callback, Command, CommBackend, Dataset

if TYPE_CHECKING:
    from titan_core.config import Data, TrainerConfig
    from titan_core.topology import Topology


def _default_backend(config: TrainerConfig) -> Topology:
    from titan_core.comm import init

    return init(config)


@hookimpl
def titan_comm_backends() -> list[CommBackend]:
    return [
        CommBackend(
            "default",
            _default_backend,
            "one process, or torchrun's env:// rendezvous (NCCL on CUDA, gloo on CPU)",
        )
    ]


def _tensorboard(trainer: Any) -> Any:
    from titan_core.metrics import TensorBoardWriter

    return TensorBoardWriter.build(trainer)


def _metrics_file(trainer: Any) -> Any:
    from titan_core.metrics import MetricsFileWriter

    return MetricsFileWriter.build(trainer)


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback("tensorboard", _tensorboard, order=80, description="metrics.enable_tensorboard scalars"),
        Callback("metrics_file", _metrics_file, order=80, description="metrics.jsonl in job.dump_folder"),
    ]


def _bundled(data: Data) -> Iterable[str]:
    from titan_core.data.corpus import documents

    return documents(data.bundled_documents)


def _bundled_held_out(data: Data) -> Iterable[str]:
    from titan_core.data.corpus import HELD_OUT_SEED, documents

    return documents(data.bundled_documents, seed=HELD_OUT_SEED)


def _text(data: Data) -> Iterable[str]:
    from titan_core.data.loader import read_text_files

    return read_text_files(data.path)


@hookimpl
def titan_datasets() -> list[Dataset]:
    return [
        Dataset(
            "bundled",
            _bundled,
            "generated English-like corpus shipped with titan (offline)",
            held_out=_bundled_held_out,
            reads_path=False,
        ),
        Dataset("text", _text, "local .jsonl ({'text': ...} per line) or .txt files at data.path"),
    ]


@hookimpl
def titan_commands() -> list[Command]:
    from titan_core import cli

    return [
        Command("run", "train with a recipe", cli.configure_run, cli.run_command),
        Command("plugins", "inspect installed plugins", cli.configure_plugins, cli.plugins_command),
        Command("models", "inspect model families and flavors", cli.configure_models, cli.models_command),
        Command("recipes", "inspect recipes", cli.configure_recipes, cli.recipes_command),
    ]
