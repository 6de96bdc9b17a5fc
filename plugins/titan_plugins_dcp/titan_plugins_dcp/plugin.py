"""Hook implementations of the DCP plugin (no torch import here: ``titan plugins list``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from titan_core import Checkpointer, Command, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _build(config: TrainerConfig, topology: Topology) -> Any:
    from titan_plugins_dcp.checkpointer import DCPCheckpointer

    return DCPCheckpointer(config, topology)


def _launch_check(config: TrainerConfig, processes: int) -> None:
    if config.checkpoint.create_seed_checkpoint:
        from titan_plugins_dcp.launch import check_seed_launch

        check_seed_launch(config.parallelism, processes)


def _verify(
    path: str, rank: int, world_size: int, *, check_meta: Callable[[int, dict[str, Any]], None]
) -> str | None:
    from titan_plugins_dcp.checkpointer import verify_folder

    # check_meta: the trainer compares the model meta.json records with the run's.
    return verify_folder(path, rank, world_size, check_meta=check_meta)


def _export(args: argparse.Namespace) -> int:
    from titan_plugins_dcp.export import run

    return run(args)


#: What the checkpointer writes in ``checkpoint.folder`` (``_folder``'s names): ``step-N`` with
#: ``N`` in plain digits, no leading zero, and the ``step-N.tmp`` / ``step-N.old`` of a save in
#: progress. Globs have no "digits only", and a ``*`` would also match a user's ``step-1-v2``
#: copy, so there is one pattern per number of digits (up to 10^18 steps): a user's
#: ``step-3-hf`` export or ``step-006`` copy matches none, and ``--overwrite`` leaves it.
OUTPUTS = tuple(
    f"step-{number}{suffix}"
    for suffix in ("", ".tmp", ".old")
    for number in ("[0-9]", *("[1-9]" + "[0-9]" * more for more in range(1, 18)))
)


@hookimpl
def titan_checkpointers() -> list[Checkpointer]:
    return [
        Checkpointer(
            "dcp",
            _build,
            "torch.distributed.checkpoint: resharding save/resume of model, optimizer, LR "
            "schedule and step; seed checkpoints",
            launch_check=_launch_check,
            verify=_verify,
            outputs=OUTPUTS,
            seeds=("step-0",),  # a seed run's step-0: --overwrite of a run started from it keeps it
        )
    ]


@hookimpl
def titan_commands() -> list[Command]:
    from titan_plugins_dcp.export import configure  # torch-free at import

    return [
        Command(
            "export",
            "write a checkpoint as a Hugging Face model folder (--to hf)",
            configure,
            _export,
            "titan export CHECKPOINT_DIR --to hf OUT_DIR: config.json + safetensors + tokenizer that "
            "transformers' AutoModelForCausalLM.from_pretrained loads",
        )
    ]
