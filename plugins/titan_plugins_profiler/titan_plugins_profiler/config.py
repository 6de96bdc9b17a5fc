"""The ``profiler`` config section (the plugin's own; the paths are those of titan's first release).

No ``from __future__ import annotations`` here: :func:`titan_core.config.section` reads the real
annotation objects.
"""

from typing import Any, Literal

import attrs

from titan_core.config import field, local_path, positive, section


@section
class Profiler:
    #: Profiler used when profiling or memory snapshots are enabled (torch.profiler, the only one).
    backend: Literal["torch"] = "torch"
    #: Record torch.profiler traces every ``profile_freq`` steps.
    enable_profiling: bool = False
    #: Folder for profiler traces, joined to ``job.dump_folder`` (an absolute path as it is).
    # A path field as the core's (``local_path``): blank (an unset variable, which would be the
    # dump folder itself) and a leading ``~`` (which only a shell expands) are refused.
    save_traces_folder: str = field(default="profile_traces", validator=local_path)
    #: Steps between profiler traces.
    profile_freq: int = field(default=10, validator=positive)
    #: Record memory snapshots: the CUDA caching allocator's history on GPUs, a tensor-level
    #: account of the rank on CPU; each with an HTML page beside it.
    enable_memory_snapshot: bool = False
    #: Folder for memory snapshots, joined to ``job.dump_folder`` (an absolute path as it is).
    # Neither blank nor starting with ``~``, as ``save_traces_folder``.
    save_memory_snapshot_folder: str = field(default="memory_snapshot", validator=local_path)
    #: Steps between memory snapshots; ``None`` uses ``profile_freq``.
    memory_snapshot_freq: int | None = field(default=None, validator=positive)


def check(config: Any) -> list[str]:
    """Fields that neither traces nor snapshots read in this config (``profile_freq`` serves
    snapshots too, when ``memory_snapshot_freq`` is unset): set, they would change nothing."""
    p = config.profiler
    snapshots_use_it = p.enable_memory_snapshot and p.memory_snapshot_freq is None
    read = {
        "save_traces_folder": p.enable_profiling,
        "profile_freq": p.enable_profiling or snapshots_use_it,
        "save_memory_snapshot_folder": p.enable_memory_snapshot,
        "memory_snapshot_freq": p.enable_memory_snapshot,
    }
    defaults = {f.name: f.default for f in attrs.fields(type(p))}
    return [
        f"profiler.{name}: {getattr(p, name)!r} does nothing here (profiler.enable_profiling = "
        f"{p.enable_profiling}, enable_memory_snapshot = {p.enable_memory_snapshot}); remove it from the "
        "recipe, or enable what reads it"
        for name, used in read.items()
        if not used and getattr(p, name) != defaults[name]
    ]
