"""Hook implementation of the profiler plugin (no torch import here: ``titan plugins list``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_core import Profiler, hookimpl

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.topology import Topology


def _build(config: TrainerConfig, topology: Topology) -> Any:
    from titan_plugins_profiler.session import ProfilerSession

    return ProfilerSession(config, topology)


@hookimpl
def titan_profilers() -> list[Profiler]:
    return [
        Profiler(
            "torch",
            _build,
            "torch.profiler traces every profiler.profile_freq steps; CUDA memory snapshots "
            "every profiler.memory_snapshot_freq steps and on out-of-memory",
        )
    ]
