"""Activation checkpointing: which blocks are wrapped, unchanged state-dict keys, unchanged losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import TINY_MODEL, tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import Trainer
from titan_plugins_parallel.activation_checkpoint import wrapped_indices


def test_full_and_op_wrap_every_block_an_integer_option_every_nth() -> None:
    assert wrapped_indices("full", 4) == [0, 1, 2, 3]
    assert wrapped_indices("selective", 4, "op") == [0, 1, 2, 3]
    assert wrapped_indices("selective", 5, "2") == [1, 3]
    assert wrapped_indices("selective", 7, "3") == [2, 5]
    assert wrapped_indices("none", 4) == []


def backward_matmuls(mode: str, option: str = "op", **model: Any) -> int:
    """``aten.mm`` calls during the backward of one tiny Llama 3 block, under ``mode``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_plugins_parallel.activation_checkpoint import apply

    class CountMatmuls(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func == torch.ops.aten.mm.default:
                CountMatmuls.calls += 1
            return func(*args, **(kwargs or {}))

    config = tiny_config(
        **{"activation_checkpoint.mode": mode, "activation_checkpoint.selective_ac_option": option}
    )
    config.model.overrides = {**config.model.overrides, **model}
    spec = get_registry().get("models", "llama3", what="model")
    torch.manual_seed(0)
    model = spec.build(spec.flavor(config.model.flavor, config.model.overrides))
    model.init_weights(buffer_device=torch.device("cpu"))

    class Ctx:
        pass

    ctx = Ctx()
    ctx.config = config  # type: ignore[attr-defined]
    if mode != "none":
        apply([model], ctx)  # type: ignore[arg-type]
    loss = model(torch.randint(0, 100, (2, 16))).float().mean()
    with CountMatmuls():
        loss.backward()
    return CountMatmuls.calls


def test_op_policy_recomputes_every_second_matmul_of_each_block() -> None:
    plain, op, full = backward_matmuls("none"), backward_matmuls("selective", "op"), backward_matmuls("full")
    blocks = TINY_MODEL["n_layers"]
    # Full recomputation redoes each block's forward matmuls; "op" keeps the 1st, 3rd, ... of them.
    per_block = (full - plain) // blocks
    assert per_block >= 2 and full - plain == per_block * blocks
    assert op - plain == blocks * (per_block // 2)


@pytest.mark.parametrize(("fuse_w13", "recomputed"), [(True, 1), (False, 2)])
def test_op_policy_recomputes_only_wo_when_gate_and_up_are_one_matmul(
    fuse_w13: bool, recomputed: int
) -> None:
    """A Llama block's matmuls under the ``op`` policy: fused Q/K/V (kept), ``wo`` (recomputed),
    then the fused gate/up projection (kept) and ``w2`` (its output is not needed in backward);
    with ``w1`` and ``w3`` apart, ``w3`` is recomputed too."""
    plain = backward_matmuls("none", fuse_w13=fuse_w13)
    op = backward_matmuls("selective", "op", fuse_w13=fuse_w13)
    assert op - plain == TINY_MODEL["n_layers"] * recomputed


def train_tiny(tmp_path: Path, seed: Path, **overrides: Any) -> tuple[Trainer, list[float]]:
    config = tiny_config(
        **{"checkpoint.initial_load_path": str(seed), "job.dump_folder": str(tmp_path), **overrides}
    )
    trainer = Trainer(config, get_registry())
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return trainer, [row["loss"] for row in history]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> tuple[list[str], list[float]]:
    """State-dict keys and losses without activation checkpointing."""
    trainer, losses = train_tiny(tmp_path_factory.mktemp("plain"), seed_checkpoint)
    return list(trainer.parts[0].state_dict()), losses


@pytest.mark.parametrize(
    ("mode", "extra", "wrapped"),
    [
        ("full", {"activation_checkpoint.preserve_rng_state": True}, {"0", "1", "2", "3"}),
        (
            "selective",
            {
                "activation_checkpoint.selective_ac_option": "2",
                "activation_checkpoint.determinism_check": "none",
                "activation_checkpoint.debug": True,
            },
            {"1", "3"},
        ),
        ("selective", {}, {"0", "1", "2", "3"}),
    ],
)
def test_checkpointed_blocks_give_the_losses_of_no_checkpointing(
    tmp_path: Path,
    seed_checkpoint: Path,
    plain: tuple[list[str], list[float]],
    mode: str,
    extra: dict,
    wrapped: set[str],
) -> None:
    keys, expected = plain
    trainer, losses = train_tiny(tmp_path, seed_checkpoint, **{"activation_checkpoint.mode": mode, **extra})
    layers = trainer.parts[0].layers
    assert {k for k, block in layers.items() if type(block).__name__ == "CheckpointWrapper"} == wrapped
    assert "activation_checkpoint" in trainer.ctx.applied
    # Keys are those of the unwrapped model, so the seed (and any checkpoint) loads as is.
    assert list(trainer.parts[0].state_dict()) == keys
    assert len(losses) == len(expected) >= 5
    assert losses == pytest.approx(expected, rel=1e-5)


class _PolicyCtx:
    """What ``torch.utils.checkpoint`` passes a selective policy: forward or recomputation."""

    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def test_op_policy_saves_flex_attention_in_eager_and_compiled_form() -> None:
    """Flex attention is a higher-order operator (no ``.default`` overload); through its own
    ``torch.compile`` it reaches the policy as ``inductor_compiled_code``. Both must be kept,
    or backward would run the attention forward again."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from titan_plugins_parallel.activation_checkpoint import op_policy

    flex = torch.ops.higher_order.flex_attention  # torch 2.11-2.14 all have it
    policy = op_policy()
    for is_recompute in (False, True):
        assert policy(_PolicyCtx(is_recompute), flex) == CheckpointPolicy.MUST_SAVE
    compiled = getattr(torch.ops.higher_order, "inductor_compiled_code", None)
    if compiled is not None:
        assert policy(_PolicyCtx(False), compiled) == CheckpointPolicy.MUST_SAVE
    # Cheap elementwise work is still recomputed.
    assert policy(_PolicyCtx(False), torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_op_policy_alternates_over_bf16_and_float8_matmuls_alike() -> None:
    """torchao's Float8Linear multiplies with ``aten._scaled_mm``: counted with ``aten.mm``, so a
    float8 block keeps every other matmul as a bf16 block does, in forward and recomputation."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from titan_plugins_parallel.activation_checkpoint import op_policy

    mm, scaled = torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default
    order = [mm, scaled, scaled, mm, scaled]
    policy = op_policy()
    forward = [policy(_PolicyCtx(False), op) for op in order]
    recompute = [policy(_PolicyCtx(True), op) for op in order]
    save, redo = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == recompute == [save, redo, save, redo, save]
    # The maxima float8 scaling is computed from are kept whole.
    assert policy(_PolicyCtx(False), torch.ops.aten.amax.default) == save


@pytest.mark.parametrize(
    ("mode", "fields", "refused"),
    [
        ("none", {"preserve_rng_state": True}, ["activation_checkpoint.preserve_rng_state"]),
        (
            "none",
            {"debug": True, "determinism_check": "none"},
            ["activation_checkpoint.determinism_check", "activation_checkpoint.debug"],
        ),
        ("none", {"selective_ac_option": "2"}, ["activation_checkpoint.selective_ac_option"]),
        ("full", {"memory_budget": 0.7}, ["activation_checkpoint.memory_budget"]),
        ("full", {"selective_ac_option": "3"}, ["activation_checkpoint.selective_ac_option"]),
        ("selective", {"memory_budget": 0.2}, ["activation_checkpoint.memory_budget"]),
        ("memory_budget", {"preserve_rng_state": True}, ["activation_checkpoint.preserve_rng_state"]),
        ("memory_budget", {"selective_ac_option": "2"}, ["activation_checkpoint.selective_ac_option"]),
        # What each mode does read is accepted.
        ("full", {"preserve_rng_state": True, "determinism_check": "none", "debug": True}, []),
        ("selective", {"selective_ac_option": "2", "preserve_rng_state": True}, []),
        ("memory_budget", {"memory_budget": 0.2}, []),
        ("none", {}, []),
    ],
)
def test_a_setting_the_mode_does_not_read_is_refused_naming_the_mode(
    mode: str, fields: dict[str, Any], refused: list[str]
) -> None:
    """A recipe that sets ``memory_budget`` under ``selective`` (or ``preserve_rng_state`` with no
    recomputation) would train as if it had not: one error per such field, naming the mode."""
    from titan_core.config import ConfigError, TrainerConfig, validate

    config = TrainerConfig()
    config.compile.enable = True
    config.activation_checkpoint.mode = mode  # type: ignore[assignment]
    for name, value in fields.items():
        setattr(config.activation_checkpoint, name, value)
    if not refused:
        validate(config, source="r")
        return
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert [p.split(":")[0] for p in info.value.problems] == refused
    assert all(f"mode = {mode!r}" in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(("option", "warned"), [("5", True), ("4", False)])
def test_an_every_nth_option_beyond_the_blocks_says_it_recomputes_nothing(option: str, warned: bool) -> None:
    """Every 5th of 4 blocks wraps none: the strategy still applies, so it must say so."""
    import torch
    from structlog.testing import capture_logs

    from titan_plugins_parallel.activation_checkpoint import apply

    config = tiny_config(
        **{"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": option}
    )
    spec = get_registry().get("models", "llama3", what="model")
    model = spec.build(spec.flavor(config.model.flavor, config.model.overrides))

    class Ctx:
        pass

    ctx = Ctx()
    ctx.config = config  # type: ignore[attr-defined]
    with capture_logs() as logs:
        [model] = apply([model], ctx)  # type: ignore[arg-type]
    wrapped = [k for k, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == ([] if warned else ["3"])
    warnings = [e for e in logs if e["log_level"] == "warning"]
    if warned:
        assert [e["event"] for e in warnings] == ["activation checkpointing wraps no block"]
        assert "selective_ac_option = '5'" in warnings[0]["reason"] and "have 4" in warnings[0]["reason"]
    else:
        assert warnings == []
    assert torch.is_tensor(model(torch.randint(0, 100, (1, 8))))


def test_op_policy_keeps_a_blocks_collectives_so_backward_does_not_communicate_again() -> None:
    """A block's all-reduce (the MoE balance loss sums its counts over CP ranks) runs once, in
    forward: recomputing it would communicate again in backward (a fake 2-rank group in one
    process counts the calls)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_plugins_parallel.activation_checkpoint import op_policy_contexts

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            counts = funcol.all_reduce(x.detach().sum(0), "sum", dist.group.WORLD)
            return torch.sin(self.w(x)) * counts.mean()

    class CountCollectives(TorchDispatchMode):
        calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "_c10d_functional" and func.__name__.startswith("all_reduce"):
                CountCollectives.calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        block = checkpoint_wrapper(Block(), context_fn=op_policy_contexts)
        out = block(torch.randn(4, 8, requires_grad=True))
        with CountCollectives():
            out.sum().backward()
        assert CountCollectives.calls == []
        assert block._checkpoint_wrapped_module.w.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_blocks_in_a_module_list_are_wrapped_and_a_model_without_layers_is_refused() -> None:
    """A model keeping its blocks in an nn.ModuleList (FSDP and compile accept one) was left
    unwrapped, and so was one without `layers`: the strategy was listed as applied and nothing
    was recomputed, without a word."""
    import torch
    from torch import nn

    from titan_core.errors import UsageError
    from titan_plugins_parallel.activation_checkpoint import apply

    class Ctx:
        config = tiny_config(**{"activation_checkpoint.mode": "full"})

    class Listed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block(x)
            return x

    [model] = apply([Listed()], Ctx())  # type: ignore[arg-type]
    assert [type(b).__name__ for b in model.layers] == ["CheckpointWrapper"] * 3
    assert model(torch.ones(2, 4)).shape == (2, 4)

    class Unlisted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    with pytest.raises(
        UsageError, match=r"mode = 'full' wraps each block of the model's `layers`.*has no `layers`"
    ):
        apply([Unlisted()], Ctx())  # type: ignore[arg-type]


def _stage(keys: list[str]) -> Any:
    """A pipeline stage as the PP split leaves it: the model's blocks it holds, under their keys."""
    from torch import nn

    part = nn.Module()
    part.layers = nn.ModuleDict({key: nn.Linear(4, 4) for key in keys})
    return part


def _ac_ctx(n_layers: int, **fields: Any) -> Any:
    from types import SimpleNamespace

    config = tiny_config(**{f"activation_checkpoint.{k}": v for k, v in fields.items()})
    return SimpleNamespace(config=config, model_args={"n_layers": n_layers})


def _wrapped_keys(parts: list[Any]) -> list[list[str]]:
    return [[k for k, b in p.layers.items() if type(b).__name__ == "CheckpointWrapper"] for p in parts]


@pytest.mark.parametrize(
    ("n_layers", "stages", "option", "wrapped"),
    [
        # Interleaved PP, one block per stage, two stages per rank: every 2nd block of the model is
        # 1 and 3; counted per stage, each stage's only block was its 1st, and nothing was wrapped
        # (with a warning that the rank's parts "have 2" blocks).
        (4, [["0"], ["2"]], "2", [[], []]),
        (4, [["1"], ["3"]], "2", [["1"], ["3"]]),
        # PP 2 of 6 blocks: blocks 1, 3, 5 as documented, not 1 and 4 (each stage's 2nd).
        (6, [["0", "1", "2"]], "2", [["1"]]),
        (6, [["3", "4", "5"]], "2", [["3", "5"]]),
        (4, [["2", "3"]], "3", [["2"]]),
    ],
)
def test_every_nth_block_is_counted_over_the_whole_model_on_each_pipeline_stage(
    n_layers: int, stages: list[list[str]], option: str, wrapped: list[list[str]]
) -> None:
    """``selective_ac_option = N`` recomputes the model's blocks N-1, 2N-1, ... whatever the
    layout: a stage holds the blocks under their model-wide keys, which are what is counted."""
    from structlog.testing import capture_logs

    from titan_plugins_parallel.activation_checkpoint import apply

    ctx = _ac_ctx(n_layers, mode="selective", selective_ac_option=option)
    with capture_logs() as logs:
        parts = apply([_stage(keys) for keys in stages], ctx)
    assert _wrapped_keys(parts) == wrapped
    # A rank holding none of the recomputed blocks is not warned: other stages hold them.
    assert [e for e in logs if e["log_level"] == "warning"] == []


def test_an_every_nth_option_beyond_the_models_blocks_warns_on_every_stage() -> None:
    from structlog.testing import capture_logs

    from titan_plugins_parallel.activation_checkpoint import apply

    with capture_logs() as logs:
        apply([_stage(["2", "3"])], _ac_ctx(4, mode="selective", selective_ac_option="5"))
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert "selective_ac_option = '5'" in warning["reason"] and "have 4" in warning["reason"]


def _dropout_model(p: float) -> Any:
    """A third-party model whose blocks use dropout: a linear, ``nn.Dropout(p)``, a linear."""
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict(
                {str(i): nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 8)) for i in range(2)}
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers.values():
                x = block(x)
            return x

    torch.manual_seed(0)
    return Model()


def _dropout_grads(model: Any) -> Any:
    import torch

    torch.manual_seed(1)
    model(torch.ones(4, 8)).square().sum().backward()
    return model.layers["0"][0].weight.grad


@pytest.mark.parametrize(("mode", "option"), [("full", "op"), ("selective", "op"), ("selective", "1")])
def test_dropout_in_a_recomputed_block_needs_the_rng_state_preserved(mode: str, option: str) -> None:
    """Recomputation without ``preserve_rng_state`` draws other dropout masks than the forward:
    the gradients were those of another network, without a word. Refused, naming the module;
    with the state preserved, the gradients are those of no checkpointing."""
    import torch

    from titan_core.errors import UsageError
    from titan_plugins_parallel.activation_checkpoint import apply

    fields = {"mode": mode} if mode == "full" else {"mode": mode, "selective_ac_option": option}
    with pytest.raises(UsageError) as info:
        apply([_dropout_model(0.1)], _ac_ctx(2, **fields))
    message = str(info.value)
    assert "layers.0.1" in message and "Dropout(p=0.1" in message, message
    assert "activation_checkpoint.preserve_rng_state = True" in message and "\n" not in message

    expected = _dropout_grads(_dropout_model(0.1))
    [model] = apply([_dropout_model(0.1)], _ac_ctx(2, preserve_rng_state=True, **fields))
    assert type(model.layers["0"]).__name__ == "CheckpointWrapper"
    torch.testing.assert_close(_dropout_grads(model), expected, rtol=0, atol=0)
    # Dropout with p = 0 draws nothing: no refusal.
    apply([_dropout_model(0.0)], _ac_ctx(2, **fields))


def test_blocks_in_a_sequential_are_wrapped() -> None:
    """``layers = nn.Sequential(...)`` was refused as having no `layers`."""
    import torch
    from torch import nn

    from titan_plugins_parallel.activation_checkpoint import apply

    model = nn.Module()
    model.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    [model] = apply([model], _ac_ctx(2, mode="full"))
    assert [type(b).__name__ for b in model.layers] == ["CheckpointWrapper"] * 2
    assert model.layers(torch.ones(2, 4)).shape == (2, 4)


@pytest.mark.parametrize("option", ["\u00b2", "\u0663"])
def test_an_every_nth_option_of_other_digits_is_refused_as_such(option: str) -> None:
    """A superscript two failed as ``invalid literal for int()``; an Arabic-Indic three was taken
    as 3 (``str.isdigit`` accepts both)."""
    from titan_core.config import ConfigError, TrainerConfig

    with pytest.raises(ConfigError, match=r"expected 'op' or a positive integer such as '2'"):
        TrainerConfig().activation_checkpoint.selective_ac_option = option


@pytest.mark.slow
def test_every_nth_block_under_interleaved_pipeline_stages_matches_one_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    """PP 2 with two one-block stages per rank and every 2nd block recomputed: each stage's only
    block was counted as its 1st, so nothing was recomputed (and each rank warned that its parts
    "have 2" blocks). Now blocks 1 and 3 are, with the one-process losses."""
    from tests.parallel_harness import assert_losses_close, log_records, run_titan_train, step_losses

    overrides = {
        "checkpoint.initial_load_path": str(seed_checkpoint),
        "parallelism.pp": 2,
        "parallelism.dp_shard": 1,
        "parallelism.pp_stages_per_rank": 2,
        "parallelism.pp_schedule": "Interleaved1F1B",
        "activation_checkpoint.mode": "selective",
        "activation_checkpoint.selective_ac_option": "2",
    }
    result = run_titan_train(tmp_path, 2, overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_losses_close(step_losses(result.stdout, rank=1), reference_losses)
    records = log_records(result.stdout)
    assert not [r for r in records if r.get("event") == "activation checkpointing wraps no block"]


def test_op_policy_counts_the_matmuls_of_biased_linears() -> None:
    """``nn.Linear(bias=True)`` multiplies with ``aten.addmm``, which the policy did not count:
    a plugin model with biased projections recomputed every matmul under ``op``, as ``full``."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from titan_plugins_parallel.activation_checkpoint import op_policy

    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    policy = op_policy()
    save, redo = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(_PolicyCtx(False), op) for op in (addmm, addmm, mm, addmm)] == [save, redo, save, redo]
