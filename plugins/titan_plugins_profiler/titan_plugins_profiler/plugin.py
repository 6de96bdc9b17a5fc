"""Hook implementations of the profiler plugin (no torch import here: ``titan plugins list``).

The profiler is a loop callback: it is built when ``profiler.enable_profiling`` or
``profiler.enable_memory_snapshot`` is set, starts before the first step, steps after every
step, and on a failure (out of memory) writes the ``_exit`` snapshot.
"""

from __future__ import annotations

from typing import Any

from titan_core import Callback, ConfigSection, hookimpl


class _SessionCallback:
    """Drives a :class:`~titan_plugins_profiler.session.ProfilerSession` from the loop's points."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def on_train_start(self, step: int) -> None:
        self.session.step_num = step  # trace folders carry the global step after a resume
        self.session.__enter__()

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        self.session.step()

    def on_train_end(self, step: int) -> None:
        self.session.__exit__(None, None, None)

    def on_failure(self, step: int, exc: BaseException) -> None:
        self.session.__exit__(type(exc), exc, exc.__traceback__)


def _build(trainer: Any) -> Any:
    p = trainer.config.profiler
    if not (p.enable_profiling or p.enable_memory_snapshot):
        return None
    from titan_plugins_profiler.session import ProfilerSession

    return _SessionCallback(ProfilerSession(trainer.config, trainer.topology))


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback(
            "torch_profiler",
            _build,
            order=90,
            description="torch.profiler traces every profiler.profile_freq steps; memory "
            "snapshots every profiler.memory_snapshot_freq steps and on out-of-memory",
        )
    ]


@hookimpl
def titan_config_sections() -> list[ConfigSection]:
    from titan_plugins_profiler.config import Profiler

    return [ConfigSection("profiler", Profiler, "traces and memory snapshots")]
