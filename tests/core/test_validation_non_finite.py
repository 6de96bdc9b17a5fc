"""A validation loss that is NaN or inf while the training loss is finite: it was logged and
written to metrics.jsonl without a word (Megatron stops on a NaN forward loss in evaluation too;
torchtitan logs it). The run goes on (training is sound, and fine-tuning on odd validation data
may be meant), with one warning per such validation naming the step, the value and the two
likely causes: the validation data, or the model diverging in eval mode."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import LogWarnings, plugin_module, record_warnings, tiny_llama3
from titan_core import Strategy
from titan_core import trainer as trainer_module
from titan_core._registry import Registry
from titan_core.trainer import train


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> LogWarnings:
    return record_warnings(monkeypatch, trainer_module)


def _eval_mode_gives(value: float) -> Registry:
    """A strategy making the model's eval-mode forward diverge (a module that behaves otherwise
    in eval mode) so that the loss is ``value``: NaN logits, or logits of -inf but for token 0
    (every other target infinitely unlikely). Training (train mode) is untouched."""

    def spoil(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if module.training:
            return None
        if math.isnan(value):
            return torch.full_like(output, math.nan)
        spoilt = torch.full_like(output, -math.inf)
        spoilt[..., 0] = 0.0
        return spoilt

    def apply(parts: list[torch.nn.Module], ctx: object) -> list[torch.nn.Module]:
        for part in parts:
            part.register_forward_hook(spoil)
        return parts

    registry = Registry().load_entry_points()
    strategy = Strategy("eval_diverges", 70, lambda config, dims: True, apply)
    registry.register(plugin_module("eval_plugin", titan_strategies=[strategy]), "eval_plugin")
    return registry


def _config(tmp_path: Path) -> Any:
    config = tiny_llama3(tmp_path, steps=4)
    config.validation.enable = True
    config.validation.freq = 2
    config.validation.steps = 1
    return config


def _non_finite(warnings: LogWarnings) -> list[tuple[str, dict[str, Any]]]:
    return [(e, f) for e, f in warnings.records if "validation loss is not finite" in e]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_validation_loss_is_a_warning_naming_the_step_and_the_likely_causes(
    tmp_path: Path, warnings: LogWarnings, value: float
) -> None:
    rows = train(_config(tmp_path), _eval_mode_gives(value))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # training goes on: its loss is finite
    assert all(math.isfinite(r["loss"]) for r in rows)
    validated = [r for r in rows if "validation/loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    assert all(not math.isfinite(r["validation/loss"]) for r in validated)  # recorded as it is
    # inf's perplexity is inf, not e^700 (a finite number no model gives)
    assert all(not math.isfinite(r["validation/perplexity"]) for r in validated)
    found = _non_finite(warnings)
    assert [f["step"] for _, f in found] == [2, 4]
    event = found[0][0]
    assert event.startswith(f"validation loss is not finite ({value}) at step 2, while the training loss is")
    assert "validation.path" in event and "validation.dataset" in event  # the data
    assert "eval mode" in event  # the model's eval-mode forward


def test_a_finite_validation_loss_draws_no_warning(tmp_path: Path, warnings: LogWarnings) -> None:
    from titan_core._registry import get_registry

    rows = train(_config(tmp_path), get_registry())
    assert all(math.isfinite(r["validation/loss"]) for r in rows if "validation/loss" in r)
    assert _non_finite(warnings) == []
