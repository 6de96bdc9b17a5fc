"""Bad values of the ``profiler`` section, set in a recipe: each is one ``titan: error:`` naming
the field and what to change (exit 2), or accepted for a run that does what it means."""

from __future__ import annotations

import pytest

from tests.plugins.config_probes import ConfigProbe

ON = {"profiler.enable_profiling": "True"}
SNAP = {"profiler.enable_memory_snapshot": "True"}

PROBES = [
    ({"profiler.backend": "'Torch'"}, "profiler.backend: expected one of torch"),
    ({"profiler.backend": "''"}, "profiler.backend: expected one of torch"),
    ({"profiler.enable_profiling": "1"}, "profiler.enable_profiling: expected bool, got int"),
    ({**ON, "profiler.profile_freq": "0"}, "profiler.profile_freq: expected a positive integer"),
    ({**ON, "profiler.profile_freq": "-1"}, "profiler.profile_freq: expected a positive integer"),
    ({**ON, "profiler.profile_freq": "2.0"}, "profiler.profile_freq: expected int, got float"),
    ({**ON, "profiler.profile_freq": "True"}, "profiler.profile_freq: expected int, got bool"),
    ({**ON, "profiler.profile_freq": "nan"}, "profiler.profile_freq: expected int, got float"),
    ({**ON, "profiler.profile_freq": "None"}, "profiler.profile_freq: expected int, got None"),
    ({**ON, "profiler.profile_freq": "'10'"}, "profiler.profile_freq: expected int, got str"),
    ({**ON, "profiler.profile_freq": "10**15"}, None),  # no trace in the run: a warning says so
    ({**ON, "profiler.profile_freq": "10**30"}, "profiler.profile_freq: "),  # beyond TOML's integers
    ({**ON, "profiler.save_traces_folder": "''"}, "profiler.save_traces_folder: '' is empty"),
    ({**ON, "profiler.save_traces_folder": "'  '"}, "profiler.save_traces_folder: '  ' is empty"),
    ({**ON, "profiler.save_traces_folder": "'~/x'"}, "profiler.save_traces_folder: '~/x' starts with '~'"),
    ({**ON, "profiler.save_traces_folder": "None"}, "profiler.save_traces_folder: expected str, got None"),
    # Fixed: accepted, then the run failed building the profiler ("embedded null byte", exit 1).
    ({**ON, "profiler.save_traces_folder": "'a\\x00b'"}, "save_traces_folder: 'a\\x00b' holds a NUL"),
    ({**ON, "profiler.save_traces_folder": "'.'"}, None),  # iteration_N folders in the dump folder
    ({**SNAP, "profiler.memory_snapshot_freq": "0"}, "profiler.memory_snapshot_freq: expected a positive"),
    ({**SNAP, "profiler.memory_snapshot_freq": "1.0"}, "memory_snapshot_freq: expected int or None"),
    ({**SNAP, "profiler.memory_snapshot_freq": "True"}, "memory_snapshot_freq: expected int or None"),
    ({**SNAP, "profiler.save_memory_snapshot_folder": "''"}, "save_memory_snapshot_folder: '' is empty"),
    (
        {**SNAP, "profiler.save_memory_snapshot_folder": "'a\\x00b'"},
        "profiler.save_memory_snapshot_folder: 'a\\x00b' holds a NUL",
    ),
    ({"profiler.profile_freq": "5"}, "profiler.profile_freq: 5 does nothing here"),
    ({"profiler.memory_snapshot_freq": "5"}, "profiler.memory_snapshot_freq: 5 does nothing here"),
]


@pytest.mark.parametrize(("settings", "expected"), PROBES, ids=lambda v: str(v)[:60])
def test_a_profiler_value(settings: dict[str, str], expected: str | None, config_probe: ConfigProbe) -> None:
    config_probe(settings, expected)
