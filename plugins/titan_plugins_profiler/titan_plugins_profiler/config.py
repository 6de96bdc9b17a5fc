"""The ``profiler`` config section (the plugin's own; the paths are those of titan's first release).

No ``from __future__ import annotations`` here: :func:`titan_core.config.section` reads the real
annotation objects.
"""

from typing import Literal

from titan_core.config import field, positive, section


@section
class Profiler:
    #: Profiler used when profiling or memory snapshots are enabled (torch.profiler, the only one).
    backend: Literal["torch"] = "torch"
    #: Record torch.profiler traces every ``profile_freq`` steps.
    enable_profiling: bool = False
    #: Folder (under ``job.dump_folder``) for profiler traces.
    save_traces_folder: str = "profile_traces"
    #: Steps between profiler traces.
    profile_freq: int = field(default=10, validator=positive)
    #: Record memory snapshots: the CUDA caching allocator's history on GPUs, a tensor-level
    #: account of the rank on CPU; each with an HTML page beside it.
    enable_memory_snapshot: bool = False
    #: Folder (under ``job.dump_folder``) for memory snapshots.
    save_memory_snapshot_folder: str = "memory_snapshot"
    #: Steps between memory snapshots; ``None`` uses ``profile_freq``.
    memory_snapshot_freq: int | None = field(default=None, validator=positive)
