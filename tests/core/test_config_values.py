"""Boundary and invalid values of every core config field, pinned: each refused one is one
``path: message`` error naming the field where the recipe sets it (or, for a combination, when
the recipe returns), and each accepted one is kept as given and trains as it means."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.conftest import error_line, tiny_llama3
from titan_core.config import ConfigError, TrainerConfig, validate

NAN, INF = float("nan"), float("inf")
BIG = 2**63  # one past the largest integer TOML (config.toml) holds
HUGE = 10**400  # an integer beyond float range


def _set(config: TrainerConfig, path: str, value: object) -> None:
    section, name = path.split(".")
    setattr(getattr(config, section), name, value)


# (path, value, what the error says after "path: ")
REFUSED_WHERE_SET = [
    # integers: 0 / -1 where positive, floats, bools, None, strings, beyond 64 bits
    ("training.steps", 0, "expected a positive integer, got 0"),
    ("training.steps", -1, "expected a positive integer, got -1"),
    ("training.steps", 2.0, "expected int, got float 2.0"),
    ("training.steps", 10.5, "expected int, got float 10.5"),
    ("training.steps", True, "expected int, got bool True"),
    ("training.steps", None, "expected int, got None"),
    ("training.steps", "10", "expected int, got str '10'"),
    ("training.steps", NAN, "expected int, got float nan"),
    ("training.steps", BIG, "expected an integer config.toml can hold"),
    ("training.seq_len", 2**64, "expected an integer config.toml can hold"),
    ("training.local_batch_size", 0, "expected a positive integer, got 0"),
    ("training.global_batch_size", 0, "expected a positive integer, got 0"),
    ("training.global_batch_size", False, "expected int or None, got bool False"),
    ("training.warmup_steps", -1, "expected an integer >= 0, got -1"),
    ("training.warmup_steps", 1.0, "expected int, got float 1.0"),
    ("data.bundled_documents", 0, "expected a positive integer, got 0"),
    ("data.prefetch", -1, "expected an integer >= 0, got -1"),
    ("data.prefetch", BIG, "expected an integer config.toml can hold"),
    ("parallelism.dp_shard", -2, "expected -1 or a positive integer, got -2"),
    ("parallelism.dp_replicate", 0, "expected a positive integer, got 0"),
    ("parallelism.tp", True, "expected int, got bool True"),
    ("parallelism.pp", BIG, "expected an integer config.toml can hold"),
    ("parallelism.pp_microbatches", 0, "expected a positive integer, got 0"),
    ("validation.freq", 0, "expected a positive integer, got 0"),
    ("validation.steps", -1, "expected a positive integer, got -1"),
    ("metrics.log_freq", 0, "expected a positive integer, got 0"),
    ("checkpoint.interval", 0, "expected a positive integer, got 0"),
    ("checkpoint.keep_latest_k", -1, "expected an integer >= 0, got -1"),
    ("checkpoint.load_step", -1, "expected an integer >= 0, got -1"),
    ("checkpoint.keep_latest_k", BIG, "expected an integer config.toml can hold"),
    ("debug.max_steps", 0, "expected a positive integer, got 0"),
    ("debug.seed", BIG, "expected an integer config.toml can hold"),
    ("debug.seed", 1.0, "expected int or None, got float 1.0"),
    ("comm.trace_buf_size", -1, "expected an integer >= 0, got -1"),
    ("comm.init_timeout_seconds", 0, "expected a positive integer, got 0"),
    # a timeout beyond what datetime.timedelta holds: was OverflowError blamed on the comm plugin
    ("comm.init_timeout_seconds", 10**14, "is beyond the longest timeout torch takes"),
    ("comm.train_timeout_seconds", 10**14, "is beyond the longest timeout torch takes"),
    # floats: NaN, inf, -inf, bools, strings, out of range, ints beyond float range
    ("training.lr", NAN, "expected a finite number, got nan"),
    ("training.lr", -INF, "expected a finite number, got -inf"),
    ("training.lr", 0, "expected a positive integer, got 0"),
    ("training.lr", -1e-3, "expected a positive number, got -0.001"),
    ("training.lr", True, "expected float, got bool True"),
    ("training.lr", "1e-3", "expected float, got str '1e-3'"),
    ("training.lr", HUGE, "expected a number within float range, got an integer of 401 digits"),
    ("training.weight_decay", HUGE, "expected a number within float range"),
    ("training.eps", HUGE, "expected a number within float range"),
    ("training.max_norm", HUGE, "expected a number within float range"),
    ("metrics.peak_tflops", HUGE, "expected a number within float range"),
    ("debug.init_full_model_max_gib", HUGE, "expected a number within float range"),
    ("training.weight_decay", NAN, "expected a finite number, got nan"),
    ("training.eps", 0.0, "expected a positive number, got 0.0"),
    ("training.eps", 1e-300, "is below float32's smallest normal number"),
    ("training.max_norm", INF, "0 (or any value <= 0) turns gradient clipping off"),
    ("training.max_norm", -INF, "expected a finite number, got -inf"),
    ("training.decay_ratio", 1.5, "expected a value in [0, 1], got 1.5"),
    ("training.decay_ratio", NAN, "expected a value in [0, 1], got nan"),
    ("training.min_lr_factor", INF, "expected a value in [0, 1], got inf"),
    ("training.beta1", NAN, "expected a value in [0, 1), got nan"),
    ("training.beta2", 1, "expected a value in [0, 1), got 1"),
    ("metrics.peak_tflops", 0.0, "expected a positive number, got 0.0"),
    ("metrics.peak_tflops", INF, "expected a finite number, got inf"),
    ("debug.init_full_model_max_gib", -1.0, "expected a number >= 0, got -1.0"),
    ("debug.init_full_model_max_gib", NAN, "expected a finite number, got nan"),
    # bools: numbers and strings are no bools
    ("checkpoint.enable", 1, "expected bool, got int 1"),
    ("validation.enable", "true", "expected bool, got str 'true'"),
    ("debug.deterministic", None, "expected bool, got None"),
    # Literal choices: case matters, as TOML's strings do
    ("training.dtype", "BFLOAT16", "expected one of float32, bfloat16, got 'BFLOAT16'"),
    ("training.device", "CPU", "expected one of auto, cpu, cuda, got 'CPU'"),
    ("training.single_device_mixed_precision", "FSDP", "expected one of fsdp, autocast, got 'FSDP'"),
    ("parallelism.fsdp_reshard_after_forward", True, "expected one of default, always, never, got True"),
    ("debug.fake_tensors", "", "expected one of auto, on, off, got ''"),
    # paths: blank, '~', None where not optional
    ("job.dump_folder", "", "'' is empty"),
    ("job.dump_folder", "~/runs", "starts with '~'"),
    ("job.dump_folder", None, "expected str, got None"),
    ("data.path", " ", "' ' is empty"),
    ("checkpoint.initial_load_path", "", "leave it unset (None) to train from the freshly"),
    ("checkpoint.folder", ".", "names job.dump_folder itself"),
    ("metrics.save_tb_folder", "", "'' is empty"),
    # names looked up among plugins' records: blank was "unknown model ''" without the field, or
    # (validation.dataset) taken as unset, validating on data.dataset without a word
    ("model.name", "", "'' is empty (what an unset variable gives); give a model name"),
    ("model.flavor", " ", "' ' is empty (what an unset variable gives); give a flavor"),
    ("data.dataset", "", "'' is empty (what an unset variable gives); give a dataset name"),
    ("validation.dataset", "", "leave it unset (None) to validate on data.dataset"),
    ("comm.backend", " ", "' ' is empty (what an unset variable gives); give a comm backend name"),
    ("checkpoint.backend", "", "'' is empty (what an unset variable gives); give a checkpointer name"),
    (
        "parallelism.pp_schedule",
        "",
        "'' is empty (what an unset variable gives); give a pipeline schedule name",
    ),
    ("model.name", None, "expected str, got None"),
    # tables and their entries
    ("model.overrides", [("dim", 64)], "expected a table (dict), got list"),
    ("model.overrides", {"dim": None}, ".dim: expected int or float or bool or str, got None"),
    ("model.overrides", {"dim": [64]}, ".dim: expected int or float or bool or str, got list [64]"),
    ("model.overrides", {1: 64}, "key 1: expected str, got int 1"),
]


@pytest.mark.parametrize(("path", "value", "expected"), REFUSED_WHERE_SET, ids=lambda v: repr(v)[:30])
def test_a_bad_value_is_refused_where_it_is_set_naming_the_field(
    path: str, value: object, expected: str
) -> None:
    config = TrainerConfig()
    with pytest.raises(ConfigError) as caught:
        _set(config, path, value)
    assert len(caught.value.problems) == 1
    problem = caught.value.problems[0]
    assert problem.startswith(path), problem
    assert expected in problem, problem


# Combinations that make no sense: refused when the recipe returns, naming the field to change.
REFUSED_TOGETHER = [
    ({"training.local_batch_size": 4, "training.global_batch_size": 6}, "training.global_batch_size: 6"),
    ({"training.lr": 20.0, "training.weight_decay": 0.1}, "training.weight_decay: 0.1 x training.lr 20"),
    ({"training.lr": 1e38, "training.beta1": 0.9}, "training.lr: 1e+38 is too large"),
    ({"checkpoint.load_only": True}, "checkpoint.load_only: has no effect"),
    ({"checkpoint.load_step": 0}, "checkpoint.load_step: has no effect"),
    ({"checkpoint.enable": True, "checkpoint.folder": "../outputs"}, "checkpoint.folder: '../outputs'"),
    ({"debug.deterministic_warn_only": True}, "debug.deterministic_warn_only: has no effect"),
    ({"parallelism.pp_microbatches": 4}, "parallelism.pp_microbatches: 4 does nothing"),
    ({"parallelism.pp_stages_per_rank": 2}, "parallelism.pp_stages_per_rank: 2 does nothing"),
]


@pytest.mark.parametrize(("values", "expected"), REFUSED_TOGETHER, ids=lambda v: str(v)[:40])
def test_a_combination_that_makes_no_sense_is_refused_naming_the_field(
    values: dict[str, object], expected: str
) -> None:
    config = TrainerConfig()
    config.job.dump_folder = "./outputs"
    for path, value in values.items():
        _set(config, path, value)
    with pytest.raises(ConfigError) as caught:
        validate(config)
    assert any(p.startswith(expected) for p in caught.value.problems), caught.value.problems


# Boundary values that mean something: kept as given (no rounding, no bool taken as a number).
ACCEPTED = [
    ("training.steps", 2**63 - 1),
    ("training.warmup_steps", 0),
    ("training.seq_len", 1),
    ("training.global_batch_size", None),
    ("training.lr", 1),  # an int where a float goes: a number
    ("training.lr", 1e-12),
    ("training.weight_decay", 0.0),
    ("training.decay_ratio", 0.0),
    ("training.decay_ratio", 1.0),
    ("training.min_lr_factor", 0.0),
    ("training.min_lr_factor", 1.0),
    ("training.beta1", 0.0),
    ("training.eps", 1.2e-38),
    ("training.max_norm", 0.0),
    ("training.max_norm", -1.0),  # <= 0: no clipping
    ("training.dtype", "bfloat16"),
    ("data.shuffle_buffer", 0),
    ("data.prefetch", 0),
    ("parallelism.dp_shard", -1),
    ("comm.trace_buf_size", 0),
    ("comm.init_timeout_seconds", 86400 * 365),
    ("checkpoint.keep_latest_k", 0),
    ("checkpoint.backend", "DCP"),  # record names are looked up case-insensitively
    ("debug.seed", -(2**63)),
    ("debug.seed", 2**63 - 1),
    ("debug.init_full_model_max_gib", 0.0),
    ("validation.dataset", None),
    ("job.description", ""),
    ("model.overrides", {}),
]


@pytest.mark.parametrize(("path", "value"), ACCEPTED, ids=lambda v: repr(v)[:30])
def test_a_boundary_value_that_means_something_is_kept_as_given(path: str, value: object) -> None:
    config = TrainerConfig()
    _set(config, path, value)
    validate(config)
    section, name = path.split(".")
    kept = getattr(getattr(config, section), name)
    assert kept == value and type(kept) is type(value)


def test_a_float_beyond_float_range_is_one_cli_error_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lr = 10**400`` (an int Python holds, no float does) was ``recipe 'r' raised
    OverflowError: int too large to convert to float``, naming no field."""
    from titan_core.cli import main

    (tmp_path / "overflow_recipes.py").write_text(
        "from titan_core.config import TrainerConfig\n\n"
        "def r():\n    c = TrainerConfig()\n    c.training.lr = 10**400\n    return c\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "overflow_recipes", raising=False)
    assert main(["run", "--module", "overflow_recipes", "--recipe", "r", "--print-config"]) == 2
    line = error_line(capsys)
    assert "training.lr: expected a number within float range" in line, line


def test_boundary_values_together_train_as_they_mean(tmp_path: Path) -> None:
    """One sequence of 1 token, no warm-up or decay (the peak LR every step), no clipping, no
    shuffle or prefetch, 3 microbatches accumulated, and ``debug.max_steps`` beyond the steps:
    2 steps at training.lr, finite losses."""
    from titan_core._registry import get_registry
    from titan_core.trainer import train

    config = tiny_llama3(tmp_path, steps=2)
    t = config.training
    t.seq_len, t.warmup_steps, t.decay_ratio, t.max_norm = 1, 0, 0.0, 0.0
    t.local_batch_size, t.global_batch_size = 2, 6
    config.data.shuffle_buffer, config.data.prefetch = 0, 0
    config.debug.max_steps = 50
    config.metrics.log_freq = 1
    rows = list(train(validate(config), get_registry()))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([t.lr, t.lr])


@pytest.mark.parametrize(
    ("field", "value"),
    [("model.name", "FSDP"), ("data.dataset", "txt"), ("validation.dataset", "held_out")],
)
def test_an_unknown_record_name_is_one_cli_error_naming_the_field(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    field: str,
    value: str,
) -> None:
    """``unknown model 'FSDP'`` did not say which setting held the name (``checkpoint.backend``'s
    error did)."""
    from titan_core.cli import main

    (tmp_path / "unknown_name_recipes.py").write_text(
        "from titan_core.config import TrainerConfig\n\n"
        f"def r():\n    c = TrainerConfig()\n    c.validation.enable = True\n    c.{field} = {value!r}\n"
        "    return c\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unknown_name_recipes", raising=False)
    assert main(["run", "--module", "unknown_name_recipes", "--recipe", "r", "--print-config"]) == 2
    first = capsys.readouterr().err.splitlines()[0]  # the next line says where plugins are listed
    assert first.startswith(f"titan: error: unknown {field} {value!r}; known: "), first
