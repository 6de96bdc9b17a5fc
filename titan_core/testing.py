"""Checks for model-plugin authors, in the spirit of pytest's ``pytester``: is my ModelSpec sound?

:func:`check_model_spec` goes the way the trainer goes and fails with every problem it finds::

    from titan_core.testing import check_model_spec
    from my_plugin.plugin import titan_models

    def test_my_model_is_sound():
        (spec,) = titan_models()
        check_model_spec(spec, "debug", tied=[("output.weight", "tok_embeddings.weight")])

It builds the flavor on the meta device, materialises it with ``to_empty`` (restoring parameter
sharing, as the trainer does), fills every parameter and buffer with NaN and runs
``init_weights``: anything still NaN was never initialised. Integer and boolean tensors (position
ids, masks) have no NaN: they are filled with two different markers, ``init_weights`` running
once over each, and an element holding both markers was never written. It checks that sharing survived
``init_weights`` and that the ``tied`` pairs share one parameter, compares ``num_params`` with the
real count, runs a forward pass, runs ``init_weights`` on a first and a last pipeline stage
(the other ends ``None``), and applies the TP plan on a fake mesh (one process) to check
that every parameter became a DTensor and that a forward pass runs under the plan. Both forwards
must return plain logits of shape ``(batch, seq, vocab_size)``: under the plan (called with
``loss_parallel=False``) that means gathered over the vocabulary and the sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from titan_core.records import ModelSpec
from titan_core.tied import retie, shared_parameters

__all__ = ["ModelCheckError", "check_model_spec"]


class ModelCheckError(AssertionError):
    """A model spec failed :func:`check_model_spec`; the message lists every problem."""


def _materialise(spec: ModelSpec, args: Any) -> tuple[nn.Module, list[list[str]]]:
    with torch.device("meta"):
        model = spec.build(args)
    groups = shared_parameters(model)
    model.to_empty(device="cpu")
    retie([model], groups)
    return model, groups


def check_model_spec(
    spec: ModelSpec,
    flavor: str,
    *,
    overrides: Mapping[str, Any] | None = None,
    tied: Sequence[tuple[str, str]] = (),
    tp_degree: int = 2,
    seq_len: int = 16,
    batch_size: int = 2,
    pipeline: bool = True,
) -> None:
    """Raise :class:`ModelCheckError` naming every problem of ``spec``'s ``flavor``.

    ``pipeline=False``: skip the check that ``init_weights`` runs on a pipeline stage (a model
    that refuses pipeline parallelism in its ``validate``)."""
    args = spec.flavor(flavor, overrides)
    problems: list[str] = []
    model, groups = _materialise(spec, args)
    untouched = _left_uninitialised(model)
    names = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        if name in untouched:
            problems.append(f"{name}: not initialised by init_weights ({untouched[name]} after to_empty)")
    for name, _ in model.named_buffers():
        if name in untouched:
            problems.append(f"buffer {name}: not initialised by init_weights ({untouched[name]})")
    after = {frozenset(g) for g in shared_parameters(model)}
    for group in groups:
        if frozenset(group) not in after:
            problems.append(f"{' and '.join(group)}: shared on meta, untied by init_weights")
    for a, b in tied:
        if a not in names or b not in names:
            problems.append(f"tied pair {a} / {b}: no such parameter ({', '.join(sorted(names))[:200]})")
        elif names[a] is not names[b]:
            problems.append(f"{a} and {b}: expected one tied parameter, found two independent ones")
    counted = sum(p.numel() for p in model.parameters())
    declared = spec.num_params(args, True)
    if counted != declared:
        problems.append(f"num_params(args, True) = {declared:,} but the model has {counted:,} parameters")
    if vocab := _vocab_size(args):
        tokens = torch.randint(0, vocab, (batch_size, seq_len))
        try:
            logits = model(tokens)
        except Exception as exc:
            problems.append(f"forward pass failed: {type(exc).__name__}: {exc}")
        else:
            if problem := _logits_problem(logits, (batch_size, seq_len, vocab), "forward without tp_plan"):
                problems.append(problem)
            elif not torch.isfinite(logits).all():
                problems.append("forward returned non-finite logits after init_weights")
    if pipeline:
        problems += _init_on_stages(spec, args)
    if spec.tp_plan is not None:
        problems += _check_tp_plan(spec, args, tp_degree, batch_size, seq_len * tp_degree)
    if problems:
        raise ModelCheckError(
            f"model {spec.name!r} flavor {flavor!r}:\n" + "\n".join(f"  {p}" for p in problems)
        )


def _init_on_stages(spec: ModelSpec, args: Any) -> list[str]:
    """``init_weights`` on a first and a last pipeline stage: the other stages' end modules
    (``ModelSpec.first_stage_modules``/``last_stage_modules``) are ``None`` there, and the trainer
    calls ``init_weights`` on each stage; one that reads a dropped module fails only under PP.
    Skipped for a model pipeline parallelism refuses anyway: no ``layers`` to split, or a
    parameter tied across the two ends (an embedding tied to the output)."""
    model, groups = _materialise(spec, args)
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
        return []
    ends = (tuple(spec.first_stage_modules), tuple(spec.last_stage_modules))
    for group in groups:
        tops = {name.split(".", 1)[0] for name in group}
        if tops & set(ends[0]) and tops & set(ends[1]):
            return []
    problems = []
    for dropped in (tuple(spec.last_stage_modules), tuple(spec.first_stage_modules)):
        stage, _ = _materialise(spec, args)
        held = [n for n in dropped if getattr(stage, n, None) is not None]
        if not held:
            continue
        for name in held:
            setattr(stage, name, None)
        try:
            with torch.no_grad():
                stage.init_weights(buffer_device=torch.device("cpu"))
        except Exception as exc:
            problems.append(
                f"init_weights failed on a pipeline stage without {', '.join(held)} (None there): "
                f"{type(exc).__name__}: {exc}; skip the modules a stage does not hold, as the forward "
                "does (or pass pipeline=False for a model that refuses pipeline parallelism)"
            )
    return problems


def _fill(tensor: torch.Tensor, second: bool) -> bool:
    """Fill ``tensor`` with a marker ``init_weights`` would not write (NaN; for integers and
    booleans, one extreme on the first pass and the other on the second); ``False`` for a dtype
    without one."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(not second)
    else:
        try:
            info = torch.iinfo(tensor.dtype)
        except TypeError:
            return False
        tensor.fill_(info.min if second else info.max)
    return True


def _left_uninitialised(model: nn.Module) -> dict[str, str]:
    """Run ``init_weights`` on markers and name the parameters and buffers it left (in part)
    untouched, each with what was left. A float keeps NaN; an integer or boolean tensor (position
    ids, a mask made with ``torch.arange`` on the meta device) has no NaN, so ``init_weights`` runs
    twice, seeded alike, over two different markers: an element that holds each pass's marker
    was never written."""

    def named() -> list[tuple[str, torch.Tensor]]:  # init_weights may assign a buffer anew
        return [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]

    found: dict[str, str] = {}
    first: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for second in (False, True):
            tensors = named()
            exact = [(n, t) for n, t in tensors if not (t.is_floating_point() or t.is_complex())]
            if second and not exact:
                break
            # The first pass marks every tensor, the second the integer and boolean ones again.
            marked = {n for n, t in (exact if second else tensors) if _fill(t, second)}
            torch.manual_seed(0)
            model.init_weights(buffer_device=torch.device("cpu"))
            for name, tensor in named():
                if tensor.is_floating_point() or tensor.is_complex():
                    if not second and torch.isnan(tensor).any():
                        found[name] = "NaN left"
                elif not second:
                    first[name] = tensor.clone()
                elif name in marked and name in first and first[name].shape == tensor.shape:
                    low, high = (False, True) if tensor.dtype == torch.bool else _extremes(tensor.dtype)
                    if ((first[name] == high) & (tensor == low)).any():
                        found[name] = "the to_empty memory left"
    return found


def _extremes(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return info.min, info.max


def _forward_under_tp(model: nn.Module, args: Any, tp: int, batch_size: int, seq_len: int) -> list[str]:
    """Run one forward pass of the TP-planned ``model`` on CPU. The fake process group moves no
    data, so the values mean nothing; what it catches is a plan the model's forward cannot run
    under (a plain tensor meeting a DTensor, a layout the next module does not expect), and one
    whose logits are not whole on every rank: collectives still give their outputs the right
    shapes, so a plan that leaves them split shows in the shape."""
    vocab = _vocab_size(args)
    if not vocab:
        return []
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.to_local().normal_(0.0, 0.02)  # type: ignore[attr-defined]
        try:
            logits = model(torch.randint(0, vocab, (batch_size, seq_len)))
        except Exception as exc:
            return [f"forward pass failed under tp_plan on a {tp}-rank mesh: {type(exc).__name__}: {exc}"]
    which = f"forward under tp_plan on a {tp}-rank mesh"
    problem = _logits_problem(logits, (batch_size, seq_len, vocab), which, tp)
    return [problem] if problem else []


def _logits_problem(logits: Any, expected: tuple[int, int, int], which: str, tp: int = 1) -> str | None:
    """Why ``logits`` are not the plain ``(batch, seq, vocab_size)`` tensor the trainer's loss
    takes (a vocabulary- or sequence-sharded rest of a TP plan trains on the wrong classes or
    tokens, or fails only at the first step), or ``None``."""
    from torch.distributed.tensor import DTensor

    want = f"expected (batch, seq, vocab_size) = {expected}"
    if isinstance(logits, DTensor):
        # check_model_spec calls the plan with loss_parallel=False: only loss parallel's context
        # takes DTensor logits; without it the loss fails at the first step (mixed Tensor and
        # DTensor).
        return (
            f"{which} returned a DTensor ({', '.join(map(repr, logits.placements))}) although "
            "tp_plan was called with loss_parallel=False, where the loss takes plain logits; "
            "give the output projection use_local_output=True and output_layouts=Replicate() "
            "when loss_parallel is False"
        )
    if not isinstance(logits, torch.Tensor):
        return f"{which} returned {type(logits).__name__}, not a logits tensor; {want}"
    shape = tuple(logits.shape)
    if shape == expected:
        return None
    batch, seq, vocab = expected
    got = f"{which} returned shape {shape}, {want}"
    if tp > 1 and shape == (batch, seq, vocab // tp):
        return (
            f"{got}: the output projection's plan leaves the logits sharded over the vocabulary "
            f"(each rank holds vocab_size / {tp}), so the loss would see the wrong classes; use a "
            "plan that gathers them when loss_parallel is False (output_layouts=Replicate(), "
            "as titan_core.blocks.tp_plan_ends does)"
        )
    if tp > 1 and shape == (batch, seq // tp, vocab):
        return (
            f"{got}: the plan leaves the logits sharded over the sequence (each rank holds seq / "
            f"{tp} positions), so the loss would see the wrong tokens; gather the sequence at the "
            "output projection (ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))"
        )
    return got


def _vocab_size(args: Any) -> int | None:
    return getattr(args, "vocab_size", None) or (args.get("vocab_size") if isinstance(args, dict) else None)


def _check_tp_plan(spec: ModelSpec, args: Any, tp: int, batch_size: int, seq_len: int) -> list[str]:
    """Apply the TP plan on a one-process fake mesh of ``tp`` ranks: every parameter a DTensor,
    and a forward pass that runs under it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        return []  # a process group exists already (a distributed test): do not replace it
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = spec.build(args)
        try:
            spec.tp_plan(model, mesh["tp"], False)
        except Exception as exc:
            return [f"tp_plan failed on a {tp}-rank mesh: {type(exc).__name__}: {exc}"]
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            return [f"tp_plan left plain (non-DTensor) parameters: {', '.join(plain[:5])}"]
        return _forward_under_tp(model, args, tp, batch_size, seq_len)
    finally:
        dist.destroy_process_group()
