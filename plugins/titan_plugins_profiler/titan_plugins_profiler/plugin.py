"""Hook implementations of the profiler plugin (no torch import here: ``titan plugins list``).

The profiler is a loop callback (:class:`~titan_plugins_profiler.session.ProfilerSession`),
built when ``profiler.enable_profiling`` or ``profiler.enable_memory_snapshot`` is set; its
config section ``profiler`` is the plugin's own (:mod:`titan_plugins_profiler.config`).
"""

from __future__ import annotations

from typing import Any

from titan_core import Callback, ConfigSection, hookimpl


def _build(trainer: Any) -> Any:
    p = trainer.config.profiler
    if not (p.enable_profiling or p.enable_memory_snapshot):
        return None
    from titan_plugins_profiler.session import ProfilerSession

    return ProfilerSession(trainer)


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback(
            "torch_profiler",
            _build,
            order=90,
            description="torch.profiler traces every profiler.profile_freq steps; memory snapshots "
            "(CUDA allocator, or a CPU tensor account) every profiler.memory_snapshot_freq steps and "
            "on out-of-memory, each with its HTML page",
        )
    ]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    from titan_plugins_profiler.config import Profiler

    return [ConfigSection("profiler", Profiler, "torch.profiler traces and memory snapshots")]
