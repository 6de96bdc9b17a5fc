"""Hook implementations of the comm plugin: the fake backends (the ``default`` one is the core's;
each declares ``FAKE_PP_RANK`` as its variable, so the core refuses it for any other backend, and a
launch check, so ``run_train.sh`` refuses a launch that cannot work before torchrun starts), the
gloo flight recorder (a loop callback) and ``titan fr analyze``.

Backends are imported only when a run selects one; nothing here imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_core import Callback, Command, CommBackend, hookimpl
from titan_plugins_comm.contract import fake_launch_check, hybrid_launch_check

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _fake(config: TrainerConfig) -> Topology:
    from titan_plugins_comm.fake import init

    return init(config)


def _real_pp_fake_spmd(config: TrainerConfig) -> Topology:
    from titan_plugins_comm.real_pp_fake_spmd import init

    return init(config)


#: Both backends exist to size a layout: their runs always write the memory report.
_SIZING = {"debug.memory_report": True}


@hookimpl
def titan_comm_backends() -> list[CommBackend]:
    return [
        CommBackend(
            "fake",
            _fake,
            "one process stands for logical rank FAKE_PP_RANK*NGPU/pp of an NGPU-rank job; "
            "no communication (memory and shape debugging, docs/debugging.md)",
            env_vars=("FAKE_PP_RANK",),
            sets=_SIZING,
            launch_check=fake_launch_check,
            simulates_peers=True,
        ),
        CommBackend(
            "real_pp_fake_spmd",
            _real_pp_fake_spmd,
            "torchrun, one process per PP rank: real pipeline sends/receives, fake DP/TP/CP/EP "
            "(docs/debugging.md)",
            # Declared so that its own launch check (FAKE_PP_RANK is invalid in hybrid mode, the
            # pipeline rank is torchrun's RANK) gives the precise error.
            env_vars=("FAKE_PP_RANK",),
            sets=_SIZING,
            launch_check=hybrid_launch_check,
            simulates_peers=True,
        ),
    ]


def _flight_recorder(trainer: Any) -> Any:
    from titan_plugins_comm.flight_recorder import build

    return build(trainer)


def _configure_fr(parser: Any) -> None:
    from titan_plugins_comm.fr_analyze import configure

    configure(parser)


def _run_fr(args: Any) -> int:
    from titan_plugins_comm.fr_analyze import run

    return run(args)


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback(
            "flight_recorder",
            _flight_recorder,
            order=10,
            description="gloo runs: every rank dumps its flight-recorder trace to "
            "job.dump_folder/comm_traces when a collective fails or times out",
            # NCCL's dumps (on CUDA) go there too: --overwrite removes the earlier run's.
            outputs=("comm_traces",),
        )
    ]


@hookimpl
def titan_commands() -> list[Command]:
    return [Command("fr", "flight-recorder dumps: analyze (which ranks are behind)", _configure_fr, _run_fr)]
