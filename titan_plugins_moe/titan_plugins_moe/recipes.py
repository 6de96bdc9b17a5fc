"""MoE recipes: plain functions returning titan's config (copy one to change it).

The debug recipes train on a CPU in about a minute; the real ones give the published shapes
with the balancing their authors used and a parallel layout sized for H100/H200-class GPUs.
"""

from __future__ import annotations

from titan_core.config import TrainerConfig


def _debug(flavor: str, folder: str) -> TrainerConfig:
    config = TrainerConfig()
    config.model.name = "moe"
    config.model.flavor = flavor
    config.job.dump_folder = f"./outputs/{folder}"
    config.training.steps = 30
    config.training.local_batch_size = 8
    config.training.seq_len = 256
    config.training.lr = 3e-3
    config.training.warmup_steps = 3
    config.metrics.log_freq = 1
    config.debug.seed = 0
    return config


def moe_debugmodel() -> TrainerConfig:
    """MoE debug model (dim 256, 6 layers, 8 experts top-2 + shared) on the bundled corpus."""
    return _debug("debugmodel", "moe_debugmodel")


def qwen3_moe_debugmodel() -> TrainerConfig:
    """Qwen3-MoE architecture at debug size (q/k norm, 8 experts top-2), sequence-wise balance loss."""
    config = _debug("qwen3_debugmodel", "qwen3_moe_debugmodel")
    config.moe.aux_loss_weight = 0.001
    return config


def deepseek_v3_debugmodel() -> TrainerConfig:
    """DeepSeek-V3 architecture at debug size (MLA, group-limited sigmoid routing), both balancings."""
    config = _debug("deepseek_v3_debugmodel", "deepseek_v3_debugmodel")
    config.moe.bias_update_rate = 0.001
    config.moe.aux_loss_weight = 0.0001
    return config


def _large(flavor: str, lr: float, warmup: int) -> TrainerConfig:
    config = TrainerConfig()
    config.model.name = "moe"
    config.model.flavor = flavor
    config.job.dump_folder = f"./outputs/{flavor}"
    config.training.steps = 1000
    config.training.seq_len = 4096
    config.training.lr = lr
    config.training.warmup_steps = warmup
    config.training.dtype = "bfloat16"
    config.activation_checkpoint.mode = "full"
    config.metrics.log_freq = 10
    config.checkpoint.interval = 500
    return config


def qwen3_30b_a3b() -> TrainerConfig:
    """Qwen3-30B-A3B on 8 GPUs: EP 8 (16 experts per GPU) inside FSDP 8, bf16, full AC."""
    config = _large("qwen3_30b_a3b", 3e-4, 200)
    config.training.local_batch_size = 2
    config.parallelism.ep = 8
    config.moe.aux_loss_weight = 0.001  # Qwen's router_aux_loss_coef
    return config


def deepseek_v2_lite() -> TrainerConfig:
    """DeepSeek-V2-Lite (15.7B) on 8 GPUs: EP 8 inside FSDP 8, bf16, full AC, balance loss 0.001."""
    config = _large("deepseek_v2_lite", 4.2e-4, 200)
    config.training.local_batch_size = 2
    config.parallelism.ep = 8
    config.moe.aux_loss_weight = 0.001
    return config


def deepseek_v3_671b() -> TrainerConfig:
    """DeepSeek-V3 671B on 512 GPUs: PP 8 x FSDP 64 with EP 64, bf16, full AC, DeepSeek's balancing."""
    # DeepSeek warmed up over 2,000 steps of a far longer run; within this recipe's 1,000 steps
    # the LR must reach its peak and decay, so the warm-up is the other large recipes' 200.
    config = _large("deepseek_v3_671b", 2.2e-4, 200)
    config.training.local_batch_size = 8
    config.parallelism.pp = 8
    config.parallelism.ep = 64
    config.parallelism.pp_microbatches = 8
    config.moe.bias_update_rate = 0.001
    config.moe.aux_loss_weight = 0.0001
    return config


RECIPES = [
    moe_debugmodel,
    qwen3_moe_debugmodel,
    deepseek_v3_debugmodel,
    qwen3_30b_a3b,
    deepseek_v2_lite,
    deepseek_v3_671b,
]
