"""The router callback: balancing settings, the expert-bias update and router statistics.

Built once per run (``titan_callbacks``) from the ``moe`` config section, it

* hands the sequence-wise balance loss its weight and the sequences of a step (the local batch
  times the microbatches of gradient accumulation, so the terms of pipeline and accumulation
  microbatches add up to the step's mean) on every MoE layer of this rank's parts, under context
  parallelism the ``cp`` group too (a sequence's expert counts are summed over its shards, so
  each sequence's loss is the whole sequence's: ``moe.sequence_balance_loss``), and the MTP
  term its share of the step (``1 / microbatches``, as the trainer scales the loss);
* after each optimizer step, takes the layers' token counts (``MoE.stats``, one entry per forward
  of the step; forwards beyond the step's ``local_batch_size * microbatches * seq_len / cp``
  tokens, the pipeline schedule's first-step metadata inference, are dropped) and, with
  ``moe.bias_update_rate > 0``, sums them over the data-parallel and context ranks (one small
  all-reduce for all layers) and moves each expert's selection bias by
  ``rate * sign(mean - count)``, centred so the biases keep a zero mean (a common shift changes no
  choice); all on the device, nothing is read on the host;
* with ``moe.router_stats`` on, after each optimizer step, sums the counts over the
  data-parallel ranks (the all-reduce of the bias update, or one of its own) and adds up, on the
  device, per MoE layer that step's imbalance ``max / mean`` of tokens per expert and the fewest /
  most tokens an expert got;
* on logging steps (``metrics``, called on every rank), reads those sums once and reports their
  means over the steps since the last log, the worst and mean imbalance over layers, the balance
  loss and multi-token-prediction term added per step (averaged over the data-parallel ranks:
  the whole batch's) and the largest bias.
  Layers are labelled by block index (``moe/layer3/...``), those of multi-token-prediction
  modules ``moe/layermtp0/...``.

Under pipeline parallelism a rank holds its own stages' layers only: on logging steps the stages
add up their per-layer sums (one small all-reduce over the ``pp`` group, each layer living on one
stage), so every rank, the logging one (the last stage) included, reports every MoE layer and the
whole model's balance loss.

A run whose data-parallel, context or tensor peers are simulated while its pipeline stages are
real (``real_pp_fake_spmd``), or a simulated pipeline stage after the first (``fake`` with
computed tensors), reports none of these values: the simulated collectives move nothing, so the
counts would be one rank's, not the batch's (and under TP, EP or on a later stage counted on
activations received as garbage), and the balance loss would be divided by ranks that added
nothing. The balancing itself still runs (one line says what is left out).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_core.fake_tensors import is_fake
from titan_core.log import get_logger
from titan_plugins_moe.moe import MoE

log = get_logger("titan.moe")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_MTP = re.compile(r"(?:^|\.)mtp\.(\d+)(?:\.|$)")


def moe_layers(parts: list[torch.nn.Module]) -> list[tuple[str, MoE]]:
    """``(label, MoE)`` of every MoE layer in ``parts``: the block index (``"3"``), or ``"mtp0"``
    for a multi-token-prediction module's; in model order, whatever wraps them (FSDP, activation
    checkpointing, compile)."""
    found: dict[tuple[int, int], tuple[str, MoE]] = {}
    for part in parts:
        for name, module in part.named_modules():
            if not isinstance(module, MoE):
                continue
            if match := _MTP.search(name):
                found[(1, int(match.group(1)))] = (f"mtp{match.group(1)}", module)
            elif match := _LAYER.search(name):
                found[(0, int(match.group(1)))] = (match.group(1), module)
            else:
                found[(2, len(found))] = (name, module)
    return [found[key] for key in sorted(found)]


def mtp_models(parts: list[torch.nn.Module]) -> list[Any]:
    """The model parts with multi-token-prediction modules."""
    return [m for part in parts for m in part.modules() if getattr(m, "mtp", None) is not None]


def _dp_group(trainer: Any) -> Any:
    """The process group that sees other tokens for the same layers: ``dp_cp`` (None: alone)."""
    pd = trainer.parallel_dims
    if trainer.mesh is None or pd.dp * pd.cp == 1:
        return None
    return trainer.mesh["dp_cp"].get_group()


def _cp_group(trainer: Any) -> Any:
    """The process group each sequence is sharded over (context parallel; None: whole here)."""
    if trainer.mesh is None or trainer.parallel_dims.cp == 1:
        return None
    return trainer.mesh["cp"].get_group()


def _stage_group(trainer: Any) -> Any:
    """The process group of the pipeline stages (None: no pipeline parallelism, or simulated
    stages: a fake comm backend's all-reduce moves nothing, and the other stages' layers would
    read as zeros)."""
    if trainer.mesh is None or getattr(trainer.parallel_dims, "pp", 1) == 1:
        return None
    if "pp" in trainer.topology.simulated:
        return None
    return trainer.topology.group("pp", trainer.mesh)


def simulated_peers(trainer: Any) -> list[str]:
    """The simulated mesh dimensions that make this rank's statistics junk that would pass for
    real, for a backend keeping a dimension real (``real_pp_fake_spmd``: its pipeline stages
    exchange real values and add up their statistics): those of more than one rank whose
    collectives the statistics rely on (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; EP borrows
    its ranks from ``dp_shard`` and ``cp``), which move nothing. Under any simulating backend also
    ``pp`` when this rank holds a stage after the first (one without the embedding): its input is
    what a simulated receive returned. (A backend simulating every peer, ``fake``, keeps a first
    stage's values: every value of such a run is documented as meaningless, and the rank's counts
    show how its own tokens were routed.)"""
    topology = getattr(trainer, "topology", None)
    if topology is None or trainer.mesh is None:
        return []
    pd = trainer.parallel_dims
    found = []
    if getattr(topology, "groups", None):
        dims = ("dp_replicate", "dp_shard", "cp", "tp")
        found = [d for d in dims if d in topology.simulated and getattr(pd, d, 1) > 1]
    later_stage = any(getattr(part, "tok_embeddings", True) is None for part in trainer.parts)
    if "pp" in topology.simulated and getattr(pd, "pp", 1) > 1 and later_stage:
        found.append("pp")
    return found


def all_labels(model_args: Any) -> list[str] | None:
    """The labels of every MoE layer of the whole model (all pipeline stages), in model order, from
    its arguments; ``None`` when they are not this plugin's (no ``n_layers``/``n_dense_layers``)."""
    try:
        n_layers, n_dense = int(model_args.n_layers), int(model_args.n_dense_layers)
        n_mtp = int(getattr(model_args, "n_mtp_layers", 0))
    except (AttributeError, TypeError, ValueError):
        return None
    return [str(i) for i in range(min(n_dense, n_layers), n_layers)] + [f"mtp{k}" for k in range(n_mtp)]


def take_step(moe: MoE, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-expert counts and balance loss of the last forwards of ``moe`` that routed ``tokens``
    tokens in all (earlier ones are a pipeline schedule's metadata inference); clears ``stats``."""
    records = list(moe.stats or [])
    if moe.stats is not None:
        moe.stats.clear()
    kept, seen = [], 0
    for n, counts, aux in reversed(records):
        if seen >= tokens:
            break
        kept.append((counts, aux))
        seen += n
    if not kept:
        return torch.zeros(moe.num_experts, dtype=torch.int64, device=moe.router.expert_bias.device), None
    total = torch.stack([c for c, _ in kept]).sum(dim=0)
    losses = [a for _, a in kept if a is not None]
    return total, torch.stack(losses).sum() if losses else None


class RouterCallback:
    def __init__(
        self,
        layers: list[tuple[str, MoE]],
        settings: Any,
        tokens: int,
        group: Any,
        device: torch.device,
        mtp: list[Any] = (),  # type: ignore[assignment]
        stage_group: Any = None,
        labels: list[str] | None = None,
        reported: bool = True,
    ) -> None:
        self.index = [i for i, _ in layers]
        self.layers = [m for _, m in layers]
        #: Pipeline parallel: the ``pp`` group and every stage's MoE layer labels (``labels``), whose
        #: per-layer sums the stages add up on logging steps; this rank's layers are at ``slots``.
        self.stage_group = None
        self.labels, self.slots = list(self.index), list(range(len(self.index)))
        if stage_group is not None and labels is not None and set(self.index) <= set(labels):
            self.stage_group = stage_group
            self.labels, self.slots = list(labels), [labels.index(i) for i in self.index]
        self.tokens = tokens
        self.rate = settings.bias_update_rate
        self.stats = settings.router_stats
        self.aux = settings.aux_loss_weight > 0
        self.group = group
        #: Per layer, summed over the steps since the last log: each step's imbalance (max / mean
        #: tokens per expert, over the data-parallel ranks), fewest and most tokens of an expert.
        self.window = torch.zeros(3, len(self.layers), dtype=torch.float64, device=device)
        self.aux_window = torch.zeros((), dtype=torch.float32, device=device)
        self.mtp = list(mtp)
        self.mtp_window = torch.zeros((), dtype=torch.float32, device=device)
        self.steps = 0
        #: False when simulated peers make the values junk (:func:`simulated_peers`): the bias
        #: update and balance loss run, but no value is reported.
        self.reported = reported

    @classmethod
    def build(cls, trainer: Any) -> RouterCallback | None:
        layers = moe_layers(trainer.parts)
        settings = trainer.config.moe
        stages = _stage_group(trainer)
        labels = all_labels(getattr(trainer, "model_args", None)) if stages is not None else None
        # A pipeline stage without MoE layers (only dense blocks) still joins the stages' sum on
        # logging steps: every rank of the ``pp`` group has to call the all-reduce.
        if not layers and not labels:
            return None
        t = trainer.config.training
        # Gradient accumulation divides each microbatch's loss by their number (the trainer's
        # loss_fn); the terms injected here get the same share: the balance loss is averaged over
        # the step's sequences, the MTP term scaled, and a step routes every microbatch's tokens.
        accumulation = getattr(trainer, "accumulation", 1)
        cp_group = _cp_group(trainer) if settings.aux_loss_weight > 0 else None
        for _, moe in layers:
            moe.aux_loss_weight = settings.aux_loss_weight
            moe.aux_batch_size = t.local_batch_size * accumulation
            if cp_group is not None:
                moe.aux_cp_group, moe.aux_cp = cp_group, trainer.parallel_dims.cp
        mtp = mtp_models(trainer.parts)
        for model in mtp:
            model.mtp_loss_scale = 1 / accumulation
        asked = (
            settings.bias_update_rate > 0 or settings.router_stats != "off" or settings.aux_loss_weight > 0
        )
        if not asked and not mtp:
            return None
        for _, moe in layers:
            moe.stats = []
        for model in mtp:
            model.mtp_stats = []
        tokens = t.local_batch_size * accumulation * t.seq_len // trainer.parallel_dims.cp
        simulated = simulated_peers(trainer)
        if simulated:
            log.info(
                "MoE router statistics, balance loss and bias are not logged",
                reason=f"this run simulates its {', '.join(simulated)} peers, whose collectives move "
                "nothing: the values would be one rank's, or computed on activations received as "
                "garbage, not the batch's; a real run reports them",
            )
            # The bias update sums nothing over simulated ranks: each rank's counts steer its bias.
            return cls(layers, settings, tokens, None, trainer.device, mtp, stages, labels, reported=False)
        return cls(layers, settings, tokens, _dp_group(trainer), trainer.device, mtp, stages, labels)

    def _all_reduce(self, counts: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=self.group)
        return counts

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        self.steps += 1
        if not self.layers:  # a pipeline stage of dense blocks only: nothing routed here
            return
        taken = [take_step(m, self.tokens) for m in self.layers]
        counts = torch.stack([c for c, _ in taken])
        load = None
        stats = self.stats != "off" and self.reported
        if self.rate > 0 or stats:  # the step's counts over the data-parallel ranks
            load = self._all_reduce(counts.clone()).double()
        if self.rate > 0:
            # Centred in float64 (``load`` is), then float32: a float32 mean sums the experts'
            # steps first, which overflowed to inf (then NaN) for a rate the bias itself holds.
            delta = self.rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
            delta = (delta - delta.mean(dim=1, keepdim=True)).float()
            for m, d in zip(self.layers, delta, strict=True):
                m.router.expert_bias.add_(d)
        if stats:
            # This step's statistics: the imbalance of counts summed over the interval would
            # average different experts' peaks away (the longer the interval, the more).
            mean = load.mean(dim=1)
            highs = load.max(dim=1).values
            imbalance = torch.where(mean > 0, highs / mean.clamp_min(1e-12), 0.0)
            self.window += torch.stack([imbalance, load.min(dim=1).values, highs])
        losses = [a for _, a in taken if a is not None]
        if losses:
            self.aux_window += torch.stack(losses).sum()
        for model in self.mtp:
            if model.mtp_stats:
                self.mtp_window += torch.stack(model.mtp_stats).sum()
                model.mtp_stats.clear()

    def _gather(self, steps: int) -> torch.Tensor:
        """``(5, max(len(labels), 2))`` float64 on the host: per layer (columns in ``labels``
        order) the interval's mean imbalance, fewest and most tokens of an expert, and the layer's
        largest bias; row 4 holds the balance loss and MTP term per step (columns 0 and 1),
        whole-batch means. Under PP every stage's layers: the stages' tensors added up (each layer
        lives on one stage, the others hold zeros for it)."""
        device = self.window.device
        packed = torch.zeros(5, max(len(self.labels), 2), dtype=torch.float64, device=device)
        slots = torch.tensor(self.slots, dtype=torch.long, device=device)
        packed[:3].index_copy_(1, slots, self.window / steps)
        if self.rate > 0 and self.layers:
            bias = torch.stack([m.router.expert_bias.abs().max() for m in self.layers]).double()
            packed[3].index_copy_(0, slots, bias)
        if self.aux or self.mtp:
            # Each rank's terms are the means over its own sequences: the batch's is their mean.
            ranks = 1
            if self.group is not None:
                import torch.distributed as dist

                ranks = dist.get_world_size(self.group)
            losses = self._all_reduce(torch.stack([self.aux_window, self.mtp_window])) / (steps * ranks)
            packed[4, :2] = losses.double()
        if self.stage_group is not None:
            import torch.distributed as dist

            dist.all_reduce(packed, group=self.stage_group)
        return packed.cpu()  # the one host read

    @torch.no_grad()
    def metrics(self, step: int) -> dict[str, float]:
        steps, self.steps = max(self.steps, 1), 0
        if is_fake(self.window) or not self.reported:  # shape-only steps, simulated peers
            return {}
        packed = self._gather(steps)
        imbalance, lows, highs, bias = packed[:4, : len(self.labels)]
        losses = packed[4]
        self.window.zero_()
        self.aux_window.zero_()
        self.mtp_window.zero_()
        row: dict[str, float] = {}
        if self.aux:
            row["moe/aux_loss"] = float(f"{float(losses[0]):.6g}")
        if self.mtp:
            row["moe/mtp_loss"] = float(f"{float(losses[1]):.6g}")
        if self.rate > 0:
            row["moe/expert_bias_absmax"] = float(f"{float(bias.max()):.6g}")
        if self.stats == "off":
            return row
        row["moe/imbalance_max"] = round(float(imbalance.max()), 4)
        row["moe/imbalance_mean"] = round(float(imbalance.mean()), 4)
        if self.stats == "per_layer":
            for i, layer in enumerate(self.labels):
                row[f"moe/layer{layer}/imbalance"] = round(float(imbalance[i]), 4)
                row[f"moe/layer{layer}/tokens_min"] = round(float(lows[i]), 2)
                row[f"moe/layer{layer}/tokens_max"] = round(float(highs[i]), 2)
        return row


def build(trainer: Any) -> RouterCallback | None:
    return RouterCallback.build(trainer)
