"""Llama 3 recipes: plain functions returning titan's config. Copy one into your own module and
change what you need (``titan run --module my_project.recipes --recipe my_recipe``).

Document masking (``model.overrides.document_mask``: a token attends only within its own packed
document; the trainer fills ``bos_id`` from the tokenizer) is on in ``llama3_70b`` and
``llama3_405b``. It works with every layout except context parallel (``flavors.validate``
refuses ``parallelism.cp > 1``); pipeline stages after the first get each microbatch's token ids
from the pipeline strategy. ``llama3_debugmodel`` and ``llama3_8b`` keep plain causal attention.
The debug model's documented losses and CPU timings were measured that way. So were the memory
figures of the layouts built on ``llama3_8b`` (``docs/debugging.md``). With the mask, the
one-step fake diagnostic of ``llama3_8b`` on CUDA spends 136 s in its step on an H200, because
flex attention compiles first. Turn it on with ``config.model.overrides["document_mask"] = True``.
"""

from __future__ import annotations

from titan_core.config import TrainerConfig


def _llama3(flavor: str) -> TrainerConfig:
    config = TrainerConfig()
    config.model.name = "llama3"
    config.model.flavor = flavor
    return config


def llama3_debugmodel() -> TrainerConfig:
    """Llama 3 debug model (dim 256, 6 layers) on the bundled corpus; trains in ~1 min on a CPU."""
    config = _llama3("debugmodel")
    config.job.dump_folder = "./outputs/llama3_debugmodel"
    config.training.steps = 30
    config.training.local_batch_size = 8
    config.training.seq_len = 256
    config.training.lr = 3e-3
    config.training.warmup_steps = 3
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = True
    config.debug.seed = 0
    return config


def _large(flavor: str, lr: float) -> TrainerConfig:
    config = _llama3(flavor)
    config.job.dump_folder = f"./outputs/llama3_{flavor.lower()}"
    config.training.steps = 1000
    config.training.local_batch_size = 1
    config.training.seq_len = 8192
    config.training.lr = lr
    config.training.warmup_steps = 200
    config.training.dtype = "bfloat16"
    config.activation_checkpoint.mode = "selective"
    config.metrics.log_freq = 10
    config.checkpoint.interval = 500
    return config


def llama3_8b() -> TrainerConfig:
    """Llama 3.1 8B, FSDP over all ranks, bf16, selective activation checkpointing."""
    return _large("8B", 3e-4)


def _document_masked(config: TrainerConfig) -> TrainerConfig:
    """Block-causal attention over the packed documents (``bos_id`` comes from the tokenizer)."""
    config.model.overrides = {**config.model.overrides, "document_mask": True}
    return config


def llama3_70b() -> TrainerConfig:
    """Llama 3.1 70B, FSDP with TP 8, bf16, full activation checkpointing, document masking."""
    config = _large("70B", 1.5e-4)
    config.parallelism.tp = 8
    config.activation_checkpoint.mode = "full"
    return _document_masked(config)


def llama3_405b() -> TrainerConfig:
    """Llama 3.1 405B, FSDP with TP 8, bf16, full activation checkpointing, document masking."""
    config = _large("405B", 8e-5)
    config.parallelism.tp = 8
    config.activation_checkpoint.mode = "full"
    return _document_masked(config)
