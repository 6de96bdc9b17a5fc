"""Every debug flavor trains through titan's trainer with a falling loss; router statistics reach
the log rows and TensorBoard; the specs pass titan's model-plugin checks (init, counts, TP plan)."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_core._registry import get_registry
from titan_core.config import TrainerConfig
from titan_core.testing import check_model_spec
from titan_core.trainer import train
from titan_plugins_moe import recipes
from titan_plugins_moe.flavors import FLAVORS

DEBUG_FLAVORS = sorted(f for f in FLAVORS if "debugmodel" in f)


def small(config: TrainerConfig, tmp_path: Path, steps: int = 12) -> TrainerConfig:
    config.job.dump_folder = str(tmp_path)
    config.training.steps = steps
    config.training.warmup_steps = 2
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.device = "cpu"
    config.data.bundled_documents = 300
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    return config


@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
def test_debug_flavor_passes_the_model_checks(flavor: str) -> None:
    (spec,) = [s for s in get_registry().records("models").values() if s.name == "moe"]
    check_model_spec(spec, flavor, overrides={"dim": 64, "n_layers": 3, "vocab_size": 256})


@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
def test_debug_flavor_trains_with_a_falling_loss(flavor: str, tmp_path: Path) -> None:
    config = small(recipes.moe_debugmodel(), tmp_path)
    config.model.flavor = flavor
    config.model.overrides = {"dim": 128, "n_layers": 3}
    config.moe.bias_update_rate = 0.001
    config.moe.aux_loss_weight = 0.001
    rows = train(config, get_registry())
    losses = [r["loss"] for r in rows]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert all(r["moe/imbalance_max"] >= 1.0 for r in rows)
    assert all(r["moe/aux_loss"] > 0 for r in rows)


def test_router_statistics_reach_the_log_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = small(recipes.deepseek_v3_debugmodel(), tmp_path, steps=4)
    config.metrics.log_freq = 2
    config.metrics.enable_tensorboard = True
    rows = train(config, get_registry())
    assert [r["step"] for r in rows] == [1, 2, 4]
    moe_layers = [i for i in range(FLAVORS["deepseek_v3_debugmodel"].n_layers) if i >= 1]
    for row in rows:
        for i in moe_layers:
            assert row[f"moe/layer{i}/imbalance"] >= 1.0
            assert 0 <= row[f"moe/layer{i}/tokens_min"] <= row[f"moe/layer{i}/tokens_max"]
        assert row["moe/expert_bias_absmax"] > 0  # the bias moved (rate 0.001 per step)
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("moe/imbalance_max", "moe/layer1/imbalance", "moe/aux_loss", "train/loss"):
        assert tag in tags, tags
    assert [e.step for e in acc.Scalars("moe/layer3/tokens_max")] == [1, 2, 4]


def test_activation_checkpointing_changes_neither_losses_nor_statistics(tmp_path: Path) -> None:
    """Recomputed forwards are not counted twice: the bias update and the statistics agree."""
    runs = {}
    for mode in ("none", "full"):
        config = small(recipes.deepseek_v3_debugmodel(), tmp_path / mode, steps=4)
        config.activation_checkpoint.mode = mode
        runs[mode] = train(config, get_registry())
    for plain, recomputed in zip(runs["none"], runs["full"], strict=True):
        assert recomputed["loss"] == pytest.approx(plain["loss"], rel=1e-5)
        for key in ("moe/layer1/tokens_max", "moe/layer3/tokens_min", "moe/expert_bias_absmax"):
            assert recomputed[key] == plain[key], key


def test_gradient_accumulation_matches_one_large_batch_with_balancing_and_mtp(tmp_path: Path) -> None:
    """Two microbatches of 2 train like one batch of 4: the balance loss and the MTP term are
    scaled like the language-model loss, the bias update and statistics count every microbatch."""
    runs = {}
    for name, local, global_batch in (("big", 4, None), ("accumulated", 2, 4)):
        config = small(recipes.deepseek_v3_debugmodel(), tmp_path / name, steps=3)
        config.model.overrides = {"dim": 64, "n_layers": 3, "n_mtp_layers": 1}
        config.moe.bias_update_rate = 0.01
        config.moe.aux_loss_weight = 0.1
        config.training.local_batch_size = local
        config.training.global_batch_size = global_batch
        runs[name] = train(config, get_registry())
    keys = ("loss", "grad_norm", "moe/aux_loss", "moe/mtp_loss", "moe/layer2/tokens_max")
    keys += ("moe/layer1/tokens_min", "moe/expert_bias_absmax")
    for key in keys:
        got, want = [r[key] for r in runs["accumulated"]], [r[key] for r in runs["big"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), key
