"""Validation (``[validation]``): loss and perplexity on held data, logged and in TensorBoard."""

from __future__ import annotations

import itertools
import json
import math
import random
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.conftest import plugin_module, tiny_llama3
from tests.parallel_harness import log_records, run_titan_train, write_seed_checkpoint
from titan_core import Dataset, Strategy
from titan_core._registry import Registry, get_registry
from titan_core.config import Data
from titan_core.errors import PluginError, UsageError
from titan_core.parallelize import cross_entropy_loss
from titan_core.trainer import Trainer, train


def with_validation(tmp_path: Path, steps: int = 4) -> object:
    config = tiny_llama3(tmp_path, steps)
    config.validation.enable = True
    config.validation.freq = 2
    config.validation.steps = 2
    return config


def test_validation_loss_is_the_models_loss_on_the_validation_batches(tmp_path: Path) -> None:
    config = with_validation(tmp_path)
    config.metrics.enable_tensorboard = True
    trainer = Trainer(config, get_registry())
    history = trainer.train()
    validated = [r for r in history if "validation/loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    with torch.no_grad():
        batches = itertools.islice(iter(trainer.val_batches), 2)
        expected = sum(float(cross_entropy_loss(trainer.parts[0](i), lab)) for i, lab in batches) / 2
    last = validated[-1]
    assert last["validation/loss"] == pytest.approx(expected, rel=1e-4)
    assert last["validation/perplexity"] == pytest.approx(math.exp(expected), rel=1e-3)
    trainer.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"validation/loss", "validation/perplexity", "train/loss", "train/lr"} <= set(tags)


def test_validation_loss_is_written_at_full_precision(tmp_path: Path) -> None:
    """metrics.jsonl held validation/loss rounded to 5 decimals (7.83389): about 1e-6 relative,
    so a validation curve could not be checked against a reference as closely as the training
    loss (written at full precision)."""
    config = with_validation(tmp_path, steps=2)
    trainer = Trainer(config, get_registry())
    try:
        (validated,) = [r for r in trainer.train() if "validation/loss" in r]
        with torch.no_grad():
            batches = itertools.islice(iter(trainer.val_batches), 2)
            expected = sum(cross_entropy_loss(trainer.parts[0](i), lab) for i, lab in batches) / 2
    finally:
        trainer.close()
    assert validated["validation/loss"] == pytest.approx(float(expected), rel=1e-7, abs=0)
    assert validated["validation/perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-6, abs=0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["validation/loss"] == validated["validation/loss"]


def _trainer_info(monkeypatch: pytest.MonkeyPatch, wanted: str) -> list[dict[str, Any]]:
    """The fields of each ``wanted`` info event the trainer logs (still logged as usual)."""
    import titan_core.trainer as trainer_module

    events: list[dict[str, Any]] = []
    real = trainer_module.log

    class Log:
        def info(self, event: str, **fields: Any) -> None:
            if event == wanted:
                events.append(fields)
            real.info(event, **fields)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(trainer_module, "log", Log())
    return events


def test_the_validation_log_line_keeps_full_precision_and_the_console_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``validation`` JSON line carried the loss rounded to 5 decimals and the perplexity to
    3 (a loss under 5e-6 read 0.0), though the JSON lines keep full precision; only the console
    rounds, and never a non-zero value to 0."""
    from titan_core.log import _for_console

    events = _trainer_info(monkeypatch, "validation")
    rows = train(with_validation(tmp_path, steps=2), get_registry())
    (validated,) = [r for r in rows if "validation/loss" in r]
    (line,) = events
    assert line["loss"] == validated["validation/loss"]
    assert line["perplexity"] == validated["validation/perplexity"]
    console = _for_console({"event": "validation", **line})
    assert console["loss"] == f"{validated['validation/loss']:.5f}"
    tiny = _for_console({"event": "validation", "step": 2, "loss": 3.2e-7, "perplexity": 1.0000003})
    assert tiny["loss"] == "3.200e-07" and tiny["perplexity"] == "1.000"


def test_validation_reads_the_same_sequences_however_the_batch_is_split(tmp_path: Path) -> None:
    """A validation step is one global batch: shrinking the microbatch to fit memory (more
    gradient accumulation, same global batch) must not change the validation set or its loss."""
    losses = {}
    for local in (4, 2, 1):
        config = with_validation(tmp_path / str(local))
        config.training.local_batch_size, config.training.global_batch_size = local, 4
        config.data.shuffle_buffer = 0
        history = train(config, get_registry())
        losses[local] = [(r["loss"], r.get("validation/loss")) for r in history]
    for local in (2, 1):
        for (train_a, val_a), (train_b, val_b) in zip(losses[4], losses[local], strict=True):
            assert train_b == pytest.approx(train_a, rel=1e-5)
            assert (val_a is None) == (val_b is None)
            if val_a is not None:
                assert val_b == pytest.approx(val_a, rel=1e-5)


def test_validation_leaves_training_unchanged(tmp_path: Path) -> None:
    plain = tiny_llama3(tmp_path / "plain", 4)
    without = [r["loss"] for r in train(plain, get_registry())]
    with_it = [r["loss"] for r in train(with_validation(tmp_path / "val"), get_registry())]
    assert with_it == pytest.approx(without, rel=1e-6)


def test_validation_runs_no_backward_and_keeps_the_gradients(tmp_path: Path) -> None:
    trainer = Trainer(with_validation(tmp_path), get_registry())
    backward = {"training": 0, "validation": 0}
    phase = ["training"]
    params = list(trainer.parts[0].parameters())
    for param in params:
        param.register_hook(lambda grad: backward.__setitem__(phase[0], backward[phase[0]] + 1))
    validate, kept = trainer.validate, []

    def observed() -> dict[str, float]:
        before = [p.grad.clone() for p in params]  # the step's gradients (zeroed at the next one)
        phase[0] = "validation"
        try:
            return validate()
        finally:
            phase[0] = "training"
            kept.append(
                all(
                    p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params, before, strict=True)
                )
            )

    trainer.validate = observed  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
    assert kept == [True, True]  # steps 2 and 4 validated
    assert backward["validation"] == 0 and backward["training"] == 4 * len(params)


class ReplacedStep:
    """A third party's replacement of the step (``ctx.replace_forward_backward``): forward/backward."""

    def __init__(self, parts: list[torch.nn.Module], loss_fn: object) -> None:
        self.parts, self.loss_fn = parts, loss_fn

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        loss = self.loss_fn(self.parts[0](inputs, **kwargs), labels)
        loss.backward()
        return loss.detach()


class ReplacedStepWithEvaluate(ReplacedStep):
    """The same, with the forward-only ``evaluate`` validation uses."""

    evaluated = 0

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        assert not torch.is_grad_enabled() and not self.parts[0].training
        ReplacedStepWithEvaluate.evaluated += 1
        return self.loss_fn(self.parts[0](inputs, **kwargs), labels)


@pytest.mark.parametrize("step", [ReplacedStep, ReplacedStepWithEvaluate])
def test_a_replaced_step_validates_with_its_evaluate_or_its_step(tmp_path: Path, step: type) -> None:
    def apply(parts: list[torch.nn.Module], ctx: object) -> list[torch.nn.Module]:
        ctx.replace_forward_backward("replaced", step)
        return parts

    registry = Registry().load_entry_points()
    strategy = Strategy("replaced", 70, lambda config, dims: True, apply)
    registry.register(plugin(titan_strategies=[strategy]), "third_party_step")
    config = with_validation(tmp_path)
    config.training.global_batch_size = 4  # 2 microbatches: the step's loss_fn is scaled by 1/2
    ReplacedStepWithEvaluate.evaluated = 0
    trainer = Trainer(config, registry)
    try:
        rows = trainer.train()
        with torch.no_grad():
            # validation.steps = 2 global batches of 2 microbatches each
            batches = itertools.islice(iter(trainer.val_batches), 4)
            expected = sum(float(cross_entropy_loss(trainer.parts[0](i), lab)) for i, lab in batches) / 4
    finally:
        trainer.close()
    assert "replaced" in trainer.ctx.applied
    assert rows[-1]["validation/loss"] == pytest.approx(expected, rel=1e-4)
    assert ReplacedStepWithEvaluate.evaluated == (8 if step is ReplacedStepWithEvaluate else 0)


def test_validation_on_other_files(tmp_path: Path) -> None:
    corpus = tmp_path / "val.jsonl"
    corpus.write_text("\n".join(f'{{"text": "held out document {i} about rivers"}}' for i in range(300)))
    config = with_validation(tmp_path / "out", steps=2)
    config.validation.dataset, config.validation.path = "text", str(corpus)
    rows = train(config, get_registry())
    on_bundled = train(with_validation(tmp_path / "same", steps=2), get_registry())
    assert rows[-1]["validation/loss"] != pytest.approx(on_bundled[-1]["validation/loss"], rel=1e-3)


def test_missing_validation_path_names_the_validation_field(tmp_path: Path) -> None:
    config = with_validation(tmp_path)
    config.validation.dataset, config.validation.path = "text", str(tmp_path / "nowhere")
    with pytest.raises(UsageError, match=r"^validation\.path: .*nowhere' does not exist"):
        Trainer(config, get_registry())


# -- held-out documents (Dataset.held_out) ------------------------------------------------------


def windows(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> set[tuple[int, ...]]:
    """The packed token windows (``seq_len + 1`` tokens) of ``batches``."""
    return {
        tuple(row.tolist()) for inputs, labels in batches for row in torch.cat([inputs, labels[:, -1:]], 1)
    }


def test_bundled_held_out_documents_are_never_training_documents() -> None:
    bundled = get_registry().get("datasets", "bundled")
    data = Data()  # the default 4000 documents
    training, held_out = list(bundled.documents(data)), list(bundled.held_out(data))
    assert len(held_out) == len(training) == 4000
    assert not set(held_out) & set(training)


def test_bundled_validation_reads_no_training_sequence(tmp_path: Path) -> None:
    trainer = Trainer(with_validation(tmp_path), get_registry())
    try:
        # One whole pass over the training documents, in packing order (BOS + text + EOS each).
        loader = attrs.evolve(trainer.batches, shuffle_buffer=0, batch_size=1)
        tokens = sum(len(ids) + 2 for ids in trainer.tokenizer.encode_batch(list(loader.documents())))
        training = windows(itertools.islice(iter(loader), tokens // (loader.seq_len + 1)))
        validation = windows(itertools.islice(iter(trainer.val_batches), 2))
    finally:
        trainer.close()
    assert len(validation) == 4 and len(training) > 500
    assert not validation & training


def plugin(**hooks: object) -> types.ModuleType:
    """A third-party plugin module implementing ``hooks`` (name -> records)."""
    return plugin_module("third_party_data", **hooks)


def training_text(data: Data) -> Iterable[str]:
    return (f"The river falls {i} times and the market opens." for i in range(400))


def held_out_text(data: Data) -> Iterable[str]:
    return (f"A quiet storm gathers {i} times while the tower sleeps." for i in range(400))


def third_party_trainer(tmp_path: Path, dataset: Dataset) -> Trainer:
    registry = Registry().load_entry_points()
    registry.register(plugin(titan_datasets=[dataset]), "third_party_data")
    config = with_validation(tmp_path, steps=2)
    config.data.dataset = dataset.name
    return Trainer(config, registry)


def test_a_plugins_held_out_documents_are_validated_on(tmp_path: Path) -> None:
    trainer = third_party_trainer(tmp_path, Dataset("mine", training_text, held_out=held_out_text))
    try:
        ((inputs, _),) = itertools.islice(iter(trainer.val_batches), 1)
        ((train_inputs, _),) = itertools.islice(iter(attrs.evolve(trainer.batches, shuffle_buffer=0)), 1)
        rows = trainer.train()
    finally:
        trainer.close()
    tok = trainer.tokenizer
    first = [tok.bos_id, *tok.encode_batch([next(iter(held_out_text(Data())))])[0]]
    assert inputs[0, : len(first)].tolist() == first
    assert train_inputs[0, : len(first)].tolist() != first  # training still reads `documents`
    assert [r["step"] for r in rows if "validation/loss" in r] == [2]
    assert "validation reads the training data" not in (tmp_path / "train.log").read_text()


def test_a_dataset_without_held_out_documents_validates_on_training_text_and_warns(tmp_path: Path) -> None:
    trainer = third_party_trainer(tmp_path, Dataset("plain", training_text))
    try:
        ((inputs, _),) = itertools.islice(iter(trainer.val_batches), 1)
        rows = trainer.train()
    finally:
        trainer.close()
    tok = trainer.tokenizer
    first = [tok.bos_id, *tok.encode_batch([next(iter(training_text(Data())))])[0]]
    assert inputs[0, : len(first)].tolist() == first
    assert [r["step"] for r in rows if "validation/loss" in r] == [2]
    warnings = [
        line
        for line in (tmp_path / "train.log").read_text().splitlines()
        if "validation reads the training" in line
    ]
    assert len(warnings) == 1
    assert "'plain'" in warnings[0] and "set validation.path or validation.dataset" in warnings[0]


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed") / "seed.pt")


VALIDATION = {"validation.enable": True, "validation.freq": 3, "validation.steps": 2}


def validation_losses(folder: Path, nproc: int, seed: Path, overrides: dict) -> list[tuple[int, float]]:
    overrides = {"checkpoint.initial_load_path": str(seed), **VALIDATION, **overrides}
    result = run_titan_train(folder, nproc, overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [r for r in log_records(result.stdout) if r.get("event") == "validation"]
    return [(r["step"], r["loss"]) for r in records if r.get("rank", 0) == 0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, seed: Path) -> list[tuple[int, float]]:
    return validation_losses(tmp_path_factory.mktemp("one"), 1, seed, {"training.local_batch_size": 4})


@pytest.mark.parametrize(
    "layout",
    [
        {"parallelism.dp_shard": 2, "training.local_batch_size": 2},
        {"parallelism.tp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4},
        # PP validates through its schedule, forward only (schedule.eval).
        {"parallelism.pp": 2, "parallelism.dp_shard": 1, "training.local_batch_size": 4},
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_two_ranks_validate_like_one_process(
    tmp_path: Path, seed: Path, one_process: list[tuple[int, float]], layout: dict
) -> None:
    found = validation_losses(tmp_path, 2, seed, layout)
    assert [s for s, _ in found] == [s for s, _ in one_process] == [3, 6]
    assert [v for _, v in found] == pytest.approx([v for _, v in one_process], rel=1e-4)


@pytest.mark.parametrize("spelling", ["relative", "dotted", "symlink"])
def test_the_training_file_under_another_spelling_is_still_the_training_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """``validation.path`` naming the training file another way reads training text: the warning
    must not depend on how the path is spelled."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"The river falls {i} times and the market opens.\n" for i in range(400)))
    monkeypatch.chdir(tmp_path)
    other = {
        "relative": "corpus.txt",
        "dotted": f"{tmp_path}/./corpus.txt",
        "symlink": str(tmp_path / "link.txt"),
    }[spelling]
    if spelling == "symlink":
        (tmp_path / "link.txt").symlink_to(corpus)
    config = with_validation(tmp_path, steps=2)
    config.data.dataset, config.data.path = "text", str(corpus)
    config.validation.path = other
    trainer = Trainer(config, get_registry())
    trainer.close()
    assert "validation reads the training data" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("section", ["data", "validation"])
def test_a_path_the_dataset_does_not_read_is_refused(tmp_path: Path, section: str) -> None:
    # The bundled corpus is generated: a path given with it was silently ignored (validation then
    # scored the training stream instead of the held-out documents, a file that did not exist
    # included).
    config = with_validation(tmp_path / "out")
    getattr(config, section).path = str(tmp_path / "held_out.jsonl")
    with pytest.raises(
        UsageError,
        match=rf"^{section}\.path = .*held_out\.jsonl' is not read: .*'bundled'.*{section}\.dataset = 'text'",
    ):
        Trainer(config, get_registry())
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_plugin_dataset_that_reads_no_path_says_so(tmp_path: Path) -> None:
    registry = Registry().load_entry_points()
    generated = Dataset("gen", training_text, "generated", reads_path=False)
    registry.register(plugin(titan_datasets=[generated]), "third_party_data")
    config = with_validation(tmp_path)
    config.validation.dataset, config.validation.path = "gen", "x.jsonl"
    with pytest.raises(
        UsageError, match=r"validation\.path = 'x\.jsonl' is not read: validation\.dataset 'gen'"
    ):
        Trainer(config, registry)


def test_a_validation_folders_skipped_files_are_named_by_validation_path(tmp_path: Path) -> None:
    folder = tmp_path / "held_out"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(f'{{"text": "held out document {i}"}}' for i in range(300)))
    (folder / "notes.csv").write_text("not, data")
    config = with_validation(tmp_path / "out", steps=2)
    config.validation.dataset, config.validation.path = "text", str(folder)
    Trainer(config, get_registry()).close()
    (line,) = [
        line for line in (tmp_path / "out" / "train.log").read_text().splitlines() if "skipping" in line
    ]
    assert f"validation.path {str(folder)!r}: skipping 1 other file: notes.csv" in line


def test_validation_on_a_file_of_the_training_folder_warns(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for part in range(2):
        lines = (f'{{"text": "part {part} document {i} about rivers and hills"}}' for i in range(200))
        (folder / f"part{part}.jsonl").write_text("\n".join(lines))
    config = with_validation(tmp_path / "out", steps=2)
    config.data.dataset, config.data.path = "text", str(folder)
    config.validation.dataset, config.validation.path = "text", str(folder / "part0.jsonl")
    train(config, get_registry())
    log = (tmp_path / "out" / "train.log").read_text()
    assert "validation reads part of the training data: validation.path" in log


def test_a_bad_line_deep_in_the_validation_data_names_validation_path(tmp_path: Path) -> None:
    """Met by a later validation (the first read saw a good first line), it said data.path."""
    corpus = tmp_path / "val.jsonl"
    good = [f'{{"text": "held out document {i} about rivers"}}' for i in range(300)]
    corpus.write_text("\n".join([*good, '{"body": "no text"}']))
    config = with_validation(tmp_path / "out", steps=2)
    config.validation.dataset, config.validation.path = "text", str(corpus)
    config.validation.steps = 400  # reads past the good lines
    with pytest.raises(UsageError, match=r"^validation\.path: .*val\.jsonl:301 is not a JSON object"):
        train(config, get_registry())


@pytest.mark.parametrize("where", ["call", "first document"])
def test_a_validation_dataset_failing_on_its_first_read_is_one_error_naming_it(
    tmp_path: Path, where: str
) -> None:
    """The build reads the first validation document (to refuse an empty set): a plugin's
    exception there was a bare traceback, where the training data's is one error naming it."""
    from titan_core.errors import PluginError

    def broken(data: Data) -> Iterable[str]:
        if where == "call":
            raise ConnectionError("the validation shard server is down")
        yield from ()
        raise ConnectionError("the validation shard server is down")

    registry = Registry().load_entry_points()
    registry.register(
        plugin(titan_datasets=[Dataset("remote", broken, reads_path=False)]), "third_party_data"
    )
    config = with_validation(tmp_path)
    config.validation.dataset, config.validation.path = "remote", None
    with pytest.raises(PluginError) as info:
        Trainer(config, registry)
    message = str(info.value)
    assert message.startswith(
        "validation.dataset 'remote' (plugin third_party_data) failed reading document 1 of pass 1 "
        "over the data: "
    )
    assert "ConnectionError: the validation shard server is down" in message


def test_the_run_summary_shows_a_small_final_loss_and_mfu_without_rounding_them_to_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's ``final loss`` was ``:.5f`` and its MFU ``:.2f%``: a loss of 3e-7 read
    ``0.00000`` and a small model's MFU ``0.00%``, beside rows that show them."""
    blocks = _trainer_info(monkeypatch, "run summary")
    trainer = Trainer(tiny_llama3(tmp_path, 1), get_registry())
    try:
        figures = {"tps": 10.0, "mfu_pct": 4.2e-4, "loss": 3.2e-7, "warmup_excluded": False}
        monkeypatch.setattr(trainer.metrics, "summary", lambda: figures)
        trainer._log_summary(1, 1.0)
    finally:
        trainer.close()
    (block,) = blocks
    assert block["final_loss"] == "3.200e-07"
    assert block["mfu"] == "4.200e-04%"


# -- the validation set is checked when the run is built, and read the same every time ----------


@pytest.mark.parametrize("source", ["file", "held-out"])
def test_a_validation_set_smaller_than_one_batch_is_refused_before_training(
    tmp_path: Path, source: str
) -> None:
    """Found only at the first validation: ``validation.freq`` steps trained (hours, on a real
    run) before a bad input any build could see stopped it."""
    if source == "file":
        registry = get_registry()
        corpus = tmp_path / "val.jsonl"
        corpus.write_text('{"text": "a tiny held out document"}\n')
        config = with_validation(tmp_path / "out")
        config.validation.dataset, config.validation.path = "text", str(corpus)
        name = r"validation\.dataset 'text' \(plugin core[^)]*\)"
    else:
        registry = Registry().load_entry_points()
        tiny = Dataset("mine", training_text, held_out=lambda data: ["one short document"])
        registry.register(plugin(titan_datasets=[tiny]), "third_party_data")
        config = with_validation(tmp_path / "out")
        config.data.dataset = "mine"
        name = r"validation.dataset 'mine' \(plugin third_party_data\) \(held-out documents\)"
    with pytest.raises(UsageError, match=rf"{name} is too small for one step: one pass gives \d+ tokens"):
        Trainer(config, registry)


def test_held_out_documents_that_are_empty_are_named_not_validation_path(tmp_path: Path) -> None:
    """It said ``validation.dataset = 'mine' yields no documents; check validation.path``: neither
    field was set, and the dataset reads no path; its ``held_out`` gave nothing."""
    registry = Registry().load_entry_points()
    empty = Dataset("mine", training_text, held_out=lambda data: [], reads_path=False)
    registry.register(plugin(titan_datasets=[empty]), "third_party_data")
    config = with_validation(tmp_path)
    config.data.dataset = "mine"
    with pytest.raises(UsageError) as info:
        Trainer(config, registry)
    message = str(info.value)
    assert message.startswith(
        "validation.dataset 'mine' (plugin third_party_data) (held-out documents) yields no documents"
    )
    assert "Dataset.held_out" in message and "validation.path" in message
    assert "check validation.path" not in message


def _one_shared_iterator(data: Data) -> Iterable[str]:
    return SHARED[0]


SHARED: list[Iterable[str]] = []


@pytest.mark.parametrize("held_out", ["one iterator", "another order each call"])
def test_held_out_documents_read_differently_each_time_are_one_error(tmp_path: Path, held_out: str) -> None:
    """Every validation reads its documents from the start. A ``held_out`` returning one shared
    iterator (or the documents in another order each call) gave each validation other text,
    exit 0: validation/loss curves of different sets, compared as one."""
    from titan_core.errors import PluginError

    texts = list(held_out_text(Data()))
    if held_out == "one iterator":
        SHARED[:] = [iter(texts)]
        function = _one_shared_iterator
    else:
        rng = random.Random(0)
        function = lambda data: rng.sample(texts, len(texts))
    with pytest.raises(PluginError) as info:
        trainer = third_party_trainer(tmp_path, Dataset("drifting", training_text, held_out=function))
        try:
            trainer.train()
        finally:
            trainer.close()
    message = str(info.value)
    assert message.startswith(
        "validation.dataset 'drifting' (plugin third_party_data) (held-out documents) gave another "
        "first document"
    )
    assert "the same documents in the same order on every call" in message


def test_training_documents_from_one_shared_iterator_are_refused_before_training(tmp_path: Path) -> None:
    """The build reads the first document (to fail a wrong data.path at once), and a dataset
    returning one shared iterator then trained without it, without a word, in a run shorter than
    one pass (a longer one failed at pass 2)."""
    shared = iter(f"The river falls {i} times and the market opens." for i in range(100000))
    registry = Registry().load_entry_points()
    registry.register(plugin(titan_datasets=[Dataset("once", lambda data: shared)]), "third_party_data")
    config = with_validation(tmp_path, steps=2)
    config.validation.enable = False
    config.data.dataset = "once"
    with pytest.raises(PluginError) as info:
        trainer = Trainer(config, registry)
        try:
            trainer.train()
        finally:
            trainer.close()
    text = str(info.value)
    assert text.startswith(
        "data.dataset 'once' (plugin third_party_data) gave another first document on a later read"
    ), text
    assert "The river falls 1 times" in text and "The river falls 0 times" in text, text
