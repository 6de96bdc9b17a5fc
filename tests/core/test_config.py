"""Config validation: every problem reported with its dotted path; printing round-trips."""

from __future__ import annotations

import json

import pytest
import tomllib

from titan_core.config import ConfigError, TrainerConfig, from_dict, render, to_dict, validate


def problems(config: TrainerConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    return info.value.problems


def test_default_config_is_valid() -> None:
    assert validate(TrainerConfig()) is not None


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("training.steps", "4", "training.steps: expected int, got str '4'"),
        ("training.lr", "big", "training.lr: expected float, got str 'big'"),
        ("training.seq_len", 0, "training.seq_len: expected a positive integer, got 0"),
        ("training.dtype", "fp8", "training.dtype: expected one of float32, bfloat16, got 'fp8'"),
        ("parallelism.tp", 2.5, "parallelism.tp: expected int, got float 2.5"),
        ("parallelism.dp_shard", 0, "parallelism.dp_shard: expected -1 or a positive integer"),
        ("metrics.enable_tensorboard", "yes", "metrics.enable_tensorboard: expected bool"),
        ("comm.init_timeout_seconds", -5, "comm.init_timeout_seconds: expected a positive integer"),
        ("checkpoint.folder", None, "checkpoint.folder: expected str, got None"),
        ("activation_checkpoint.mode", "some", "activation_checkpoint.mode: expected one of"),
        (
            "activation_checkpoint.selective_ac_option",
            "0",
            "activation_checkpoint.selective_ac_option: expected 'op' or a positive integer",
        ),
        (
            "activation_checkpoint.selective_ac_option",
            2,
            "activation_checkpoint.selective_ac_option: expected str",
        ),
        ("debug.seed", "42", "debug.seed: expected int or None, got str '42'"),
    ],
)
def test_invalid_value_names_its_path(path: str, value: object, expected: str) -> None:
    config = TrainerConfig()
    section, name = path.split(".")
    setattr(getattr(config, section), name, value)
    found = problems(config)
    assert len(found) == 1
    assert found[0].startswith(expected)


def test_every_problem_is_reported_at_once() -> None:
    config = TrainerConfig()
    config.training.steps = "x"
    config.parallelism.pp = 0
    config.profiler = 3
    found = problems(config)
    assert [p.split(":")[0] for p in found] == ["training.steps", "parallelism.pp", "profiler"]


def test_recipe_returning_something_else() -> None:
    with pytest.raises(ConfigError, match="expected a TrainerConfig, got dict"):
        validate({"training": {}})


def test_unknown_attribute_cannot_be_set() -> None:
    # attrs slots: a typo in a recipe fails where it is made, not silently.
    with pytest.raises(AttributeError):
        TrainerConfig().training.stepz = 3  # type: ignore[attr-defined]


def test_render_toml_and_json_round_trip() -> None:
    config = TrainerConfig()
    config.training.steps = 7
    config.parallelism.pp_microbatches = 4
    data = tomllib.loads(render(config, "toml"))
    assert data["training"]["steps"] == 7
    assert data["parallelism"]["pp_microbatches"] == 4
    assert "initial_load_path" not in data["checkpoint"]  # None is shown as a comment
    assert json.loads(render(config, "json")) == to_dict(config)
    assert from_dict(to_dict(config)) == config


def test_from_dict_errors_carry_paths() -> None:
    data = to_dict(TrainerConfig())
    data["training"]["steps"] = "many"
    data["parallelism"]["typo"] = 1
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    text = "\n".join(info.value.problems)
    assert "training.steps: invalid value for type, expected int" in text
    assert "parallelism: extra fields found (typo)" in text


def test_interface_field_paths_exist() -> None:
    """The field paths other issues and users build on (the foundation issue's list)."""
    paths = {
        "job": ["dump_folder"],
        "training": ["steps", "local_batch_size", "seq_len", "lr", "warmup_steps", "max_norm", "dtype"],
        "parallelism": ["dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "pp_schedule", "pp_microbatches"],
        "comm": ["backend", "init_timeout_seconds", "train_timeout_seconds", "trace_buf_size"],
        "profiler": [
            "enable_profiling",
            "profile_freq",
            "enable_memory_snapshot",
            "save_memory_snapshot_folder",
            "memory_snapshot_freq",
        ],
        "metrics": ["log_freq", "enable_tensorboard"],
        "checkpoint": ["enable", "folder", "interval", "load_only", "create_seed_checkpoint"],
        "activation_checkpoint": ["mode", "preserve_rng_state", "determinism_check", "debug"],
        "debug": ["seed", "deterministic", "deterministic_warn_only"],
    }
    data = to_dict(TrainerConfig())
    for section, names in paths.items():
        for name in names:
            assert name in data[section], f"{section}.{name}"
