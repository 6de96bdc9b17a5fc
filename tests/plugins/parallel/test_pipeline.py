"""Pipeline parallel: stage layout, clear errors, and per-step losses equal to one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import titan_env
from tests.parallel_harness import GLOBAL_BATCH, REPO, TINY_MODEL, child_env, log_records, run_titan_train
from tests.plugins.parallel.rows import GRAD_NORM_ABS, assert_rows_close, layout_rows, one_process_rows
from titan_core.config import TrainerConfig
from titan_core.errors import UsageError
from titan_plugins_parallel import pipeline

#: Every schedule titan documents; the single-stage ones hold 1 stage per rank, the rest 2.
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]


def _on_gloo(schedule: str) -> Any:
    """``schedule`` as a parameter of a test that trains it over gloo: the V schedules need torch
    2.13 there (titan refuses them on 2.11, ``test_a_v_schedule_on_gloo_needs_a_torch_that_starts_it``)."""
    import torch

    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    old = schedule in ("ZBVZeroBubble", "DualPipeV") and major_minor < (2, 13)
    skip = pytest.mark.skipif(old, reason="V schedules on gloo need torch >= 2.13")
    return pytest.param(schedule, marks=skip)


# -- layout (no processes) ---------------------------------------------------------------------


def test_blocks_split_contiguously_with_the_remainder_first() -> None:
    names = [str(i) for i in range(7)]
    assert pipeline.split_layers(names, 3) == [["0", "1", "2"], ["3", "4"], ["5", "6"]]
    assert pipeline.split_layers(names[:4], 4) == [["0"], ["1"], ["2"], ["3"]]


@pytest.mark.parametrize(
    ("schedule", "configured", "stages"),
    [("GPipe", None, 1), ("1F1B", 1, 1), ("Interleaved1F1B", None, 2), ("Interleaved1F1B", 3, 3)],
)
def test_stages_per_rank_follow_the_schedule(schedule: str, configured: int | None, stages: int) -> None:
    assert pipeline.stages_per_rank(pipeline.schedule_class(schedule), configured) == stages


def test_loop_and_v_placement() -> None:
    assert pipeline.stage_ids_of(1, 2, 2, v_style=False) == [1, 3]
    assert pipeline.stage_ids_of(0, 2, 2, v_style=True) == [0, 3]
    assert pipeline.stage_ids_of(1, 2, 2, v_style=True) == [1, 2]


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(UsageError, match=r"pp_schedule='Zigzag'.*GPipe, 1F1B, Interleaved1F1B"):
        pipeline.schedule_class("Zigzag")


@pytest.mark.parametrize("name", ["PipelineScheduleSingle", "PipelineScheduleMulti", "pipelineschedulemulti"])
def test_a_base_class_of_the_schedules_is_refused_before_launch(name: str) -> None:
    """``get_schedule_class`` maps torch's two base classes as well; named as the schedule, they
    passed the check and every rank stopped at step 1 (``Can't instantiate abstract class
    PipelineScheduleSingle``, or ``KeyError: 0`` from Multi's empty order of actions)."""
    problems = _check({"parallelism.pp_schedule": name})
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"parallelism.pp_schedule={name!r} names PipelineSchedule"), problems
    assert "DualPipeV" in problems[0]


@pytest.mark.parametrize(
    ("schedule", "configured", "message"),
    [("1F1B", 2, "runs one stage per rank"), ("ZBVZeroBubble", 3, "exactly two stages per rank")],
)
def test_stage_count_the_schedule_cannot_run(schedule: str, configured: int, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        pipeline.stages_per_rank(pipeline.schedule_class(schedule), configured)


def test_a_schedule_without_pipeline_parallel_is_refused_naming_the_field() -> None:
    """``pp_schedule = "Interleaved1F1B"`` with ``pp = 1`` (the degree forgotten) trained without
    any pipeline and exit 0, where ``pp_microbatches`` and ``pp_stages_per_rank`` are refused."""
    from titan_core.config import ConfigError, validate

    config = TrainerConfig()
    config.parallelism.pp_schedule = "Interleaved1F1B"
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert info.value.problems == [
        "parallelism.pp_schedule: 'Interleaved1F1B' does nothing with parallelism.pp = 1 (only "
        "pipeline parallel reads it); set parallelism.pp > 1, or leave it '1F1B'"
    ]
    config.parallelism.pp = 2
    validate(config, source="r")
    config.parallelism.pp, config.parallelism.pp_schedule = 1, "1F1B"  # the default is no request
    validate(config, source="r")


def test_microbatches_must_divide_the_local_batch() -> None:
    config = TrainerConfig()
    config.training.local_batch_size = 4
    assert pipeline.microbatches(config, num_stages=2) == 2
    config.parallelism.pp_microbatches = 3
    with pytest.raises(UsageError, match=r"pp_microbatches=3 must divide training.local_batch_size=4"):
        pipeline.microbatches(config, num_stages=2)


#: ``ModelSpec``'s default pipeline ends.
FIRST, LAST = ("tok_embeddings",), ("norm", "output")


def _ctx(config: TrainerConfig, pp: int, rank: int, n_layers: int = 4) -> SimpleNamespace:
    from titan_plugins_llama3.flavors import Llama3Args

    args = Llama3Args(dim=32, n_layers=n_layers, n_heads=4, vocab_size=64, max_seq_len=16)
    dims = SimpleNamespace(pp=pp, coordinates=lambda r: {"pp": r})
    spec = SimpleNamespace(name="llama3", first_stage_modules=FIRST, last_stage_modules=LAST)
    topology = SimpleNamespace(rank=rank)
    calls: list = []
    return SimpleNamespace(
        config=config,
        parallel_dims=dims,
        spec=spec,
        model_args=args,
        topology=topology,
        state={},
        computes_loss=True,
        replace_forward_backward=lambda owner, build: calls.append(owner),
        replaced=calls,
    )


def _meta_model(ctx: SimpleNamespace):
    import torch

    from titan_plugins_llama3.model import Llama3

    with torch.device("meta"):
        return Llama3(ctx.model_args)


def test_stages_keep_their_blocks_names_and_ends() -> None:
    config = TrainerConfig()
    config.training.local_batch_size = 4
    config.parallelism.pp_schedule = "Interleaved1F1B"
    firsts = []
    for rank in (0, 1):
        ctx = _ctx(config, pp=2, rank=rank)
        stages = pipeline.apply([_meta_model(ctx)], ctx)
        plan = ctx.state["pp"]
        assert plan.ids == [rank, rank + 2]
        assert [list(s.layers.keys()) for s in stages] == [[str(rank)], [str(rank + 2)]]
        assert (plan.has_first, plan.has_last) == (rank == 0, rank == 1)
        assert ctx.computes_loss == (rank == 1)  # only the rank holding the last stage
        assert ctx.replaced == ["pp"]  # the schedule replaces forward/backward
        firsts.append(stages[0])
    assert firsts[0].tok_embeddings is not None and firsts[1].tok_embeddings is None
    assert firsts[0].output is None and stages[1].output is not None  # rank 1's stage 3 is last


def _with_position_table(ctx: SimpleNamespace):
    """A GPT-2-style model: a learned position table beside the token embedding, at top level."""
    import torch

    model = _meta_model(ctx)
    with torch.device("meta"):
        model.pos_embeddings = torch.nn.Embedding(16, ctx.model_args.dim)
    return model


def test_a_top_level_module_the_spec_does_not_place_is_refused() -> None:
    """A module beside ``layers`` and the declared ends would be copied to every stage, where only
    the first stage's copy trains and a checkpoint may keep another's untrained one."""
    import torch

    config = TrainerConfig()
    config.training.local_batch_size = 4
    with pytest.raises(UsageError, match=r"model 'llama3'.*pos_embeddings.*every stage.*first_stage_modules"):
        pipeline.apply([_with_position_table(_ctx(config, pp=2, rank=1))], _ctx(config, pp=2, rank=1))
    ctx = _ctx(config, pp=2, rank=0)
    model = _meta_model(ctx)
    model.scale = torch.nn.Parameter(torch.ones(1, device="meta"))  # a parameter of the model itself
    with pytest.raises(UsageError, match=r"model 'llama3'.*parameter scale.*every stage"):
        pipeline.apply([model], ctx)


@pytest.mark.parametrize("rank", [0, 1])
def test_declared_first_stage_modules_live_on_the_first_stage_only(rank: int) -> None:
    config = TrainerConfig()
    config.training.local_batch_size = 4
    ctx = _ctx(config, pp=2, rank=rank)
    ctx.spec.first_stage_modules = ("tok_embeddings", "pos_embeddings")
    (stage,) = pipeline.apply([_with_position_table(ctx)], ctx)
    held = {
        n for n in ("tok_embeddings", "pos_embeddings", "norm", "output") if getattr(stage, n) is not None
    }
    assert held == ({"tok_embeddings", "pos_embeddings"} if rank == 0 else {"norm", "output"})
    names = {n for n, _ in stage.named_parameters()}
    assert ("pos_embeddings.weight" in names) == (rank == 0)


def test_a_declared_stage_module_the_model_lacks_is_refused() -> None:
    config = TrainerConfig()
    config.training.local_batch_size = 4
    ctx = _ctx(config, pp=2, rank=0)
    ctx.spec.last_stage_modules = ("ln_f", "output")  # a typo or another model's name
    with pytest.raises(UsageError, match=r"last_stage_modules names ln_f.*model 'llama3' has no such module"):
        pipeline.apply([_meta_model(ctx)], ctx)


def test_a_module_named_in_both_stage_lists_is_refused() -> None:
    """A module in both lists is dropped by every stage that is not first and every one that is
    not last, so by all of them: the model would train without it, without a word."""
    config = TrainerConfig()
    config.training.local_batch_size = 4
    ctx = _ctx(config, pp=2, rank=0)
    ctx.spec.first_stage_modules = ("tok_embeddings", "norm")
    expected = r"first_stage_modules and last_stage_modules both name norm of model 'llama3'.*one list only"
    with pytest.raises(UsageError, match=expected):
        pipeline.apply([_meta_model(ctx)], ctx)
    # Refused before launch too: the spec alone shows it.
    problems = pipeline.check(config, SimpleNamespace(pp=2), ctx.spec, ctx.model_args)
    assert any("both name norm" in p for p in problems), problems


@pytest.mark.parametrize("field", ["first_stage_modules", "last_stage_modules"])
def test_the_blocks_named_as_a_stage_end_are_refused(field: str) -> None:
    """``layers`` is split across the stages; as an end, every stage but one would drop all its
    blocks."""
    config = TrainerConfig()
    config.training.local_batch_size = 4
    ctx = _ctx(config, pp=2, rank=0)
    setattr(ctx.spec, field, (*getattr(ctx.spec, field), "layers"))
    expected = rf"ModelSpec.{field} names layers, the blocks of model 'llama3'.*splits across the stages"
    with pytest.raises(UsageError, match=expected):
        pipeline.apply([_meta_model(ctx)], ctx)
    problems = pipeline.check(config, SimpleNamespace(pp=2), ctx.spec, ctx.model_args)
    assert any(f"ModelSpec.{field} names layers" in p for p in problems), problems


def test_too_few_blocks_for_the_stages() -> None:
    config = TrainerConfig()
    config.training.local_batch_size = 4
    config.parallelism.pp_schedule = "Interleaved1F1B"
    ctx = _ctx(config, pp=2, rank=0, n_layers=3)
    with pytest.raises(UsageError, match=r"3 blocks for pp=2 x 2 stages per rank = 4 stages"):
        pipeline.apply([_meta_model(ctx)], ctx)


def _check(layout: dict[str, Any], pp: int = 2, **model: Any) -> list[str]:
    """The strategy's ``Strategy.check`` (before anything is built) of the tiny config + ``layout``."""
    from titan_plugins_llama3.flavors import Llama3Args

    config = TrainerConfig()
    config.training.local_batch_size = 4
    for path, value in layout.items():
        section, name = path.split(".")
        setattr(getattr(config, section), name, value)
    args = Llama3Args(
        **{"dim": 32, "n_layers": 4, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16, **model}
    )
    spec = SimpleNamespace(name="llama3", first_stage_modules=FIRST, last_stage_modules=LAST)
    return pipeline.check(config, SimpleNamespace(pp=pp), spec, args)


@pytest.mark.parametrize(
    ("layout", "model", "expected"),
    [
        ({}, {}, []),
        (
            {"parallelism.pp_schedule": "Zigzag"},
            {},
            ["parallelism.pp_schedule='Zigzag' is not a schedule of torch.distributed.pipelining; use GPipe"],
        ),
        (
            {"parallelism.pp_schedule": "1F1B", "parallelism.pp_stages_per_rank": 2},
            {},
            ["parallelism.pp_stages_per_rank=2, but Schedule1F1B runs one stage per rank"],
        ),
        (
            {"parallelism.pp_schedule": "Interleaved1F1B"},
            {"n_layers": 3},
            ["pipeline parallel needs at least one block per stage: 3 blocks for pp=2 x 2 stages per rank"],
        ),
        (
            {},
            {"tie_embeddings": True},
            ["tied input/output embeddings cannot be split across pipeline stages"],
        ),
        (
            {"parallelism.pp_microbatches": 3},
            {},
            ["parallelism.pp_microbatches=3 must divide training.local_batch_size=4"],
        ),
        (
            {"parallelism.pp_microbatches": 1},
            {},
            ["parallelism.pp_schedule=1F1B needs at least as many microbatches as stages (2), got "],
        ),
        (
            {"parallelism.pp_schedule": "DualPipeV", "parallelism.pp_microbatches": 2},
            {},
            ["parallelism.pp_schedule=DualPipeV needs at least as many microbatches as stages (4)"],
        ),
        (
            {
                "parallelism.pp_schedule": "Interleaved1F1B",
                "parallelism.pp_microbatches": 5,
                "training.local_batch_size": 10,
            },
            {},
            ["parallelism.pp_schedule=Interleaved1F1B runs microbatches in rounds of pp=2 and needs"],
        ),
        (
            {"parallelism.pp_schedule": "Interleaved1F1B", "parallelism.pp_microbatches": 3},
            {"n_layers": 2, "tie_embeddings": True},
            [
                "pipeline parallel needs at least one block",
                "tied input/output",
                "parallelism.pp_microbatches=3 must divide",
            ],
        ),
    ],
    ids=[
        "fits",
        "unknown-schedule",
        "stages-the-schedule-cannot-run",
        "fewer-blocks-than-stages",
        "tied-embeddings",
        "microbatches-not-dividing-the-batch",
        "1F1B-fewer-microbatches-than-stages",
        "DualPipeV-fewer-microbatches-than-stages",
        "interleaved-microbatches-not-in-rounds",
        "every-problem-at-once",
    ],
)
def test_check_refuses_from_the_config_the_degrees_and_the_model_arguments(
    layout: dict[str, Any], model: dict[str, Any], expected: list[str]
) -> None:
    # (Under torch 2.11 on the CPU a V schedule is refused besides: its own test, below.)
    problems = [p for p in _check(layout, **model) if "needs torch 2.13 or newer" not in p]
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected, strict=True):
        assert problem.startswith(start), problem


#: The schedules that split each backward into an input-gradient and a weight-gradient pass.
SPLIT_BACKWARD = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
COMPILED = {"compile.enable": True, "compile.backend": "aot_eager"}
OP_POLICY = {"activation_checkpoint.mode": "selective"}


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD)
@pytest.mark.parametrize(
    ("fields", "start"),
    [
        (COMPILED, "compile.enable: parallelism.pp_schedule={schedule} splits each stage's backward"),
        (
            {**COMPILED, "activation_checkpoint.mode": "memory_budget"},
            "compile.enable: parallelism.pp_schedule={schedule} splits each stage's backward",
        ),
        (
            OP_POLICY,
            "activation_checkpoint.selective_ac_option: 'op' under parallelism.pp_schedule={schedule}",
        ),
        (
            {"activation_checkpoint.mode": "full", "activation_checkpoint.debug": True},
            "activation_checkpoint.debug: parallelism.pp_schedule={schedule} splits each stage's",
        ),
        (
            {
                **OP_POLICY,
                "activation_checkpoint.selective_ac_option": "2",
                "activation_checkpoint.debug": True,
            },
            "activation_checkpoint.debug: parallelism.pp_schedule={schedule} splits each stage's",
        ),
    ],
    ids=["compile", "memory_budget", "op-policy", "full-debug", "every-2nd-debug"],
)
def test_a_split_backward_schedule_refuses_compiled_blocks_and_the_op_policy(
    schedule: str, fields: dict[str, Any], start: str
) -> None:
    """The zero-bubble schedules run a stage's backward as two autograd passes (input, then
    weight gradients). A compiled block's backward is one opaque node (``Failed to run stage
    backward input``, pytorch#161904; torch's own check sees only a compiled stage root) and the
    op policy allows one backward per recomputed region (``Trying to backward an extra time``);
    a whole-block checkpoint's ``debug`` recording fails on the second pass (``AttributeError:
    '_GeneratorContextManager' object has no attribute 'args'``). All stopped step 1 on every
    rank, exit 1, instead of being refused before launch."""
    layout = {"parallelism.pp_schedule": schedule, "parallelism.pp_microbatches": 4, **fields}
    problems = [p for p in _check(layout) if "needs torch 2.13 or newer" not in p]
    assert len(problems) == 1 and problems[0].startswith(start.format(schedule=schedule)), problems


@pytest.mark.parametrize(
    ("schedule", "fields"),
    [
        ("ZBVZeroBubble", {"activation_checkpoint.mode": "full"}),
        ("DualPipeV", {**OP_POLICY, "activation_checkpoint.selective_ac_option": "2"}),
        ("Interleaved1F1B", {**COMPILED, **OP_POLICY}),
        ("1F1B", {**COMPILED, "activation_checkpoint.mode": "memory_budget"}),
        ("Interleaved1F1B", {"activation_checkpoint.mode": "full", "activation_checkpoint.debug": True}),
    ],
)
def test_whole_block_checkpoints_and_compile_under_other_schedules_still_pass(
    schedule: str, fields: dict[str, Any]
) -> None:
    # Whole-block recomputation runs each backward pass over its own recomputation (checked
    # against one process by hand, docs/parallelism.md); the other schedules run one backward.
    layout = {"parallelism.pp_schedule": schedule, "parallelism.pp_microbatches": 4, **fields}
    assert [p for p in _check(layout) if "needs torch 2.13 or newer" not in p] == []


@pytest.mark.parametrize(
    ("version", "device", "backend", "refused"),
    [
        ("2.11.0+cu130", "cpu", "default", True),
        ("2.11.0", "auto", "default", True),  # no CUDA here: auto is the CPU
        ("2.13.0+cpu", "cpu", "default", False),
        ("2.14.1", "cpu", "default", False),
        ("2.11.0", "cpu", "fake", False),  # simulated peers: no gloo pairs
    ],
)
def test_a_v_schedule_on_gloo_needs_a_torch_that_starts_it(
    monkeypatch: pytest.MonkeyPatch, version: str, device: str, backend: str, refused: bool
) -> None:
    """torch 2.11's V-schedule start-up (ZBVZeroBubble, DualPipeV) sends from each stage to its
    neighbours, the rank's own other stage included, which gloo cannot do: the run ended at step
    1 with gloo's 'Pair is not connected' and a peer-died error."""
    import torch

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    layout = {"parallelism.pp_schedule": "ZBVZeroBubble", "training.device": device, "comm.backend": backend}
    problems = _check(layout)
    expected = "parallelism.pp_schedule=ZBVZeroBubble on the CPU (gloo) needs torch 2.13 or newer"
    assert [p for p in problems if p.startswith(expected)] == ([problems[0]] if refused else []), problems
    assert _check({**layout, "parallelism.pp_schedule": "Interleaved1F1B"}) == []


def _stub_stage(index: int, num_stages: int, pp: int, rank: int) -> SimpleNamespace:
    """What a schedule's constructor reads of a stage (torch 2.11-2.14), without a process group."""
    return SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_size=pp,
        group_rank=rank,
        is_first=index == 0,
        is_last=index == num_stages - 1,
        submod=None,
    )


@pytest.mark.parametrize("schedule", [*SCHEDULES, "LoopedBFS", "DualPipeV"])
def test_the_checks_microbatch_rules_are_the_schedule_constructors(schedule: str) -> None:
    """``check`` knows before any stage exists what each schedule's constructor rejects (a
    ValueError once every rank had built its stages): the same verdict for every layout tried."""
    cls = pipeline.schedule_class(schedule)
    per_rank = pipeline.stages_per_rank(cls, None)
    v_style = cls.__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    for pp in (2, 3, 4):
        num_stages = pp * per_rank
        for n in range(1, 13):
            try:
                for rank in range(1 if pipeline.is_single_stage(cls) else pp):
                    ids = pipeline.stage_ids_of(rank, pp, per_rank, v_style)
                    stages = [_stub_stage(i, num_stages, pp, rank) for i in ids]
                    cls(stages[0] if pipeline.is_single_stage(cls) else stages, n, loss_fn=lambda out, y: out)
                accepted = True
            except ValueError:
                accepted = False
            problem = pipeline.schedule_problem(cls, n, num_stages, pp)
            assert (problem is None) == accepted, (schedule, pp, n, problem)


# -- runs (torchrun, gloo) -------------------------------------------------------------------


@pytest.fixture
def reference_rows(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> list[dict]:
    """Step records (loss, grad norm) of one process from the seed checkpoint."""
    return one_process_rows(tmp_path_factory, seed_checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [_on_gloo(s) for s in SCHEDULES])
def test_pp2_matches_one_process(
    schedule: str, tmp_path: Path, seed_checkpoint: Path, reference_rows: list[dict]
) -> None:
    """Each schedule: same losses and grad norms; every PP rank's step line carries the loss."""
    overrides = {
        "checkpoint.initial_load_path": str(seed_checkpoint),
        "parallelism.pp": 2,
        "parallelism.pp_schedule": schedule,
    }
    result = run_titan_train(tmp_path, 2, overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [r for r in log_records(result.stdout) if r.get("event") == "step"]
    for rank in (0, 1):  # rank 0 holds no last stage (except under ZBV): the loss was broadcast
        # The grad norm sums both stages' squares over the PP group (titan_core.grad_norm).
        assert_rows_close([r for r in records if r.get("rank") == rank], reference_rows)
    built = next(r for r in log_records(result.stdout) if r.get("event") == "built")
    assert built["strategies"] == ["pp"]


@pytest.mark.slow
def test_pp2_with_fsdp2_matches_one_process(
    tmp_path: Path, seed_checkpoint: Path, reference_rows: list[dict]
) -> None:
    overrides = {
        "parallelism.pp": 2,
        "parallelism.dp_shard": 2,
        "parallelism.pp_schedule": "Interleaved1F1B",
        "parallelism.pp_microbatches": 2,
        "training.local_batch_size": GLOBAL_BATCH // 2,
    }
    assert_rows_close(layout_rows(tmp_path, 4, seed_checkpoint, overrides), reference_rows)


#: Document masking on the tiny model: its sequences hold several bundled documents.
MASKED = {"model.overrides": {**TINY_MODEL, "document_mask": True}}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [_on_gloo(s) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")])
def test_pp2_masks_documents_on_every_stage_as_one_process_does(
    schedule: str,
    tmp_path_factory: pytest.TempPathFactory,
    seed_checkpoint: Path,
    reference_rows: list[dict],
) -> None:
    """Stages after the first build the mask from the token ids the schedule passes them."""
    masked = masked_reference_rows(tmp_path_factory, seed_checkpoint)
    # The mask matters here: the gradient norms move by far more than the comparison's tolerance
    # (1.5e-3 at step 1 on the causal run's 0.895), so a stage that dropped it could not match.
    moved = max(abs(m["grad_norm"] - r["grad_norm"]) for m, r in zip(masked, reference_rows, strict=True))
    assert moved > 10 * GRAD_NORM_ABS
    overrides = {**MASKED, "parallelism.pp": 2, "parallelism.pp_schedule": schedule}
    rows = layout_rows(tmp_path_factory.mktemp(f"masked_{schedule}"), 2, seed_checkpoint, overrides, rank=1)
    assert_rows_close(rows, masked)


_MASKED: dict[Path, list[dict]] = {}


def masked_reference_rows(tmp_path_factory: pytest.TempPathFactory, seed: Path) -> list[dict]:
    """One process with document masking, from ``seed``, once per session."""
    if seed not in _MASKED:
        _MASKED[seed] = layout_rows(tmp_path_factory.mktemp("masked_reference"), 1, seed, MASKED)
    return _MASKED[seed]


# -- validation: forward only (schedule.eval) ----------------------------------------------------

#: Trains a layout (``tiny_config`` + the JSON overrides of argv[1]) in this process and prints
#: one ``validation result`` record per rank: the step rows, the gradients computed while training and while
#: validating (a hook on every parameter), and whether each validation left the step's gradients
#: as they were.
VALIDATION_SCRIPT = """
import json
import sys

import torch

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import Trainer

trainer = Trainer(tiny_config(**json.loads(sys.argv[1])), get_registry())
params = [p for part in trainer.parts for p in part.parameters()]
backward = {"training": 0, "validation": 0}
phase = ["training"]
for param in params:
    param.register_hook(lambda grad: backward.__setitem__(phase[0], backward[phase[0]] + 1))
validate, kept = trainer.validate, []


def observed():
    before = [p.grad.clone() for p in params]
    phase[0] = "validation"
    try:
        return validate()
    finally:
        phase[0] = "training"
        same = [p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params, before, strict=True)]
        kept.append(all(same))


trainer.validate = observed
completed = False
try:
    rows = trainer.train()
    completed = True
finally:
    trainer.close(completed=completed)
result = {"rank": trainer.topology.rank, "rows": rows, "backward": backward, "kept": kept}
print(json.dumps({"event": "validation result", **result}), flush=True)
"""


def validation_run(folder: Path, nproc: int, seed: Path, overrides: dict[str, Any]) -> dict[int, dict]:
    """Each rank's ``validation result`` of :data:`VALIDATION_SCRIPT` for a run from ``seed``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "validate_layout.py"
    script.write_text(VALIDATION_SCRIPT)
    overrides = {
        "job.dump_folder": str(folder / "out"),
        "checkpoint.initial_load_path": str(seed),
        "training.steps": 3,
        **overrides,
    }
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launch += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    result = subprocess.run(
        [*launch, str(script), json.dumps(overrides)],
        cwd=REPO,
        env=child_env(folder),
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = [r for r in log_records(result.stdout) if r.get("event") == "validation result"]
    assert result.returncode == 0 and len(found) == nproc, result.stdout[-3000:] + result.stderr[-5000:]
    return {r["rank"]: r for r in found}


#: Validation after every step, the first one included: pytorch#162822 (torch 2.9) left the
#: backward infrastructure uninitialised when a schedule evaluated before its first step; titan
#: validates only after a step, and training must go on correctly after each validation.
EVERY_STEP = {"validation.enable": True, "validation.freq": 1, "validation.steps": 2}


@pytest.fixture(scope="module")
def one_process_validation(tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path) -> dict:
    return validation_run(tmp_path_factory.mktemp("validation_one"), 1, seed_checkpoint, EVERY_STEP)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule", [_on_gloo(s) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")]
)
def test_pp2_validation_is_forward_only_and_leaves_training_unchanged(
    schedule: str, tmp_path: Path, seed_checkpoint: Path, one_process_validation: dict
) -> None:
    """The V schedules (rank 0 holds the first and the last stage) hand the last stage's input
    gradients to the rank's other stage in memory, which torch's forward-only ``eval`` still
    did: the first validation stopped the run (``can't steal_bwd_input if this stage doesn't
    have backward``), exit 1."""
    layout = {"parallelism.pp": 2, "parallelism.pp_schedule": schedule}
    validated = validation_run(tmp_path / "validated", 2, seed_checkpoint, {**layout, **EVERY_STEP})
    plain = validation_run(tmp_path / "plain", 2, seed_checkpoint, layout)
    expected = [r["validation/loss"] for r in one_process_validation["rows"]]
    assert len(expected) == 3
    for rank in (0, 1):
        got, without = validated[rank], plain[rank]
        # The validation loss is the one process's (broadcast to the rank without the last stage).
        assert [r["validation/loss"] for r in got["rows"]] == pytest.approx(expected, rel=1e-4)
        # No gradient is computed while validating; the step's gradients are left as they were.
        assert got["backward"]["validation"] == 0 and got["kept"] == [True, True, True]
        assert got["backward"]["training"] == without["backward"]["training"] > 0
        # Training after each validation goes on exactly as without validation.
        assert [r["loss"] for r in got["rows"]] == pytest.approx(
            [r["loss"] for r in without["rows"]], rel=1e-6
        )
        assert [r["grad_norm"] for r in got["rows"]] == [r["grad_norm"] for r in without["rows"]]


def test_a_stage_whose_forward_calls_a_dropped_module_names_the_contract() -> None:
    """A model that ignores the pipeline contract (its forward calls ``tok_embeddings`` on a stage
    that holds none) fails naming the model and what to change, not with a bare TypeError."""
    import torch

    from titan_core.errors import PluginError
    from titan_plugins_llama3.model import Llama3

    class Careless(Llama3):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h)
            return self.output(self.norm(h))

    config = TrainerConfig()
    config.training.local_batch_size = 4
    ctx = _ctx(config, pp=2, rank=1)
    with torch.device("meta"):
        model = Careless(ctx.model_args)
    (stage,) = pipeline.apply([model], ctx)
    hidden = torch.zeros(2, 8, ctx.model_args.dim, device="meta")
    expected = r"model 'llama3'.*pipeline contract.*stage 1 of 2.*tok_embeddings.*None"
    with pytest.raises(PluginError, match=expected):
        stage(hidden)

    class ReadsTheWeight(Llama3):  # a tied head or a functional embedding reads the dropped weight
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding(tokens, self.tok_embeddings.weight)

    with torch.device("meta"):
        (stage,) = pipeline.apply([ReadsTheWeight(ctx.model_args)], _ctx(config, pp=2, rank=1))
    with pytest.raises(PluginError, match=expected):
        stage(hidden)
    other = TypeError("unrelated")

    class Unrelated(Llama3):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            raise other

    with torch.device("meta"):
        (stage,) = pipeline.apply([Unrelated(ctx.model_args)], _ctx(config, pp=2, rank=1))
    with pytest.raises(TypeError) as raised:
        stage(hidden)
    assert raised.value is other  # any other error of the model's is its own


CARELESS_RUN = """
import attrs
from titan_core import hookimpl
from titan_plugins_llama3 import plugin as llama3
from titan_plugins_llama3.model import Llama3
from titan_plugins_llama3.recipes import llama3_debugmodel


class Careless(Llama3):
    def forward(self, tokens):  # breaks the pipeline contract: a later stage embeds again
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return h if self.output is None else self.output(self.norm(h))


class CarelessPlugin:
    @hookimpl
    def titan_models(self):
        (spec,) = llama3.titan_models()
        return [attrs.evolve(spec, name="careless", build=Careless)]


def careless_pp2():
    config = llama3_debugmodel()
    config.model.name = "careless"
    config.parallelism.pp = 2
    config.training.local_batch_size, config.training.seq_len = 2, 32
    config.training.device = "cpu"
    config.debug.fake_tensors = "off"
    config.metrics.enable_tensorboard = False
    return config


"""

CARELESS_LAUNCH = """
from careless_recipes import CarelessPlugin
from titan_core import _registry
from titan_core.cli import exit_process, main

registry = _registry.Registry().load_entry_points()
registry.register(CarelessPlugin(), "careless")
_registry._default = registry
args = ["--module", "careless_recipes", "--recipe", "careless_pp2", "--comm-backend", "fake"]
exit_process(main(["run", *args]))
"""


def test_a_run_of_a_model_breaking_the_pipeline_contract_ends_with_one_error(tmp_path: Path) -> None:
    """The same through ``titan run`` on the later stage of a simulated pipeline: torch's pipeline
    stage wraps the model's error in its own RuntimeError; the run ends with titan's one line."""
    (tmp_path / "careless_recipes.py").write_text(CARELESS_RUN)
    (tmp_path / "launch.py").write_text(CARELESS_LAUNCH)
    result = subprocess.run(
        [sys.executable, "launch.py"],
        cwd=tmp_path,
        env=titan_env(NGPU="2", FAKE_PP_RANK="1", PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert len(errors) == 1 and "model 'careless' does not follow the pipeline contract" in errors[0]
    assert "stage 1 of 2" in errors[0] and "tok_embeddings is None" in errors[0]
    assert "Traceback" not in result.stderr
