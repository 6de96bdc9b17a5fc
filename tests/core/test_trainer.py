"""The trainer in one process: seeding, schedule, clipping, dtypes, outputs."""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import pytest
import torch

from tests.conftest import tiny_llama3
from titan_core import hookimpl
from titan_core._registry import Registry, get_registry
from titan_core.config import TrainerConfig
from titan_core.errors import PluginError, UsageError
from titan_core.schedule import WarmupStableDecay
from titan_core.trainer import Trainer, train


def tiny(tmp_path: Path, steps: int = 4) -> TrainerConfig:
    return tiny_llama3(tmp_path, steps)


def losses(config: TrainerConfig) -> list[float]:
    return [row["loss"] for row in train(config, get_registry())]


def test_same_seed_same_losses_other_seed_differs(tmp_path: Path) -> None:
    config = tiny(tmp_path)
    config.debug.deterministic = True
    first, again = losses(config), losses(config)
    assert first == again
    config.debug.seed = 1
    config.job.dump_folder = str(tmp_path / "seed1")  # another run: its own folder
    assert losses(config) != first


def test_lr_schedule_warmup_then_decay() -> None:
    config = TrainerConfig()
    config.training.steps, config.training.warmup_steps = 10, 2
    config.training.decay_ratio, config.training.min_lr_factor = 0.5, 0.1
    factors = [WarmupStableDecay.from_config(config.training)(i) for i in range(10)]
    assert factors[:2] == pytest.approx([1 / 3, 2 / 3])
    assert factors[2:6] == [1.0] * 4  # constant until the last decay_ratio of the steps
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))


def test_lr_schedule_never_goes_below_its_floor_past_the_last_step() -> None:
    config = TrainerConfig()
    config.training.steps, config.training.warmup_steps = 10, 2
    config.training.decay_ratio, config.training.min_lr_factor = 1.0, 0.0
    schedule = WarmupStableDecay.from_config(config.training)
    assert [schedule(i) for i in range(9, 40)] == [0.0] * 31  # was negative: gradient ascent


def test_clipping_bounds_the_update(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=1)
    config.training.max_norm = 1e-3
    trainer = Trainer(config, get_registry())
    before = [p.detach().clone() for p in trainer.parts[0].parameters()]
    inputs, labels = next(iter(trainer.batches))
    trainer.forward_backward(inputs, labels)
    norm = trainer.clip_gradients()
    clipped = torch.sqrt(sum(p.grad.norm() ** 2 for p in trainer.parts[0].parameters()))
    assert norm > 1e-3 and clipped == pytest.approx(1e-3, rel=1e-3)
    trainer.optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.parts[0].parameters(), strict=True))
    trainer.close()


def test_bf16_autocast_on_cpu_trains(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=3)
    config.training.dtype = "bfloat16"
    found = losses(config)
    assert len(found) == 3 and all(torch.isfinite(torch.tensor(found)))


def test_outputs_written(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=2)
    config.metrics.enable_tensorboard = True
    rows = train(config, get_registry())
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "config.toml").read_text().count("[training]") == 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_vocab_too_small_for_tokenizer(tmp_path: Path) -> None:
    config = tiny(tmp_path)
    config.model.overrides = {**config.model.overrides, "vocab_size": 100}
    expected = "tokenizer has .* tokens but model llama3/debugmodel has a vocabulary of 100"
    with pytest.raises(UsageError, match=expected):
        Trainer(config, get_registry())


def test_missing_strategy_plugin_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny(tmp_path)
    config.parallelism.tp = 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # degrees are checked against it first
    registry = Registry(disabled={"parallel"}).load_entry_points()
    fake_backend = next(iter(registry.records("comm_backends").values()))

    def topology(config: TrainerConfig) -> object:
        from titan_core.topology import Topology

        return Topology(world_size=2, rank=0, local_rank=0, device=torch.device("cpu"))

    registry.register(_Backend(attrs.evolve(fake_backend, name="two_ranks", init=topology)), "two_ranks")
    config.comm.backend = "two_ranks"
    with pytest.raises(PluginError, match=r"needs strategies for tp .*titan-plugins-parallel"):
        Trainer(config, registry)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (None, r"data\.path: .* does not exist"),
        ({}, r"data\.path: no \.jsonl or \.txt files"),
        # An empty file: named with the tokens it holds and what one step needs, as a small one.
        (
            {"empty.jsonl": ""},
            r"data: data\.dataset 'text' \(plugin core[^)]*\) at data\.path '.*corpus' is too small for one "
            r"step: one pass gives 0 tokens \(no documents\), and one step needs 66 tokens",
        ),
    ],
)
def test_bad_data_path_fails_before_the_model_is_built(
    tmp_path: Path, files: dict[str, str] | None, expected: str
) -> None:
    config = tiny(tmp_path)
    config.data.dataset = "text"
    config.data.path = str(tmp_path / "corpus")
    if files is not None:
        (tmp_path / "corpus").mkdir()
        for name, text in files.items():
            (tmp_path / "corpus" / name).write_text(text)
    with pytest.raises(UsageError, match=expected):
        Trainer(config, _unbuildable(config))


def _unbuildable(config: TrainerConfig) -> Registry:
    """A registry whose model (set in ``config``) fails the test if it is built: what is checked
    must be refused before the model is built (and, on a GPU, compiled)."""
    registry = Registry().load_entry_points()
    llama3 = registry.get("models", "llama3")

    def never(args: object) -> None:
        raise AssertionError("the model was built before the data was checked")

    class Unbuildable:
        @hookimpl
        def titan_models(self) -> list:
            return [attrs.evolve(llama3, name="unbuildable", build=never)]

    registry.register(Unbuildable(), "unbuildable")
    config.model.name = "unbuildable"
    return registry


_FEW_WORDS = '{"text": "only a few words here"}\n'


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # 2 x (32 + 1) tokens for one step of one rank; a line of a few words holds about 8.
        (
            "small jsonl",
            r"one pass gives \d+ tokens \(1 document\), and one step needs 66 tokens \(1 "
            r"data-parallel rank\(s\) x training\.local_batch_size=2 x \(training\.seq_len=32 \+ 1\)\); "
            r"add documents, or lower training\.seq_len or training\.local_batch_size$",
        ),
        ("empty txt", r"one pass gives 0 tokens \(1 document, empty\), and one step needs 66 tokens"),
        ("empty documents", r"one pass gives 0 tokens \(3 documents, all empty\)"),
        # Accumulation: one step reads 2 microbatches of 2 sequences; the data fills only one.
        (
            "one microbatch of two",
            r"one step needs 132 tokens \(1 data-parallel rank\(s\) x "
            r"training\.local_batch_size=2 x 2 microbatches \(training\.global_batch_size=4\) x "
            r"\(training\.seq_len=32 \+ 1\)\)",
        ),
        (
            "validation",
            r"^data: validation\.dataset 'text' \(plugin core[^)]*\) is too small for one step: "
            r"one pass gives "
            r"\d+ tokens \(1 document\)",
        ),
    ],
)
def test_data_too_small_for_one_step_is_refused_before_the_model_is_built(
    tmp_path: Path, case: str, expected: str
) -> None:
    """Found at the end of the first pass, which only step 1 reached: after the model was built
    (and, on a GPU, compiled), minutes into the run, from the prefetch thread."""
    config = tiny(tmp_path / "out")
    corpus = tmp_path / "corpus.jsonl"
    config.data.dataset, config.data.path = "text", str(corpus)
    if case == "small jsonl":
        corpus.write_text(_FEW_WORDS)
    elif case == "empty txt":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("")
        config.data.path = str(corpus)
    elif case == "empty documents":  # blank after tokenizing: BOS and EOS alone
        corpus.write_text('{"text": ""}\n' * 3)
    elif case == "one microbatch of two":
        corpus.write_text(_FEW_WORDS * 9)  # 9 x 14 = 126 tokens: 3 sequences, not 4
        config.training.global_batch_size = 4
    else:
        corpus.write_text(_FEW_WORDS * 40)
        config.validation.enable = True
        config.validation.dataset, config.validation.path = "text", str(tmp_path / "val.jsonl")
        (tmp_path / "val.jsonl").write_text(_FEW_WORDS)
    with pytest.raises(UsageError, match=expected) as info:
        Trainer(config, _unbuildable(config))
    message = str(info.value)
    assert "\n" not in message
    if case != "validation":
        assert message.startswith("data: data.dataset 'text' (plugin core")  # the dataset's plugin named
        assert f") at data.path {str(corpus)!r} is too small" in message


class _Backend:
    def __init__(self, record: object) -> None:
        self.record = record

    @hookimpl
    def titan_comm_backends(self) -> list:
        return [self.record]


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_the_extreme_seeds_the_config_allows_initialise_every_pipeline_stage(seed: int) -> None:
    """A later stage adds its PP coordinate to the seed; at the ends of the range that must wrap,
    not overflow on that stage's rank alone."""
    from titan_core._registry import get_registry
    from titan_core.init import initialise

    spec = get_registry().get("models", "llama3")
    args = spec.flavor("debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 4})
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    for coordinate in (0, 1):
        mode = initialise(
            [model],
            spec,
            args,
            seed,
            device=torch.device("cpu"),
            simulated=False,
            max_full_gib=8.0,
            pp_coordinate=coordinate,
            world_size=2,
        )
        assert mode and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_warmup_as_long_as_the_run_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import titan_core.trainer as trainer_module

    seen: list[str] = []
    real = trainer_module.log
    monkeypatch.setattr(
        trainer_module,
        "log",
        type(
            "L",
            (),
            {"warning": lambda self, e, **k: seen.append(e), "__getattr__": lambda self, n: getattr(real, n)},
        )(),
    )
    config = tiny_llama3(tmp_path, 4)
    config.training.warmup_steps = 4
    Trainer(config, get_registry()).close()
    assert any(
        "training.warmup_steps=4 >= training.steps=4: the learning rate never reaches" in w for w in seen
    )
    seen.clear()
    config = tiny_llama3(tmp_path / "b", 4)
    config.training.warmup_steps = 3
    Trainer(config, get_registry()).close()
    assert not any("warmup_steps" in w for w in seen)


def test_a_bos_id_override_other_than_the_tokenizers_is_refused(tmp_path: Path) -> None:
    """The document mask splits at the model's bos_id, the loader frames with the tokenizer's."""
    config = tiny(tmp_path)
    config.model.overrides = {**config.model.overrides, "bos_id": 7}
    with pytest.raises(UsageError, match=r"model\.overrides\.bos_id=7 is not the tokenizer's BOS id 0"):
        Trainer(config, get_registry())


def _with_param_groups(tmp_path: Path, param_groups: object) -> tuple[TrainerConfig, Registry]:
    """The tiny Llama 3 as a plugin's model ``grouped`` whose ``ModelSpec.param_groups`` is given."""
    registry = Registry().load_entry_points()
    llama3 = registry.get("models", "llama3")

    class Grouped:
        @hookimpl
        def titan_models(self) -> list:
            return [attrs.evolve(llama3, name="grouped", param_groups=param_groups)]

    registry.register(Grouped(), "grouped")
    config = tiny(tmp_path)
    config.model.name = "grouped"
    return config, registry


def test_param_groups_with_no_decay_on_norms_train_every_parameter_as_adamw_would(tmp_path: Path) -> None:
    """Groups of their own weight decay: every parameter trains, each with its group's decay."""

    def no_decay_on_norms(model: torch.nn.Module, training: object) -> list[dict]:
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        vectors = [p for p in model.parameters() if p.ndim < 2]
        return [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]

    config, registry = _with_param_groups(tmp_path, no_decay_on_norms)
    config.training.weight_decay = 0.5
    trainer = Trainer(config, registry)
    try:
        assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.5, 0.0]
        before = {n: p.detach().clone() for n, p in trainer.parts[0].named_parameters()}
        trainer.train()
        assert all(not torch.equal(before[n], p) for n, p in trainer.parts[0].named_parameters())
    finally:
        trainer.close()


def test_param_groups_that_leave_parameters_out_are_refused_naming_them(tmp_path: Path) -> None:
    """A parameter in no group was never updated: the norms of a decay group of matrices only
    stayed at their initial values for the whole run, without a word."""

    def matrices_only(model: torch.nn.Module, training: object) -> list[dict]:
        return [{"params": [p for p in model.parameters() if p.ndim >= 2]}]

    config, registry = _with_param_groups(tmp_path, matrices_only)
    expected = (
        r"model 'grouped' .*ModelSpec\.param_groups left 5 trainable parameters out of every group "
        r"\(layers\.0\.attention_norm\.weight, layers\.0\.ffn_norm\.weight, "
        r"layers\.1\.attention_norm\.weight, "
        r"and 2 more\): AdamW would never update them"
    )
    with pytest.raises(PluginError, match=expected):
        Trainer(config, registry)


def test_param_groups_naming_a_parameter_twice_or_failing_are_one_plugin_error(tmp_path: Path) -> None:
    """Both ended in a bare traceback (torch's ``ValueError: some parameters appear in more than
    one parameter group``, the plugin's own ``KeyError``)."""

    def twice(model: torch.nn.Module, training: object) -> list[dict]:
        params = list(model.parameters())
        return [{"params": params}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    def failing(model: torch.nn.Module, training: object) -> list[dict]:
        raise KeyError("norm")

    config, registry = _with_param_groups(tmp_path, twice)
    expected = (
        r"ModelSpec\.param_groups put 5 parameters in more than one group \(layers\.0\.attention_norm\.weight"
    )
    with pytest.raises(PluginError, match=expected):
        Trainer(config, registry)
    config, registry = _with_param_groups(tmp_path / "failing", failing)
    with pytest.raises(PluginError, match=r"model 'grouped' .*failed in param_groups: KeyError: 'norm'"):
        Trainer(config, registry)
