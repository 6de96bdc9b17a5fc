"""Load balancing and router statistics: the sequence-wise balance loss, its gradient injection,
the expert-bias update, what a step records (and what it must not), the ``moe`` config checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_plugins_moe import config as moe_config
from titan_plugins_moe.balance import RouterCallback, take_step
from titan_plugins_moe.config import MoEConfig
from titan_plugins_moe.flavors import FLAVORS, MoEArgs
from titan_plugins_moe.model import MoE, MoETransformer
from titan_plugins_moe.moe import sequence_balance_loss

ARGS = attrs.evolve(
    FLAVORS["deepseek_v3_debugmodel"], dim=32, n_heads=4, vocab_size=64, n_layers=3, n_experts=8, top_k=2
)


def build(args: MoEArgs = ARGS, seed: int = 0) -> MoETransformer:
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def layer(model: MoETransformer, i: int = 1) -> MoE:
    moe = model.layers[str(i)].feed_forward
    assert isinstance(moe, MoE)
    return moe


def fake_trainer(model: torch.nn.Module, settings: MoEConfig, batch: int, seq: int) -> SimpleNamespace:
    return SimpleNamespace(
        parts=[model],
        config=SimpleNamespace(moe=settings, training=SimpleNamespace(local_batch_size=batch, seq_len=seq)),
        parallel_dims=SimpleNamespace(dp=1, cp=1),
        mesh=None,
        device=torch.device("cpu"),
    )


# -- the sequence-wise balance loss -------------------------------------------------------------


def test_balance_loss_is_one_when_balanced_and_grows_with_skew() -> None:
    batch, seq, experts, k = 2, 8, 4, 2
    uniform = torch.full((batch * seq, experts), 1 / experts)
    # Every expert gets seq * k / experts slots of each sequence.
    balanced = torch.tensor([[0, 1], [2, 3]] * (batch * seq // 2))
    torch.testing.assert_close(sequence_balance_loss(uniform, balanced, batch, k), torch.ones(batch))
    skewed_scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(batch * seq, -1)
    skewed = torch.tensor([[0, 1]]).expand(batch * seq, -1)
    # f = (2, 2, 0, 0), P = (0.7, 0.1, 0.1, 0.1): sum f*P = 1.6
    torch.testing.assert_close(
        sequence_balance_loss(skewed_scores, skewed, batch, k), torch.full((batch,), 1.6)
    )


def test_balance_loss_normalises_sigmoid_scores() -> None:
    scores = torch.rand(6, 4) + 0.1
    experts = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    got = sequence_balance_loss(scores, experts, 1, 2)
    assert torch.allclose(got, sequence_balance_loss(scores / scores.sum(-1, keepdim=True), experts, 1, 2))


def test_aux_loss_gradient_is_that_of_the_added_term() -> None:
    """The injected gradient equals backpropagating ``out.sum() + weight * mean balance loss``."""
    model = build()
    moe = layer(model)
    x = torch.randn(3, 5, ARGS.dim)
    moe.aux_loss_weight = 0.3
    moe(x).sum().backward()
    injected = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.aux_loss_weight = 0.0
    out = moe(x)
    _, experts, scores = moe.router(x.reshape(-1, ARGS.dim))
    aux = 0.3 * sequence_balance_loss(scores, experts, 3, ARGS.top_k).mean()
    (out.sum() + aux).backward()
    torch.testing.assert_close(injected, moe.router.gate.weight.grad)
    assert not torch.equal(injected, torch.zeros_like(injected))


def test_aux_loss_of_microbatches_adds_up_to_the_batch_mean() -> None:
    """With ``aux_batch_size`` = the local batch, pipeline microbatches give the batch's gradient."""
    model = build()
    moe = layer(model)
    moe.aux_loss_weight, moe.aux_batch_size = 0.5, 4
    x = torch.randn(4, 6, ARGS.dim)
    moe(x).sum().backward()
    whole = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    for half in x.split(2):
        moe(half).sum().backward()
    torch.testing.assert_close(moe.router.gate.weight.grad, whole)


def test_context_parallel_shards_give_the_whole_sequences_loss_and_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each CP rank's term uses the whole sequence's expert counts and its shard's mean scores:
    the mean of the ranks' terms (what is logged) and of their gradients (what the data-parallel
    average over the ``cp`` ranks takes) are the one-process sequence loss and its gradient."""
    from titan_plugins_moe import moe as moe_module
    from titan_plugins_parallel.context_parallel import chunk_positions

    cp, batch, seq, weight = 2, 3, 8, 0.3
    model = build()
    moe = layer(model)
    x = torch.randn(batch, seq, ARGS.dim)
    shards = [x[:, chunk_positions(r, cp, seq)] for r in range(cp)]  # load-balanced chunks

    moe.aux_loss_weight = weight
    (moe(x) * 0).sum().backward()  # only the injected balance loss has a gradient
    whole = moe.router.gate.weight.grad.clone()
    _, experts, scores = moe.router(x.reshape(-1, ARGS.dim))
    expected = weight * sequence_balance_loss(scores, experts, batch, ARGS.top_k).mean()

    # The all-reduce over the cp group: the shards' per-sequence expert counts summed.
    total = torch.zeros(batch, ARGS.n_experts)
    for shard in shards:
        _, chosen, _ = moe.router(shard.reshape(-1, ARGS.dim))
        slots = chosen.reshape(batch, -1)
        total.scatter_add_(1, slots, torch.ones_like(slots, dtype=total.dtype))
    group = object()

    def all_reduce(load: torch.Tensor, g: object) -> torch.Tensor:
        assert g is group and load.shape == total.shape
        return total

    monkeypatch.setattr(moe_module, "_sum_over", all_reduce)
    moe.aux_cp_group, moe.aux_cp = group, cp
    moe.stats = []
    grads = []
    for shard in shards:
        moe.zero_grad()
        (moe(shard) * 0).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    logged = torch.stack([aux for _, _, aux in moe.stats]).mean()
    torch.testing.assert_close(logged, expected.detach())
    torch.testing.assert_close(torch.stack(grads).mean(dim=0), whole)
    # Each shard counted as a sequence of its own (the old behaviour) is another loss.
    moe.aux_cp_group, moe.aux_cp = None, 1
    moe.stats = []
    for shard in shards:
        moe(shard)
    alone = torch.stack([aux for _, _, aux in moe.stats]).mean()
    assert not torch.allclose(alone, expected.detach(), rtol=1e-4, atol=0)


# -- what a step records -------------------------------------------------------------------------


def test_recorded_once_per_training_forward_not_under_no_grad_or_recomputation() -> None:
    model = build()
    moe = layer(model)
    moe.stats = []
    x = torch.randn(2, 4, ARGS.dim, requires_grad=True)
    with torch.no_grad():
        moe(x)
    assert moe.stats == []
    # Recomputed whole inside backward: without early stopping the recomputation reaches the end
    # of the forward, where the layer records (titan's activation checkpointing is non-reentrant).
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert len(moe.stats) == 1
    tokens, counts, aux = moe.stats[0]
    assert tokens == 8 and int(counts.sum()) == 8 * ARGS.top_k and aux is None


def test_a_surplus_forward_before_the_step_is_dropped() -> None:
    """torch's pipeline schedules run a metadata-inference forward on placeholders first."""
    moe = layer(build())
    garbage, real_a, real_b = torch.tensor([9, 0]), torch.tensor([1, 3]), torch.tensor([2, 2])
    moe.stats = [(2, garbage, None), (2, real_a, torch.tensor(0.5)), (2, real_b, torch.tensor(0.25))]
    counts, aux = take_step(moe, tokens=4)
    assert counts.tolist() == [3, 5] and float(aux) == 0.75
    assert moe.stats == []


# -- the bias update and the statistics ---------------------------------------------------------------


def skewed_model() -> MoETransformer:
    model = build(attrs.evolve(ARGS, n_expert_groups=1, n_limited_groups=1))
    with torch.no_grad():  # every token prefers experts 0 and 1
        for i in (1, 2):
            layer(model, i).router.gate.weight[:2] += 0.5 * torch.ones(ARGS.dim)
    return model


def test_bias_update_moves_a_skewed_router_towards_balance() -> None:
    model = skewed_model()
    batch, seq = 4, 16
    callback = RouterCallback.build(fake_trainer(model, MoEConfig(bias_update_rate=0.02), batch, seq))
    # Tokens that differ enough for one step to spread them: each step's imbalance is reported.
    x = torch.ones(batch, seq, ARGS.dim) + 2.0 * torch.randn(batch, seq, ARGS.dim)
    history = []
    for step in range(1, 61):
        layer(model)(x)
        layer(model, 2)(x)
        callback.after_optimizer_step(step)
        if step in (1, 59, 60):  # step 60's statistics are that step's alone
            history.append(callback.metrics(step))
    first, _, last = history
    assert first["moe/layer1/imbalance"] > 3.0  # 2 of 8 experts take nearly all slots
    for i in (1, 2):
        assert last[f"moe/layer{i}/imbalance"] < min(2.0, first[f"moe/layer{i}/imbalance"] / 2)
    assert last["moe/layer1/tokens_min"] > 0
    bias = layer(model).router.expert_bias
    assert bias[:2].max() < 0 < bias[2:].max()  # favoured experts pushed down, others up
    assert abs(float(bias.mean())) < 1e-6  # centred
    # The bias changes the choice only: the weights stay the unbiased scores.
    weights, experts, scores = layer(model).router(x.reshape(-1, ARGS.dim))
    torch.testing.assert_close(
        weights, 2.5 * scores.gather(1, experts) / scores.gather(1, experts).sum(-1, keepdim=True)
    )


def test_bias_update_balances_group_limited_routing_too() -> None:
    """DeepSeek-V3's routing: the two favoured experts share a group, which wins every token's
    group choice; the bias also steers the choice of groups (their scores include it)."""
    model = build(attrs.evolve(ARGS, n_expert_groups=4, n_limited_groups=2))
    with torch.no_grad():
        for i in (1, 2):
            layer(model, i).router.gate.weight[:2] += 0.5
    callback = RouterCallback.build(fake_trainer(model, MoEConfig(bias_update_rate=0.02), 4, 16))
    noise = torch.randn(4, 16, ARGS.dim, generator=torch.Generator().manual_seed(1))
    x = torch.ones(4, 16, ARGS.dim) + 2.0 * noise
    rows = []
    for step in range(1, 61):
        layer(model)(x)
        layer(model, 2)(x)
        callback.after_optimizer_step(step)
        if step in (1, 59, 60):
            rows.append(callback.metrics(step))
    first, _, last = rows
    for i in (1, 2):
        assert first[f"moe/layer{i}/imbalance"] == 4.0  # every slot on experts 0 and 1
        assert last[f"moe/layer{i}/imbalance"] < 3.0
        bias = layer(model, i).router.expert_bias
        assert bias[:2].max() < 0 < bias[2:].min()


def test_statistics_summarise_the_interval_per_step() -> None:
    model = build()
    callback = RouterCallback.build(fake_trainer(model, MoEConfig(), batch=1, seq=4))
    moe1, moe2 = layer(model, 1), layer(model, 2)
    n = ARGS.n_experts
    for step in (1, 2):
        moe1.stats.append((4, torch.tensor([8] + [0] * (n - 1)), None))  # all 8 slots on expert 0
        moe2.stats.append((4, torch.tensor([1] * n), None))
        callback.after_optimizer_step(step)
    row = callback.metrics(2)
    assert (
        row["moe/layer1/imbalance"] == n
        and row["moe/layer1/tokens_max"] == 8
        and row["moe/layer1/tokens_min"] == 0
    )
    assert row["moe/layer2/imbalance"] == 1.0 and row["moe/layer2/tokens_max"] == 1.0
    assert row["moe/imbalance_max"] == n and row["moe/imbalance_mean"] == (n + 1) / 2
    assert "moe/aux_loss" not in row and "moe/expert_bias_absmax" not in row
    # The interval restarts after a log.
    moe1.stats.append((4, torch.tensor([1] * n), None))
    moe2.stats.append((4, torch.tensor([1] * n), None))
    callback.after_optimizer_step(3)
    assert callback.metrics(3)["moe/imbalance_max"] == 1.0
    summary = RouterCallback.build(fake_trainer(model, MoEConfig(router_stats="summary"), 1, 4))
    assert not any("layer" in k for k in summary.metrics(1))


def test_the_imbalance_is_each_steps_not_the_intervals_sum() -> None:
    # Two steps, each sending every slot of layer 1 to one expert (another one each step): every
    # step is as imbalanced as it gets (n), which the counts summed over the interval (two busy
    # experts: n / 2) hid more the longer metrics.log_freq was.
    model = build()
    callback = RouterCallback.build(fake_trainer(model, MoEConfig(), batch=1, seq=4))
    n = ARGS.n_experts
    for step in (1, 2):
        counts = [0] * n
        counts[step - 1] = 8
        layer(model, 1).stats.append((4, torch.tensor(counts), None))
        layer(model, 2).stats.append((4, torch.tensor([1] * n), None))
        callback.after_optimizer_step(step)
    row = callback.metrics(2)
    assert row["moe/layer1/imbalance"] == n and row["moe/imbalance_max"] == n
    assert row["moe/layer1/tokens_max"] == 8 and row["moe/layer1/tokens_min"] == 0


def test_callback_sets_the_loss_weight_and_is_absent_when_nothing_is_asked() -> None:
    model = build()
    off = MoEConfig(router_stats="off")
    assert RouterCallback.build(fake_trainer(model, off, 8, 16)) is None
    assert layer(model).stats is None  # nothing is recorded either
    callback = RouterCallback.build(
        fake_trainer(model, MoEConfig(aux_loss_weight=0.01, router_stats="off"), 8, 16)
    )
    assert callback is not None
    assert (layer(model).aux_loss_weight, layer(model).aux_batch_size) == (0.01, 8)
    llama_like = torch.nn.Linear(2, 2)
    assert RouterCallback.build(fake_trainer(llama_like, MoEConfig(bias_update_rate=0.1), 8, 16)) is None


def test_callback_gives_the_layers_the_context_parallel_group() -> None:
    model = build()
    group = object()
    trainer = fake_trainer(model, MoEConfig(aux_loss_weight=0.01), 8, 16)
    trainer.parallel_dims = SimpleNamespace(dp=1, cp=2)
    trainer.mesh = {
        "cp": SimpleNamespace(get_group=lambda: group),
        "dp_cp": SimpleNamespace(get_group=lambda: None),
    }
    RouterCallback.build(trainer)
    assert (layer(model).aux_cp_group, layer(model).aux_cp) == (group, 2)
    # Without context parallelism every sequence is whole on its rank.
    other = build()
    RouterCallback.build(fake_trainer(other, MoEConfig(aux_loss_weight=0.01), 8, 16))
    assert (layer(other).aux_cp_group, layer(other).aux_cp) == (None, 1)


def pipeline_trainer(model: torch.nn.Module, simulated: frozenset[str] = frozenset()) -> SimpleNamespace:
    """A fake trainer of one pipeline stage out of two (the stages' group is ``"pp-group"``)."""
    trainer = fake_trainer(model, MoEConfig(bias_update_rate=0.01), 2, 8)
    trainer.parallel_dims = SimpleNamespace(dp=1, cp=1, pp=2)
    trainer.mesh = {"dp_cp": SimpleNamespace(get_group=lambda: None)}
    trainer.topology = SimpleNamespace(simulated=simulated, group=lambda dim, mesh: f"{dim}-group")
    trainer.model_args = model.args
    return trainer


def test_under_pipeline_parallelism_every_stage_joins_the_sum_of_all_layers() -> None:
    """Each stage lays its layers out among every MoE layer of the model (summed over the ``pp``
    group on logging steps); a stage of dense blocks only takes part too (else the others wait)."""
    model = build(attrs.evolve(ARGS, n_layers=4))
    del model.layers["1"], model.layers["2"]  # this stage holds blocks 0 (dense) and 3
    callback = RouterCallback.build(pipeline_trainer(model))
    assert callback.stage_group == "pp-group"
    assert (callback.labels, callback.slots) == (["1", "2", "3"], [2])
    dense_only = build(attrs.evolve(ARGS, n_layers=4))
    for i in ("1", "2", "3"):
        del dense_only.layers[i]
    joined = RouterCallback.build(pipeline_trainer(dense_only))
    assert joined is not None and joined.layers == [] and joined.slots == []
    joined.after_optimizer_step(1)  # nothing routed here: no counts, no update
    # Simulated stages (a fake comm backend) move nothing: each reports its own layers.
    alone = RouterCallback.build(pipeline_trainer(model, simulated=frozenset({"pp"})))
    assert alone.stage_group is None and alone.labels == ["3"]
    assert RouterCallback.build(pipeline_trainer(dense_only, simulated=frozenset({"pp"}))) is None


def test_the_aux_loss_is_reported() -> None:
    model = build()
    callback = RouterCallback.build(fake_trainer(model, MoEConfig(aux_loss_weight=0.01), batch=2, seq=8))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    callback.after_optimizer_step(1)
    row = callback.metrics(1)
    # Two MoE layers, each ~0.01 x (balance loss >= ~1).
    assert 0.015 < row["moe/aux_loss"] < 0.1


# -- config ------------------------------------------------------------------------------------------


def test_balancing_without_a_moe_model_is_a_config_error() -> None:
    cfg = SimpleNamespace(model=SimpleNamespace(name="llama3"), moe=MoEConfig(aux_loss_weight=0.01))
    (problem,) = moe_config.check(cfg)
    assert problem.startswith(
        "moe.aux_loss_weight: set to 0.01, but model.name = 'llama3' has no routed experts"
    )
    assert moe_config.check(SimpleNamespace(model=SimpleNamespace(name="moe"), moe=cfg.moe)) == []


def test_bad_values_fail_on_the_field() -> None:
    from titan_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"bias_update_rate: expected a number >= 0, got -0.1"):
        MoEConfig(bias_update_rate=-0.1)
    with pytest.raises(ConfigError, match=r"router_stats: expected one of off, summary, per_layer"):
        MoEConfig(router_stats="all")


def hybrid_trainer(model: torch.nn.Module, **degrees: int) -> SimpleNamespace:
    """A fake trainer of one process of ``real_pp_fake_spmd`` (every mesh dimension but ``pp``
    simulated) with the given parallel degrees (1 where not given)."""
    trainer = pipeline_trainer(model, simulated=frozenset({"dp_replicate", "dp_shard", "cp", "tp"}))
    trainer.config.moe = MoEConfig(bias_update_rate=0.01, aux_loss_weight=0.01)
    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 2, **degrees}
    trainer.parallel_dims = SimpleNamespace(**sizes, dp=sizes["dp_replicate"] * sizes["dp_shard"], ep=1)
    # One pipeline stage holds the whole model here: no stage group to add the stages' values up.
    trainer.topology.group = lambda dim, mesh: None
    trainer.topology.groups = {"pp": "real-pp-group"}  # the pipeline stages are real processes
    return trainer


@pytest.mark.parametrize("degrees", [{"tp": 2}, {"dp_shard": 2}, {"cp": 2}])
def test_statistics_of_simulated_peers_are_left_out(degrees: dict[str, int]) -> None:
    """Under ``real_pp_fake_spmd`` the data/context/tensor-parallel peers are simulated: their
    collectives move nothing, so the counts were one rank's (not summed over the batch), of
    garbage activations under TP/EP, and the balance loss was divided by ranks that added
    nothing; they were logged as the batch's. They are left out; the balancing still runs."""
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))

    def one_step(trainer: SimpleNamespace) -> dict[str, float]:
        model = trainer.parts[0]
        callback = RouterCallback.build(trainer)
        assert callback is not None
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        callback.after_optimizer_step(1)
        assert layer(model).router.expert_bias.abs().max() > 0  # the bias update ran
        return callback.metrics(1)

    trainer = hybrid_trainer(build(), **degrees)
    # The statistics never ask for the simulated data-parallel group: its all-reduce would return
    # this rank's values. (The balance loss takes the ``cp`` group, as the job it stands for.)
    trainer.mesh = {
        "dp_cp": SimpleNamespace(get_group=_no_group("dp_cp")),
        "cp": SimpleNamespace(get_group=lambda: None),
    }
    assert not any(k.startswith("moe/") for k in one_step(trainer))
    # Every simulated degree 1 (NGPU = pp): the run is real, its statistics are reported.
    row = one_step(hybrid_trainer(build()))
    assert {"moe/layer1/imbalance", "moe/aux_loss", "moe/expert_bias_absmax"} <= row.keys()
    # Every peer simulated (``fake``): each value of the run is documented as meaningless, and the
    # first stage's counts are those of its own tokens (tests/plugins/comm/test_fake.py).
    every_peer = hybrid_trainer(build(), **degrees)
    every_peer.topology.groups = {}
    every_peer.mesh = {name: SimpleNamespace(get_group=lambda: None) for name in ("dp_cp", "cp")}
    assert "moe/layer1/imbalance" in one_step(every_peer)


def _no_group(name: str) -> Any:
    def get_group() -> None:
        raise AssertionError(f"asked for the simulated {name} group")

    return get_group


def test_a_later_simulated_stage_leaves_its_statistics_out() -> None:
    """Under ``--comm-backend fake`` with computed tensors a stage after the first routes the
    activations its simulated receive returned (zeros): every token tied on the first experts and
    the stage logged imbalance 4.0 of 4 experts, ``tokens_min`` 0, each step, as if measured."""
    model = build(attrs.evolve(ARGS, n_layers=4))
    model.tok_embeddings = None  # a later stage: its input comes from the previous one
    trainer = pipeline_trainer(model, simulated=frozenset({"pp"}))
    callback = RouterCallback.build(trainer)
    assert callback is not None
    layer(model, 3)(torch.zeros(2, 8, ARGS.dim))
    callback.after_optimizer_step(1)
    assert not any(k.startswith("moe/") for k in callback.metrics(1))
    # The first stage routes the real tokens: it reports its own layers (test above).
