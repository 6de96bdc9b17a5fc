"""The seed checkpoint's launch rule, without torch: one process, every parallel degree 1.

Torch-free so that a check made before any process starts (``run_train.sh``'s launch check, one
cheap process before torchrun) or before ``init_process_group`` can call it, and every rank of a
launch that breaks the rule raises the same one-line :class:`~titan_core.errors.UsageError`.
"""

from __future__ import annotations

from typing import Any

from titan_core.errors import UsageError

#: The parallel degrees a seed run needs at 1, as named in ``parallelism``.
DEGREES = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")


def wrong_degrees(parallelism: Any) -> dict[str, int]:
    """The degrees of ``parallelism`` (any object with the degree attributes) that are not 1."""
    values = {name: getattr(parallelism, name) for name in DEGREES}
    if values["dp_shard"] == -1:  # -1 takes the ranks the other degrees leave: 1 on one process
        values["dp_shard"] = 1
    return {f"parallelism.{name}": value for name, value in values.items() if value != 1}


def check_seed_launch(parallelism: Any, world_size: int) -> None:
    """Raise :class:`UsageError` unless a seed checkpoint can be written: one process, degrees 1.

    The message is the same on every rank (it depends only on the config and the world size), so
    each rank of a torchrun launch prints the same line.
    """
    degrees = wrong_degrees(parallelism)
    got = [f"{name}={value}" for name, value in degrees.items()]
    if world_size != 1:
        got.append(f"world size {world_size}")
    if not got:
        return
    # A seed run of several processes would need collectives to write one copy of the weights,
    # and any layout can load the one-process seed later: say how to launch one process.
    fix = f"set {' and '.join(degrees)} to 1 in the recipe and run it" if degrees else "run the recipe"
    raise UsageError(
        "checkpoint.create_seed_checkpoint: a seed checkpoint is written by one process, got "
        f"{', '.join(got)}; {fix} as one process: NGPU=1 ./run_train.sh, or torchrun "
        "--nproc_per_node 1, or titan run without torchrun. Runs with other layouts then load the "
        "seed checkpoint through DCP resharding"
    )
