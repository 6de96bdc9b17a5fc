"""The trainer: build everything from the config and plugins, then run the loop.

Build order (docs/architecture.md): comm backend -> parallel dims -> plugins this run needs and
the model's own checks -> mesh -> model on meta -> strategies -> materialise and init ->
optimizer, schedule, data -> checkpoint load -> callbacks. Plugin dispatch happens here, once:
the loop calls bound methods of the callbacks that implement them and nothing else, and reads
device values only on the steps that log or save.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, nullcontext
from typing import Any

import attrs
import torch
from torch import nn

from titan_core._registry import Registry
from titan_core.callbacks import Callbacks
from titan_core.config import ConfigError, TrainerConfig, optimizer_problems
from titan_core.data.loader import PackedBatches, files_fingerprint, read_documents, same_start
from titan_core.data.prefetch import Prefetcher
from titan_core.errors import (
    PluginError,
    TitanError,
    UsageError,
    call_plugin,
    describe,
    is_out_of_memory,
    write_failure,
)
from titan_core.fake_tensors import ZeroBatches, fake_mode, is_fake, wanted
from titan_core.layout import check_layout
from titan_core.log import attach_file, capture, detach_file, fixed, get_logger, setup_logging
from titan_core.log import file_failure as log_file_failure
from titan_core.metrics import MetricsLogger, check_callback_metrics
from titan_core.parallel_dims import ParallelDims
from titan_core.parallelize import ParallelContext, apply_strategies, cross_entropy_loss
from titan_core.resume import CheckpointSaves, model_changes, restore, resume_record, takes_keyword
from titan_core.run import (
    apply_backend_settings,
    check_launch,
    launched_processes,
    model_figure,
    peer_failure,
    process_rank,
    refuse_unread_env,
)
from titan_core.run_folder import (
    RunFolder,
    RunFolderLock,
    plugin_outputs,
    run_dp,
    tb_location,
)
from titan_core.schedule import WarmupStableDecay
from titan_core.stop_signals import (
    STOPS,
    AgreedStop,
    SigtermStop,
    StopSignals,
    Terminated,
    hold_sigterm_for_the_error_line,
)
from titan_core.tied import retie, shared_parameters
from titan_core.topology import Topology, check_same_config, peer_cause, post_failure
from titan_core.validation import validation_batches

log = get_logger("titan.trainer")

__all__ = [
    "LOG_FILE",
    "PLUGIN_ERROR_FILE",
    "Trainer",
    "cross_entropy_loss",
    "train",
]

#: The logging rank's console-format log, under ``job.dump_folder`` (docs/getting_started.md).
LOG_FILE = "train.log"
#: Where a plugin's failing call leaves its traceback, under ``job.dump_folder`` (rank 0; rank N
#: writes ``plugin_error.rankN.log``). Not one of the run's outputs: a rerun may use the folder.
PLUGIN_ERROR_FILE = "plugin_error.log"


class Diverged(TitanError):
    """The loss or the gradient norm stopped being finite."""

    exit_code = 1


def set_determinism(config: TrainerConfig, seed: int) -> None:
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=config.debug.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if config.debug.deterministic_warn_only:
            log.warning(
                "debug.deterministic_warn_only: non-deterministic operators only warn, so this run "
                "is unfit for numerical validation (titan compare refuses it)"
            )
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, config: TrainerConfig, registry: Registry, *, overwrite: bool = False) -> None:
        """Build the run; ``overwrite`` deletes another run's outputs in the dump folder first."""
        #: Contexts the run stays inside until ``close`` (the fake mode of shape-only steps).
        self._contexts = ExitStack()
        #: The background thread preparing batches while training (``data.prefetch``).
        self.prefetcher: Prefetcher | None = None
        #: Whether the loop ran its last step (what is left is closing the run).
        self.finished = False
        try:
            self._build(config, registry, overwrite)
        except SigtermStop as exc:
            self._abandon()
            if not str(exc):
                exc.args = (
                    f"during the build: nothing was trained or saved; {self._rerun_after_the_build()}",
                )
            raise
        except BaseException:
            # Torchrun's SIGTERM to the other ranks, once one has ended, must not cut this
            # rank's error line off (a Ctrl-C's too), nor the cleanup before it.
            hold_sigterm_for_the_error_line()
            self._abandon()
            raise

    def stopped_outside_the_loop(self, exc: BaseException) -> str:
        """Where a signal raised outside the loop stopped the run, for its line: after the last
        step (a second Ctrl-C while the run closed), or before the first."""
        if self.finished:
            return f"after the last step ({self.step}): the run completed"
        if isinstance(exc, SigtermStop):
            return f"before its first step: nothing was trained or saved; {self._rerun_after_the_build()}"
        return ""  # a Ctrl-C before the first step: nothing happened to say more of

    def _rerun_after_the_build(self) -> str:
        """What the same command does after a build that SIGTERM stopped."""
        resumed = getattr(self, "resumed_from", 0)  # set once a checkpoint is loaded
        if resumed:
            return f"run the same command to resume from the checkpoint of step {resumed}"
        if self.config.checkpoint.enable:  # perhaps stopped while it looked for one
            return (
                "run the same command to start the run (or resume it from its last checkpoint, if it has one)"
            )
        return "run the same command to start the run"

    def _abandon(self) -> None:
        """After a failed build: nothing of it stays behind in this process (the fake mode, the
        prefetch thread, the log file, the dump folder's lock, the process groups), so the next
        run here, e.g. into the same folder once the problem is fixed, starts clean."""
        cleanups = [self._contexts.close]
        if self.prefetcher is not None:
            cleanups.append(self.prefetcher.close)
        cleanups.append(detach_file)
        if getattr(self, "lock", None) is not None:
            cleanups.append(self.lock.release)
        if getattr(self, "topology", None) is not None:
            cleanups.append(lambda: self.topology.shutdown(completed=False))
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as exc:  # the build's own error is the one to report
                log.debug("cleanup after a failed build failed", error=repr(exc))

    def _build(self, config: TrainerConfig, registry: Registry, overwrite: bool) -> None:
        """The build order of the module docstring, one step per method."""
        self.config = config
        self.registry = registry
        self.step = 0
        self.started_at = time.perf_counter()
        self._join()
        strategies, dataset = self._resolve_plugins()
        # The launcher's first process prepares the dump folder: under a backend simulating peers
        # it may hold any logical rank (FAKE_PP_RANK), and logical rank 0 may not be launched.
        first = process_rank(os.environ) == 0
        self.lock = RunFolderLock.take(config, is_writer=first)
        self.run_folder = RunFolder(
            config,
            dp=run_dp(config, registry, self.parallel_dims),
            overwrite=overwrite,
            is_writer=first,
            outputs=plugin_outputs(registry),
            registry=registry,
        )
        if overwrite:  # no process writes before the first one has removed the replaced outputs
            self._wait_for_every_process()
        # The data before the model: data too small for one step (or a validation set too small
        # for one) is refused in seconds, not after the model is built and, on a GPU, compiled.
        self._build_data(dataset)
        self._build_model(strategies)
        self._build_optimizer()
        restore(self)
        if self.step == 0:
            self._load_initial_weights()
        self.run_folder.started(resumed=self.step > 0)
        self._build_step()
        self._open_outputs()
        # Callbacks last, after everything they may look at exists.
        self.callbacks = Callbacks(*self._build_callbacks(), guard=self._guarded_callback)
        t = config.training
        n_params = sum(_local(p).numel() for part in self.parts for p in part.parameters())
        log.info(
            "built",
            recipe=config.recipe,
            model=f"{config.model.name}/{config.model.flavor}",
            params_total=self.params_total,
            params_local=n_params,
            degrees=self.parallel_dims.degrees(),
            global_batch_size=t.local_batch_size * self.parallel_dims.dp * self.accumulation,
            microbatches_per_step=self.accumulation,
            strategies=self.ctx.applied,
            callbacks=self.callback_names,  # as titan plugins list names them
            device=str(self.device),
            comm_backend=config.comm.backend,
        )

    # -- build steps, in order -------------------------------------------------------------------

    def _join(self) -> None:
        """Who we are: the comm backend builds the topology; degrees are checked right away."""
        config, registry = self.config, self.registry
        backend = registry.get("comm_backends", config.comm.backend, what="comm.backend")
        apply_backend_settings(config, registry)  # done by `titan run` already; a Python caller too
        refuse_unread_env(registry, config.comm.backend, os.environ)
        check_launch(config, registry, launched_processes(os.environ))
        # validate() refuses these; a Python caller may have built the config without it, and the
        # optimizer would then fail deep inside torch after the model is built.
        if problems := optimizer_problems(config.training):
            raise ConfigError(problems)
        # Before the topology: no traceback file (whose name has the rank) and no dump folder yet.
        self.topology: Topology = call_plugin(
            lambda: f"{registry.label('comm_backends', backend.name)} failed to start",
            backend.init,
            config,
            passes=lambda exc: peer_failure(exc, config) is not None,  # reported as the others
        )
        if not isinstance(self.topology, Topology):  # its first use failed deep inside titan
            raise PluginError(
                f"{self.registry.label('comm_backends', backend.name)}: init returned "
                f"{'None' if self.topology is None else 'a ' + type(self.topology).__name__}, not a "
                "titan_core.topology.Topology (CommBackend.init)"
            )
        setup_logging(rank=self.topology.rank)
        capture()  # lines from here on go to <dump_folder>/train.log once it is known who writes it
        if self.topology.world_size > 1 and not self.topology.simulates_peers:
            # Before anything is built or written: ranks running different configs hung, or
            # trained on inconsistently (check_same_config says how).
            check_same_config(config)
        self.parallel_dims = ParallelDims.from_config(config.parallelism, self.topology.world_size)
        self.device = self.topology.device
        self.seed = config.debug.seed if config.debug.seed is not None else 0
        set_determinism(config, self.seed)
        self.steps = config.training.steps
        if config.debug.max_steps is not None:
            self.steps = min(self.steps, config.debug.max_steps)

    def _wait_for_every_process(self) -> None:
        if launched_processes(os.environ) == 1:
            return
        if self.topology.barrier is not None:
            self.topology.barrier()
        else:
            torch.distributed.barrier()

    def _resolve_plugins(self) -> tuple[list[Any], Any]:
        """The plugins this run needs, the model's and the strategies' own checks
        (:func:`check_layout`, as ``run_train.sh``'s check before torchrun), before anything heavy
        is built: a wrong name or value fails here, in seconds. Returns the strategies and the
        dataset."""
        config, registry = self.config, self.registry
        layout = check_layout(config, registry, self.parallel_dims, self._as_plugin)
        self.spec, self.tokenizer, self.model_args = layout.spec, layout.tokenizer, layout.model_args
        self.accumulation = layout.accumulation
        strategies = layout.strategies
        self.fake_tensors = wanted(config.debug.fake_tensors, self.topology, self.spec, self.device)
        dataset = registry.get("datasets", config.data.dataset, what="data.dataset")
        # A wrong data.path should fail now, not once the model is built: read one document.
        # A plugin's exception there is one error naming the dataset and its plugin
        # (read_documents), as every later read's does (the same label).
        #: ``data.dataset 'x' (plugin p, dist 1.0)``: the field and the plugin behind its value.
        self._data_label = "data." + registry.label("datasets", config.data.dataset)
        self._first_document = next(
            read_documents(lambda: dataset.documents(config.data), self._data_label), None
        )
        if self._first_document is None:  # an empty file: too small, named as a small one is
            self._packed(lambda: ()).check_one_step()
        c = config.checkpoint
        self.checkpointer: Any = None
        if c.enable or c.create_seed_checkpoint:
            self.checkpointer = registry.get("checkpointers", c.backend, what="checkpoint.backend").build(
                config, self.topology
            )
        return strategies, dataset

    def _build_model(self, strategies: list[Any]) -> None:
        """Mesh, model on meta, strategies in their declared order (parameter sharing survives
        each), then this rank's shards materialised and initialised as one process would
        (init.py). Shape-only runs (fake_tensors.py) materialise fake tensors and stay fake until
        close."""
        config = self.config
        self.mesh = self.parallel_dims.build_mesh(self.device.type) if self.topology.world_size > 1 else None
        with torch.device("meta"):
            model = self._plugin_call(
                "models", self.spec.name, "failed to build", self.spec.build, self.model_args
            )
        if not isinstance(model, nn.Module):  # a forgotten ``return`` was an AttributeError in tied.py
            raise PluginError(
                f"{self.registry.label('models', self.spec.name)} returned {type(model).__name__} from "
                "build; it must return the model, an nn.Module (built on the meta device)"
            )
        tied = shared_parameters(model)
        # The built model's count (as torchtitan logs it), the spec's compared with it.
        self.params_total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        self._compare_count(int(self._model_figure("num_params", self.model_args, True)))
        self.ctx = ParallelContext(
            config, self.parallel_dims, self.mesh, self.spec, self.model_args, self.topology
        )
        self.parts: list[nn.Module] = apply_strategies(
            model,
            [attrs.evolve(s, apply=self._guarded_apply(s)) for s in strategies],
            self.ctx,
            after_each=lambda parts: retie(parts, tied),
        )
        if self.fake_tensors:
            self._contexts.enter_context(fake_mode())
        for part in self.parts:
            part.to_empty(device=self.device)
        retie(self.parts, tied)
        if self.fake_tensors:
            self.init_mode = "none (fake tensors)"
        else:
            from titan_core.init import initialise

            self.init_mode = initialise(
                self.parts,
                self.spec,
                self.model_args,
                self.seed,
                device=self.device,
                simulated=self.topology.simulates_peers,
                max_full_gib=config.debug.init_full_model_max_gib,
                pp_coordinate=self.parallel_dims.coordinates(self.topology.rank)["pp"],
                world_size=self.topology.world_size,
                label=self.registry.label("models", self.spec.name),
                call=lambda fn, *args: self._plugin_call(
                    "models", self.spec.name, "failed in init_weights", fn, *args
                ),
            )
        for part in self.parts:
            part.train()

    def _load_initial_weights(self) -> None:
        """``checkpoint.initial_load_path`` into the built model, in place (the optimizer, built
        already, holds the same parameters and no state yet). Only a run that resumes nothing
        reads it: a resume replaced those weights, so reading them cost a whole model's load (an
        8B import) and failed the resume once the folder was moved away."""
        path = self.config.checkpoint.initial_load_path
        if path is None:  # a blank one is refused by the config (read as unset, it trained from scratch)
            return
        if self.fake_tensors:
            log.info("fake tensors: checkpoint.initial_load_path is not read (no values to load)")
            return
        from titan_core.initial_weights import load_initial_weights

        self._verify_initial_folder(path)
        load_initial_weights(
            self.parts, path, self.spec, self.model_args, collectives=not self.topology.simulates_peers
        )

    def _verify_initial_folder(self, path: str) -> None:
        """Refuse a checkpoint folder the checkpointer wrote that it cannot vouch for (damaged
        data, an unfinished save, a non-finite loss): a resume skips such a folder, and a run
        starting from it would train on corrupt weights without a word.

        What the path is comes first: a file (a ``.pt`` state dict) is no checkpointer's folder,
        and a run with checkpointing off needs no checkpointer installed to load one (nor a
        Hugging Face folder); only a DCP checkpoint folder, which a checkpointer may have written,
        needs ``checkpoint.backend`` to check it."""
        from titan_core.initial_weights import is_dcp_folder

        if not os.path.isdir(path):
            return  # a file, or nothing there: the loader says what is wrong with it
        backend = self.config.checkpoint.backend
        try:
            record = self.registry.get("checkpointers", backend, what="checkpoint.backend")
        except TitanError as exc:
            if not is_dcp_folder(path):
                return  # a Hugging Face folder (or none the loader can read, which it names)
            raise type(exc)(
                f"checkpoint.initial_load_path: {path!r} is a DCP checkpoint folder, which "
                f"checkpoint.backend {backend!r} checks before it is loaded (an unfinished save, "
                "damaged data or a save after a non-finite loss would otherwise load without a "
                "word); install or enable that checkpointer, or set checkpoint.backend to the one "
                f"that wrote the folder: {exc}"
            ) from None
        if record.verify is None:
            return
        simulated = self.topology.simulates_peers  # a simulated group's collectives return nothing
        world = 1 if simulated else self.topology.world_size
        rank = 0 if simulated else self.topology.rank
        verify = record.verify
        if takes_keyword(verify, "check_meta"):
            verify = functools.partial(
                verify, check_meta=lambda _step, meta: self._compare_initial_model(path, meta)
            )
        why = self._as_plugin(
            lambda: f"the check of {self.registry.label('checkpointers', record.name)}",
            verify,
            path,
            rank,
            world,
        )
        if why is not None:
            raise UsageError(f"checkpoint.initial_load_path: {path!r} cannot be loaded: {why}")

    def _compare_initial_model(self, path: str, meta: Any) -> None:
        """Warn when the folder's recorded model (the ``meta`` its save stored, which
        ``Checkpointer.verify`` hands over through ``check_meta``) is not this run's: another
        ``rope_theta`` or ``norm_eps`` keeps every shape, so the weights load and train as another
        model's without a word (a Hugging Face folder whose config.json differs is refused). A
        warning, not a refusal: fine-tuning under other RoPE settings can be meant, and a change
        of shape is refused by the load already. Compared as a resume compares
        (``resume.model_changes``: resolved arguments, compute-only ones left out)."""
        saved = meta.get("model") if isinstance(meta, Mapping) else None
        if not isinstance(saved, Mapping):  # no record (a seed saved without one, an earlier titan)
            return
        changes = model_changes(self.spec, saved, resume_record(self.config, 0)["model"])
        if changes:
            log.warning(
                f"checkpoint.initial_load_path: {path!r} was saved by another model than this run's "
                f"({'; '.join(changes)}): its weights load (the shapes fit), but they were trained as "
                "the recorded model, and this run computes with its own settings; if that is not "
                "meant, set model.flavor / model.overrides to the checkpoint's"
            )

    def _build_optimizer(self) -> None:
        """AdamW over the parameter groups and the LR schedule."""
        t = self.config.training
        self.optimizer = torch.optim.AdamW(
            self._param_groups(),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            weight_decay=t.weight_decay,
            # One fused kernel per step on CUDA; foreach elsewhere (fused needs CUDA/CPU kernels
            # for every parameter type, which DTensors on CPU meshes lack).
            **({"fused": True} if self.device.type == "cuda" else {"foreach": True}),
        )
        self.schedule = WarmupStableDecay.from_config(t)
        if t.warmup_steps >= t.steps:
            log.warning(
                f"training.warmup_steps={t.warmup_steps} >= training.steps={t.steps}: the learning rate "
                f"never reaches training.lr={t.lr:g} (it ends at {t.lr * self.schedule(t.steps - 1):.3g}) "
                "and never decays; lower warmup_steps below steps"
            )
        elif self.schedule(0) == 0:
            # The decay ends at the floor on the last step; with one step and no warm-up that is
            # the only step, and at min_lr_factor = 0 it trains nothing (AdamW at LR 0).
            log.warning(
                f"training.steps={t.steps} with training.warmup_steps=0 decays to "
                f"training.min_lr_factor={t.min_lr_factor:g} on its only step: it runs at learning "
                "rate 0 and leaves the weights as they are; set warmup_steps >= 1, decay_ratio = 0 "
                "or min_lr_factor > 0"
            )
        # A function, not the schedule object: LambdaLR saves a callable object's attributes in
        # its state dict and a resume would silently bring back the old schedule.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: self.schedule(i))

    def _build_data(self, dataset: Any) -> None:
        """This rank's share of the packed training batches, and the validation batches."""
        config, t = self.config, self.config.training
        #: The training files' count and bytes, once (a checkpoint records them for a resume;
        #: without a checkpointer nothing reads them, so the folder is not listed for them).
        records = dataset.reads_path and self.checkpointer is not None
        self.data_files = files_fingerprint(config.data.path) if records else None
        self.batches: Any
        if self.fake_tensors:  # no values: skip tokenizing the job's stream to find this rank's batch
            self.batches = ZeroBatches(t.local_batch_size, t.seq_len)
        else:
            # Every pass from the document the build read (same_start says why).
            self.batches = self._packed(
                lambda: same_start(
                    dataset.documents(config.data),
                    self._first_document,
                    self._data_label,
                )
            )
            self.batches.check_one_step()
        self.val_batches = validation_batches(self, self.registry) if config.validation.enable else None

    def _packed(self, documents: Callable[[], Iterable[str]]) -> PackedBatches:
        """This rank's packed training batches of ``documents``."""
        config, t = self.config, self.config.training
        coords = self.parallel_dims.coordinates(self.topology.rank)
        return PackedBatches(
            documents=documents,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            batch_size=t.local_batch_size,
            dp_rank=coords["dp_replicate"] * self.parallel_dims.dp_shard + coords["dp_shard"],
            dp_degree=self.parallel_dims.dp,
            seed=self.seed,
            shuffle_buffer=config.data.shuffle_buffer,
            name=self._data_label + (f" at data.path {config.data.path!r}" if config.data.path else ""),
            batches_per_step=self.accumulation,
            batches_needed=self.accumulation,
            steps=self.steps,
        )

    def steps_field(self) -> str:
        """The setting that ends this run: ``debug.max_steps`` when it cuts ``training.steps``."""
        return "debug.max_steps" if self.steps < self.config.training.steps else "training.steps"

    def _build_step(self) -> None:
        """The step function (a strategy may replace it: PP), autocast and the metrics."""
        t = self.config.training
        # Gradient accumulation: each microbatch's loss is divided by their number, so the summed
        # gradients (and the summed losses) are those of the whole batch's mean. Wrapped before the
        # step function is built: a strategy's replacement (PP) gets the scaled loss too.
        self._loss_fn = self.ctx.loss_fn
        if self.accumulation > 1:
            self.ctx.loss_fn = _scaled(self._loss_fn, 1 / self.accumulation)
        self._step_fn = self.ctx.build_step(self.parts, self._forward_backward)
        self.autocast: Any = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if t.dtype == "bfloat16" and not self.ctx.mixed_precision_applied
            else nullcontext()
        )
        tokens = t.local_batch_size * t.seq_len * self.accumulation
        self.metrics = MetricsLogger(
            self.config,
            self.device,
            self._model_figure("flops_per_token", self.model_args, t.seq_len),
            # Tokens per device and step: a DP rank's tokens are shared by its cp x tp x pp
            # devices, each doing that share of their FLOPs (torchtitan's non_data_parallel_size).
            # Divided by cp alone, TP or PP logged tokens/s and MFU tp x pp times too high.
            tokens / self.parallel_dims.non_data_parallel_size,
            total_steps=self.steps,
            throughput=not self.fake_tensors,
        )

    def _open_outputs(self) -> None:
        """The logging rank writes ``config.toml`` and (appending on a resume) ``train.log``."""
        config = self.config
        self.is_logging_rank = self._is_logging_rank()
        # A resume with no step left trains nothing: the folder's run.json and config.toml go on
        # saying what trained its steps, not what this rerun changed.
        records = not (self.step and self.step >= self.steps)
        if records:
            self.run_folder.claim(is_logging_rank=self.is_logging_rank)
        if self.is_logging_rank:
            from titan_core.config import render

            os.makedirs(config.job.dump_folder, exist_ok=True)
            path = os.path.join(config.job.dump_folder, "config.toml")
            try:
                if records:
                    text = render(config)  # rendered first: a failure leaves no empty config.toml
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(text)
                path = os.path.join(config.job.dump_folder, LOG_FILE)
                attach_file(path, append=self.step > 0)
            except OSError as exc:  # a full disk
                raise write_failure(path, exc, what="the run's files") from None
        else:
            detach_file()

    # -- build helpers ---------------------------------------------------------------------------

    def _param_groups(self) -> list[dict[str, Any]]:
        if self.spec.param_groups is None:
            return [{"params": [p for part in self.parts for p in part.parameters() if p.requires_grad]}]
        groups: list[dict[str, Any]] = []
        for part in self.parts:
            found = self._plugin_call(
                "models",
                self.spec.name,
                "failed in param_groups",
                self.spec.param_groups,
                part,
                self.config.training,
            )
            groups += self._checked_groups(part, found)
        return groups

    def _checked_groups(self, part: nn.Module, found: Any) -> list[dict[str, Any]]:
        """``ModelSpec.param_groups``'s groups of ``part``, each of its trainable parameters in
        exactly one: a parameter left out is never updated (AdamW skips it, the run trains on
        without a word), and one named twice fails inside torch's optimizer as a bare traceback."""
        label = f"{self.registry.label('models', self.spec.name)}: ModelSpec.param_groups"
        if not isinstance(found, list) or not all(isinstance(g, dict) and "params" in g for g in found):
            raise PluginError(
                f"{label} returned {type(found).__name__}; it must return a list of dicts with "
                "'params' (torch's parameter groups, e.g. [{'params': [...], 'weight_decay': 0.0}])"
            )
        groups = [{**g, "params": list(g["params"])} for g in found]  # a generator is read once
        names = {id(p): n for n, p in part.named_parameters()}
        seen: dict[int, int] = {}
        for g in groups:
            for p in g["params"]:
                seen[id(p)] = seen.get(id(p), 0) + 1

        def listed(ids: list[int]) -> str:
            shown = ", ".join(names.get(i, "a tensor that is no parameter of the model") for i in ids[:3])
            return shown + (f", and {len(ids) - 3} more" if len(ids) > 3 else "")

        problems = []
        twice = [i for i, count in seen.items() if count > 1]
        if twice:
            problems.append(f"put {len(twice)} parameters in more than one group ({listed(twice)})")
        foreign = [i for i in seen if i not in names]
        if foreign:
            problems.append(
                f"returned {len(foreign)} tensors that are no parameters of this rank's model part"
            )
        missing = [id(p) for p in part.parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            problems.append(
                f"left {len(missing)} trainable parameters out of every group ({listed(missing)}): AdamW "
                "would never update them"
            )
        if problems:
            raise PluginError(
                f"{label} {'; '.join(problems)}; put every parameter in exactly one group (e.g. a group "
                "with 'weight_decay': 0.0 for norms and biases), or set requires_grad=False on those "
                "meant to stay frozen"
            )
        return [g for g in groups if g["params"]]

    def _build_callbacks(self) -> tuple[list[Any], list[str]]:
        """The built callback objects and, in the same order, the labels errors name them by."""
        # every(): a callback name two plugins provide fails the run; records() would drop both.
        records = sorted(self.registry.every("callbacks").values(), key=lambda r: (r.order, r.name))
        built: list[Any] = []
        labels: list[str] = []
        #: The record names of the callbacks this run uses (the ``built`` log line's list).
        self.callback_names: list[str] = []
        for r in records:
            obj = self._plugin_call("callbacks", r.name, "failed to build", r.build, self)
            if obj is not None:
                built.append(obj)
                labels.append(self.registry.label("callbacks", r.name))
                self.callback_names.append(r.name)
        if self.checkpointer is not None:
            built.append(CheckpointSaves(self))
            labels.append(f"the checkpoint saves of checkpoint.backend {self.config.checkpoint.backend!r}")
            self.callback_names.append(f"checkpoint saves ({self.config.checkpoint.backend})")
        return built, labels

    # -- plugin code that fails ------------------------------------------------------------------

    def _plugin_call(self, kind: str, name: str, failed: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, plugin code of the record ``name`` of ``kind`` (:meth:`_as_plugin`)."""
        return self._as_plugin(lambda: f"{self.registry.label(kind, name)} {failed}", fn, *args)

    def _compare_count(self, counted: int) -> None:
        """Warn when the spec's analytic ``num_params`` is not the built model's count:
        ``--print-config``, ``titan models list`` and the initialisation's memory threshold use
        the spec's figure, and a miscount there went on without a word."""
        if counted != self.params_total:
            log.warning(
                f"{self.registry.label('models', self.spec.name)} counts {counted} parameters "
                f"(num_params) but the built model has {self.params_total}: titan models list and "
                "--print-config show the spec's count; fix ModelSpec.num_params (its flops_per_token, "
                "for MFU, likely too)"
            )

    def _model_figure(self, field: str, *args: Any) -> float:
        """The model spec's ``field`` (a count), one error naming the model if it fails or is none."""
        label = lambda: self.registry.label("models", self.spec.name)
        return model_figure(label, field, self._as_plugin, getattr(self.spec, field), *args)

    def _guarded_callback(self, label: str, point: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A callback's method as the loop calls it: its exception becomes one error naming it;
        in ``on_failure`` a warning, since the run is failing already: one that raised there
        replaced the run's own error (and its traceback file), and the later callbacks'
        ``on_failure`` (the profiler's snapshot, the flight recorder's dump) never ran."""
        if point == "on_failure":

            def on_failure(*args: Any) -> None:
                try:
                    fn(*args)
                except Exception as exc:
                    log.warning(
                        f"{label} failed in on_failure; the run's own error follows", reason=describe(exc)
                    )

            return on_failure
        return lambda *args: self._as_plugin(lambda: f"{label} failed in {point}", fn, *args)

    def _as_plugin(self, what: Callable[[], str], fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, plugin code (:func:`~titan_core.errors.call_plugin`): an exception other
        than a :class:`TitanError` (and the allocator's and a failed collective's, which the run
        reports its own way) becomes one :class:`PluginError` starting with ``what()``; the
        original is chained and its traceback written to :data:`PLUGIN_ERROR_FILE`, whose path
        the message gives."""
        return call_plugin(
            what,
            fn,
            *args,
            message=self._plugin_error_message,
            passes=lambda exc: is_out_of_memory(exc) or peer_failure(exc, self.config) is not None,
        )

    def _plugin_error_message(self, message: str, exc: Exception) -> str:
        """``message: the exception's first line``, and where the traceback was kept."""
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        message += f": {type(exc).__name__}: {first[:300]}" if first else f": {type(exc).__name__}"
        where = self._keep_traceback(exc, message)
        message += f"; the traceback is in {where}" if where else " (the traceback is chained to this error)"
        return message

    def _guarded_apply(self, strategy: Any) -> Callable[..., Any]:
        def apply(parts: list[nn.Module], ctx: ParallelContext) -> Any:
            result = self._plugin_call(
                "strategies", strategy.name, "failed to apply", strategy.apply, parts, ctx
            )
            if not isinstance(result, list) or not all(isinstance(p, nn.Module) for p in result):
                raise PluginError(
                    f"{self.registry.label('strategies', strategy.name)} returned "
                    f"{type(result).__name__} from apply; it must return the list of model parts to "
                    "train (nn.Module each), e.g. the parts it was given"
                )
            return result

        return apply

    def _keep_traceback(self, exc: BaseException, message: str) -> str | None:
        """Write ``exc``'s traceback under ``job.dump_folder``; the file's path, or ``None``."""
        rank = self.topology.rank
        name = PLUGIN_ERROR_FILE if rank == 0 else PLUGIN_ERROR_FILE.replace(".log", f".rank{rank}.log")
        path = os.path.join(self.config.job.dump_folder, name)
        try:
            os.makedirs(self.config.job.dump_folder, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}: {message}\n\n")
                f.write("".join(traceback.format_exception(exc)))
        except OSError:
            return None
        return path

    def _is_logging_rank(self) -> bool:
        """The rank whose loss is meaningful: the first DP/TP/CP coordinate of a loss-computing rank."""
        coords = self.parallel_dims.coordinates(self.topology.rank)
        return self.ctx.computes_loss and all(v == 0 for k, v in coords.items() if k != "pp")

    # -- one step ----------------------------------------------------------------------------------

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """The default step function: forward, loss, backward on one model part."""
        with self.autocast:
            logits = self.parts[0](inputs, **kwargs)
        loss = self.ctx.loss_fn(logits, labels)
        loss.backward()
        return loss.detach()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Loss of this step (``None`` on ranks that do not compute it)."""
        kwargs: dict[str, Any] = {}
        for transform in self.ctx.batch_transforms:
            inputs, labels, kwargs = transform(inputs, labels, kwargs)
        with ExitStack() as stack:
            for context in self.ctx.step_contexts:
                stack.enter_context(context())
            return self._step_fn(inputs, labels, kwargs)

    def accumulate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward/backward over this step's microbatches; the summed (already scaled) loss.

        Gradient sync (FSDP2's reduce-scatter, HSDP's all-reduce) is switched off on every
        microbatch but the last, on the parts that support it (``set_requires_gradient_sync``);
        gradients add up locally meanwhile. Pipeline stages manage their own sync per schedule
        step; each microbatch is then one whole schedule step.
        """
        n = self.accumulation
        total: torch.Tensor | None = None
        for i in range(n):
            inputs, labels = next(batches)
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if n > 1:
                self._gradient_sync(i == n - 1)
            loss = self.forward_backward(inputs, labels)
            if loss is not None:
                total = loss if total is None else total + loss
        return total

    def _gradient_sync(self, enabled: bool) -> None:
        for part in self.parts:
            switch = getattr(part, "set_requires_gradient_sync", None)
            if callable(switch):
                switch(enabled)

    def validate(self) -> dict[str, float]:
        """Mean validation loss over ``validation.steps`` global batches and perplexity.

        A forward without gradients: the trainer's own, or the ``evaluate`` of a strategy's
        replacement step (pipeline parallel runs its schedule forward only). A replacement
        without ``evaluate`` has no forward-only path, so its step function runs instead (forward
        and backward) and the gradients are dropped. Buffers (e.g. MoE token counts) are put back
        as they were, so validation leaves no trace on training.
        """
        from titan_core.grad_norm import mean_over_dp

        assert self.val_batches is not None
        # ``!=``, not ``is not``: every ``self._forward_backward`` is a new bound method.
        replaced = self._step_fn != self._forward_backward
        evaluate = getattr(self._step_fn, "evaluate", None) if replaced else None
        buffers = [(b, b.detach().clone()) for part in self.parts for b in part.buffers()]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for part in self.parts:
            part.eval()
        try:
            # A validation step reads one global batch, in the training step's microbatches, so
            # the validation set does not change with the split of the batch (accumulation).
            batches = self.config.validation.steps * self.accumulation
            for inputs, labels in itertools.islice(iter(self.val_batches), batches):
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                if replaced and evaluate is None:
                    loss = self.forward_backward(inputs, labels)
                    self.optimizer.zero_grad(set_to_none=True)
                    if loss is not None:
                        loss = _plain(loss).float() * self.accumulation  # undo the microbatch scaling
                else:
                    with torch.no_grad():
                        loss = self._eval_loss(inputs, labels, evaluate)
                if loss is not None:
                    total += _plain(loss).float()
        finally:
            for part in self.parts:
                part.train()
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        value = float(mean_over_dp(total / batches, self.ctx))
        # exp(700) keeps a huge finite loss from overflowing; an infinite one's perplexity is
        # infinite (e^700 would pass for a figure some model gave). NaN stays NaN.
        perplexity = math.inf if value == math.inf else math.exp(min(value, 700))
        # Full precision, as the training loss: a validation curve is checked against a
        # reference from metrics.jsonl (titan compare); the log line rounds what it shows.
        return {"validation/loss": value, "validation/perplexity": perplexity}

    def _warn_non_finite_validation(self, step: int, value: float) -> None:
        """Warn of a NaN or inf validation loss: logged and written as it is, it went by without
        a word. The training loss of this step was checked finite already (a validating step
        logs, and a logging step is checked), so training is sound and goes on (Megatron stops
        on a NaN evaluation loss; a run that fine-tunes past odd validation data should not lose
        its progress): what differs is the data or the forward in eval mode."""
        if math.isfinite(value):
            return
        log.warning(
            f"validation loss is not finite ({value}) at step {step}, while the training loss is: "
            "the validation data may not be like the training data (validation.path, "
            "validation.dataset: text the model's logits cannot fit), or the model diverges in "
            "eval mode, where training's forward does not (a module behaving otherwise under "
            "model.eval(): dropout, a norm's running statistics, a strategy's evaluate). "
            "Training goes on; validation/loss is recorded as it is",
            step=step,
        )

    def _eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, evaluate: Any = None
    ) -> torch.Tensor | None:
        """One batch's loss, forward only: the trainer's forward, or a replacement's ``evaluate``."""
        kwargs: dict[str, Any] = {}
        for transform in self.ctx.batch_transforms:
            inputs, labels, kwargs = transform(inputs, labels, kwargs)
        with ExitStack() as stack:
            for context in self.ctx.step_contexts:
                stack.enter_context(context())
            if evaluate is not None:
                loss = evaluate(inputs, labels, kwargs)
                # What the step returns: scaled by 1 / microbatches per step, like its loss_fn.
                return None if loss is None else _plain(loss).float() * self.accumulation
            with self.autocast:
                logits = self.parts[0](inputs, **kwargs)
            return self._loss_fn(logits, labels).detach()

    def _validates(self, step: int) -> bool:
        v = self.config.validation
        return (
            self.val_batches is not None
            and not self.topology.simulates_peers  # simulated peers compute no meaningful loss
            and (step % v.freq == 0 or step == self.steps)
        )

    def clip_gradients(self) -> torch.Tensor:
        from titan_core.grad_norm import clip_grad_norm

        return clip_grad_norm(self.parts, self.config.training.max_norm, self.ctx)

    def train(self, signals: StopSignals | None = None) -> list[dict[str, float]]:
        """Train (or write the seed checkpoint); ``signals``: the scope the caller keeps open past
        this call (``train`` closes the run inside it), else one of its own."""
        if signals is None:
            with StopSignals() as signals:
                return self.train(signals)
        if self.config.checkpoint.create_seed_checkpoint:
            save_seed = self.checkpointer.save_seed
            # The model it holds, where the checkpointer records it: a run resuming from the seed
            # (its checkpoint folder) is then refused for another model before reading it.
            takes_meta = takes_keyword(save_seed, "meta")
            save_seed(
                self.parts,
                **({"meta": {"model": resume_record(self.config, 0)["model"]}} if takes_meta else {}),
            )
            return []
        batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(self.batches)
        # Resumed: skip the batches the restored steps consumed.
        for _ in range(self.consumed):
            next(batches)
        # Shape-only runs' zero batches cost nothing to make (and the thread would make them
        # outside the fake mode, which is the training thread's).
        if self.config.data.prefetch and not self.fake_tensors:
            self.prefetcher = Prefetcher(batches, self.config.data.prefetch, pin=self.device.type == "cuda")
            batches = self.prefetcher
        log.info(
            "training starts",
            steps=self.steps,
            first_step=self.step + 1,
            dump_folder=self.config.job.dump_folder,
        )
        cb = self.callbacks
        first = self.step + 1
        training_started = time.perf_counter()
        try:
            for fn in cb.on_train_start:
                fn(self.step)
            self._run_steps(batches, signals)
            self.finished = True
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and not exc.args:  # a second Ctrl-C, at once
                lost = self._after_interrupt(self.step, in_flight=True)
                exc.args = (f"during step {self.step}, at once (a second Ctrl-C){lost}",)
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"titan-phase: {getattr(self, 'phase', 'the start of training')} of step {self.step}"
                )
            log.error("training stopped", step=self.step, reason=f"{type(exc).__name__}: {exc}")
            self._tell_peers(exc)
            for fn in cb.on_failure:
                fn(self.step, exc)
            raise
        for fn in cb.on_train_end:
            fn(self.step)
        log.info("training completed", steps=self.steps)
        self._log_summary(first, time.perf_counter() - training_started)
        return self.metrics.history

    def _tell_peers(self, exc: BaseException) -> None:
        """Post why this process fails for its peers, or note why a peer failed first: the peers
        of a rank that raised failed in their next collective saying only 'a peer died', and
        torchrun (run_train.sh: LOG_RANK=0) showed rank 0's line alone, without the cause."""
        t = self.topology
        if t.world_size == 1 or t.simulates_peers or isinstance(exc, KeyboardInterrupt):
            return
        if peer_failure(exc, self.config) is None:
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            reason = first if isinstance(exc, TitanError) else f"{type(exc).__name__}: {first}"
            post_failure(t.rank, reason)
        elif hasattr(exc, "add_note") and (cause := peer_cause(t.rank, t.world_size)) is not None:
            exc.add_note(f"titan-peer-cause: {cause}")  # peer_failure puts it in the error line

    def _log_summary(self, first: int, training_seconds: float) -> None:
        """The end-of-run block: time, throughput after warm-up, final loss, where outputs are."""
        from titan_core.metrics import _duration

        s = self.metrics.summary()
        c = self.config
        dump = os.path.abspath(c.job.dump_folder)
        warm = " (after the first logged interval)" if s["warmup_excluded"] else ""
        if self.fake_tensors:  # nothing was computed
            shapes_only = "n/a (fake tensors: debug.fake_tensors)"
            figures = {"tokens_per_s": "n/a", "mfu": "n/a", "final_loss": shapes_only}
        else:
            figures = {
                "tokens_per_s": f"{s['tps']:,.0f}{warm}" if s["tps"] else "n/a",
                "mfu": f"{fixed(s['mfu_pct'], 2)}%{warm}"
                if s["mfu_pct"] is not None
                else "n/a (set metrics.peak_tflops for this device)",
                "final_loss": fixed(s["loss"], 5)
                if s["loss"] is not None
                else "n/a (not computed on this rank)"
                if first <= self.steps
                else "n/a (no step ran)",
            }
        files = [LOG_FILE, "metrics.jsonl", "config.toml", "run.json"] if self.is_logging_rank else []
        if c.metrics.enable_tensorboard:
            files.append(c.metrics.save_tb_folder + "/")
        if self.checkpointer is not None and not c.checkpoint.load_only:
            files.append(c.checkpoint.folder + "/")
        # What this rank really wrote (a rank that does not log writes no log, metrics or TensorBoard).
        files = [f for f in files if os.path.exists(os.path.join(dump, f.rstrip("/")))]
        tb = tb_location(dump, c.metrics.save_tb_folder)
        if not c.metrics.enable_tensorboard:
            tensorboard = "off (metrics.enable_tensorboard = True writes it)"
        else:
            tensorboard = f"tensorboard --logdir {tb}" if os.path.isdir(tb) else "not written by this rank"
        log.info(
            "run summary",
            _block=True,
            steps=f"{first}-{self.steps} of {self.steps}"
            if first <= self.steps
            else f"none left: the checkpoint of step {self.step} is the last of "
            f"{self.steps_field()} = {self.steps}",
            wall_time=_duration(time.perf_counter() - self.started_at),
            training_time=_duration(training_seconds),
            **figures,
            outputs=f"{dump} ({', '.join(files)})" if files else dump,
            tensorboard=tensorboard,
        )

    def _run_steps(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], signals: StopSignals) -> None:
        cb = self.callbacks
        first = self.step + 1
        # Device-side: whether every loss and gradient norm so far was finite (read only when the
        # step logs or saves, so steps in between never wait for the device).
        self.first_bad = torch.zeros((), dtype=torch.long, device=self.device)  # 0: none yet
        check_values = not self.topology.simulates_peers
        # Several real processes decide together when a signal stops them (AgreedStop); one
        # process acts on it at once.
        several = self.topology.world_size > 1 and not self.topology.simulates_peers
        agree = AgreedStop(signals) if several else None
        self.metrics.start()  # step time counts from here, not from the build
        for step in range(first, self.steps + 1):
            self.step = step
            self.optimizer.zero_grad(set_to_none=True)
            for fn in cb.before_forward_backward:
                fn(step)
            # What the step is doing (a plain string, for the error a failed collective ends in).
            self.phase = "forward/backward (FSDP gathers and reduce-scatters, TP/CP/EP collectives, PP sends)"
            loss = self.accumulate(batches)
            for fn in cb.after_forward_backward:
                fn(step)
            self.phase = "the gradient-norm all-reduce"
            grad_norm = self.clip_gradients()
            if check_values:
                ok = grad_norm.isfinite() if loss is None else _local(loss).isfinite() & grad_norm.isfinite()
                self.first_bad = torch.where((self.first_bad == 0) & ~ok, step, self.first_bad)
            self.phase = "the optimizer step"
            self.optimizer.step()
            for fn in cb.after_optimizer_step:
                fn(step)
            lr = self.optimizer.param_groups[0]["lr"]  # the LR this step used (a Python float)
            self.scheduler.step()
            last = step == self.steps
            validates = self._validates(step)
            # The last step of a stopped run logs, and so does a step that validates.
            logs = self.metrics.logs(step) or validates
            terminated, interrupted = signals.terminated, signals.interrupted
            if agree is not None:
                self.phase = "the all-reduce of the stop-signal flags"
                terminated, interrupted = agree.step(post=not last)
            self.phase = "the loss all-reduce of the log line"
            logs = logs or terminated or interrupted
            if check_values and (logs or last or terminated or self._saves(step, last)):
                self._check_finite(step)
            row: dict[str, float] = {}
            if logs:
                validation: dict[str, float] = {}
                if validates:
                    with self.metrics.paused():  # not counted in step time and throughput
                        validation = self.validate()
                values = self._reduce_for_log(loss, grad_norm)
                row = self.metrics.step_done(step, *values, lr=lr, force=True)
                self.phase = "the callbacks' metrics"
                for label, fn in cb.metric_sources:
                    row.update(check_callback_metrics(fn(step), label))
                self.metrics.emit(row)
                if validation:
                    log.info(
                        "validation",
                        step=step,
                        # Full precision, as every JSON line; the console rounds (log.py).
                        loss=validation["validation/loss"],
                        perplexity=validation["validation/perplexity"],
                    )
                    row.update(validation)  # to the metric writers (TensorBoard, metrics.jsonl)
                    self._warn_non_finite_validation(step, validation["validation/loss"])
            else:
                self.metrics.step_done(step, None, None)
            self.phase = "the end-of-step callbacks (checkpoint save)"
            for fn in cb.on_step_end:
                fn(step, row, last or terminated)
            if (failure := log_file_failure()) is not None:  # train.log could not be written
                raise failure
            if step == first and self.device.type == "cuda":
                # The first step compiles, autotunes and creates the optimizer state; the freed
                # fragments it leaves in the caching allocator would otherwise stay reserved.
                torch.cuda.empty_cache()
            if step == first and self.topology.after_first_step is not None:
                self.phase = "the barrier before the training timeout"
                self.topology.after_first_step(self.mesh)
            if terminated and not last:
                raise Terminated(f"stopped by SIGTERM at step {step}{self._after_sigterm(step)}")
            if interrupted and not last:
                raise KeyboardInterrupt(f"after step {step}{self._after_interrupt(step)}")

    def _saves(self, step: int, last: bool) -> bool:
        return self.checkpointer is not None and self.checkpointer.should_save(step, last)

    def _after_interrupt(self, step: int, *, in_flight: bool = False) -> str:
        """What a Ctrl-C leaves, for its one line: it saves nothing (SIGTERM saves the step).
        ``in_flight``: a second Ctrl-C stopped ``step`` at once, before its end."""
        if self.checkpointer is None:
            return "; checkpointing is off, so nothing was saved: the same command starts over from step 1"
        saved = self.last_saved or self.resumed_from
        if saved == step and not in_flight:  # checkpoint.interval saved it
            return f", which is saved: the same command resumes from step {step + 1}"
        unsaved = "" if in_flight else ", without saving it"
        instead = "" if in_flight else " (SIGTERM instead of Ctrl-C saves the step in flight)"
        if not saved:
            return (
                f"{unsaved}, and no checkpoint exists yet: the same command starts over from step 1{instead}"
            )
        return (
            f"{unsaved}: the same command resumes from the checkpoint of step {saved} and trains steps "
            f"{saved + 1}-{step} again{instead}"
        )

    def _after_sigterm(self, step: int) -> str:
        """What a rerun of the stopped command does, for the SIGTERM error."""
        if self._saves(step, True):
            return " after saving a checkpoint; run the same command to resume"
        if self.checkpointer is None:
            return (
                "; checkpointing is off (checkpoint.enable = False), so no step was saved: the same "
                "command starts over from step 1"
            )
        return (
            f"; the checkpointer saved no checkpoint of step {step} (checkpoint.load_only?): the same "
            "command resumes from its last checkpoint, if it has one"
        )

    def _check_finite(self, step: int) -> None:
        bad = int(self.first_bad)  # the one host sync, on logging and saving steps only
        if bad:
            raise Diverged(
                f"the loss or gradient norm became non-finite (NaN or inf) at step {bad}; stopped at "
                f"step {step} before saving anything from it. Lower training.lr or check the data, "
                f"then run again: {self._after_divergence()}"
            )

    def _after_divergence(self) -> str:
        """What a rerun of a diverged run starts from, for its error: the last checkpoint (every
        one saved is of a step before the bad one: a step after it saves only once checked), or
        from step 1, and why. "Resume from the last checkpoint" sent users after checkpoints a
        run with checkpointing off, or one that diverged before its first save, never had."""
        c = self.config.checkpoint
        if self.checkpointer is None:
            return (
                "checkpointing is off (checkpoint.enable = False), so nothing was saved and the run "
                "starts over from step 1 (checkpoint.enable = True keeps the steps before a failure)"
            )
        saved = self.last_saved or self.resumed_from
        if saved:
            return (
                f"the same command resumes from the last checkpoint, of step {saved} (in "
                f"{os.path.join(self.config.job.dump_folder, c.folder)})"
            )
        if c.load_only:
            return "checkpoint.load_only = True saves no checkpoint, so the run starts over from step 1"
        return (
            f"no checkpoint was saved yet (checkpoint.interval = {c.interval}), so the run starts over "
            "from step 1 (a smaller checkpoint.interval keeps more of a run)"
        )

    def _reduce_for_log(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> tuple[Any, Any]:
        """Loss averaged over the data-parallel ranks (only on steps that log)."""
        from titan_core.grad_norm import mean_over_dp

        if loss is not None:
            loss = mean_over_dp(loss, self.ctx)
        if is_fake(grad_norm):  # shape-only steps have no values
            return (None if loss is None else math.nan), math.nan
        value = None if loss is None else float(loss)
        return value, float(grad_norm)

    def close(self, *, completed: bool = False) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.metrics.close()
        detach_file()
        if self.lock is not None:
            self.lock.release()
        self.topology.shutdown(completed=completed)
        self._contexts.close()


def _scaled(loss_fn: Any, factor: float) -> Any:
    def scaled(logits: Any, labels: Any) -> Any:
        return loss_fn(logits, labels) * factor

    return scaled


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (replicated) DTensor loss."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def train(config: TrainerConfig, registry: Registry, *, overwrite: bool = False) -> list[dict[str, float]]:
    trainer = Trainer(config, registry, overwrite=overwrite)
    completed = False
    try:
        # One scope from the start of training until the run's files are closed and its process
        # group ended (with the peers, after a completed run): a signal is a flag all along, read
        # after each step; after the last step it changes nothing, and nothing is cut off half-way.
        with StopSignals() as signals:
            try:
                history = trainer.train(signals)
                completed = True
            finally:
                trainer.close(completed=completed)
    except STOPS as exc:
        if not exc.args:  # raised outside the loop, which says where it stopped
            exc.args = (trainer.stopped_outside_the_loop(exc),)
        raise
    return history
