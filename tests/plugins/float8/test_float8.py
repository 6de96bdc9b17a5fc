"""The float8 strategy on CPU with emulation: conversion, the filter, training, config, refusals."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.config import ConfigError
from titan_core.errors import UsageError
from titan_core.trainer import Trainer

torchao_float8 = pytest.importorskip("torchao.float8")


def float8_config(tmp_path: Path, **overrides: Any) -> Any:
    return tiny_config(
        **{
            "job.dump_folder": str(tmp_path),
            "float8.enable": True,
            "float8.emulate": True,
            "training.steps": 8,
            **overrides,
        }
    )


def train(config: Any) -> tuple[Trainer, list[float]]:
    trainer = Trainer(config, get_registry())
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return trainer, [row["loss"] for row in history]


def float8_names(trainer: Trainer) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {n for n, m in trainer.parts[0].named_modules() if isinstance(m, Float8Linear)}


def test_linear_layers_become_float8_except_the_output_and_training_converges(tmp_path: Path) -> None:
    from torch import nn

    trainer, losses = train(float8_config(tmp_path))
    model = trainer.parts[0]
    converted = float8_names(trainer)
    blocks = [f"layers.{i}" for i in range(len(model.layers))]
    projections = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    projections += ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert converted == {f"{b}.{p}" for b in blocks for p in projections}
    # The default filter keeps the output projection in high precision.
    assert type(model.output) is nn.Linear and model.output.weight.dtype.is_floating_point
    assert trainer.ctx.applied[0] == "float8"  # before every other strategy
    assert set(trainer.ctx.state["float8"]["converted"]) == converted
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5


def test_float8_losses_follow_the_high_precision_run(tmp_path: Path) -> None:
    """Same seed and data: float8 casts perturb each step a little, not the trajectory."""
    _, plain = train(float8_config(tmp_path / "plain", **{"float8.enable": False, "training.steps": 5}))
    _, f8 = train(float8_config(tmp_path / "f8", **{"training.steps": 5}))
    assert f8 != plain  # the float8 casts did happen
    assert f8 == pytest.approx(plain, rel=0.05)


def test_filter_fqns_keeps_the_named_layers_in_high_precision(tmp_path: Path) -> None:
    config = float8_config(tmp_path, **{"float8.filter_fqns": "output, feed_forward", "training.steps": 1})
    trainer, _ = train(config)
    converted = float8_names(trainer)
    assert converted and all(".attention." in name for name in converted)


def test_rowwise_recipe_with_selective_checkpointing(tmp_path: Path) -> None:
    config = float8_config(
        tmp_path,
        **{"float8.recipe": "rowwise", "activation_checkpoint.mode": "selective", "training.steps": 4},
    )
    trainer, losses = train(config)
    assert trainer.ctx.applied[:2] == ["float8", "activation_checkpoint"]
    # The checkpoint wrapper wraps blocks whose linears were converted first.
    assert any("_checkpoint_wrapped_module" in name for name in float8_names(trainer))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_the_section_is_off_by_default_and_validates_its_fields() -> None:
    config = tiny_config()
    assert config.float8.enable is False and config.float8.filter_fqns == "output"
    with pytest.raises(ConfigError, match=r"float8\.recipe: expected one of tensorwise, rowwise"):
        config.float8.recipe = "columnwise"
    with pytest.raises(ConfigError, match=r"float8\.filter_fqns: expected comma-separated"):
        config.float8.filter_fqns = "output,,router"
    with pytest.raises(ConfigError, match=r"float8\.emulate: expected bool"):
        config.float8.emulate = "yes"


def _refusal(config: Any) -> str:
    with pytest.raises(UsageError) as info:
        Trainer(config, get_registry())
    message = str(info.value)
    assert "\n" not in message
    return message


def test_cpu_without_emulation_is_refused_with_what_to_change(tmp_path: Path) -> None:
    message = _refusal(float8_config(tmp_path, **{"float8.emulate": False}))
    assert message.startswith("float8.enable: the run computes on cpu")
    assert "float8.emulate = True" in message


def test_a_missing_torchao_is_refused_with_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails: ModuleNotFoundError
    message = _refusal(float8_config(tmp_path))
    assert message.startswith("float8.enable: torchao's float8 training could not be imported")
    assert "pip install" in message


def test_a_filter_that_leaves_nothing_to_convert_is_refused(tmp_path: Path) -> None:
    message = _refusal(float8_config(tmp_path, **{"float8.filter_fqns": "layers,output"}))
    assert message.startswith("float8.filter_fqns: no linear layer of the model was converted")


def test_a_filter_name_that_matches_no_linear_is_refused_naming_the_linears(tmp_path: Path) -> None:
    """``outptu`` converted the output projection it meant to keep, and the log said it was kept."""
    message = _refusal(float8_config(tmp_path, **{"float8.filter_fqns": "outptu", "training.steps": 1}))
    assert message.startswith("float8.filter_fqns: 'outptu' is part of no linear layer's name")
    assert "the model's linears: layers.0.attention.wq" in message and "correct the name" in message


def test_a_float8_setting_without_float8_enable_is_refused() -> None:
    from titan_core.config import ConfigError, TrainerConfig, validate

    config = TrainerConfig()
    config.float8.emulate = True  # does nothing: float8 is off
    with pytest.raises(ConfigError, match=r"float8.emulate: True does nothing with float8.enable = False"):
        validate(config, source="r")
    config.float8.enable = True
    validate(config, source="r")


@pytest.mark.parametrize(
    ("filter_fqns", "warned"), [("feed_forward", True), ("", True), ("output,feed_forward", False)]
)
def test_a_filter_that_leaves_out_output_says_the_final_projection_is_converted(
    tmp_path: Path, filter_fqns: str, warned: bool
) -> None:
    """``filter_fqns = 'feed_forward'`` (meant as "also keep the FFN") replaces the default
    ``output``: the final projection was converted to float8, and the log only counted it among the
    converted layers."""
    from structlog.testing import capture_logs

    config = float8_config(tmp_path, **{"float8.filter_fqns": filter_fqns, "training.steps": 1})
    with capture_logs() as logs:
        trainer = Trainer(config, get_registry())
    trainer.close()
    warnings = [e for e in logs if e["log_level"] == "warning" and "final projection" in e["event"]]
    if not warned:
        assert warnings == []
        return
    (warning,) = warnings
    assert warning["converted"] == ["output"]
    assert "float8.filter_fqns" in warning["reason"] and "output" in warning["reason"]


def test_float8_on_cpu_without_emulation_is_one_error_line_from_titan_run(tmp_path: Path) -> None:
    """torchao's import printed a torch deprecation warning (``register_constant() on Enum
    subclasses``) before titan's error line, and before every float8 run's first log line."""
    import subprocess

    from tests.parallel_harness import REPO, child_env, write_recipe_module

    module = write_recipe_module(
        tmp_path, {"float8.enable": True, "training.steps": 1, "job.dump_folder": str(tmp_path / "out")}
    )
    result = subprocess.run(
        [sys.executable, "-m", "titan_core.train", "--module", module, "--recipe", "layout"],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "titan: error: float8.enable: the run computes on cpu, which has no float8 matmul; train on a "
        "CUDA GPU of compute capability 8.9+ (H100, H200), set float8.emulate = True (float8 numerics "
        "in high precision, no speed-up), or set float8.enable = False"
    ]


def test_a_models_high_precision_modules_stay_out_of_float8(tmp_path: Path) -> None:
    """An MoE router's gate (dim -> 16 experts, aligned) was converted by the default filter:
    top-k expert choices from float8 scores, without a word (torchtitan keeps the router in
    high precision). Its model declares it (``ModelSpec.high_precision_modules``); whatever
    float8.filter_fqns says, it stays an nn.Linear, and the run says which layers the model kept."""
    from torch import nn

    config = float8_config(
        tmp_path,
        **{
            "model.name": "moe",
            "model.flavor": "qwen3_debugmodel",
            "model.overrides": {
                "dim": 64,
                "n_layers": 2,
                "n_experts": 16,
                "top_k": 2,
                "expert_hidden_dim": 32,
            },
            "float8.filter_fqns": "output",
            "training.steps": 2,
        },
    )
    trainer, losses = train(config)
    model = trainer.parts[0]
    gates = [m for n, m in model.named_modules() if n.endswith("router.gate")]
    assert gates and all(type(m) is nn.Linear for m in gates)
    converted = float8_names(trainer)
    assert converted and not any("router" in name for name in converted)
    assert all(math.isfinite(x) for x in losses)
    assert "router.gate" in (tmp_path / "train.log").read_text()  # named as kept by the model


@pytest.mark.parametrize(
    ("fields", "start"),
    [
        ({"float8.emulate": False}, "float8.enable: the run computes on cpu, which has no float8 matmul"),
        (
            {"float8.filter_fqns": "layers,output"},
            "float8.filter_fqns: no linear layer of the model was converted",
        ),
        ({"float8.filter_fqns": "outptu"}, "float8.filter_fqns: 'outptu' is part of no linear layer's name"),
    ],
    ids=["cpu-without-emulation", "filter-keeps-everything", "filter-typo"],
)
def test_a_refused_float8_setting_is_refused_by_the_layout_check_before_launch(
    tmp_path: Path, fields: dict[str, Any], start: str
) -> None:
    """The strategy refused these in ``apply`` only, in every torchrun worker: under
    ``NGPU=2 ./run_train.sh`` the run ended with torchrun's ChildFailedError report and exit 1,
    where the layout check (``Strategy.check``, run before torchrun starts) gives one line, exit 2."""
    from titan_core.layout import check_layout
    from titan_core.parallel_dims import ParallelDims

    config = float8_config(tmp_path, **{"parallelism.dp_shard": 2, "training.local_batch_size": 2, **fields})
    with pytest.raises(UsageError) as info:
        check_layout(config, get_registry(), ParallelDims(1, 2, 1, 1, 1, 1, 2))
    assert str(info.value).startswith(start), str(info.value)
    assert "\n" not in str(info.value)


def test_an_accepted_float8_layout_passes_the_layout_check(tmp_path: Path) -> None:
    from titan_core.layout import check_layout
    from titan_core.parallel_dims import ParallelDims

    config = float8_config(tmp_path, **{"parallelism.dp_shard": 2, "training.local_batch_size": 2})
    layout = check_layout(config, get_registry(), ParallelDims(1, 2, 1, 1, 1, 1, 2))
    assert layout.strategies[0].name == "float8"
