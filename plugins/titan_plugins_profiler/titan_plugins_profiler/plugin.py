"""Hook implementations of the profiler plugin (no torch import here: ``titan plugins list``).

The profiler is a loop callback (:class:`~titan_plugins_profiler.session.ProfilerSession`),
built when ``profiler.enable_profiling`` or ``profiler.enable_memory_snapshot`` is set; its
config section ``profiler`` is the plugin's own (:mod:`titan_plugins_profiler.config`).
"""

from __future__ import annotations

from typing import Any

from titan_core import Callback, ConfigSection, hookimpl

#: The default ``profiler.save_traces_folder`` and ``save_memory_snapshot_folder``: ``--overwrite``
#: removes them with the earlier run's outputs (``Callback.outputs``).
OUTPUTS = ("profile_traces", "memory_snapshot")


def _build(trainer: Any) -> Any:
    """The session, or ``None``; either way the folders keep no earlier attempt's traces and
    snapshots of the steps this run trains (:func:`~titan_plugins_profiler.outputs.clear_stale`)."""
    from titan_plugins_profiler.outputs import clear_stale

    p = trainer.config.profiler
    clear_stale(trainer.config, trainer.step, trainer.topology.rank, trainer.topology.world_size)
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
            outputs=OUTPUTS,
        )
    ]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    from titan_plugins_profiler.config import Profiler, check

    return [ConfigSection("profiler", Profiler, "torch.profiler traces and memory snapshots", check)]
