"""``profiler.save_traces_folder`` and ``save_memory_snapshot_folder`` are path fields like the
core's (``titan_core.config.local_path``): a blank value (an unset variable) was the dump folder
itself, traces written among the run's own files; ``"~/traces"`` a folder named ``~`` in the dump
folder. Both are refused on the recipe's line, naming the field and the fix."""

from __future__ import annotations

import pytest

from titan_core.config import ConfigError, TrainerConfig

_FIELDS = ["save_traces_folder", "save_memory_snapshot_folder"]


@pytest.mark.parametrize("name", _FIELDS)
@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_profiler_folder_is_refused_naming_the_default(name: str, value: str) -> None:
    config = TrainerConfig()
    default = getattr(config.profiler, name)
    with pytest.raises(ConfigError) as info:
        setattr(config.profiler, name, value)
    (problem,) = info.value.problems
    assert problem.startswith(f"profiler.{name}: {value!r} is empty (what an unset variable gives"), problem
    assert f"give a path (the default: {default!r})" in problem
    assert getattr(config.profiler, name) == default  # the value stays what it was


@pytest.mark.parametrize("name", _FIELDS)
def test_a_profiler_folder_starting_with_the_home_shorthand_is_refused(name: str) -> None:
    config = TrainerConfig()
    with pytest.raises(ConfigError) as info:
        setattr(config.profiler, name, "~/traces")
    (problem,) = info.value.problems
    assert problem.startswith(f"profiler.{name}: '~/traces' starts with '~'"), problem
    assert "os.path.expanduser('~/traces')" in problem
    setattr(config.profiler, name, "runs/~a")  # a '~' further in is a plain character
    setattr(config.profiler, name, "/tmp/traces")  # an absolute path as it is


@pytest.mark.parametrize("name", _FIELDS)
def test_a_blank_profiler_folder_in_a_toml_config_is_refused(name: str) -> None:
    from titan_core.config import from_dict, to_dict

    data = to_dict(TrainerConfig())
    data["profiler"][name] = ""
    with pytest.raises(ConfigError, match=rf"profiler\.{name}: '' is empty"):
        from_dict(data)
