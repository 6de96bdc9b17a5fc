"""The trainer: build everything from the config and plugins, then run the loop.

Build order (docs/architecture.md): comm backend -> parallel dims and mesh -> model on meta ->
strategies -> materialise and init -> optimizer, schedule, data -> checkpoint load. The loop
calls no hooks: the profiler and checkpointer plugins are built before it, and it calls only their
methods.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_core._registry import Registry
from titan_core.config import TrainerConfig
from titan_core.data.loader import PackedBatches, load_tokenizer
from titan_core.errors import PluginError, TitanError, UsageError
from titan_core.log import get_logger, setup_logging
from titan_core.memory_report import MemoryReport, local_shard
from titan_core.metrics import MetricsLogger
from titan_core.parallel_dims import ParallelDims
from titan_core.parallelize import (
    ParallelContext,
    apply_strategies,
    required_strategies,
    select_strategies,
)
from titan_core.topology import Topology

log = get_logger("titan.trainer")

#: Optional plugin kinds the trainer builds, and the package of this repository providing them.
_PROVIDERS = {"profilers": "titan_plugins_profiler", "checkpointers": "titan_plugins_dcp"}


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def lr_lambda(config: TrainerConfig) -> Any:
    """Linear warm-up, constant, then linear decay to ``min_lr_factor`` over ``decay_ratio``."""
    t = config.training
    warmup = t.warmup_steps
    decay_steps = round((t.steps - warmup) * t.decay_ratio)
    decay_start = t.steps - decay_steps

    def factor(step: int) -> float:  # LambdaLR's step counts from 0
        step += 1
        if step <= warmup:
            return step / (warmup + 1)
        if step <= decay_start or decay_steps == 0:
            return 1.0
        progress = (step - decay_start) / decay_steps
        return 1.0 - (1.0 - t.min_lr_factor) * progress

    return factor


def set_determinism(config: TrainerConfig, seed: int) -> None:
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=config.debug.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, config: TrainerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.step = 0

        # 1. Who we are: the comm backend builds the topology; degrees are checked right away.
        backend = registry.get("comm_backends", config.comm.backend, what="comm backend")
        self.topology: Topology = backend.init(config)
        setup_logging(rank=self.topology.rank)
        self.parallel_dims = ParallelDims.from_config(config.parallelism, self.topology.world_size)
        # On under the fake backends or debug.memory_report; else a stand-in that does nothing.
        self.memory_report = MemoryReport.maybe(config, self.topology, self.parallel_dims)
        self.device = self.topology.device
        self.seed = config.debug.seed if config.debug.seed is not None else 0
        set_determinism(config, self.seed)

        # 2. Plugins this run needs, resolved before anything heavy is built.
        self.spec = registry.get("models", config.model.name, what="model")
        try:
            self.model_args = self.spec.flavor(config.model.flavor, config.model.overrides)
        except LookupError as exc:
            field = "model.overrides" if config.model.flavor in self.spec.flavors else "model.flavor"
            raise UsageError(f"{field}: {exc}") from None
        strategies = registry.records("strategies")
        missing = [n for n in required_strategies(config, self.parallel_dims) if n not in strategies]
        if missing:
            raise PluginError(
                f"this run needs the strategies {', '.join(missing)} (from the parallel degrees "
                f"{self.parallel_dims.degrees()} and the recipe), which no installed plugin "
                "provides; install titan-plugins-parallel (pip install -e plugins/titan_plugins_parallel)"
            )
        dataset = registry.get("datasets", config.data.dataset, what="dataset")
        # A wrong data.path should fail now, not once the model is built: read one document.
        if next(iter(dataset.documents(config.data)), None) is None:
            raise UsageError(f"data.dataset = {config.data.dataset!r} yields no documents; check data.path")
        p, c = config.profiler, config.checkpoint
        self.profiler: Any = _NoProfiler()
        if p.enable_profiling or p.enable_memory_snapshot:
            self.profiler = self._optional_plugin("profilers", "profiler").build(config, self.topology)
        self.checkpointer: Any = None
        if c.enable or c.create_seed_checkpoint:
            record = self._optional_plugin("checkpointers", "checkpoint")
            self.checkpointer = record.build(config, self.topology)
        self.tokenizer = load_tokenizer(config.data.tokenizer_path)
        vocab = getattr(self.model_args, "vocab_size", None)
        if vocab is not None and self.tokenizer.vocab_size > vocab:
            raise UsageError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model "
                f"{config.model.name}/{config.model.flavor} has a vocabulary of {vocab}; use a "
                "flavor with a larger vocabulary or a smaller tokenizer (data.tokenizer_path)"
            )

        # 3. Mesh, model on meta, strategies in their declared order.
        self.mesh = self.parallel_dims.build_mesh(self.device.type) if self.topology.world_size > 1 else None
        with torch.device("meta"):
            model = self.spec.build(self.model_args)
        self.ctx = ParallelContext(
            config, self.parallel_dims, self.mesh, self.spec, self.model_args, self.topology
        )
        self.parts: list[nn.Module] = apply_strategies(
            model, select_strategies(strategies, config, self.parallel_dims), self.ctx
        )

        # 4. Materialise this rank's shards and initialise them (PP stages get their own seed).
        pp_rank = self._coordinate("pp")
        torch.manual_seed(self.seed + pp_rank)
        for part in self.parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights(buffer_device=self.device)
            part.train()
        torch.manual_seed(self.seed)
        if config.checkpoint.initial_load_path:
            from titan_core.initial_weights import load_full_state_dict

            load_full_state_dict(self.parts, config.checkpoint.initial_load_path)

        # 5. Optimizer, schedule, data.
        t = config.training
        params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            weight_decay=t.weight_decay,
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        dp_rank = self._coordinate("dp_replicate") * self.parallel_dims.dp_shard + self._coordinate(
            "dp_shard"
        )
        self.batches = PackedBatches(
            documents=lambda: dataset.documents(config.data),
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            batch_size=t.local_batch_size,
            dp_rank=dp_rank,
            dp_degree=self.parallel_dims.dp,
            seed=self.seed,
            shuffle_buffer=config.data.shuffle_buffer,
        )
        if self.checkpointer is not None and not c.create_seed_checkpoint:
            self.step = self.checkpointer.load(self.parts, self.optimizer, self.scheduler)
            self.profiler.step_num = self.step  # trace folders carry the global step
        self.pipeline = (
            self.ctx.build_pipeline(self.parts, cross_entropy_loss)
            if self.ctx.build_pipeline is not None
            else None
        )
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if t.dtype == "bfloat16" and not self.ctx.mixed_precision_applied
            else nullcontext()
        )
        tokens = t.local_batch_size * t.seq_len
        self.metrics = MetricsLogger(
            config,
            self.device,
            self.spec.flops_per_token(self.model_args, t.seq_len),
            tokens // self.parallel_dims.cp,  # tokens this device processes per step
            write=self._is_logging_rank(),
        )
        if self._is_logging_rank():
            from titan_core.config import render

            os.makedirs(config.job.dump_folder, exist_ok=True)
            with open(os.path.join(config.job.dump_folder, "config.toml"), "w") as f:
                f.write(render(config))
        n_params = sum(local_shard(p).numel() for part in self.parts for p in part.parameters())
        log.info(
            "built",
            recipe=config.recipe,
            model=f"{config.model.name}/{config.model.flavor}",
            params_total=self.spec.num_params(self.model_args, True),
            params_local=n_params,
            degrees=self.parallel_dims.degrees(),
            strategies=self.ctx.applied,
            device=str(self.device),
            comm_backend=config.comm.backend,
        )

    # -- helpers -----------------------------------------------------------------------------------

    def _optional_plugin(self, kind: str, section: str) -> Any:
        """The record named by ``<section>.backend``; if missing, say which distribution has it."""
        name = getattr(self.config, section).backend
        try:
            return self.registry.get(kind, name, what=section)
        except TitanError as exc:
            package = _PROVIDERS[kind]
            raise PluginError(
                f"{section}.backend = {name!r}: {exc}\ntitan's own {kind} come from "
                f"{package.replace('_', '-')}; install it with pip install -e plugins/{package}"
            ) from None

    def _coordinate(self, dim: str) -> int:
        if dim == "pp" and self.topology.pp_rank is not None:
            return self.topology.pp_rank
        return self.parallel_dims.coordinates(self.topology.rank)[dim]

    def _is_logging_rank(self) -> bool:
        """The rank whose loss is meaningful: the first DP/TP/CP coordinate of the last stage.

        The last stage is where the schedule put it (the last PP rank, or rank 0 of a V schedule).
        """
        coords = self.parallel_dims.coordinates(self.topology.rank)
        return self.ctx.has_last_stage and all(v == 0 for k, v in coords.items() if k != "pp")

    def _loss_context(self) -> Any:
        if self.ctx.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    # -- one step ------------------------------------------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Loss of this step (``None`` on pipeline ranks without the last stage)."""
        kwargs: dict[str, Any] = {}
        if self.ctx.shard_batch is not None:
            inputs, labels, kwargs = self.ctx.shard_batch(inputs, labels)
        if self.pipeline is not None:
            return self.pipeline.step(inputs, labels, kwargs)
        with self._loss_context():
            with self.autocast:
                logits = self.parts[0](inputs, **kwargs)
            loss = cross_entropy_loss(logits, labels)
            loss.backward()
        return loss.detach()

    def clip_gradients(self) -> torch.Tensor:
        from titan_core.grad_norm import clip_grad_norm

        return clip_grad_norm(self.parts, self.config.training.max_norm, self.ctx)

    def train(self) -> list[dict[str, float]]:
        config = self.config
        steps = config.training.steps
        if config.debug.max_steps is not None:
            steps = min(steps, config.debug.max_steps)
        if config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed(self.parts)
            return []
        batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(self.batches)
        for _ in range(self.step):  # resumed: skip the batches the restored steps consumed
            next(batches)
        log.info("training starts", steps=steps, first_step=self.step + 1, dump_folder=config.job.dump_folder)
        with self.profiler:
            self._run_steps(batches, steps)
        self.metrics.close()
        log.info("training completed", steps=steps)
        return self.metrics.history

    def _run_steps(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        first = self.step + 1
        report = self.memory_report
        report.start(self.parts, self.optimizer, steps)
        for self.step in range(first, steps + 1):
            inputs, labels = next(batches)
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            report.before_forward_backward(self.step)
            loss = self.forward_backward(inputs, labels)
            report.after_forward_backward(self.step)
            grad_norm = self.clip_gradients()
            self.optimizer.step()
            report.after_optimizer_step(self.step)
            self.scheduler.step()
            self.metrics.step_done(self.step, *self._reduce_for_log(loss, grad_norm))
            if self.checkpointer is not None:
                last = self.step == steps
                self.checkpointer.save(self.step, self.parts, self.optimizer, self.scheduler, last=last)
            self.profiler.step()
            if self.step == first and self.topology.after_first_step is not None:
                self.topology.after_first_step(self.mesh)

    def _reduce_for_log(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> tuple[Any, Any]:
        """Loss averaged over the data-parallel ranks (only on steps that log)."""
        if self.step % self.config.metrics.log_freq and self.step != 1:
            return None, None
        from titan_core.grad_norm import mean_over_dp

        if loss is not None:
            loss = mean_over_dp(loss, self.ctx)
        value = None if loss is None else float(loss)
        return value, float(grad_norm)

    def close(self, *, completed: bool = False) -> None:
        self.topology.shutdown(completed=completed)


class _NoProfiler(nullcontext):
    """Stands in for the profiler when profiling is off, so the loop has no branch for it."""

    def step(self) -> None:
        pass


def train(config: TrainerConfig, registry: Registry) -> list[dict[str, float]]:
    trainer = Trainer(config, registry)
    completed = False
    try:
        history = trainer.train()
        completed = True
    finally:
        trainer.close(completed=completed)
    # Under the fake backends received activations and reduced values are garbage by design.
    if history and not trainer.topology.fake and not math.isfinite(history[-1].get("loss", 0.0)):
        raise UsageError("the loss diverged (not finite); lower training.lr or check the data")
    return history
