"""Bad values of the ``moe`` section, set in a recipe: each is one ``titan: error:`` naming the
field and what to change (exit 2), or the run does what the value means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.plugins.config_probes import ConfigProbe

PROBES = [
    # (base recipe, {field: expression}, expected error text or None: accepted)
    ("moe", {"moe.bias_update_rate": "-0.001"}, "moe.bias_update_rate: expected a number >= 0"),
    ("moe", {"moe.bias_update_rate": "nan"}, "moe.bias_update_rate: expected a finite number"),
    ("moe", {"moe.bias_update_rate": "inf"}, "moe.bias_update_rate: expected a finite number"),
    ("moe", {"moe.bias_update_rate": "True"}, "moe.bias_update_rate: expected float, got bool"),
    ("moe", {"moe.bias_update_rate": "'0.001'"}, "moe.bias_update_rate: expected float, got str"),
    ("moe", {"moe.bias_update_rate": "None"}, "moe.bias_update_rate: expected float, got None"),
    ("moe", {"moe.bias_update_rate": "10**400"}, "moe.bias_update_rate: "),
    # Fixed: 0 in the float32 bias (balancing silently off), inf there (the bias NaN, exit 0).
    ("moe", {"moe.bias_update_rate": "1e-320"}, "moe.bias_update_rate: 1e-320 is below float32's smallest"),
    ("moe", {"moe.bias_update_rate": "1e300"}, "moe.bias_update_rate: 1e+300 is beyond float32's largest"),
    # Fixed: within float32, but the bias would pass its range within training.steps (30).
    ("moe", {"moe.bias_update_rate": "1e37"}, "moe.bias_update_rate: 1e+37 moves each expert bias"),
    ("moe", {"moe.bias_update_rate": "0"}, None),
    ("moe", {"moe.bias_update_rate": "1"}, None),
    ("moe", {"moe.bias_update_rate": "0.001"}, None),
    ("moe", {"moe.aux_loss_weight": "-1"}, "moe.aux_loss_weight: expected a number >= 0"),
    ("moe", {"moe.aux_loss_weight": "nan"}, "moe.aux_loss_weight: expected a finite number"),
    ("moe", {"moe.aux_loss_weight": "-inf"}, "moe.aux_loss_weight: expected a finite number"),
    ("moe", {"moe.aux_loss_weight": "False"}, "moe.aux_loss_weight: expected float, got bool"),
    # Fixed: 0 in the float32 loss (moe/aux_loss 0.0); inf there (a "divergence" blaming the LR).
    ("moe", {"moe.aux_loss_weight": "1e-320"}, "moe.aux_loss_weight: 1e-320 is below float32's smallest"),
    ("moe", {"moe.aux_loss_weight": "1e300"}, "moe.aux_loss_weight: 1e+300 is beyond float32's largest"),
    ("moe", {"moe.aux_loss_weight": "1e-4"}, None),
    ("moe", {"moe.router_stats": "'Summary'"}, "moe.router_stats: expected one of off, summary, per_layer"),
    ("moe", {"moe.router_stats": "'per-layer'"}, "moe.router_stats: expected one of off, summary, per_layer"),
    ("moe", {"moe.router_stats": "''"}, "moe.router_stats: expected one of"),
    ("moe", {"moe.router_stats": "None"}, "moe.router_stats: expected one of"),
    ("moe", {"moe.router_stats": "False"}, "moe.router_stats: expected one of"),
    ("moe", {"moe.router_stats": "'summary'"}, None),
    ("llama3", {"moe.bias_update_rate": "0.001"}, "moe.bias_update_rate: set to 0.001, but model.name"),
    ("llama3", {"moe.aux_loss_weight": "0.001"}, "moe.aux_loss_weight: set to 0.001, but model.name"),
    # Fixed: router statistics for a model without routers were accepted and did nothing.
    ("llama3", {"moe.router_stats": "'summary'"}, "moe.router_stats: 'summary' does nothing with model.name"),
    ("llama3", {"moe.router_stats": "'off'"}, "moe.router_stats: 'off' does nothing with model.name"),
]


@pytest.mark.parametrize(("base", "settings", "expected"), PROBES, ids=lambda v: str(v)[:60])
def test_a_moe_value(
    base: str, settings: dict[str, str], expected: str | None, config_probe: ConfigProbe
) -> None:
    config_probe(settings, expected, base)


def test_the_largest_bias_rate_accepted_keeps_the_bias_finite(tmp_path: Path) -> None:
    """At the edge of the overflow check (2 * rate * steps just below float32's largest), the
    bias stays finite over the run: the check refuses no rate the bias can hold."""
    from titan_core._registry import get_registry
    from titan_core.trainer import train
    from titan_plugins_moe import recipes

    config = recipes.moe_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 2}
    config.job.dump_folder = str(tmp_path)
    config.training.steps = 2
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.warmup_steps = 1
    config.data.bundled_documents = 200
    config.metrics.enable_tensorboard = False
    config.moe.bias_update_rate = 3.4e38 / 4 * 0.99
    train(config, get_registry())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    biases = [r["moe/expert_bias_absmax"] for r in rows if "moe/expert_bias_absmax" in r]
    assert biases and all(b is not None and b < 3.5e38 for b in biases), biases
