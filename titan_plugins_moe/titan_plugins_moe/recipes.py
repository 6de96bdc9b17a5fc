"""MoE recipes: plain functions returning titan's config (copy one to change it)."""

from __future__ import annotations

from titan_core.config import TrainerConfig


def moe_debugmodel() -> TrainerConfig:
    """MoE debug model (dim 256, 6 layers, 8 experts top-2 + shared) on the bundled corpus."""
    config = TrainerConfig()
    config.model.name = "moe"
    config.model.flavor = "debugmodel"
    config.job.dump_folder = "./outputs/moe_debugmodel"
    config.training.steps = 30
    config.training.local_batch_size = 8
    config.training.seq_len = 256
    config.training.lr = 3e-3
    config.training.warmup_steps = 3
    config.metrics.log_freq = 1
    config.debug.seed = 0
    return config
