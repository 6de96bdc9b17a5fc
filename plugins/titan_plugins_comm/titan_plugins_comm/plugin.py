"""Hook implementations of the comm plugin: the fake backends (the ``default`` one is the core's),
the check that their variables are not set for another backend, the gloo flight recorder (a loop
callback) and ``titan fr analyze``.

Backends are imported only when a run selects one; nothing here imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_core import Callback, Command, CommBackend, Strategy, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
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


def _refuse_fake_only_env(config: TrainerConfig, _parallel_dims: ParallelDims) -> bool:
    """Raise when FAKE_PP_RANK is set for a backend that ignores it; never selects the strategy.

    A strategy because the trainer asks every strategy whether it applies once the backend is
    chosen and before the dump folder, the data or the model is touched, and the ``default``
    backend, which would ignore the variable, is the core's: no hook of this plugin runs in it.
    """
    import os

    from titan_plugins_comm.contract import refuse_fake_only_env

    refuse_fake_only_env(config.comm.backend, os.environ)
    return False


def _never_applied(parts: list[Any], _ctx: Any) -> list[Any]:
    return parts


@hookimpl
def titan_strategies() -> list[Strategy]:
    return [
        Strategy(
            "fake_env_check",
            order=0,
            applies=_refuse_fake_only_env,
            apply=_never_applied,
            description="applies to no run: refuses FAKE_PP_RANK when the comm backend is not "
            "fake, which would ignore it (docs/debugging.md)",
        )
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
        )
    ]


@hookimpl
def titan_commands() -> list[Command]:
    return [Command("fr", "flight-recorder dumps: analyze (which ranks are behind)", _configure_fr, _run_fr)]
