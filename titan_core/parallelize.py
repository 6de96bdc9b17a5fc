"""Applying strategies to the model, and what strategies may contribute to the training step.

The model is built on the meta device as one part. Strategies then run in ascending
``Strategy.order``; each takes the list of model parts and returns it (pipeline parallelism turns
one part into this rank's stages; the others transform each part in place):

    PP split (10) -> TP (20) -> EP (25) -> CP (30) -> activation checkpointing (40)
    -> torch.compile (50) -> FSDP/HSDP (60)

Only then are the parts materialised on the device and initialised by ``init_weights``.

Besides transforming the parts, a strategy changes the training step only through the
contributions of :class:`ParallelContext` — the same for titan's strategies and a third party's:

- ``loss_fn``: the loss of logits and labels; a strategy may wrap it (a z-loss, an auxiliary loss);
- ``batch_transforms``: ``(inputs, labels, kwargs) -> (inputs, labels, kwargs)`` before the
  forward (context parallelism cuts each sequence and passes positions to the model);
- ``step_contexts``: context-manager factories entered around forward, loss and backward (loss
  parallelism);
- ``replace_forward_backward``: a step function that replaces the trainer's forward/backward
  (pipeline schedules), with a forward-only ``evaluate`` for validation if it can; at most one
  strategy may;
- ``mixed_precision_applied``: the strategy casts parameters to the compute dtype itself, so the
  trainer does not autocast;
- ``computes_loss``: false on ranks whose loss is not meaningful (pipeline ranks without the last
  stage): the log line comes from a rank that computes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import attrs

from titan_core.errors import PluginError, UsageError, problems_returned
from titan_core.records import PARALLEL_DIMS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.records import ModelSpec, Strategy
    from titan_core.topology import Topology

#: Named order slots; third-party strategies may use values in between.
ORDER = {
    "pp": 10,
    "tp": 20,
    "ep": 25,
    "cp": 30,
    "activation_checkpoint": 40,
    "compile": 50,
    "fsdp": 60,
}

#: ``step(inputs, labels, kwargs) -> loss | None``: one forward/backward over a batch. A step
#: that replaces the trainer's may also have ``evaluate`` of the same signature: the forward
#: alone (see :meth:`ParallelContext.replace_forward_backward`).
StepFn = Callable[["torch.Tensor", "torch.Tensor", dict[str, Any]], Any]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float32: the default ``ParallelContext.loss_fn``."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@attrs.define
class ParallelContext:
    """What strategies see, and what they contribute to the training step."""

    config: TrainerConfig
    parallel_dims: ParallelDims
    #: The world DeviceMesh and its flattened views (``parallel_dims.Meshes``; index it like a
    #: DeviceMesh: ``mesh["tp"]``, ``mesh["dp_shard_cp"]``); ``None`` on a single process.
    mesh: Any
    spec: ModelSpec
    model_args: Any
    topology: Topology
    #: ``loss_fn(logits, labels) -> scalar loss``; strategies may wrap it.
    loss_fn: Callable[[Any, Any], Any] = cross_entropy_loss
    #: Applied in order before the forward: ``(inputs, labels, kwargs) -> (inputs, labels, kwargs)``.
    batch_transforms: list[Callable[..., tuple[Any, Any, dict[str, Any]]]] = attrs.field(factory=list)
    #: Factories of context managers entered around forward, loss and backward.
    step_contexts: list[Callable[[], AbstractContextManager[Any]]] = attrs.field(factory=list)
    #: Set by a strategy's parameter casting (e.g. FSDP mixed precision): no autocast needed.
    mixed_precision_applied: bool = False
    #: Whether this rank's loss is meaningful (false on pipeline ranks without the last stage).
    computes_loss: bool = True
    #: State a strategy keeps for itself or for later strategies, by strategy name.
    state: dict[str, Any] = attrs.field(factory=dict)
    #: Names of the strategies applied, in order (logged once).
    applied: list[str] = attrs.field(factory=list)
    _step_builder: tuple[str, Callable[..., StepFn]] | None = None

    def replace_forward_backward(
        self, owner: str, build: Callable[[list[nn.Module], Callable], StepFn]
    ) -> None:
        """Replace the trainer's forward/backward: ``build(parts, loss_fn) -> step``.

        ``build`` is called once the parts are materialised; ``step(inputs, labels, kwargs)``
        runs forward and backward over the whole batch and returns the loss (``None`` when this
        rank does not compute it). Two strategies replacing it is a usage error.

        Validation: the trainer knows no forward of its own for a replaced step, so give the
        step object (any callable) an ``evaluate(inputs, labels, kwargs) -> loss | None``
        method: the forward and the loss alone, returning what ``step`` would for the same batch
        (the same ``loss_fn``, so the same scaling, on the same ranks). The trainer calls it
        under ``torch.no_grad()`` with the parts in eval mode, inside ``batch_transforms`` and
        ``step_contexts`` as for ``step``. Without it, validation runs ``step`` itself and
        drops the gradients: the same loss, at the cost of a backward (and, under FSDP, its
        gradient reduce-scatters) per validation batch.
        """
        if self._step_builder is not None and self._step_builder[0] != owner:
            raise UsageError(
                f"strategies {self._step_builder[0]!r} and {owner!r} both replace the training "
                "step's forward/backward; disable one of them"
            )
        self._step_builder = (owner, build)

    def build_step(self, parts: list[nn.Module], default: StepFn) -> StepFn:
        """The step function: a strategy's replacement, else ``default``."""
        if self._step_builder is None:
            return default
        return self._step_builder[1](parts, self.loss_fn)


def select_strategies(
    strategies: dict[str, Strategy],
    config: TrainerConfig,
    parallel_dims: ParallelDims,
    call: Callable[..., Any] = lambda strategy, fn, *args: fn(*args),
) -> list[Strategy]:
    """The strategies this run applies, in order; ``call(strategy, fn, *args)`` runs the
    plugin's ``applies`` (the trainer's names the plugin when it raises)."""
    chosen = [s for s in strategies.values() if call(s, s.applies, config, parallel_dims)]
    return sorted(chosen, key=lambda s: (s.order, s.name))


def apply_strategies(
    model: nn.Module,
    strategies: list[Strategy],
    ctx: ParallelContext,
    after_each: Callable[[list[nn.Module]], None] = lambda parts: None,
) -> list[nn.Module]:
    parts = [model]
    for strategy in strategies:
        parts = strategy.apply(parts, ctx)
        try:
            after_each(parts)
        except UsageError as exc:
            raise UsageError(f"after strategy {strategy.name!r}: {exc}") from None
        ctx.applied.append(strategy.name)
    return parts


def unhandled_dims(parallel_dims: ParallelDims, chosen: list[Strategy]) -> list[str]:
    """Parallel degrees above 1 that no chosen strategy handles (``Strategy.handles``).

    Asked of the records, not of their names: a run with ``tp = 2`` and no strategy handling
    ``tp`` would otherwise train as if it had one rank.
    """
    needed = [d for d in PARALLEL_DIMS if getattr(parallel_dims, d) > 1]
    handled = {dim for s in chosen for dim in s.handles}
    return [d for d in needed if d not in handled]


def _refuse_shared_dims(registry: Any, chosen: list[Strategy]) -> None:
    """Two applied strategies that handle one parallel dimension would both implement it: titan's
    FSDP handles ``dp_replicate`` whenever dp > 1, so a third party's DDP applied beside it
    failed in every worker after the model was built (torch's ``replicate`` refuses a module
    under ``fully_shard``), or, with a strategy torch does not catch, reduced the gradients
    twice. Refused before anything is built, naming both and what resolves it."""
    owners: dict[str, Strategy] = {}
    for strategy in chosen:
        for dim in strategy.handles:
            first = owners.setdefault(dim, strategy)
            if first is strategy:
                continue
            plugins = sorted({registry.provider("strategies", s.name).name for s in (first, strategy)})
            raise PluginError(
                f"{registry.label('strategies', first.name)} and "
                f"{registry.label('strategies', strategy.name)} both handle {dim} in this run "
                "(Strategy.handles), so each would implement it over the other; turn one of them "
                "off in the config, or disable its plugin (--disable-plugin NAME, "
                f"TITAN_DISABLE_PLUGINS: {' or '.join(plugins)})"
            )


def _refuse_unhandled(registry: Any, parallel_dims: ParallelDims, chosen: list[Strategy]) -> None:
    """A degree above 1 that no applied strategy handles (:func:`unhandled_dims`) is one error
    saying why: an installed strategy that handles it but did not apply is named (a config
    switch of its own is off: bad input, exit 2); otherwise no loaded plugin provides one, and
    the disabled plugins are named beside the install hint (one of them may be the provider)."""
    unhandled = unhandled_dims(parallel_dims, chosen)
    if not unhandled:
        return
    degrees = f"parallel degrees {parallel_dims.degrees()}"
    idle = [s for s in registry.every("strategies").values() if set(s.handles) & set(unhandled)]
    if idle:
        named = "; ".join(
            f"{registry.label('strategies', s.name)} handles "
            f"{'it' if len(unhandled) == 1 else ', '.join(d for d in s.handles if d in unhandled)} "
            "but does not apply to this run (its applies returned False: its own config may turn it on)"
            for s in idle
        )
        raise UsageError(
            f"this run needs a strategy for {', '.join(unhandled)} ({degrees}): {named}; turn one on, "
            "or set the degree to 1"
        )
    disabled = sorted(p.name for p in registry.plugins.values() if p.status == "disabled")
    note = f" (disabled plugins: {', '.join(disabled)})" if disabled else ""
    raise PluginError(
        f"this run needs strategies for {', '.join(unhandled)} ({degrees}), which no loaded plugin "
        f"provides{note}; install a parallelism plugin (titan's is titan-plugins-parallel: "
        "docs/architecture.md)"
    )


def _yes_or_no(answer: Any, label: Callable[[], str]) -> bool:
    """A strategy's ``applies`` answer, which must be a bool: the string ``"False"`` applied the
    strategy (truthiness) and a forgotten ``return`` left it out, without a word either way."""
    if not isinstance(answer, bool):
        raise PluginError(
            f"{label()} returned {type(answer).__name__} {answer!r} from applies; it must return True "
            "or False"
        )
    return answer


def check_strategies(
    registry: Any,
    config: TrainerConfig,
    parallel_dims: ParallelDims,
    spec: ModelSpec,
    model_args: Any,
    call: Callable[..., Any] = lambda what, fn, *args: fn(*args),
) -> list[Strategy]:
    """The strategies this run applies, in order (:func:`select_strategies`), once every degree
    above 1 has one that handles it (:func:`unhandled_dims`) and each one's ``Strategy.check``
    finds no problem in the config, the degrees, the model spec and its arguments; raises one
    :class:`UsageError` with every problem found otherwise. ``call(what, fn, *args)`` runs plugin
    code (``applies``, ``check``): an exception becomes one :class:`PluginError` starting with
    ``what()``, which names the strategy and its plugin
    (:func:`~titan_core.errors.call_plugin`). Builds nothing and starts no collective: the
    trainer and ``run_train.sh``'s check before torchrun (:func:`titan_core.run.preflight`)
    share it, so a layout is refused the same way by both."""

    chosen = select_strategies(
        registry.every("strategies"),  # a name two plugins provide fails: records() would drop both
        config,
        parallel_dims,
        lambda s, fn, *args: _yes_or_no(
            call(lambda: f"{registry.label('strategies', s.name)} failed in applies", fn, *args),
            lambda: registry.label("strategies", s.name),
        ),
    )
    # Two applied strategies of one order would run in the order of their names (the sort's tie
    # break), which neither plugin chose: a strategy at fsdp's slot ran before or after FSDP
    # depending on how it was spelt. Refused, naming both, before anything is built.
    for before, after in itertools.pairwise(chosen):
        if before.order == after.order:
            raise PluginError(
                f"{registry.label('strategies', before.name)} and "
                f"{registry.label('strategies', after.name)} both have order {before.order}, so which "
                "runs first is undefined; give one of them an order no other strategy has (titan's "
                "slots: titan_core.parallelize.ORDER; third-party strategies go in between)"
            )
    _refuse_shared_dims(registry, chosen)
    _refuse_unhandled(registry, parallel_dims, chosen)
    problems: list[str] = []
    for strategy in chosen:
        if strategy.check is None:
            continue
        found = call(
            lambda s=strategy: f"{registry.label('strategies', s.name)} failed in check",
            strategy.check,
            config,
            parallel_dims,
            spec,
            model_args,
        )
        problems += problems_returned(
            found, f"{registry.label('strategies', strategy.name)}: its check returned"
        )
    if len(problems) == 1:
        raise UsageError(problems[0])
    if problems:
        raise UsageError(
            f"the parallel layout has {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)
        )
    return chosen
