"""A resume whose config differs from the checkpoint's: the model must be the same (refused
otherwise, nothing overwritten), this run's optimizer settings and schedule apply from the next
step (a warning names what changed), the data continues where the saved steps left it whatever
the accumulation, and a changed data source is named. Also: a rerun that would start over
beside this run's checkpoints is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import LogWarnings, record_warnings
from tests.parallel_harness import tiny_config
from titan_core import resume as resume_module
from titan_core import trainer as trainer_module
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import Trainer, train


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> LogWarnings:
    return record_warnings(monkeypatch, trainer_module, resume_module)


def config_in(folder: Path, **overrides: Any) -> Any:
    return tiny_config(**{"job.dump_folder": str(folder), "checkpoint.enable": True, **overrides})


def rows(config: Any) -> dict[int, dict[str, float]]:
    return {int(r["step"]): r for r in train(config, get_registry())}


def resumed_inputs(trainer: Trainer, batches: int) -> tuple[list[Any], list[Any]]:
    """The inputs of each microbatch ``trainer`` trains on (it resumes from its checkpoint), and
    the first ``batches`` of its data stream from the start, to find them in."""
    import itertools

    seen: list[Any] = []
    real = trainer.forward_backward
    trainer.forward_backward = lambda inputs, labels: (seen.append(inputs.clone()), real(inputs, labels))[1]
    try:
        stream = [inputs for inputs, _ in itertools.islice(iter(trainer.batches), batches)]  # from its start
        trainer.train()
    finally:
        trainer.close()
    return seen, stream


def test_a_resume_applies_this_runs_optimizer_settings_and_says_so(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    changed = {"training.lr": 1e-3, "training.weight_decay": 0.0, "training.beta2": 0.99}
    fresh = rows(config_in(tmp_path / "fresh", **changed))
    trainer = Trainer(config_in(tmp_path, **changed), get_registry())
    try:
        (group,) = trainer.optimizer.param_groups
        assert (group["weight_decay"], group["betas"]) == (0.0, (0.9, 0.99))
        assert trainer.scheduler.base_lrs == [1e-3]
        resumed = {int(r["step"]): r for r in trainer.train()}
    finally:
        trainer.close()
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # the LR of a run with lr=1e-3 from the start, not the checkpoint's 3e-3
        assert resumed[step]["lr"] == pytest.approx(fresh[step]["lr"], rel=1e-12)
    (message,) = [w for w in warnings.seen if "optimizer settings" in w]
    assert "training.lr: 0.003 -> 0.001" in message and "training.weight_decay: 0.1 -> 0.0" in message
    assert "training.beta2: 0.95 -> 0.99" in message


def test_a_resume_in_another_precision_says_so(tmp_path: Path, warnings: LogWarnings) -> None:
    """``training.dtype`` changes every later loss (bf16 autocast against fp32), as ``lr`` does."""
    rows(config_in(tmp_path, **{"debug.max_steps": 2}))
    rows(config_in(tmp_path, **{"debug.max_steps": 3, "training.dtype": "bfloat16"}))
    (message,) = [w for w in warnings.seen if "precision" in w]
    assert "resuming with another compute precision; this run's applies from step 3" in message
    assert "training.dtype: 'float32' -> 'bfloat16'" in message


def test_a_resume_into_another_model_of_the_same_shapes_is_refused(tmp_path: Path) -> None:
    first = rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    before = {name: (tmp_path / name).read_text() for name in ("run.json", "metrics.jsonl")}
    config = config_in(tmp_path)
    config.model.overrides = {**config.model.overrides, "rope_theta": 10_000.0}  # no shape changes
    with pytest.raises(UsageError, match=r"saved by another model \(model\.overrides: .*rope_theta"):
        Trainer(config, get_registry())
    assert {name: (tmp_path / name).read_text() for name in before} == before  # nothing overwritten
    assert sorted(first) == [1, 2, 3]


@pytest.mark.parametrize(
    "override",
    [
        {"fuse_qkv": False},  # Q, K and V in three matmuls instead of one: the same weights and math
        {"fuse_w13": True},  # the gate and up projections in one matmul instead of two
        {"max_seq_len": 4096},  # the longest sequence it accepts (a longer context later)
    ],
)
def test_a_resume_changing_only_how_the_model_computes_goes_on(tmp_path: Path, override: dict) -> None:
    """Arguments the model declares compute-only (``ModelSpec.compute_only_args``) were refused as
    "saved by another model", though every weight means what it meant."""
    uninterrupted = rows(config_in(tmp_path / "whole", **{"debug.max_steps": 5}))
    rows(config_in(tmp_path / "run", **{"debug.max_steps": 3}))
    config = config_in(tmp_path / "run", **{"debug.max_steps": 5})
    config.model.overrides = {**config.model.overrides, **override}
    resumed = rows(config)
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-5)


def test_the_data_continues_where_it_stopped_when_the_accumulation_changes(tmp_path: Path) -> None:
    """3 steps of 2 microbatches of 2 sequences consumed 12 sequences; resumed with one
    microbatch a step (a smaller global batch), step 4 trains on sequences 13-14, not 7-8."""

    import torch

    rows(
        config_in(
            tmp_path,
            **{"training.global_batch_size": 4, "training.local_batch_size": 2, "debug.max_steps": 3},
        )
    )
    trainer = Trainer(config_in(tmp_path, **{"training.local_batch_size": 2}), get_registry())
    seen, stream = resumed_inputs(trainer, 9)
    assert len(seen) == 3  # steps 4-6, one microbatch each
    for i, inputs in enumerate(seen):
        assert torch.equal(inputs, stream[6 + i])


def test_a_resume_on_other_data_is_named(tmp_path: Path, warnings: LogWarnings) -> None:
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    rows(config_in(tmp_path, **{"data.bundled_documents": 300}))
    (message,) = [w for w in warnings.seen if "another data configuration" in w]
    assert "data.bundled_documents: 200 -> 300" in message


def test_a_checkpoint_records_what_a_resume_compares(tmp_path: Path) -> None:
    accumulated = {"training.local_batch_size": 2, "training.global_batch_size": 4}
    rows(config_in(tmp_path, **{**accumulated, "debug.max_steps": 2}))
    meta = json.loads((tmp_path / "checkpoint" / "step-2" / "meta.json").read_text())["meta"]
    assert meta["samples"] == 2 * 2 * 2  # steps x microbatches x sequences each (one DP rank)
    assert meta["model"]["name"] == "llama3" and meta["optimizer"]["lr"] == 3e-3
    assert meta["data"]["data.bundled_documents"] == 200


def test_a_rerun_without_checkpointing_beside_this_runs_checkpoints_is_refused(tmp_path: Path) -> None:
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match=r"holds checkpoints of this run .* set checkpoint.enable = True"):
        Trainer(config_in(tmp_path, **{"checkpoint.enable": False}), get_registry())
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"print('a recipe, not weights')\n", r"cannot be read as a torch.save file of tensors"),
        (None, r"holds a list, not a state dict of tensors"),
    ],
)
def test_an_initial_load_path_that_is_no_state_dict_is_one_error(
    tmp_path: Path, content: bytes | None, expected: str
) -> None:
    import torch

    path = tmp_path / "weights.pt"
    if content is None:
        torch.save([torch.zeros(2)], path)
    else:
        path.write_bytes(content)
    config = tiny_config(
        **{"job.dump_folder": str(tmp_path / "out"), "checkpoint.initial_load_path": str(path)}
    )
    with pytest.raises(UsageError, match=expected):
        Trainer(config, get_registry())


@pytest.mark.parametrize("beside", [True, False])
def test_an_initial_load_path_naming_a_safetensors_file_names_its_folder(
    tmp_path: Path, beside: bool
) -> None:
    """A Hugging Face weights file given instead of its folder: the error was torch.load's
    ("device meta is invalid"), not what to give instead."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf_model"
    folder.mkdir()
    if beside:
        (folder / "config.json").write_text("{}")
    path = folder / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    config = tiny_config(
        **{"job.dump_folder": str(tmp_path / "out"), "checkpoint.initial_load_path": str(path)}
    )
    with pytest.raises(UsageError) as raised:
        Trainer(config, get_registry())
    message = str(raised.value)
    assert "is a safetensors file" in message, message
    if beside:
        assert f"give its folder, {str(folder)!r}" in message, message
    else:
        assert "config.json" in message, message


def test_a_rerun_looking_in_another_checkpoint_folder_is_refused(tmp_path: Path) -> None:
    """checkpoint.folder is operational (the same run): a rerun that looks elsewhere finds no
    checkpoint and would start over beside the run's checkpoints, replacing its logs."""
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    with pytest.raises(UsageError, match=r"holds checkpoints of this run .*another checkpoint.folder"):
        Trainer(config_in(tmp_path, **{"checkpoint.folder": "elsewhere"}), get_registry())


def test_no_shuffling_means_no_data_warning_for_another_layout() -> None:
    from titan_plugins_dcp.checkpointer import _data_changes

    saved = {"dp_degree": 2, "local_batch_size": 2, "seq_len": 32, "seed": 0, "shuffle_buffer": 0}
    assert _data_changes(saved, {**saved, "dp_degree": 1}) == {}  # the trainer skips what was consumed
    assert _data_changes(saved, {**saved, "seq_len": 64}) == {"seq_len": "32 -> 64"}
    shuffled = {**saved, "shuffle_buffer": 256}
    assert "dp_degree" in _data_changes(shuffled, {**shuffled, "dp_degree": 1})
    # A rank's shuffled sequences come in one order whatever its batch size (the batches cut it):
    # another local batch size continues the data exactly, so no warning says otherwise.
    assert _data_changes(shuffled, {**shuffled, "local_batch_size": 4}) == {}


class Events:
    """Records the warnings and infos of a module's logger, with their fields."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.seen.append(("warning", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.seen.append(("info", event, fields))
        self.real.info(event, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_both_resume_warnings_name_the_step_the_new_settings_start_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed from step-3 with another lr and steps: step 4 is the first under the new settings;
    the schedule's warning names it with its factor, as the optimizer's does."""
    from titan_core import schedule as schedule_module

    events = Events(schedule_module.log)
    monkeypatch.setattr(schedule_module, "log", events)
    monkeypatch.setattr(resume_module, "log", events)
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    resumed = rows(config_in(tmp_path, **{"training.steps": 8, "training.lr": 1e-3}))
    warned = {event: fields for kind, event, fields in events.seen if kind == "warning"}
    (schedule,) = [e for e in warned if "learning-rate schedule" in e]
    (optimizer,) = [e for e in warned if "optimizer settings" in e]
    assert "schedule at step 4:" in schedule and "apply from step 4:" in optimizer
    assert warned[schedule]["lr_factor_now"] * 1e-3 == pytest.approx(resumed[4]["lr"], rel=1e-12)


@pytest.mark.parametrize(
    ("shorter", "named"),
    [({"training.steps": 2}, "training.steps = 2"), ({"debug.max_steps": 2}, "debug.max_steps = 2")],
)
def test_a_resume_with_fewer_steps_than_the_checkpoint_holds_is_refused(
    tmp_path: Path, shorter: dict[str, Any], named: str
) -> None:
    rows(config_in(tmp_path, **{"training.steps": 4}))
    files = ("run.json", "config.toml", "metrics.jsonl", "train.log")
    before = {name: (tmp_path / name).read_text() for name in files}
    with pytest.raises(UsageError) as info:
        Trainer(config_in(tmp_path, **{"training.steps": 4, **shorter}), get_registry())
    message = str(info.value)
    assert "checkpoint of step 4" in message and named in message
    assert f"raise {named.split(' =')[0]} (above 4" in message and "--dump-folder" in message
    assert {name: (tmp_path / name).read_text() for name in files} == before  # nothing rewritten


def test_a_resume_of_a_finished_run_says_why_no_step_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows(config_in(tmp_path, **{"training.steps": 2}))
    events = Events(trainer_module.log)
    monkeypatch.setattr(trainer_module, "log", events)
    assert rows(config_in(tmp_path, **{"training.steps": 2})) == {}
    (summary,) = [fields for kind, event, fields in events.seen if event == "run summary"]
    assert summary["steps"] == "none left: the checkpoint of step 2 is the last of training.steps = 2"
    assert summary["final_loss"] == "n/a (no step ran)"


def test_a_finished_run_rerun_with_other_settings_keeps_its_records(tmp_path: Path) -> None:
    # The checkpoint is the last step: the rerun trains nothing, so config.toml and run.json must
    # still say what trained the steps (they were rewritten with the rerun's lr).
    assert len(rows(config_in(tmp_path))) > 0
    records = {name: (tmp_path / name).read_text() for name in ("config.toml", "run.json")}
    assert rows(config_in(tmp_path, **{"training.lr": 1e-3})) == {}
    assert {name: (tmp_path / name).read_text() for name in records} == records


def test_a_resume_into_a_model_of_other_parameters_names_the_model_not_missing_keys(tmp_path: Path) -> None:
    """Tied and untied embeddings have the same shapes but not the same optimizer state: the
    model's difference is named before any tensor is read (not a DCP missing-key error calling
    every checkpoint unusable), and nothing is rewritten."""
    tied = {"model.overrides": {**tiny_config().model.overrides, "tie_embeddings": True}}
    rows(config_in(tmp_path, **{**tied, "debug.max_steps": 3}))
    files = ("run.json", "config.toml", "metrics.jsonl")
    before = {name: (tmp_path / name).read_text() for name in files}
    with pytest.raises(UsageError) as info:
        Trainer(config_in(tmp_path), get_registry())
    message = str(info.value)
    assert "saved by another model (model.overrides:" in message and "tie_embeddings" in message
    assert "Missing key" not in message and "can be loaded" not in message
    assert {name: (tmp_path / name).read_text() for name in files} == before
    assert (tmp_path / "checkpoint" / "step-3").is_dir()


def test_a_resume_changing_a_plugin_sections_result_field_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings: LogWarnings
) -> None:
    """A plugin field named in ``ConfigSection.results`` changes the losses as ``training.lr``
    does: a resume that changes it is warned about the same way, naming it and the step."""
    from tests.conftest import plugin_module
    from titan_core import ConfigSection, _registry
    from titan_core.config import section

    @section
    class Smoothing:
        amount: float = 0.0
        note: str = ""

    registry = _registry.Registry().load_entry_points()
    registry.register(
        plugin_module(
            "smooth", titan_config_sections=[ConfigSection("smooth", Smoothing, results=("amount",))]
        ),
        "smooth",
    )
    monkeypatch.setattr(_registry, "_default", registry)
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    config = config_in(tmp_path)
    config.smooth.amount, config.smooth.note = 0.05, "operational"
    assert sorted(rows(config)) == [4, 5, 6]
    (message,) = [w for w in warnings.seen if "smooth." in w]
    assert "apply from step 4" in message and "smooth.amount: 0.0 -> 0.05" in message
    assert "note" not in message  # not a result field


def test_a_resume_with_another_clipping_norm_says_so(tmp_path: Path, warnings: LogWarnings) -> None:
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    rows(config_in(tmp_path, **{"training.max_norm": 0.5}))
    (message,) = [w for w in warnings.seen if "optimizer settings" in w]
    assert "training.max_norm: 1.0 -> 0.5" in message


def test_a_resume_says_the_initial_weights_are_not_read(tmp_path: Path, warnings: LogWarnings) -> None:
    rows(config_in(tmp_path / "seed", **{"checkpoint.create_seed_checkpoint": True, "training.steps": 1}))
    initial = {"checkpoint.initial_load_path": str(tmp_path / "seed" / "checkpoint" / "step-0")}
    rows(config_in(tmp_path / "run", **{**initial, "debug.max_steps": 2}))
    assert not [w for w in warnings.seen if "initial_load_path" in w]  # read and used: nothing to say
    rows(config_in(tmp_path / "run", **initial))
    (message,) = [w for w in warnings.seen if "initial_load_path" in w]
    assert "resumed from the checkpoint of step 2: checkpoint.initial_load_path is not read" in message


def test_a_resume_with_an_override_at_its_default_is_the_same_model(tmp_path: Path) -> None:
    rows(config_in(tmp_path, **{"debug.max_steps": 3}))
    same = {"model.overrides": {**tiny_config().model.overrides, "norm_eps": 1e-5}}  # the default
    assert sorted(rows(config_in(tmp_path, **same))) == [4, 5, 6]


def test_a_seed_checkpoint_of_another_model_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A seed in an absolute checkpoint folder, then a run of another rope_theta resuming there."""
    shared = {"checkpoint.folder": str(tmp_path / "seeds")}
    rows(config_in(tmp_path / "a", **{**shared, "checkpoint.create_seed_checkpoint": True}))
    other = {"model.overrides": {**tiny_config().model.overrides, "rope_theta": 10_000.0}}
    with pytest.raises(UsageError, match=r"checkpoint of step 0 .* saved by another model .*rope_theta"):
        Trainer(config_in(tmp_path / "b", **{**shared, **other}), get_registry())


def test_a_resume_spelling_data_path_another_way_is_not_another_data_source(
    tmp_path: Path, warnings: LogWarnings, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(f'{{"text": "document {i} on hills"}}' for i in range(400)))
    text = {"data.dataset": "text", "debug.max_steps": 3}
    rows(config_in(tmp_path / "run", **{**text, "data.path": str(corpus)}))
    monkeypatch.chdir(tmp_path)
    rows(config_in(tmp_path / "run", **{**text, "debug.max_steps": None, "data.path": "corpus.jsonl"}))
    assert not [w for w in warnings.seen if "another data configuration" in w]


def test_a_resume_after_the_data_files_changed_says_so(tmp_path: Path, warnings: LogWarnings) -> None:
    """The same data.path, a file added: the skip to the checkpoint's position lands elsewhere."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "b.jsonl").write_text("\n".join(f'{{"text": "document {i} on hills"}}' for i in range(400)))
    text = {"data.dataset": "text", "data.path": str(folder)}
    rows(config_in(tmp_path / "run", **{**text, "debug.max_steps": 3}))
    (folder / "a.jsonl").write_text('{"text": "a new first document"}\n')
    rows(config_in(tmp_path / "run", **text))
    (message,) = [w for w in warnings.seen if "another data configuration" in w]
    assert "the files at data.path: 1 files of" in message and "-> 2 of" in message


@pytest.mark.parametrize("change", ["renamed", "rewritten at the same size"])
def test_a_resume_after_data_files_were_renamed_or_rewritten_says_so(
    tmp_path: Path, warnings: LogWarnings, change: str
) -> None:
    """Files are read in sorted path order: a rename reorders the stream, a rewrite of the same
    size changes it; the count and bytes alone stayed the same, so neither was named."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a", "b"):
        lines = (f'{{"text": "document {i} of {name} on hills"}}' for i in range(200))
        (folder / f"{name}.jsonl").write_text("\n".join(lines))
    text = {"data.dataset": "text", "data.path": str(folder)}
    rows(config_in(tmp_path / "run", **{**text, "debug.max_steps": 3}))
    if change == "renamed":
        (folder / "a.jsonl").rename(folder / "c.jsonl")
    else:
        b = folder / "b.jsonl"
        b.write_text(b.read_text().replace("hills", "slihl"))
    rows(config_in(tmp_path / "run", **text))
    (message,) = [w for w in warnings.seen if "another data configuration" in w]
    assert "the files at data.path were renamed or rewritten (the same 2 files of" in message


def test_a_resume_of_unchanged_or_copied_data_files_says_nothing(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """The same content at the same names (a copy keeps them; times may change) is the same data."""
    import shutil
    import time

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(f'{{"text": "document {i} on hills"}}' for i in range(400)))
    text = {"data.dataset": "text", "data.path": str(folder)}
    rows(config_in(tmp_path / "run", **{**text, "debug.max_steps": 3}))
    time.sleep(0.01)
    shutil.copyfile(folder / "a.jsonl", tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").replace(folder / "a.jsonl")  # a new file, new times, same bytes
    rows(config_in(tmp_path / "run", **text))
    assert not [w for w in warnings.seen if "another data configuration" in w]


def test_a_resume_reading_an_identical_copy_at_another_path_says_nothing(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """The corpus moved (another disk, another mount): the same files at another data.path are the
    same stream, so the resume continues it without calling it another data source."""
    import shutil

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(f'{{"text": "document {i} on hills"}}' for i in range(400)))
    text = {"data.dataset": "text", "debug.max_steps": 3}
    rows(config_in(tmp_path / "run", **{**text, "data.path": str(folder)}))
    shutil.copytree(folder, tmp_path / "moved")
    resumed = rows(
        config_in(tmp_path / "run", **{**text, "debug.max_steps": None, "data.path": str(tmp_path / "moved")})
    )
    assert min(resumed) == 4
    assert not [w for w in warnings.seen if "another data configuration" in w]


def test_a_resume_reading_other_files_at_another_path_says_so(tmp_path: Path, warnings: LogWarnings) -> None:
    """Another data.path with other content is named with both paths."""
    for name in ("corpus", "other"):
        (tmp_path / name).mkdir()
        lines = (f'{{"text": "document {i} of {name}"}}' for i in range(400))
        (tmp_path / name / "a.jsonl").write_text("\n".join(lines))
    text = {"data.dataset": "text", "debug.max_steps": 3}
    rows(config_in(tmp_path / "run", **{**text, "data.path": str(tmp_path / "corpus")}))
    rows(
        config_in(tmp_path / "run", **{**text, "debug.max_steps": None, "data.path": str(tmp_path / "other")})
    )
    (message,) = [w for w in warnings.seen if "another data configuration" in w]
    assert "data.path" in message and "corpus" in message and "other" in message


def test_a_resume_does_not_need_the_initial_weights_it_replaces(tmp_path: Path) -> None:
    """The initial weights were read before the checkpointer looked for a checkpoint to resume
    from: a resume failed once they were moved away (and read a whole model for nothing)."""
    rows(config_in(tmp_path / "seed", **{"checkpoint.create_seed_checkpoint": True, "training.steps": 1}))
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    initial = {"checkpoint.initial_load_path": str(seed)}
    first = rows(config_in(tmp_path / "run", **{**initial, "debug.max_steps": 3}))
    (tmp_path / "seed").rename(tmp_path / "seed-moved")  # cleaned up once the run had started
    assert sorted(rows(config_in(tmp_path / "run", **initial))) == [4, 5, 6]
    assert sorted(first) == [1, 2, 3]


@pytest.mark.parametrize("source", ["dcp", "pt"])
def test_initial_weights_of_untied_embeddings_into_a_tied_model_are_refused(
    tmp_path: Path, source: str
) -> None:
    """They loaded without a word: the one tied matrix became the checkpoint's output.weight and
    its trained embedding was dropped."""
    import torch

    rows(config_in(tmp_path / "untied", **{"training.steps": 2}))
    tied = {**tiny_config().model.overrides, "tie_embeddings": True}
    path = str(tmp_path / "untied" / "checkpoint" / "step-2")
    if source == "pt":
        trainer = Trainer(config_in(tmp_path / "untied"), get_registry())  # resumes step 2
        try:
            state = {k: v.detach().clone() for k, v in trainer.parts[0].state_dict().items()}
        finally:
            trainer.close()
        path = str(tmp_path / "untied.pt")
        torch.save(state, path)
    config = tiny_config(
        **{
            "job.dump_folder": str(tmp_path / "tied"),
            "checkpoint.initial_load_path": path,
            "model.overrides": tied,
        }
    )
    with pytest.raises(UsageError, match=r"different tensors for output\.weight and tok_embeddings\.weight"):
        Trainer(config, get_registry()).close()
    # The same weights tied before saving load (the check compares values, not names).
    rows(config_in(tmp_path / "tied_run", **{"training.steps": 2, "model.overrides": tied}))
    config.checkpoint.initial_load_path = str(tmp_path / "tied_run" / "checkpoint" / "step-2")
    Trainer(config, get_registry()).close()


def _tokenizer_with_two_ids_swapped(source: Path, target: Path) -> None:
    """The bundled tokenizer with two ordinary tokens' ids exchanged: the same vocabulary size
    and file size, but ids 300 and 301 now mean each other's text."""
    data = json.loads(source.read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    target.write_text(json.dumps(data))


def test_a_resume_with_another_tokenizer_at_the_same_path_says_so(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """The token ids the model was trained on mean other text after the tokenizer file changed;
    the path alone (all the checkpoint recorded) was the same, so nothing was said."""
    from titan_core.data.loader import BUNDLED_TOKENIZER

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(json.loads(BUNDLED_TOKENIZER.read_text())))
    own = {"data.tokenizer_path": str(tokenizer)}
    rows(config_in(tmp_path / "run", **{**own, "debug.max_steps": 3}))
    _tokenizer_with_two_ids_swapped(tokenizer, tokenizer)
    assert sorted(rows(config_in(tmp_path / "run", **own))) == [4, 5, 6]
    (message,) = [w for w in warnings.seen if "another tokenizer" in w]
    assert "the token ids the model learnt until step 3 mean other text now" in message
    assert f"{str(tokenizer)!r}, rewritten since" in message
    assert "the same vocabulary size (612 tokens)" in message
    assert not [w for w in warnings.seen if "another data configuration" in w]  # said once


def test_a_resume_with_a_tokenizer_of_another_vocabulary_names_both_sizes(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    from titan_core.data.make_tokenizer import train_tokenizer

    rows(config_in(tmp_path / "run", **{"debug.max_steps": 3}))  # the bundled tokenizer
    smaller = tmp_path / "small" / "tokenizer.json"
    smaller.parent.mkdir()
    train_tokenizer(vocab_size=400).save(str(smaller))
    rows(config_in(tmp_path / "run", **{"data.tokenizer_path": str(smaller.parent)}))
    (message,) = [w for w in warnings.seen if "another tokenizer" in w]
    assert "titan's bundled tokenizer ->" in message and "612 -> 400 tokens" in message


def test_a_resume_with_a_copy_of_the_tokenizer_says_nothing(tmp_path: Path, warnings: LogWarnings) -> None:
    """The same tokenizer at another path, its JSON laid out otherwise, is the same tokenizer."""
    from titan_core.data.loader import BUNDLED_TOKENIZER

    rows(config_in(tmp_path / "run", **{"debug.max_steps": 3}))
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads(BUNDLED_TOKENIZER.read_text()), indent=2, sort_keys=True))
    assert sorted(rows(config_in(tmp_path / "run", **{"data.tokenizer_path": str(copy)}))) == [4, 5, 6]
    assert not [w for w in warnings.seen if "tokenizer" in w or "another data configuration" in w]


def test_a_checkpoint_without_a_tokenizer_record_resumes_without_a_word(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """An earlier titan's checkpoint records no tokenizer: nothing to compare, nothing said."""
    rows(config_in(tmp_path / "run", **{"debug.max_steps": 3}))
    meta_path = tmp_path / "run" / "checkpoint" / "step-3" / "meta.json"
    record = json.loads(meta_path.read_text())
    assert record["meta"]["tokenizer"]["vocab_size"] == 612
    del record["meta"]["tokenizer"]
    meta_path.write_text(json.dumps(record))
    assert sorted(rows(config_in(tmp_path / "run"))) == [4, 5, 6]
    assert warnings.seen == []


def test_a_resume_with_another_seq_len_continues_after_the_tokens_consumed(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """3 steps of 4 sequences of 33 tokens consumed 396 tokens; resumed with seq_len 64, the skip
    counted 12 sequences of 65 (780 tokens), so 384 tokens were never trained on. Now step 4
    starts at the first whole microbatch after token 396: sequences 8-11 of 65 tokens."""

    import torch

    rows(config_in(tmp_path, **{"debug.max_steps": 3}))  # unshuffled, local batch 4
    trainer = Trainer(config_in(tmp_path, **{"training.seq_len": 64}), get_registry())
    seen, stream = resumed_inputs(trainer, 6)
    assert [inputs.shape[1] for inputs in seen] == [64, 64, 64]
    for i, inputs in enumerate(seen):
        assert torch.equal(inputs, stream[2 + i]), i
    (message,) = [w for w in warnings.seen if "training.seq_len" in w]
    assert "resuming with training.seq_len 32 -> 64" in message
    assert "12 sequences of 33 tokens (396 tokens)" in message and "at sequence 8 of 65 tokens" in message
    assert not [w for w in warnings.seen if "not a multiple" in w]


def test_a_resume_with_another_global_batch_says_so(tmp_path: Path, warnings: LogWarnings) -> None:
    """A preempted job back on fewer ranks, with the same recipe (no ``global_batch_size``),
    takes steps of fewer sequences (``local_batch_size`` x DP degree): the losses go on from
    another batch size without a word, unlike the uninterrupted run's. Here the DP degree's part
    is played by the local batch: 4 -> 2 sequences a step (one process)."""
    rows(config_in(tmp_path, **{"debug.max_steps": 2}))  # 4 sequences a step
    assert sorted(rows(config_in(tmp_path, **{"training.local_batch_size": 2}))) == [3, 4, 5, 6]
    (message,) = [w for w in warnings.seen if "global batch" in w]
    assert "resuming with another global batch; this run's applies from step 3" in message
    assert "4 -> 2 sequences per step" in message
    assert "set training.global_batch_size = 4" in message  # what keeps the checkpoint's batch


def test_a_resume_keeping_the_global_batch_by_accumulation_says_nothing_of_it(
    tmp_path: Path, warnings: LogWarnings
) -> None:
    """The fix the warning names: the same 4 sequences a step, as 2 microbatches of 2."""
    rows(config_in(tmp_path, **{"debug.max_steps": 2}))
    kept = {"training.local_batch_size": 2, "training.global_batch_size": 4}
    assert sorted(rows(config_in(tmp_path, **kept))) == [3, 4, 5, 6]
    assert not [w for w in warnings.seen if "global batch" in w]
    meta = json.loads((tmp_path / "checkpoint" / "step-6" / "meta.json").read_text())["meta"]
    assert meta["sequences_per_step"] == 4
