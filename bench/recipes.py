"""Benchmark recipes: the shapes the torchtitan peer kit runs (../shared/peer), in titan's terms.

All use vocab 2048, bf16, selective activation checkpointing, AdamW lr 3e-4 with 5 warm-up
steps, one log line per step. Run with ``--module bench.recipes`` from the repository root.
"""

from __future__ import annotations

from titan_core.config import TrainerConfig
from titan_plugins_llama3.recipes import llama3_debugmodel

# Llama-3.2-1B's layer shape (dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192).
SHAPE_1B = {
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "multiple_of": 1024,
    "ffn_dim_multiplier": 1.5,
    "vocab_size": 2048,
}
# Llama-3.1-8B's layer shape with 8 layers.
SHAPE_8B_L8 = {"n_layers": 8, "vocab_size": 2048}


def _bench(flavor: str, overrides: dict, seq_len: int, batch: int, steps: int = 30) -> TrainerConfig:
    config = llama3_debugmodel()
    config.model.flavor = flavor
    config.model.overrides = dict(overrides)
    config.job.dump_folder = "./outputs/bench"
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.steps = steps
    config.training.lr = 3e-4
    config.training.warmup_steps = 5
    config.training.dtype = "bfloat16"
    config.activation_checkpoint.mode = "selective"
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    return config


def bench_debugmodel() -> TrainerConfig:
    """Debug model, seq 2048 x batch 8."""
    return _bench("debugmodel", {}, 2048, 8)


def bench_1b() -> TrainerConfig:
    """1B shape, seq 4096 x batch 8, eager."""
    return _bench("8B", SHAPE_1B, 4096, 8)


def bench_1b_compile() -> TrainerConfig:
    """1B shape, seq 4096 x batch 8, torch.compile per block."""
    config = bench_1b()
    config.compile.enable = True
    return config


def bench_8b_l8_compile() -> TrainerConfig:
    """8B layer shape with 8 layers, seq 8192 x batch 4, torch.compile per block."""
    config = _bench("8B", SHAPE_8B_L8, 8192, 4, steps=20)
    config.compile.enable = True
    return config
