"""Config validation: every problem reported with its dotted path; printing round-trips."""

from __future__ import annotations

import json

import pytest
import tomllib

from titan_core.config import ConfigError, TrainerConfig, from_dict, render, to_dict, validate


def test_default_config_is_valid() -> None:
    assert validate(TrainerConfig()) is not None


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("training.steps", "4", "training.steps: expected int, got str '4'"),
        ("training.lr", "big", "training.lr: expected float, got str 'big'"),
        ("training.lr", float("inf"), "training.lr: expected a finite number, got inf"),
        ("training.seq_len", 0, "training.seq_len: expected a positive integer, got 0"),
        ("training.dtype", "fp8", "training.dtype: expected one of float32, bfloat16, got 'fp8'"),
        ("training.min_lr_factor", -0.1, "training.min_lr_factor: expected a value in [0, 1], got -0.1"),
        ("training.max_norm", float("nan"), "training.max_norm: expected a finite number, got nan"),
        ("training.beta1", 1.0, "training.beta1: expected a value in [0, 1), got 1.0"),
        ("training.beta2", -0.5, "training.beta2: expected a value in [0, 1), got -0.5"),
        ("training.weight_decay", -1.0, "training.weight_decay: expected a number >= 0, got -1.0"),
        ("training.eps", float("inf"), "training.eps: expected a finite number, got inf"),
        ("data.shuffle_buffer", -1, "data.shuffle_buffer: expected an integer >= 0, got -1"),
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
        ("profiler.profile_freq", 0, "profiler.profile_freq: expected a positive integer, got 0"),
        ("debug.seed", "42", "debug.seed: expected int or None, got str '42'"),
        # torch.manual_seed takes 64 bits: larger crashed the run's start with an overflow traceback
        ("debug.seed", 2**70, "debug.seed: expected an integer config.toml can hold (a signed 64-bit"),
    ],
)
def test_invalid_value_fails_where_it_is_set_with_its_path(path: str, value: object, expected: str) -> None:
    config = TrainerConfig()
    section, name = path.split(".")
    before = getattr(getattr(config, section), name)
    with pytest.raises(ConfigError) as info:
        setattr(getattr(config, section), name, value)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(expected), info.value.problems
    assert getattr(getattr(config, section), name) == before  # the bad value was not kept


@pytest.mark.parametrize(("lr", "beta1"), [(1e38, 0.9), (3.5e37, 0.9), (1e36, 0.999), (1e300, 0.0)])
def test_an_lr_whose_adamw_step_overflows_float32_is_refused_naming_training_lr(
    lr: float, beta1: float
) -> None:
    """Finite, so the field's own check passes; but AdamW's first step size lr / (1 - beta1)
    is beyond float32's range, and torch's optimizer step raised an overflow RuntimeError (a
    traceback after the model was built) instead of one error before anything."""
    config = TrainerConfig()
    config.training.lr, config.training.beta1 = lr, beta1
    with pytest.raises(ConfigError) as info:
        validate(config)
    (problem,) = info.value.problems
    assert problem.startswith(
        f"training.lr: {lr:g} is too large: AdamW's step size lr / (1 - training.beta1)"
    )
    assert "lower training.lr to at most" in problem


@pytest.mark.parametrize(("lr", "beta1"), [(3.4e37, 0.9), (1e38, 0.0), (3e-3, 0.9)])
def test_a_large_lr_whose_adamw_step_fits_float32_is_valid(lr: float, beta1: float) -> None:
    config = TrainerConfig()
    config.training.lr, config.training.beta1 = lr, beta1
    # Without weight decay: lr x weight_decay >= 1 is refused on its own (test_training_math.py).
    config.training.weight_decay = 0.0
    assert validate(config) is config


def test_a_section_must_be_a_section() -> None:
    with pytest.raises(ConfigError, match="profiler: expected a Profiler section, got int 3"):
        TrainerConfig().profiler = 3
    with pytest.raises(ConfigError, match="training: expected a Training section"):
        TrainerConfig().training = {"steps": 3}


def test_checks_across_fields_run_once_after_the_recipe() -> None:
    config = TrainerConfig()
    config.debug.deterministic_warn_only = True  # without debug.deterministic: does nothing
    config.activation_checkpoint.mode = "selective"
    config.activation_checkpoint.debug = True  # torch cannot debug the per-operator policy
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert [p.split(":")[0] for p in info.value.problems] == [
        "debug.deterministic_warn_only",
        "activation_checkpoint.debug",
    ]


def test_a_string_that_is_not_utf8_is_refused_naming_the_field() -> None:
    """A path of undecodable bytes (``os.fsdecode``'s surrogate escapes) or a lone surrogate
    cannot be written into config.toml: the run stopped with a UnicodeEncodeError traceback after
    creating its folder, leaving an empty config.toml."""
    import os

    config = TrainerConfig()
    config.data.path = os.fsdecode(b"bad/d\xff")
    config.job.description = "lone \ud800 surrogate"
    config.model.overrides = {"note": "x\udcff"}
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    fields = [p.split(":")[0] for p in info.value.problems]
    assert fields == ["job.description", "model.overrides.note", "data.path"]
    assert "is not valid UTF-8" in info.value.problems[2] and "rename" in info.value.problems[2]


def test_load_only_without_checkpointing_is_refused() -> None:
    """With checkpointing off nothing is loaded or saved: ``load_only`` did nothing, silently."""
    config = TrainerConfig()
    config.checkpoint.load_only = True
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    (problem,) = info.value.problems
    assert problem.startswith("checkpoint.load_only: has no effect with checkpoint.enable = False")
    config.checkpoint.enable = True
    validate(config, source="r")


@pytest.mark.parametrize("field", ["pp_microbatches", "pp_stages_per_rank"])
def test_a_pipeline_setting_without_pipeline_parallel_is_refused_naming_the_field(field: str) -> None:
    """Only the pipeline strategy reads them, and only with pp > 1: with pp = 1 a run exited 0
    as if they had been applied (microbatches_per_step 1)."""
    config = TrainerConfig()
    setattr(config.parallelism, field, 3)
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert info.value.problems == [
        f"parallelism.{field}: 3 does nothing with parallelism.pp = 1 (only pipeline parallel reads "
        "it); set parallelism.pp > 1, or leave it None"
    ]
    config.parallelism.pp = 2
    validate(config, source="r")


def test_recipe_returning_something_else() -> None:
    with pytest.raises(ConfigError, match="expected a TrainerConfig, got dict"):
        validate({"training": {}})


def test_unknown_attribute_cannot_be_set() -> None:
    # attrs slots: a typo in a recipe fails where it is made, not silently.
    with pytest.raises(AttributeError):
        TrainerConfig().training.stepz = 3  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no config section of that name; sections: job, model"):
        TrainerConfig().trainingg = 3  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no config section"):
        _ = TrainerConfig().nosuchsection


def test_render_toml_and_json_round_trip() -> None:
    config = TrainerConfig()
    config.training.steps = 7
    config.parallelism.pp, config.parallelism.pp_microbatches = 2, 4
    data = tomllib.loads(render(config, "toml"))
    assert data["training"]["steps"] == 7
    assert data["parallelism"]["pp_microbatches"] == 4
    assert "initial_load_path" not in data["checkpoint"]  # None is shown as a comment
    assert json.loads(render(config, "json")) == to_dict(config)
    assert from_dict(to_dict(config)) == config


def test_from_dict_errors_carry_paths() -> None:
    data = to_dict(TrainerConfig())
    data["training"]["steps"] = "many"
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert "training.steps: expected an integer, got str 'many'" in "\n".join(info.value.problems)
    data = to_dict(TrainerConfig())
    data["parallelism"]["typo"] = 1
    with pytest.raises(ConfigError, match=r"parallelism.typo: no such field; parallelism has dp_replicate, "):
        from_dict(data)
    data = to_dict(TrainerConfig())
    data["nosection"] = {}
    with pytest.raises(ConfigError, match="nosection: no config section"):
        from_dict(data)
    data = to_dict(TrainerConfig())
    data["profiler"]["profile_freq"] = 0  # a plugin's section is checked like the core's
    with pytest.raises(ConfigError, match=r"profiler\.profile_freq: expected a positive integer"):
        from_dict(data)


@pytest.mark.parametrize(
    ("section", "name", "value", "problem"),
    [
        # cattrs' own hooks converted these without a word; a recipe setting them is refused.
        ("training", "steps", "10", "training.steps: expected an integer, got str '10'"),
        ("training", "steps", 10.5, "training.steps: expected an integer, got float 10.5"),
        ("training", "steps", True, "training.steps: expected an integer, got bool True"),
        ("training", "lr", "0.1", "training.lr: expected a number, got str '0.1'"),
        ("job", "description", 3, "job.description: expected a string, got int 3"),
        ("data", "shuffle_buffer", -1, "data.shuffle_buffer: expected an integer >= 0, got -1"),
        ("training", "dtype", "fp99", "training.dtype: expected one of 'float32', 'bfloat16', got 'fp99'"),
        ("profiler", "profile_freq", "5", "profiler.profile_freq: expected an integer, got str '5'"),
    ],
)
def test_from_dict_refuses_what_a_recipe_refuses_naming_the_field(
    section: str, name: str, value: object, problem: str
) -> None:
    """The TOML a run wrote (``titan export`` reads it) and plain data are held to the recipe's
    rules: no coercion, the field's own path, the validator's own words."""
    data = to_dict(TrainerConfig())
    data[section][name] = value
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert info.value.problems == [problem]


def test_from_dict_takes_an_integer_for_a_number() -> None:
    data = to_dict(TrainerConfig())
    data["training"]["lr"] = 1  # TOML writes 1.0 as 1 when a user types it so
    assert from_dict(data).training.lr == 1.0 and isinstance(from_dict(data).training.lr, float)


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


@pytest.mark.parametrize("folder", ["", ".", "./"])
def test_the_checkpoint_folder_cannot_be_the_dump_folder(folder: str) -> None:
    # --overwrite then called the dump folder itself a checkpoint folder "outside" it.
    with pytest.raises(ConfigError, match=rf"checkpoint\.folder: {folder!r} names job\.dump_folder itself"):
        TrainerConfig().checkpoint.folder = folder


def _recipe(fn: object) -> object:
    from titan_core.records import Recipe

    return Recipe("mine", fn)  # type: ignore[arg-type]


def test_a_recipe_that_deletes_a_section_is_one_error() -> None:
    from titan_core.recipes import call_recipe

    def mine() -> TrainerConfig:
        config = TrainerConfig()
        del config.training
        return config

    with pytest.raises(ConfigError, match=r"training: the recipe deleted this config section"):
        call_recipe(_recipe(mine))


def test_a_recipe_that_needs_arguments_is_named_with_its_own_line() -> None:
    from titan_core.errors import UsageError
    from titan_core.recipes import call_recipe

    def mine(steps: int, seed: int = 0) -> TrainerConfig:
        return TrainerConfig()

    with pytest.raises(
        UsageError, match=r"recipe 'mine' takes arguments \(steps\).*test_config\.py:\d+"
    ) as info:
        call_recipe(_recipe(mine))
    assert "titan_core" not in str(info.value)


def test_config_toml_holds_any_string_and_the_largest_seed() -> None:
    """json.dumps wrote an emoji as a surrogate pair, which is no TOML: config.toml of such a run
    could not be read back (titan compare, titan export)."""
    config = TrainerConfig()
    config.job.description = 'ablation \U0001f680 \x7f\t"q" \\'
    config.debug.seed = 2**63 - 1
    data = tomllib.loads(render(config))
    assert data["job"]["description"] == config.job.description and data["debug"]["seed"] == 2**63 - 1
    assert from_dict(data) == config
    with pytest.raises(ConfigError, match=r"debug\.seed"):
        config.debug.seed = 2**63  # beyond a TOML integer


def test_config_toml_holds_numbers_of_float_and_int_subclasses() -> None:
    """A learning rate computed with numpy (``np.sqrt``, ``np.float64`` is a float) was accepted
    and written as ``lr = np.float64(0.001)``: config.toml was no TOML, so the run's record could
    not be read back (``titan recipes copy RUN_FOLDER``, titan compare)."""
    import enum

    import numpy as np

    class Steps(enum.IntEnum):
        SHORT = 7

    config = TrainerConfig()
    config.training.lr = np.float64(1e-3)
    config.training.steps = Steps.SHORT
    config.model.overrides = {"ffn_dim_multiplier": np.float64(1.5)}
    data = tomllib.loads(render(config))
    assert data["training"]["lr"] == 1e-3 and data["training"]["steps"] == 7
    assert data["model"]["overrides"] == {"ffn_dim_multiplier": 1.5}
    assert from_dict(data) == config


@pytest.mark.parametrize(
    "path",
    [
        "job.dump_folder",
        "data.path",
        "data.tokenizer_path",
        "validation.path",
        "checkpoint.folder",
        "checkpoint.initial_load_path",
        "metrics.save_tb_folder",
    ],
)
def test_a_path_starting_with_the_home_shorthand_is_refused_naming_the_fix(path: str) -> None:
    """``job.dump_folder = "~/runs/a"`` wrote the run into ``./~/runs/a`` of the current folder
    (nothing under the home folder, exit 0); ``data.path = "~/corpus.jsonl"`` said the file does
    not exist while it did: the shell expands ``~``, Python's file functions do not."""
    config = TrainerConfig()
    section, name = path.split(".")
    with pytest.raises(ConfigError) as info:
        setattr(getattr(config, section), name, "~/runs/a")
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}: '~/runs/a' starts with '~'"), problem
    assert "os.path.expanduser('~/runs/a')" in problem
    setattr(getattr(config, section), name, "runs/~a")  # a '~' further in is a plain character
