"""Benchmark recipes: the shapes the torchtitan peer kit runs (../shared/peer), in titan's terms.

All use vocab 2048, bf16, selective activation checkpointing, AdamW lr 3e-4 with 5 warm-up
steps, document masking (block-causal attention over the packed documents), one log line per
step. Run with ``--module bench.recipes`` from the repository root.

The data and tokenizer are the peer kit's when ``bench/perf.sh`` sets ``TITAN_BENCH_DATA`` (a
``.jsonl`` file from ``.peer/make_data.py``) and ``TITAN_BENCH_TOKENIZER`` (torchtitan's test
tokenizer, 2048 tokens); without them the bundled corpus and tokenizer.
``TITAN_BENCH_DOCUMENT_MASK=0`` turns document masking off (plain causal attention).
``TITAN_BENCH_PROFILE_STEP=N`` runs N + 1 steps and writes a torch.profiler trace of step N
(``bench/trace_summary.py`` reads it). For the per-optimisation table (``bench/perf.sh ablate``):
``TITAN_BENCH_STEPS`` changes the step count, ``TITAN_BENCH_PREFETCH`` sets ``data.prefetch``
(0: each batch prepared inside the step), ``TITAN_BENCH_LOG_FREQ`` sets ``metrics.log_freq``,
``TITAN_BENCH_AC`` sets ``activation_checkpoint.mode`` (default ``selective``) and
``TITAN_BENCH_MEMORY_BUDGET`` its ``memory_budget``, ``TITAN_BENCH_MIXED_PRECISION``
``training.single_device_mixed_precision`` (``fsdp`` or ``autocast``; for ``bench/perf.sh recompute``),
``TITAN_BENCH_RESHARD`` ``parallelism.fsdp_reshard_after_forward`` (``default``, ``always``, ``never``),
``TITAN_BENCH_FUSE_W13`` the model's ``fuse_w13`` (``0`` or ``1``).

``bench_8b_l8_compile_float8`` and ``..._float8_rowwise`` are ``bench_8b_l8_compile`` with
torchao's float8 linear layers (``float8.enable``, the output projection kept in bf16): titan
only (the float8 strategy needs the torchao wheel in ``.whl``, which ``bench/perf.sh`` installs).
"""

from __future__ import annotations

import os
from typing import Any

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
# Llama-3.1-8B's layer shape with 8 layers, the SwiGLU gate and up projections as one matmul
# (``fuse_w13``): here the weights and optimizer state are most of the memory, and the selective
# ``op`` policy then recomputes only ``wo``, not ``wo`` and ``w3``, for 5 GiB more reserved, still
# under torchtitan's peak (docs/performance.md). The 1B shape keeps them apart: its activations
# are half its memory, and fused it would reserve 36.7 GiB against torchtitan's 33.1.
SHAPE_8B_L8 = {"n_layers": 8, "vocab_size": 2048, "fuse_w13": True}

#: name -> (flavor, overrides, seq_len, batch, steps, compiled): the peer kit's four runs.
CONFIGS: dict[str, tuple[str, dict[str, Any], int, int, int, bool]] = {
    "bench_debugmodel": ("debugmodel", {}, 2048, 8, 30, False),
    "bench_1b": ("8B", SHAPE_1B, 4096, 8, 30, False),
    "bench_1b_compile": ("8B", SHAPE_1B, 4096, 8, 30, True),
    "bench_8b_l8_compile": ("8B", SHAPE_8B_L8, 8192, 4, 20, True),
}

#: float8 config -> (the bf16 config it is measured against, torchao scaling recipe).
FLOAT8: dict[str, tuple[str, str]] = {
    "bench_8b_l8_compile_float8": ("bench_8b_l8_compile", "tensorwise"),
    "bench_8b_l8_compile_float8_rowwise": ("bench_8b_l8_compile", "rowwise"),
}
CONFIGS.update({name: CONFIGS[base] for name, (base, _) in FLOAT8.items()})


def bos_id(tokenizer_path: str | None) -> int:
    """The BOS id the data loader frames documents with (the document mask's boundary)."""
    from titan_core.data.loader import load_tokenizer

    bos = load_tokenizer(tokenizer_path).bos_id
    if bos is None:
        raise SystemExit(f"bench: tokenizer {tokenizer_path or 'bundled'} has no BOS token")
    return bos


def document_masking(tokenizer_path: str | None) -> dict[str, Any]:
    """Model overrides of document masking; ``TITAN_BENCH_DOCUMENT_MASK=0`` measures without it."""
    if os.environ.get("TITAN_BENCH_DOCUMENT_MASK", "1") == "0":
        return {"document_mask": False}
    return {"document_mask": True, "bos_id": bos_id(tokenizer_path)}


def fusion_overrides() -> dict[str, Any]:
    """``TITAN_BENCH_FUSE_W13=0/1``: the model's ``fuse_w13`` (unset: the config's own)."""
    value = os.environ.get("TITAN_BENCH_FUSE_W13")
    return {} if value is None else {"fuse_w13": value == "1"}


def _bench(name: str) -> TrainerConfig:
    flavor, overrides, seq_len, batch, steps, compiled = CONFIGS[name]
    data, tokenizer = os.environ.get("TITAN_BENCH_DATA"), os.environ.get("TITAN_BENCH_TOKENIZER")
    config = llama3_debugmodel()
    config.model.flavor = flavor
    config.model.overrides = {**overrides, **document_masking(tokenizer)}
    config.model.overrides.update(fusion_overrides())
    config.job.dump_folder = f"./outputs/bench/{name}"
    if data:
        config.data.dataset = "text"
        config.data.path = data
    config.data.tokenizer_path = tokenizer
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.lr = 3e-4
    config.training.warmup_steps = 5
    config.training.dtype = "bfloat16"
    config.compile.enable = compiled
    config.metrics.enable_tensorboard = False
    env = os.environ.get
    config.training.steps = int(env("TITAN_BENCH_STEPS", steps))
    if name == "bench_debugmodel":
        # The peer kit runs torchtitan's own llama3_debugmodel settings here: lr 8e-4, 2 warm-up
        # steps, round(0.8 x steps) steps decaying linearly to 0 (torchtitan's decay_ratio counts
        # all steps, titan's those after warm-up). At the 3e-4 of the other shapes titan's debug
        # run ended at loss 3.55 against torchtitan's 2.59: other settings, not other training.
        t = config.training
        t.lr, t.warmup_steps, t.min_lr_factor = 8e-4, 2, 0.0
        t.decay_ratio = min(round(0.8 * t.steps) / max(t.steps - t.warmup_steps, 1), 1.0)
    config.data.prefetch = int(env("TITAN_BENCH_PREFETCH", config.data.prefetch))
    config.metrics.log_freq = int(env("TITAN_BENCH_LOG_FREQ", 1))
    config.activation_checkpoint.mode = env("TITAN_BENCH_AC", "selective")  # type: ignore[assignment]
    ac, t = config.activation_checkpoint, config.training
    if ac.mode == "memory_budget":  # the other modes refuse a budget they would not read
        ac.memory_budget = float(env("TITAN_BENCH_MEMORY_BUDGET", ac.memory_budget))
    t.single_device_mixed_precision = env("TITAN_BENCH_MIXED_PRECISION", t.single_device_mixed_precision)  # type: ignore[assignment]
    config.parallelism.fsdp_reshard_after_forward = env("TITAN_BENCH_RESHARD", "default")  # type: ignore[assignment]
    profile_step = int(env("TITAN_BENCH_PROFILE_STEP", "0"))
    if profile_step:
        config.training.steps = profile_step + 1
        config.profiler.enable_profiling = True
        config.profiler.profile_freq = profile_step
    if name in FLOAT8:
        config.float8.enable = True
        config.float8.recipe = FLOAT8[name][1]
    return config


def bench_debugmodel() -> TrainerConfig:
    """Debug model, seq 2048 x batch 8."""
    return _bench("bench_debugmodel")


def bench_1b() -> TrainerConfig:
    """1B shape, seq 4096 x batch 8, eager."""
    return _bench("bench_1b")


def bench_1b_compile() -> TrainerConfig:
    """1B shape, seq 4096 x batch 8, torch.compile per block."""
    return _bench("bench_1b_compile")


def bench_8b_l8_compile() -> TrainerConfig:
    """8B layer shape with 8 layers, seq 8192 x batch 4, torch.compile per block."""
    return _bench("bench_8b_l8_compile")


def bench_8b_l8_compile_float8() -> TrainerConfig:
    """``bench_8b_l8_compile`` with float8 linear layers, tensorwise scaling (torchao)."""
    return _bench("bench_8b_l8_compile_float8")


def bench_8b_l8_compile_float8_rowwise() -> TrainerConfig:
    """``bench_8b_l8_compile`` with float8 linear layers, rowwise scaling (torchao)."""
    return _bench("bench_8b_l8_compile_float8_rowwise")
