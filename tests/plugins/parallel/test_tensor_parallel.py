"""Tensor + sequence + loss parallel: checks before building, and losses equal to one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_layout, tiny_config
from tests.plugins.parallel.rows import assert_rows_close, layout_rows, one_process_rows
from titan_core.errors import UsageError
from titan_core.parallel_dims import ParallelDims
from titan_core.parallelize import ParallelContext
from titan_core.topology import Topology
from titan_plugins_llama3.flavors import Llama3Args
from titan_plugins_llama3.plan import check_tp
from titan_plugins_parallel import tensor_parallel


def context(spec: Any, tp: int = 2, seq_len: int = 32) -> ParallelContext:
    config = tiny_config(**{"parallelism.tp": tp, "training.seq_len": seq_len})
    dims = ParallelDims(1, 1, 1, tp, 1, 1, tp)
    topology = Topology(world_size=tp, rank=0, local_rank=0, device=None)
    return ParallelContext(config, dims, None, spec, None, topology)


@attrs.frozen
class Spec:
    name: str = "toy"
    tp_plan: Any = None


def problems(spec: Any, tp: int = 2, seq_len: int = 32) -> list[str]:
    """The strategy's ``Strategy.check`` (run before anything is built)."""
    ctx = context(spec, tp, seq_len)
    return tensor_parallel.check(ctx.config, ctx.parallel_dims, spec, None)


def test_model_without_tp_plan_is_one_clear_error() -> None:
    assert problems(Spec()) == [
        "parallelism.tp=2, but model 'toy' supplies no tensor-parallel plan (ModelSpec.tp_plan); "
        "set parallelism.tp = 1 or use a model plugin with a TP plan"
    ]


def test_seq_len_must_split_over_tp_ranks() -> None:
    (problem,) = problems(Spec(tp_plan=lambda *a: None), seq_len=33)
    assert problem.startswith("training.seq_len=33 is not divisible by parallelism.tp=2")
    assert problems(Spec(tp_plan=lambda *a: None), seq_len=32) == []


def test_seq_len_must_split_over_tp_ranks_after_context_parallel_cut_it() -> None:
    """Under CP each TP group shards the rank's ``seq_len / cp`` tokens along the sequence.

    ``seq_len = 20`` passes CP's check (a multiple of ``2 x cp = 4``) and TP's own (a multiple of
    ``tp = 4``), but each CP rank holds 10 tokens, which 4 TP ranks cannot split: a run of that
    layout (8 processes, gloo) was aborted by gloo (SIGABRT) at step 1 with no titan error."""
    spec = Spec(tp_plan=lambda *a: None)
    config = tiny_config(**{"parallelism.tp": 4, "parallelism.cp": 2, "training.seq_len": 20})
    dims = ParallelDims(1, 1, 2, 4, 1, 1, 8)
    (problem,) = tensor_parallel.check(config, dims, spec, None)
    assert problem.startswith(
        "training.seq_len=20 is not divisible by parallelism.cp x parallelism.tp = 2 x 4 = 8:"
    )
    assert "each of the 2 context-parallel ranks holds 10 tokens" in problem
    config.training.seq_len = 24
    assert tensor_parallel.check(config, dims, spec, None) == []


def test_llama3_plan_names_every_dimension_tp_does_not_divide() -> None:
    args = Llama3Args(dim=96, n_heads=6, n_kv_heads=2, vocab_size=2048, multiple_of=32)
    check_tp(args, 2)  # all divisible
    with pytest.raises(UsageError) as info:
        check_tp(args, 4)
    message = str(info.value)
    assert "parallelism.tp=4 must divide the model's n_heads=6, n_kv_heads=2 (" in message
    with pytest.raises(UsageError) as info:
        check_tp(args, 3)
    message = str(info.value)
    assert "n_kv_heads=2, vocab_size=2048, ffn hidden dim=256 (" in message
    assert "n_heads=6" not in message


@pytest.mark.slow
def test_tp_two_ranks_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {"parallelism.tp": 2, "training.local_batch_size": GLOBAL_BATCH}
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_tp_without_loss_parallel_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {"parallelism.tp": 2, "parallelism.loss_parallel": False}
    assert_losses_close(run_layout(tmp_path, 2, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
def test_fsdp_with_tp_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    layout = {
        "parallelism.dp_shard": 2,
        "parallelism.tp": 2,
        "training.local_batch_size": GLOBAL_BATCH // 2,
    }
    assert_losses_close(run_layout(tmp_path, 4, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [{"parallelism.tp": 2, "parallelism.cp": 2}, {"parallelism.tp": 2, "parallelism.pp": 2}],
    ids=["tp2_cp2", "tp2_pp2"],
)
def test_tp_with_cp_or_pp_matches_single_process(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float], layout: dict
) -> None:
    """TP inside context-parallel shards (each TP rank gathers its heads' K/V from its CP peers)
    and inside pipeline stages."""
    assert_losses_close(run_layout(tmp_path, 4, seed_checkpoint, layout), reference_losses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"compile.backend": "aot_eager"},
        # The default backend, with gradient accumulation (two microbatches a step).
        {"parallelism.loss_parallel": False, "training.local_batch_size": GLOBAL_BATCH // 2},
        # Activation checkpointing with the compiled blocks: torch 2.13 stopped whole-block
        # checkpoints of TP blocks compiled around them at step 1 (a DeviceMesh saved as a tensor).
        {"activation_checkpoint.mode": "full"},
        {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2"},
        {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"},
    ],
    ids=["aot_eager", "inductor_accumulated", "inductor_full_ac", "inductor_every_2nd_ac", "inductor_op_ac"],
)
def test_tp_with_compiled_blocks_matches_single_process(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path, layout: dict
) -> None:
    """The embedding hands the first compiled block an AsyncCollectiveTensor (its pending
    reduce-scatter): the run used to stop at step 1's backward (``'Tensor' object has no attribute
    '_local_tensor'``); losses and gradient norms are one process's."""
    layout = {
        "parallelism.tp": 2,
        "compile.enable": True,
        "training.global_batch_size": GLOBAL_BATCH,
        **layout,
    }
    expected = one_process_rows(tmp_path_factory, seed_checkpoint)
    assert_rows_close(layout_rows(tmp_path, 2, seed_checkpoint, layout), expected)


GAPPY_RECIPE = '''
"""A model plugin registered directly, whose TP plan leaves the blocks' ffn_norm out."""
import attrs

from tests.parallel_harness import tiny_config
from titan_core import ModelSpec, get_registry, hookimpl


def gappy_plan(model, tp_mesh, loss_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    from titan_core.blocks import tp_plan_ends

    tp_plan_ends(model, tp_mesh, loss_parallel)
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        # "ffn_norm": SequenceParallel(),  <- forgotten: its weight stays a plain tensor
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


class Gappy:
    @hookimpl
    def titan_models(self) -> list[ModelSpec]:
        from titan_plugins_llama3.plugin import titan_models

        (llama3,) = titan_models()
        return [attrs.evolve(llama3, name="gappy", tp_plan=gappy_plan)]


get_registry().register(Gappy(), "gappy", "gappy-lm", "0.3")


def layout():
    config = tiny_config(**{"parallelism.tp": 2, "training.steps": 2})
    config.model.name = "gappy"
    config.job.dump_folder = "out"
    return config
'''


@pytest.mark.slow
def test_a_tp_plan_leaving_parameters_plain_is_one_error_naming_them(tmp_path: Path) -> None:
    """Every rank stopped at step 1 with torch's ``aten._foreach_mul_.Scalar got mixed
    torch.Tensor and DTensor`` traceback (gradient clipping); ``check_model_spec`` finds it, a run
    did not. Now each rank stops before building the optimizer, naming the plan, the model's
    plugin and the parameters."""
    import subprocess

    from tests.parallel_harness import child_env, torchrun_command

    (tmp_path / "gappy_recipes.py").write_text(GAPPY_RECIPE)
    result = subprocess.run(
        torchrun_command(2, "--module", "gappy_recipes", "--recipe", "layout"),
        cwd=tmp_path,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Each rank finds it; the first to fail makes torchrun stop the other (its SIGTERM line).
    errors = [line for line in result.stderr.splitlines() if "ModelSpec.tp_plan" in line]
    assert result.returncode != 0 and errors, result.stderr[-4000:]
    for line in errors:
        assert (
            "titan: error: model 'gappy' (plugin gappy, gappy-lm 0.3): ModelSpec.tp_plan left 4 "
            "parameters plain (torch.Tensor, not DTensor) on the 2-rank TP mesh: "
            "layers.0.ffn_norm.weight, layers.1.ffn_norm.weight, layers.2.ffn_norm.weight, "
            "layers.3.ffn_norm.weight;"
        ) in line, line
        assert "add them to the plan" in line and "replicate them" in line
    assert "_foreach" not in result.stderr and "[rank0]: Traceback" not in result.stderr
    assert "[rank1]: Traceback" not in result.stderr
