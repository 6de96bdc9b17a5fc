"""Hook implementations of the comm plugin: the fake backends (the ``default`` one is the core's).

Backends are imported only when a run selects one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_core import CommBackend, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _fake(config: TrainerConfig) -> Topology:
    from titan_plugins_comm.fake import init

    return init(config)


def _real_pp_fake_spmd(config: TrainerConfig) -> Topology:
    from titan_plugins_comm.real_pp_fake_spmd import init

    return init(config)


@hookimpl
def titan_comm_backends() -> list[CommBackend]:
    return [
        CommBackend(
            "fake",
            _fake,
            "one process stands for logical rank FAKE_PP_RANK*NGPU/pp of an NGPU-rank job; "
            "no communication (memory and shape debugging, docs/debugging.md)",
        ),
        CommBackend(
            "real_pp_fake_spmd",
            _real_pp_fake_spmd,
            "torchrun, one process per PP rank: real pipeline sends/receives, fake DP/TP/CP/EP "
            "(docs/debugging.md)",
        ),
    ]
