"""``compile.enable``: each block compiled in place; same losses as eager."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import Trainer


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_losses(
    tmp_path: Path, seed_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo and AOTAutograd trace every block; the ``aot_eager`` backend skips inductor's C++
    code generation, which takes over a minute on two CPU cores and is not what is tested here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    runs = {}
    for enable in (False, True):
        config = tiny_config(
            **{
                "checkpoint.initial_load_path": str(seed_checkpoint),
                "job.dump_folder": str(tmp_path / str(enable)),
                "compile.enable": enable,
            }
        )
        trainer = Trainer(config, get_registry())
        try:
            runs[enable] = [row["loss"] for row in trainer.train()]
        finally:
            trainer.close()
        compiled = [b._compiled_call_impl is not None for b in trainer.parts[0].layers.values()]
        assert compiled == [enable] * len(compiled)
        assert list(trainer.parts[0].state_dict())[1] == "layers.0.attention.wq.weight"
    assert len(runs[True]) >= 5
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)


@pytest.mark.slow
def test_blocks_share_one_graph_and_never_recompile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four blocks, four steps, selective AC and a new document mask every batch: every graph is
    compiled in step 1 and there are fewer graphs than blocks (the blocks share theirs)."""
    compiled_at: list[int] = []
    trainer: Trainer | None = None

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiled_at.append(trainer.step)
        return gm.forward  # run the captured graph as is: dynamo's guards are what is tested

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting_backend))
    torch._dynamo.reset()
    config = tiny_config(
        **{
            "job.dump_folder": str(tmp_path),
            "compile.enable": True,
            "activation_checkpoint.mode": "selective",
            "training.steps": 4,
        }
    )
    config.model.overrides.update(document_mask=True, bos_id=0)  # the bundled tokenizer's BOS
    trainer = Trainer(config, get_registry())
    try:
        losses = [row["loss"] for row in trainer.train()]
    finally:
        trainer.close()
    assert len(losses) == 4
    n_blocks = len(trainer.parts[0].layers)
    assert n_blocks == 4
    assert compiled_at and set(compiled_at) == {1}, compiled_at
    assert len(compiled_at) < n_blocks


def _saved_bytes_and_grads(trainer: Trainer) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for backward over one step of ``trainer``, and the gradients.

    Views of the model's parameters and buffers are not counted: they are held anyway (a compiled
    block that recomputes the rotary slice saves the whole rotary table, which costs nothing)."""
    batch = next(iter(trainer.batches))
    held = {
        t.untyped_storage().data_ptr() for t in [*trainer.parts[0].parameters(), *trainer.parts[0].buffers()]
    }
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in held:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.forward_backward(*batch)
    grads = [p.grad.clone() for p in trainer.parts[0].parameters()]
    return saved[0], grads


@pytest.mark.slow
def test_a_smaller_memory_budget_keeps_fewer_activations_for_the_same_gradients(
    tmp_path: Path, seed_checkpoint: Path
) -> None:
    """``memory_budget``: the compiler recomputes more under a smaller budget, and the gradients
    stay those of no recomputation. The trainers share one process without a dynamo reset: each
    must partition its own graphs, not reuse those another trainer compiled under another budget."""
    torch._dynamo.reset()
    runs: dict[str, tuple[int, list[torch.Tensor]]] = {}
    for mode, budget in (("none", 1.0), ("memory_budget", 1.0), ("memory_budget", 0.0)):
        config = tiny_config(
            **{
                "checkpoint.initial_load_path": str(seed_checkpoint),
                "job.dump_folder": str(tmp_path / f"{mode}{budget}"),
                "compile.enable": True,
                "compile.backend": "aot_eager",  # partitions like inductor, generates no C++
                "activation_checkpoint.mode": mode,
                "activation_checkpoint.memory_budget": budget,
            }
        )
        trainer = Trainer(config, get_registry())
        try:
            runs[f"{mode}{budget}"] = _saved_bytes_and_grads(trainer)
        finally:
            trainer.close()
    (kept, grads), (all_kept, _), (least_kept, least_grads) = runs.values()
    assert least_kept < 0.75 * all_kept, {k: v[0] for k, v in runs.items()}
    assert all_kept <= kept
    for a, b in zip(grads, least_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_memory_budget_needs_compile_and_a_budget_in_0_1() -> None:
    from titan_core.config import ConfigError, TrainerConfig, validate

    config = TrainerConfig()
    config.activation_checkpoint.mode = "memory_budget"
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert [p.split(":")[0] for p in info.value.problems] == ["activation_checkpoint.mode"]
    assert "compile.enable = true" in info.value.problems[0]
    config.compile.enable = True
    validate(config, source="r")
    with pytest.raises(ConfigError, match=r"activation_checkpoint.memory_budget.*\[0.0, 1.0\]"):
        config.activation_checkpoint.memory_budget = 1.5


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        # Settings nothing reads were taken without a word (as the AC fields a mode ignores are not).
        (
            {"compile.backend": "aot_eager"},
            "compile.backend: 'aot_eager' does nothing with compile.enable = False",
        ),
        ({"compile.autotune": False}, "compile.autotune: False does nothing with compile.enable = False"),
        (
            {
                "compile.enable": True,
                "compile.backend": "eager",
                "activation_checkpoint.mode": "memory_budget",
                "activation_checkpoint.memory_budget": 0.1,
            },
            "activation_checkpoint.mode: 'memory_budget' is applied by the AOT partitioner, which "
            "compile.backend = 'eager' does not run",
        ),
    ],
)
def test_a_compile_setting_nothing_reads_is_refused(fields: dict, problem: str) -> None:
    from tests.parallel_harness import apply_overrides
    from titan_core.config import ConfigError, TrainerConfig, validate

    config = apply_overrides(TrainerConfig(), fields)
    with pytest.raises(ConfigError) as info:
        validate(config, source="r")
    assert [p for p in info.value.problems if p.startswith(problem)], info.value.problems


@pytest.mark.parametrize(("backend", "package"), [("tvm", "apache-tvm"), ("openxla", "torch_xla")])
def test_a_backend_whose_package_is_missing_is_refused_before_the_model_is_built(
    monkeypatch: pytest.MonkeyPatch, backend: str, package: str
) -> None:
    """torch lists ``tvm`` and ``openxla`` whether or not their packages are installed; such a run
    built the model and stopped at step 1 (``BackendCompilerFailed: backend='tvm' raised:
    ImportError: Please install apache-tvm``, an 80-line traceback, exit 1)."""
    import importlib.util

    from tests.parallel_harness import apply_overrides
    from titan_core.config import ConfigError, TrainerConfig, validate

    fields = {"compile.enable": True, "compile.backend": backend}
    real_find_spec = importlib.util.find_spec
    installed: set[str] = set()

    def find_spec(name: str, *args: object) -> object:
        if name in ("tvm", "torch_xla"):
            return object() if name in installed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as info:
        validate(apply_overrides(TrainerConfig(), fields), source="r")
    expected = f"compile.backend: {backend!r} compiles through the package {package}"
    assert [p for p in info.value.problems if p.startswith(expected)], info.value.problems
    installed.update({"tvm", "torch_xla"})
    validate(apply_overrides(TrainerConfig(), fields), source="r")  # installed: nothing to refuse


def _compile_calls(monkeypatch: pytest.MonkeyPatch, device: str, **fields: object) -> list[dict]:
    """The keywords each block's ``torch.compile`` gets from the compile strategy on ``device``."""
    from types import SimpleNamespace

    from titan_core.config import TrainerConfig
    from titan_plugins_parallel import compile as compile_strategy

    calls: list[dict] = []

    def recording_compile(fn: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    config = TrainerConfig()
    for path, value in {"compile.enable": True, **fields}.items():
        section, name = path.split(".")
        setattr(getattr(config, section), name, value)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    ctx = SimpleNamespace(config=config, topology=SimpleNamespace(device=torch.device(device)))
    compile_strategy.apply([model], ctx)  # type: ignore[arg-type]
    return calls


def test_autotune_searches_triton_tiles_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile.autotune`` (default on): CUDA blocks compile with inductor's tile search and ATen
    matmuls; CPU blocks, another backend and ``autotune = false`` compile as before."""
    from titan_plugins_parallel.compile import AUTOTUNE

    search = {"options": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}}
    assert search["options"] == AUTOTUNE
    assert _compile_calls(monkeypatch, "cuda") == [search, search]
    assert _compile_calls(monkeypatch, "cpu") == [{}, {}]
    assert _compile_calls(monkeypatch, "cuda", **{"compile.autotune": False}) == [{}, {}]
    other = _compile_calls(monkeypatch, "cuda", **{"compile.backend": "aot_eager"})
    assert other == [{"backend": "aot_eager"}] * 2


def test_autotune_under_memory_budget_reaches_inductor_with_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``memory_budget`` the blocks compile through titan's wrapper of the inductor backend,
    which torch.compile gives no options: the wrapper passes the settings to inductor itself,
    inside the partitioner's budget."""
    import torch._functorch.config as functorch_config

    seen: list[tuple[dict, float]] = []

    def inductor(gm: object, inputs: object, **kwargs: object) -> str:
        seen.append((kwargs, functorch_config.activation_memory_budget))
        return "compiled"

    fields = {"activation_checkpoint.mode": "memory_budget", "activation_checkpoint.memory_budget": 0.3}
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: inductor)
    for device, patches in (
        ("cuda", {"config_patches": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}}),
        ("cpu", {}),
    ):
        (call, _) = _compile_calls(monkeypatch, device, **fields)
        assert set(call) == {"backend"}
        seen.clear()
        assert call["backend"](None, []) == "compiled"
        assert seen == [(patches, 0.3)]
        assert call["backend"].__name__ == "inductor_memory_budget_0.3"


def test_an_unknown_backend_is_one_error_naming_the_backends(tmp_path: Path) -> None:
    from titan_core.errors import UsageError

    config = tiny_config(
        **{"job.dump_folder": str(tmp_path), "compile.enable": True, "compile.backend": "inductr"}
    )
    with pytest.raises(
        UsageError, match=r"compile.backend = 'inductr' is not a torch.compile backend; .*inductor"
    ):
        Trainer(config, get_registry())


@pytest.mark.slow
def test_memory_budget_composes_with_fsdp_and_pipeline_stages(
    tmp_path: Path, seed_checkpoint: Path, reference_losses: list[float]
) -> None:
    """FSDP 2 and PP 2 (two stages, each compiled under the budget) give the one-process losses."""
    from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_layout

    budget = {
        "compile.enable": True,
        "compile.backend": "aot_eager",
        "activation_checkpoint.mode": "memory_budget",
        "activation_checkpoint.memory_budget": 0.2,
    }
    fsdp = {**budget, "parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2}
    assert_losses_close(run_layout(tmp_path / "fsdp", 2, seed_checkpoint, fsdp), reference_losses)
    pp = {**budget, "parallelism.pp": 2, "parallelism.dp_shard": 1}
    assert_losses_close(run_layout(tmp_path / "pp", 2, seed_checkpoint, pp, rank=1), reference_losses)


@pytest.mark.slow
def test_memory_budget_under_tensor_parallel_gives_the_one_process_steps(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, seed_checkpoint: Path
) -> None:
    """TP 2's compiled blocks take the TP process group as a graph input (an opaque script
    object): the partitioner could not size it for the budget and step 1 stopped (``Cannot
    compute the size of ... FakeScriptObject``). It holds no activation memory; losses and
    gradient norms are one process's."""
    from tests.plugins.parallel.rows import assert_rows_close, layout_rows, one_process_rows

    layout = {
        "compile.enable": True,
        "compile.backend": "aot_eager",
        "activation_checkpoint.mode": "memory_budget",
        "activation_checkpoint.memory_budget": 0.2,
        "parallelism.tp": 2,
        "parallelism.dp_shard": 1,
    }
    expected = one_process_rows(tmp_path_factory, seed_checkpoint)
    assert_rows_close(layout_rows(tmp_path, 2, seed_checkpoint, layout), expected)


def test_a_model_without_layers_is_refused_and_sequential_blocks_are_compiled() -> None:
    """A plugin model without ``layers`` (blocks named ``blocks``, say) was listed as compiled
    and ran eager, without a word; blocks in an ``nn.Sequential`` were skipped the same way."""
    from types import SimpleNamespace

    from titan_core.errors import UsageError
    from titan_plugins_parallel import compile as compile_strategy

    config = tiny_config(**{"compile.enable": True})
    ctx = SimpleNamespace(config=config, topology=SimpleNamespace(device=torch.device("cpu")))

    unlisted = torch.nn.Module()
    unlisted.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(
        UsageError, match=r"compile.enable compiles each block of the model's `layers`.*has no"
    ):
        compile_strategy.apply([unlisted], ctx)  # type: ignore[arg-type]

    sequential = torch.nn.Module()
    sequential.layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    compile_strategy.apply([sequential], ctx)  # type: ignore[arg-type]
    assert [b._compiled_call_impl is not None for b in sequential.layers] == [True, True]


@pytest.mark.slow
def test_compiled_moe_blocks_with_selective_checkpointing_keep_the_eager_losses_and_router_statistics(
    tmp_path: Path,
) -> None:
    """The MoE model (DeepSeek-V3 debug shape, document mask, balance loss, bias update),
    compiled block by block with selective recomputation: the eager losses, gradient norms and
    router statistics, so no forward, recomputed or compiled, is counted twice."""
    from titan_plugins_moe import recipes

    rows = {}
    for name, fields in (
        ("eager", {}),
        (
            "compiled",
            {
                "compile.enable": True,
                "compile.backend": "aot_eager",
                "activation_checkpoint.mode": "selective",
            },
        ),
    ):
        torch._dynamo.reset()
        config = recipes.deepseek_v3_debugmodel()
        for path, value in {
            "job.dump_folder": str(tmp_path / name),
            "training.steps": 3,
            "training.warmup_steps": 1,
            "training.seq_len": 32,
            "training.local_batch_size": 2,
            "training.device": "cpu",
            "training.dtype": "float32",
            "data.bundled_documents": 100,
            "metrics.enable_tensorboard": False,
            "moe.bias_update_rate": 0.01,
            "moe.aux_loss_weight": 0.1,
            **fields,
        }.items():
            section, field_name = path.split(".")
            setattr(getattr(config, section), field_name, value)
        config.model.overrides = {"dim": 64, "n_layers": 3, "document_mask": True, "bos_id": 0}
        trainer = Trainer(config, get_registry())
        try:
            rows[name] = trainer.train()
        finally:
            trainer.close()
    keys = ["loss", "grad_norm", "moe/aux_loss", "moe/expert_bias_absmax", "moe/layer1/tokens_max"]
    keys += ["moe/layer2/tokens_min", "moe/imbalance_mean"]
    assert len(rows["eager"]) == 3
    for eager, compiled in zip(rows["eager"], rows["compiled"], strict=True):
        assert {k: compiled[k] for k in keys} == pytest.approx({k: eager[k] for k in keys}, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"activation_checkpoint.mode": "full"},
        {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2"},
    ],
    ids=["full", "every_2nd"],
)
def test_checkpoint_debug_with_compiled_blocks_trains_like_eager(
    tmp_path: Path, seed_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, extra: dict
) -> None:
    """``activation_checkpoint.debug`` with ``compile.enable`` stopped step 1 (``debug=True is
    incompatible with non-default context_fn``: the checkpoint traced into the compiled block);
    the checkpoint now stays eager around the compiled block, and the losses are eager's."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    runs = {}
    for enable in (False, True):
        overrides = {
            "checkpoint.initial_load_path": str(seed_checkpoint),
            "job.dump_folder": str(tmp_path / str(enable)),
            "training.steps": 3,
        }
        if enable:
            overrides.update({**extra, "activation_checkpoint.debug": True, "compile.enable": True})
        trainer = Trainer(tiny_config(**overrides), get_registry())
        try:
            runs[enable] = [row["loss"] for row in trainer.train()]
        finally:
            trainer.close()
        if enable:
            wrapped = [
                b for b in trainer.parts[0].layers.values() if hasattr(b, "_checkpoint_wrapped_module")
            ]
            assert wrapped and all(b._compiled_call_impl is None for b in wrapped)
            assert all(b._checkpoint_wrapped_module._compiled_call_impl is not None for b in wrapped)
    assert len(runs[True]) == 3
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
