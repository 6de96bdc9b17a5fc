"""Expert parallelism: each ``ep`` rank holds ``experts / ep`` experts of every MoE layer, and
tokens travel to the rank of their expert and back through ``all_to_all_single``.

Token dispatch and combine (:func:`dispatch`, :func:`combine`) are reusable on their own: they
take tokens sorted by global expert and per-expert counts, exchange the counts, send each
rank's slice with uneven split sizes through the autograd-aware functional
``all_to_all_single``, regroup what arrives by local expert, and undo all of it on the way back.

The strategy works on any module that declares ``grouped_experts = True`` (titan's MoE contract,
see ``titan_plugins_moe.model``): expert weights stacked on dim 0, called as
``experts(tokens_sorted_by_expert, num_tokens_per_expert)``. Through ``distribute_module`` its
weights become DTensors sharded on dim 0 over the EP mesh, with dispatch as the forward
pre-hook and combine as the forward hook.

Meshes: EP borrows its ranks from ``dp_shard x cp`` (the flattened ``dp_shard_cp`` axis, as in
torchtitan). A second world mesh ``(pp, dp_replicate, efsdp, ep, tp)`` splits that axis into
``efsdp = dp_shard*cp/ep`` outer and ``ep`` inner (consecutive ranks form an EP group). Expert
weights are then sharded by FSDP over ``efsdp`` (and replicated over ``dp_replicate``) here,
before the FSDP strategy wraps the blocks: FSDP skips parameters of modules already sharded, so
the dense weights are sharded over ``dp_shard_cp`` and the experts over ``efsdp`` x ``ep``.

Gradient scale: an expert's gradient arrives summed over the tokens of all ``ep`` ranks (the
all-to-all's backward brings them home), while every rank's loss is its own mean; the experts'
FSDP divides by the number of ranks that average the loss (``dp_replicate*dp_shard*cp``), not by
its own mesh size, so experts get the same gradient as in a one-process run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from titan_core.errors import UsageError
from titan_core.fake_tensors import even_split, is_fake

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from titan_core.config import TrainerConfig
    from titan_core.parallel_dims import ParallelDims
    from titan_core.parallelize import ParallelContext
    from titan_core.records import ModelSpec


class DispatchState(NamedTuple):
    """What :func:`combine` needs to send expert outputs back where their tokens came from.

    A ``NamedTuple``, not a frozen attrs class: under ``compile.enable`` it is built inside a
    compiled block (after the graph break of the split sizes' ``tolist``), and dynamo cannot
    trace a frozen attrs ``__init__`` (its cached ``object.__setattr__``: "expected
    WrapperDescriptorType"), which stopped every EP run with compiled blocks at step 1.
    """

    #: Permutation from arrival order (source-rank major) to local-expert order.
    perm: Any
    #: Tokens this rank sent to / received from each EP rank.
    send_splits: list[int]
    recv_splits: list[int]


def applies(config: TrainerConfig, parallel_dims: ParallelDims) -> bool:
    """Whenever the expert-parallel degree is above 1."""
    return parallel_dims.ep > 1


def check(config: TrainerConfig, parallel_dims: ParallelDims, spec: ModelSpec, model_args: Any) -> list[str]:
    """``Strategy.check``: EP does not compose with TP, and the model must have grouped experts
    whose count ``ep`` divides. No field of a ``ModelSpec`` says whether a model has experts
    (``num_active_params`` is for ``titan models list``, and a third-party MoE model may leave it
    out), so the model is built on the meta device (no memory) and its modules are looked at as
    :func:`apply` looks at the built one. Found only there, every worker of a launch started,
    built its model and failed in turn. A model that cannot be built on meta is left to
    :func:`apply`."""
    pd = parallel_dims
    if pd.tp > 1:
        return [
            f"expert parallel (ep={pd.ep}) with tensor parallel (tp={pd.tp}) is not supported; "
            "set parallelism.tp = 1 or parallelism.ep = 1"
        ]
    if pd.ep <= 1:
        return []
    import torch

    try:
        with torch.device("meta"):
            model = spec.build(model_args)
    except Exception:  # the real build says what is wrong, naming the model
        return []
    return _expert_problems(_grouped_experts([model]), pd.ep, spec.name)


def _expert_problems(experts: list[nn.Module], ep: int, model: str) -> list[str]:
    """Why ``ep`` cannot shard these grouped-experts modules (none, or a count it does not divide)."""
    if not experts:
        return [
            f"parallelism.ep={ep} but model {model!r} has no grouped-experts (MoE) layers; set "
            "parallelism.ep = 1 or pick a MoE model (e.g. model.name = 'moe')"
        ]
    counts = sorted({m.num_experts for m in experts if m.num_experts % ep})
    return [
        f"parallelism.ep={ep} must divide the number of experts per layer ({count}); pick an ep "
        "that divides it"
        for count in counts
    ]


def dispatch(
    tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor, group: Any, *, peers_simulated: bool = False
) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
    """Send tokens (sorted by global expert) to the ranks owning their experts.

    Returns the tokens this rank's experts must process (sorted by local expert), how many each
    local expert gets, and the state for :func:`combine`. ``num_tokens_per_expert`` has one
    entry per global expert; rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)``.
    ``peers_simulated`` (a fake comm backend): nothing is received, so each peer is taken to send
    this rank's experts what this rank sends its experts (as many tokens arrive as leave).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    ep = dist.get_world_size(group)
    n_local = num_tokens_per_expert.numel() // ep
    # Exchange counts: row s of `received` = tokens rank s sends to each of my experts.
    received = torch.empty_like(num_tokens_per_expert)
    dist.all_to_all_single(received, num_tokens_per_expert.contiguous(), group=group)
    received = received.view(ep, n_local)
    if peers_simulated and not is_fake(received):
        # The buffer holds whatever memory did (torch 2.11: a count of -1.2e18 tokens; zeros
        # elsewhere, a step with no expert compute to account for).
        received = num_tokens_per_expert.view(ep, n_local).clone()
    if is_fake(received):  # shape-only steps: every rank sends every rank an even share
        send_splits = recv_splits = even_split(tokens.shape[0], ep)
    else:
        send_splits = num_tokens_per_expert.view(ep, n_local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
    arrived = funcol.all_to_all_single_autograd(tokens.contiguous(), recv_splits, send_splits, group)
    # Arrivals are grouped by source rank, then expert; regroup by local expert (stable).
    expert_of = torch.arange(n_local, device=tokens.device).repeat(ep)
    expert_of = expert_of.repeat_interleave(received.flatten(), output_size=sum(recv_splits))
    perm = expert_of.argsort(stable=True)
    return arrived[perm], received.sum(dim=0), DispatchState(perm, send_splits, recv_splits)


def combine(outputs: torch.Tensor, state: DispatchState, group: Any) -> torch.Tensor:
    """Return expert outputs to the ranks (and the order) their tokens came from."""
    import torch.distributed._functional_collectives as funcol

    back = outputs[state.perm.argsort()].contiguous()
    return funcol.all_to_all_single_autograd(back, state.send_splits, state.recv_splits, group)


def expert_mesh(ctx: ParallelContext) -> Any:
    """World mesh ``(pp, dp_replicate, efsdp, ep, tp)``: ``dp_shard_cp`` split into efsdp x ep."""
    from torch.distributed.device_mesh import init_device_mesh

    pd = ctx.parallel_dims
    shape = (pd.pp, pd.dp_replicate, pd.dp_shard * pd.cp // pd.ep, pd.ep, pd.tp)
    names = ("pp", "dp_replicate", "efsdp", "ep", "tp")
    return init_device_mesh(ctx.topology.device.type, shape, mesh_dim_names=names)


def _shard_experts(name: str, module: nn.Module, mesh: Any) -> None:
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
        module.register_parameter(pname, sharded)


def _dispatch_hook(peers_simulated: bool) -> Callable[[nn.Module, Any, Any], Any]:
    """``distribute_module``'s input hook (module, inputs, mesh): :func:`dispatch`."""

    def hook(module: nn.Module, inputs: Any, mesh: Any) -> Any:
        tokens, counts = inputs
        local, local_counts, module._ep_state = dispatch(
            tokens, counts, mesh.get_group(), peers_simulated=peers_simulated
        )
        return local, local_counts

    return hook


def _combine_hook(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    state, module._ep_state = module._ep_state, None
    return combine(outputs, state, mesh.get_group())


def _set_divide_factor(module: Any, factor: float, shard_size: int, device_type: str) -> None:
    """Divide the experts' summed gradients by ``factor`` instead of FSDP's mesh size."""
    # Renamed in torch 2.8 (set_reduce_scatter_divide_factor -> set_gradient_divide_factor).
    setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    setter(factor)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if device_type != "cuda" and shard_size > 1 and force_sum is not None:
        # A custom factor makes FSDP reduce-scatter with PREMUL_SUM, which NCCL has and gloo
        # lacks; summing and dividing afterwards is the same. Not with one shard: FSDP then skips
        # the reduce-scatter and divides by the factor itself (forcing would divide twice).
        force_sum(True)


def _grouped_experts(modules: list[nn.Module]) -> list[nn.Module]:
    return [m for part in modules for m in part.modules() if getattr(m, "grouped_experts", False)]


def _whole_model_has_experts(ctx: ParallelContext) -> bool:
    """Whether the whole model (every pipeline stage) has grouped experts: built on the meta
    device (no memory), only for a stage that has none itself."""
    import torch

    with torch.device("meta"):
        return bool(_grouped_experts([ctx.spec.build(ctx.model_args)]))


def apply(parts: list[nn.Module], ctx: ParallelContext) -> list[nn.Module]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_module

    from titan_plugins_parallel.fsdp import mixed_precision, reshard_after_forward

    pd = ctx.parallel_dims
    # :func:`check` passed before anything was built; what only the built model shows:
    experts = _grouped_experts(parts)
    if not experts and getattr(pd, "pp", 1) > 1 and _whole_model_has_experts(ctx):
        # A pipeline stage of dense blocks only (DeepSeek-V3's leading dense blocks at a high PP
        # degree): nothing to shard here, but the expert mesh's process groups are created by
        # every rank together, so this stage creates them too (or the others would wait).
        expert_mesh(ctx)
        return parts
    problems = _expert_problems(experts, pd.ep, ctx.spec.name)
    if problems:
        raise UsageError(problems[0])
    mesh = expert_mesh(ctx)
    dp_mesh = mesh[("dp_replicate", "efsdp")] if pd.dp_replicate > 1 else mesh["efsdp"]
    # The same mixed precision as the FSDP strategy gives the dense weights.
    mp = mixed_precision(ctx)
    options: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    options["reshard_after_forward"] = reshard_after_forward(ctx)
    device = ctx.topology.device.type
    # EP's ranks are borrowed from dp_shard x cp: simulated there, they send nothing real.
    dispatch_hook = _dispatch_hook(bool(ctx.topology.simulated & {"dp_shard", "cp"}))
    for module in experts:
        distribute_module(module, mesh["ep"], _shard_experts, dispatch_hook, _combine_hook)
        fully_shard(module, mesh=dp_mesh, **options)
        _set_divide_factor(module, pd.dp_replicate * pd.dp_shard * pd.cp, mesh["efsdp"].size(), device)
    return parts
