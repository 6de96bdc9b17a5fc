"""Which traces and snapshots of the profiler's folders a run keeps (no torch here).

``--overwrite`` removes the folders of the default names with the earlier run's outputs (the
plugin's record declares them in ``Callback.outputs``). A run that is not another run (the same
run started over, or resumed) keeps what it continues: every run, profiled or not, removes at its
start the files of this rank, and rank 0 those of ranks the run lacks, for the steps it is about
to train (after the checkpoint it resumed from; all of them when it starts at step 1), so that no
trace of an earlier attempt sits beside this run's as if it were its; out-of-memory ``_exit``
snapshots stay (only ``--overwrite`` removes them). Other ranks' files are left
to their ranks: under the fake backends the ranks of one run are processes run one after another.
Folders outside ``job.dump_folder`` (an absolute path) may be shared by runs of other dump folders:
nothing is removed there.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

#: ``<save_traces_folder>/iteration_<step>/rank<rank>_trace.json``
_TRACE_STEP = re.compile(r"^iteration_(\d+)$")
#: ``<save_memory_snapshot_folder>/step_<step:012d>/rank<rank>_memory_snapshot.{pickle,html}``; the
#: ``step_<step>_exit`` snapshot of an out-of-memory failure is kept: it is the evidence the next
#: attempt (a resume with a smaller batch) is made to fix.
_SNAPSHOT_STEP = re.compile(r"^step_(\d+)$")
_RANK_FILE = re.compile(r"^rank(\d+)_")
#: The memory report's CUDA snapshot (titan-plugins-memory), written in the snapshot folder at the
#: end of a run: one present at a start is an earlier attempt's.
_REPORT_PICKLE = re.compile(r"^memory_report_rank(\d+)\.pickle$")


def clear_stale(config: Any, start: int, rank: int, world_size: int) -> list[str]:
    """Remove the trace and snapshot files of steps after ``start`` that this rank (rank 0: also
    ranks ``>= world_size``) owns; the paths removed."""
    from titan_core.run_folder import inside

    dump = config.job.dump_folder
    p = config.profiler

    def mine(name: str, pattern: re.Pattern[str]) -> bool:
        match = pattern.match(name)
        return match is not None and (
            int(match.group(1)) == rank or (rank == 0 and int(match.group(1)) >= world_size)
        )

    removed = []
    for folder_name, step_pattern in (
        (p.save_traces_folder, _TRACE_STEP),
        (p.save_memory_snapshot_folder, _SNAPSHOT_STEP),
    ):
        folder = os.path.join(dump, folder_name)
        if not (inside(folder, dump) and os.path.isdir(folder)):
            continue
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if step_pattern is _SNAPSHOT_STEP and mine(entry, _REPORT_PICKLE) and os.path.isfile(path):
                removed.append(path)
                continue
            step = step_pattern.match(entry)
            if step is None or int(step.group(1)) <= start or not os.path.isdir(path):
                continue
            removed += [os.path.join(path, n) for n in sorted(os.listdir(path)) if mine(n, _RANK_FILE)]
    for path in removed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        with contextlib.suppress(OSError):  # a step folder goes once no rank's file is left in it
            if os.path.basename(path).startswith("rank"):
                os.rmdir(os.path.dirname(path))
    return removed
