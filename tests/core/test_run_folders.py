"""A dump folder holds one run: reruns resume, start the same run over, or are refused with the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_titan, tiny_llama3, tiny_recipe_source
from titan_core._registry import get_registry
from titan_core.errors import UsageError
from titan_core.trainer import train


def steps_in(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_another_config_is_refused_with_the_fix(tmp_path: Path) -> None:
    train(tiny_llama3(tmp_path, 2), get_registry())
    before = (tmp_path / "metrics.jsonl").read_text()
    config = tiny_llama3(tmp_path, 2)
    config.training.lr = 1e-3
    with pytest.raises(UsageError) as info:
        train(config, get_registry())
    message = str(info.value)
    assert "holds the outputs of another run" in message and "training.lr: 0.003 -> 0.001" in message
    assert "--dump-folder" in message and "--overwrite" in message
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing of the refused run written


def test_same_config_starts_over_without_mixing_files(tmp_path: Path) -> None:
    for _ in range(2):
        config = tiny_llama3(tmp_path, 2)
        config.metrics.enable_tensorboard = True
        train(config, get_registry())
    assert steps_in(tmp_path) == [1, 2]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    assert (tmp_path / "train.log").read_text().count("training starts") == 1


def test_overwrite_replaces_another_runs_outputs(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 3)
    config.metrics.enable_tensorboard = True
    train(config, get_registry())
    other = tiny_llama3(tmp_path, 2)
    train(other, get_registry(), overwrite=True)
    assert steps_in(tmp_path) == [1, 2]
    assert not (tmp_path / "tb").exists()  # the earlier run's TensorBoard folder went with it
    assert "steps = 2" in (tmp_path / "config.toml").read_text()


def test_outputs_without_run_json_are_refused(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(UsageError, match="outputs of a run titan cannot identify"):
        train(tiny_llama3(tmp_path, 2), get_registry())


def test_checkpointed_rerun_resumes_and_appends(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 2)
    config.checkpoint.enable = True
    train(config, get_registry())
    longer = tiny_llama3(tmp_path, 4)  # the same run, continued to 4 steps
    longer.checkpoint.enable = True
    rows = train(longer, get_registry())
    assert [r["step"] for r in rows] == [3, 4]
    assert steps_in(tmp_path) == [1, 2, 3, 4]
    log = (tmp_path / "train.log").read_text()
    assert "step 2/2" in log and "step 4/4" in log


def test_cli_refuses_then_overwrite_runs(tmp_path: Path) -> None:
    module = tmp_path / "folder_recipes.py"
    module.write_text(tiny_recipe_source("one", 1) + tiny_recipe_source("two", 2))
    dump = str(tmp_path / "out")
    common = ("run", "--module", "folder_recipes", "--dump-folder", dump)
    assert run_titan(*common, "--recipe", "one", cwd=tmp_path).returncode == 0
    refused = run_titan(*common, "--recipe", "two", cwd=tmp_path)
    assert refused.returncode == 2
    assert "titan: error: job.dump_folder" in refused.stderr and "--overwrite" in refused.stderr
    assert "Traceback" not in refused.stderr
    replaced = run_titan(*common, "--recipe", "two", "--overwrite", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert steps_in(Path(dump)) == [1, 2]


def _moe(tmp_path: Path, **moe: object) -> object:
    from titan_plugins_moe.recipes import moe_debugmodel

    config = moe_debugmodel()
    config.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_experts": 4, "expert_hidden_dim": 32}
    config.training.steps, config.training.seq_len, config.training.local_batch_size = 2, 32, 2
    config.data.bundled_documents = 200
    config.job.dump_folder = str(tmp_path)
    config.metrics.enable_tensorboard = False
    for name, value in moe.items():
        setattr(config.moe, name, value)
    return config


def test_a_plugin_sections_result_fields_define_the_run(tmp_path: Path) -> None:
    """The MoE section's balancing changes what the run computes: a rerun that changes it is
    another run (refused, nothing replaced); one that changes its router statistics is not."""
    train(_moe(tmp_path), get_registry())
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match=r"outputs of another run .*moe\.aux_loss_weight: 0\.0 -> 0\.01"):
        train(_moe(tmp_path, aux_loss_weight=0.01), get_registry())
    assert (tmp_path / "metrics.jsonl").read_text() == before
    train(_moe(tmp_path, router_stats="off"), get_registry())  # operational: the same run, started over
    assert steps_in(tmp_path) == [1, 2]


def test_a_run_json_written_before_sections_counted_still_starts_over(tmp_path: Path) -> None:
    train(_moe(tmp_path), get_registry())
    record = json.loads((tmp_path / "run.json").read_text())
    record["identity"].pop("moe")  # as an earlier titan wrote it
    (tmp_path / "run.json").write_text(json.dumps(record))
    train(_moe(tmp_path), get_registry())
    assert steps_in(tmp_path) == [1, 2]


def _registry_with_outputs(*patterns: str) -> object:
    """titan's plugins and a third party's whose callback declares ``patterns`` as its outputs."""
    from tests.conftest import plugin_module
    from titan_core import Callback
    from titan_core._registry import Registry

    registry = Registry().load_entry_points()
    toy = Callback("toy_report", lambda trainer: None, outputs=patterns)
    registry.register(plugin_module("toy", titan_callbacks=[toy]), "toy")
    return registry


def _plugin_outputs(tmp_path: Path) -> None:
    """What a plugin's callback leaves in the dump folder: per-rank files and a folder."""
    for rank in (0, 3):
        (tmp_path / f"toy_report_rank{rank}.json").write_text("{}")
    (tmp_path / "toy_logs").mkdir()
    (tmp_path / "toy_logs" / "a.log").write_text("x")


def test_overwrite_removes_the_outputs_plugins_declare(tmp_path: Path) -> None:
    registry = _registry_with_outputs("toy_report_rank*.json", "toy_logs")
    train(tiny_llama3(tmp_path, 3), registry)
    _plugin_outputs(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")  # not declared by anyone: never touched
    train(tiny_llama3(tmp_path, 2), registry, overwrite=True)
    assert not list(tmp_path.glob("toy_report_rank*.json")) and not (tmp_path / "toy_logs").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_start_over_leaves_declared_outputs_to_their_plugin(tmp_path: Path) -> None:
    """Per-rank files may come from other processes of this run (the fake backends run each
    pipeline coordinate on its own): the plugin replaces its own, the core does not remove them."""
    registry = _registry_with_outputs("toy_report_rank*.json")
    train(tiny_llama3(tmp_path, 2), registry)
    _plugin_outputs(tmp_path)
    train(tiny_llama3(tmp_path, 2), registry)
    assert len(list(tmp_path.glob("toy_report_rank*.json"))) == 2


@pytest.mark.parametrize("pattern", ["", "logs/a.json", "..", "/abs", 3])
def test_declared_outputs_stay_at_the_top_of_the_folder(pattern: object) -> None:
    from titan_core import Callback, RunOption

    with pytest.raises(TypeError, match="outputs: expected a tuple of file or folder name patterns"):
        Callback("toy", print, outputs=(pattern,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="outputs: expected"):
        RunOption("toy", "--toy", "", print, outputs=(pattern,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="outputs: expected"):
        Callback("toy", print, outputs="toy_logs")  # type: ignore[arg-type]  # a string, not a tuple


def test_a_fake_backend_run_does_not_replace_a_real_runs_history(tmp_path: Path) -> None:
    """Pure fake mode logs no losses: rerun into a real run's folder, it would have replaced that
    run's metrics as 'the same run over'. The comm backend is part of the identity."""
    (tmp_path / "fake_recipes.py").write_text(tiny_recipe_source("tiny", 2))
    args = ("run", "--module", "fake_recipes", "--recipe", "tiny", "--dump-folder", "out")
    real = run_titan(*args, cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    before = (tmp_path / "out" / "metrics.jsonl").read_text()
    fake = run_titan(*args, "--comm-backend", "fake", cwd=tmp_path, NGPU="4")
    assert fake.returncode == 2, fake.stdout + fake.stderr
    assert (
        "holds the outputs of another run" in fake.stderr
        and "comm.backend: 'default' -> 'fake'" in fake.stderr
    )
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == before


def _tb_outside(tmp_path: Path, name: str, steps: int = 2) -> object:
    """A run in ``tmp_path/name`` writing TensorBoard into ``tmp_path/shared_tb`` (absolute)."""
    config = tiny_llama3(tmp_path / name, steps)
    config.metrics.enable_tensorboard = True
    config.metrics.save_tb_folder = str(tmp_path / "shared_tb")
    return config


def _events(folder: Path) -> list[Path]:
    return sorted(folder.rglob("events.out.tfevents.*"))


def test_a_tensorboard_folder_outside_the_dump_folder_is_no_earlier_runs_outputs(tmp_path: Path) -> None:
    """A shared TensorBoard folder holding someone else's files does not make a new dump folder
    'unidentified outputs'; each dump folder writes its own subfolder there."""
    shared = tmp_path / "shared_tb"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    train(_tb_outside(tmp_path, "a"), get_registry())
    train(_tb_outside(tmp_path, "b"), get_registry(), overwrite=True)  # a new folder: nothing to replace
    assert (shared / "notes.txt").read_text() == "mine"
    subfolders = sorted(p.name for p in shared.iterdir() if p.is_dir())
    assert len(subfolders) == 2 and subfolders[0].startswith("a-") and subfolders[1].startswith("b-")
    assert all(len(_events(shared / s)) == 1 for s in subfolders)
    assert json.loads((tmp_path / "a" / "run.json").read_text())["tb_path"] == str(shared / subfolders[0])


def test_a_rerun_or_overwrite_removes_only_its_own_events_from_an_outside_tensorboard_folder(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared_tb"
    train(_tb_outside(tmp_path, "a"), get_registry())
    train(_tb_outside(tmp_path, "b"), get_registry())
    (shared / "notes.txt").write_text("mine")
    (a_sub,) = [p for p in shared.iterdir() if p.name.startswith("a-")]
    (a_sub / "notes.txt").write_text("also mine")  # not an event file: never removed
    before_b = _events(shared / next(p.name for p in shared.iterdir() if p.name.startswith("b-")))
    train(_tb_outside(tmp_path, "a"), get_registry())  # the same run over: its old events go
    assert len(_events(a_sub)) == 1
    other = _tb_outside(tmp_path, "a")
    other.training.lr = 1e-3
    old = _events(a_sub)
    train(other, get_registry(), overwrite=True)  # another run: the earlier run's events go
    assert len(_events(a_sub)) == 1 and _events(a_sub) != old
    assert (shared / "notes.txt").read_text() == "mine" and (a_sub / "notes.txt").read_text() == "also mine"
    assert [p for p in before_b if p.exists()] == before_b  # run b's events untouched


def test_a_tensorboard_folder_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path / "run", 2)
    config.metrics.enable_tensorboard = True
    config.metrics.save_tb_folder = str(tmp_path / "passwd")
    (tmp_path / "passwd").write_text("root:x:0:0")
    with pytest.raises(UsageError, match=r"metrics.save_tb_folder: .*passwd' exists and is not a folder"):
        train(config, get_registry())
    assert (tmp_path / "passwd").read_text() == "root:x:0:0"
    assert not (tmp_path / "run" / "run.json").exists()  # refused before anything is written


def test_changing_only_the_data_prefetch_is_the_same_run(tmp_path: Path) -> None:
    """``data.prefetch`` changes when batches are prepared, not which: the same run, started over."""
    train(tiny_llama3(tmp_path, 2), get_registry())
    config = tiny_llama3(tmp_path, 2)
    config.data.prefetch = 0
    train(config, get_registry())
    assert steps_in(tmp_path) == [1, 2]
    assert "prefetch" not in json.loads((tmp_path / "run.json").read_text())["identity"]["data"]


def test_a_run_json_that_recorded_the_prefetch_still_starts_over(tmp_path: Path) -> None:
    train(tiny_llama3(tmp_path, 2), get_registry())
    record = json.loads((tmp_path / "run.json").read_text())
    record["identity"]["data"]["prefetch"] = 2  # as an earlier titan wrote it
    (tmp_path / "run.json").write_text(json.dumps(record))
    config = tiny_llama3(tmp_path, 2)
    config.data.prefetch = 0
    train(config, get_registry())
    assert steps_in(tmp_path) == [1, 2]


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_overwrite_deletes_no_checkpoint_folder_outside_the_dump_folder(tmp_path: Path, where: str) -> None:
    """An absolute checkpoint.folder may be shared with other runs' checkpoints, and ".." is the
    dump folder's parent: --overwrite removed either whole (rmtree)."""
    shared = tmp_path / "ckpts"
    folder = str(shared) if where == "absolute" else ".."
    config = tiny_llama3(tmp_path / "run", 2)
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.checkpoint.folder = folder
    train(config, get_registry())
    root = shared if where == "absolute" else tmp_path
    (root / "other_runs_file.txt").write_text("keep me")
    before = sorted(p.name for p in root.iterdir())
    other = tiny_llama3(tmp_path / "run", 2)
    other.checkpoint.enable = True
    other.checkpoint.interval = 2
    other.checkpoint.folder = folder
    other.training.lr = 1e-3  # another run: --overwrite would replace the first one's outputs
    with pytest.raises(UsageError, match=r"--overwrite: checkpoint.folder .* is outside job.dump_folder"):
        train(other, get_registry(), overwrite=True)
    assert sorted(p.name for p in root.iterdir()) == before
    assert (tmp_path / "run" / "run.json").is_file()  # refused before anything was removed
    # As the error advises, the user removes the checkpoints there: the overwrite then runs
    # (an empty or emptied folder of others' files was refused all the same).
    for step in root.glob("step-*"):
        shutil.rmtree(step)
    train(other, get_registry(), overwrite=True)
    assert (root / "other_runs_file.txt").read_text() == "keep me"
    assert steps_in(tmp_path / "run") == [1, 2]


def test_a_local_batch_that_changes_the_global_batch_is_another_run(tmp_path: Path) -> None:
    # Without training.global_batch_size a step trains local_batch_size x DP sequences: another
    # local batch is another run, refused before it replaces the first one's outputs.
    train(tiny_llama3(tmp_path, 2), get_registry())
    before = (tmp_path / "metrics.jsonl").read_text()
    config = tiny_llama3(tmp_path, 2)
    config.training.local_batch_size *= 2
    with pytest.raises(UsageError, match=r"another run .*sequences_per_step: 2 -> 4"):
        train(config, get_registry())
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_a_local_batch_that_keeps_the_global_batch_is_the_same_run(tmp_path: Path) -> None:
    # With a global batch the local one only sets the accumulation: the same sequences a step.
    config = tiny_llama3(tmp_path, 2)
    config.training.global_batch_size = 4
    train(config, get_registry())
    config = tiny_llama3(tmp_path, 2)
    config.training.global_batch_size, config.training.local_batch_size = 4, 1
    train(config, get_registry())
    assert steps_in(tmp_path) == [1, 2]


def test_a_run_json_without_the_sequences_per_step_still_starts_over(tmp_path: Path) -> None:
    train(tiny_llama3(tmp_path, 2), get_registry())
    record = json.loads((tmp_path / "run.json").read_text())
    del record["identity"]["batch"]  # as an earlier titan wrote it
    (tmp_path / "run.json").write_text(json.dumps(record))
    train(tiny_llama3(tmp_path, 2), get_registry())
    assert steps_in(tmp_path) == [1, 2]


@pytest.mark.parametrize("tb_folder", ["checkpoint", "checkpoint/tb", "."])
def test_a_tensorboard_folder_overlapping_the_checkpoint_folder_is_refused(
    tmp_path: Path, tb_folder: str
) -> None:
    """A rerun replaces the TensorBoard folder and keeps the checkpoints: one folder cannot be
    both (a start-over once deleted the checkpoint folder with everything in it)."""
    config = tiny_llama3(tmp_path, 2)
    config.metrics.enable_tensorboard = True
    config.metrics.save_tb_folder = tb_folder
    config.checkpoint.enable = True
    with pytest.raises(
        UsageError, match=r"metrics.save_tb_folder .* and checkpoint.folder .* one holds the other"
    ):
        train(config, get_registry())
    assert not (tmp_path / "run.json").exists()


def test_a_start_over_removes_only_the_event_files_of_its_tensorboard_folder(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, 2)
    config.metrics.enable_tensorboard = True
    train(config, get_registry())
    (tmp_path / "tb" / "notes.txt").write_text("mine")
    (tmp_path / "tb" / "plots").mkdir()
    train(config, get_registry())  # the same run over
    assert (tmp_path / "tb" / "notes.txt").read_text() == "mine" and (tmp_path / "tb" / "plots").is_dir()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_a_tensorboard_folder_that_is_a_dangling_link_says_so(tmp_path: Path) -> None:
    """It said "exists and is not a folder" of a path that does not exist."""
    config = tiny_llama3(tmp_path / "run", 2)
    config.metrics.enable_tensorboard = True
    (tmp_path / "tb").symlink_to(tmp_path / "gone")
    config.metrics.save_tb_folder = str(tmp_path / "tb")
    with pytest.raises(
        UsageError, match=r"metrics.save_tb_folder: .*tb' is a link to .*gone', which does not exist"
    ):
        train(config, get_registry())


# -- --overwrite and the checkpoint folder: only what the checkpointer wrote goes ---------------------


def _checkpointed(dump: Path, steps: int, *, enable: bool = True, lr: float | None = None) -> object:
    config = tiny_llama3(dump, steps)
    config.checkpoint.enable = enable
    config.checkpoint.interval = steps
    if lr is not None:
        config.training.lr = lr
    return config


def _user_entries(folder: Path) -> None:
    """What a user keeps in a checkpoint folder beside titan's step folders."""
    (folder / "notes.txt").write_text("mine")
    (folder / "exported").mkdir()
    (folder / "exported" / "model.safetensors").write_text("weights")
    (folder / "step-3-hf").mkdir()  # an export named after its step: not a checkpoint of titan's
    (folder / "step-3-hf" / "config.json").write_text("{}")
    (folder / "step-006").mkdir()  # a name the DCP checkpointer never writes (a leading zero)


USER_ENTRIES = ["exported", "notes.txt", "step-006", "step-3-hf"]


@pytest.mark.parametrize("enable", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_overwrite_removes_only_the_checkpointers_entries_from_the_checkpoint_folder(
    tmp_path: Path, enable: bool
) -> None:
    """--overwrite emptied checkpoint.folder whole (a user's notes, another tool's files, an
    exported model), even for a new run that saves no checkpoint."""
    train(_checkpointed(tmp_path, 3), get_registry())
    ckpt = tmp_path / "checkpoint"
    (ckpt / "step-7.tmp").mkdir()  # an interrupted save's leftovers: the checkpointer's own
    (ckpt / "step-2.old").mkdir()
    _user_entries(ckpt)
    train(_checkpointed(tmp_path, 2, enable=enable, lr=1e-3), get_registry(), overwrite=True)
    left = sorted(p.name for p in ckpt.iterdir() if p.name != ".titan.lock")
    assert left == sorted((["step-2"] if enable else []) + USER_ENTRIES)
    assert (ckpt / "exported" / "model.safetensors").read_text() == "weights"
    assert (ckpt / "notes.txt").read_text() == "mine"
    log = (tmp_path / "train.log").read_text()
    (line,) = [ln for ln in log.splitlines() if "--overwrite" in ln]
    assert "step-3" in line and "step-7.tmp" in line and "step-2.old" in line
    assert "not written by the checkpointer" in line
    assert all(name in line for name in USER_ENTRIES)


def _toy_checkpointer_registry(**fields: object) -> object:
    """titan's plugins and a third party's checkpointer ``toy`` (DCP's build) with ``fields``."""
    from tests.conftest import plugin_module
    from titan_core import Checkpointer
    from titan_core._registry import Registry
    from titan_plugins_dcp.plugin import _build

    registry = Registry().load_entry_points()
    toy = Checkpointer("toy", _build, **fields)  # type: ignore[arg-type]
    registry.register(plugin_module("toy", titan_checkpointers=[toy]), "toy")
    return registry


@pytest.mark.parametrize("enable", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_overwrite_is_refused_when_the_checkpointer_does_not_say_what_it_wrote(
    tmp_path: Path, enable: bool
) -> None:
    """Removing nothing would leave stale checkpoints a later run resumes from; removing all
    deletes the user's files: one error, before anything is removed."""
    registry = _toy_checkpointer_registry()
    train(_checkpointed(tmp_path, 2), registry)
    ckpt = tmp_path / "checkpoint"
    _user_entries(ckpt)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    other = _checkpointed(tmp_path, 2, enable=enable, lr=1e-3)
    other.checkpoint.backend = "toy"
    with pytest.raises(UsageError) as info:
        train(other, registry, overwrite=True)
    message = str(info.value)
    assert "does not say which files" in message and "removes nothing there" in message
    assert "checkpoint.folder" in message and str(ckpt) in message
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing removed, nothing written


def test_a_checkpointer_that_declares_outputs_has_them_removed(tmp_path: Path) -> None:
    registry = _toy_checkpointer_registry(outputs=("step-[0-9]",))
    train(_checkpointed(tmp_path, 2), registry)
    _user_entries(tmp_path / "checkpoint")
    other = _checkpointed(tmp_path, 2, enable=False, lr=1e-3)
    other.checkpoint.backend = "toy"
    train(other, registry, overwrite=True)
    left = sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name != ".titan.lock")
    assert left == USER_ENTRIES


def test_overwrite_of_an_empty_checkpoint_folder_needs_no_declared_outputs(tmp_path: Path) -> None:
    registry = _toy_checkpointer_registry()
    train(tiny_llama3(tmp_path, 2), registry)
    other = _checkpointed(tmp_path, 2, lr=1e-3)
    other.checkpoint.backend = "toy"
    train(other, registry, overwrite=True)
    assert (tmp_path / "checkpoint" / "step-2").is_dir()


def test_the_launch_check_refuses_that_overwrite_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_train.sh's check (``preflight``) skipped --overwrite runs: the refusal came from every
    torchrun worker instead of once, before any started."""
    from tests.conftest import plugin_module
    from titan_core import Recipe, _registry
    from titan_core.run import preflight

    registry = _toy_checkpointer_registry()
    train(_checkpointed(tmp_path, 2), registry)

    def recipe() -> object:
        config = _checkpointed(tmp_path, 2, lr=1e-3)
        config.checkpoint.backend = "toy"
        return config

    registry.register(plugin_module("recipes", titan_recipes=[Recipe("other", recipe)]), "recipes")
    monkeypatch.setattr(_registry, "_default", registry)
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: _registry._default)
    assert preflight(["--recipe", "other", "--overwrite"], 1) == UsageError.exit_code
    err = capsys.readouterr().err
    assert err.startswith("titan: error:") and "does not say which files" in err, err
    assert (tmp_path / "checkpoint" / "step-2").is_dir() and (tmp_path / "run.json").is_file()


def test_the_dcp_checkpointer_declares_only_the_names_it_writes() -> None:
    import fnmatch

    patterns = get_registry().get("checkpointers", "dcp").outputs
    ours = ["step-0", "step-3", "step-120", "step-3.tmp", "step-120.old", "step-0.tmp"]
    others = [*USER_ENTRIES, "step-03", "step-3.tmp.bak", "step-", "steps", "step-x", "notes-step-3"]
    # copies a user makes beside a step (a glob's '*' matched their middle)
    others += ["step-1-v2", "step-10-best", "step-1.old2", "step-2_copy0", "step-1 (2).tmp"]
    ours += ["step-9", "step-10", "step-123456789012"]
    assert all(any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in ours)
    assert not [n for n in others if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@pytest.mark.parametrize("pattern", ["", "step-1/meta.json", "..", "/abs", 3])
def test_a_checkpointers_outputs_stay_at_the_top_of_its_folder(pattern: object) -> None:
    from titan_core import Checkpointer

    with pytest.raises(
        TypeError, match=r"Checkpointer\.outputs: expected a tuple of file or folder name patterns"
    ):
        Checkpointer("toy", print, outputs=(pattern,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Checkpointer\.outputs: expected"):
        Checkpointer("toy", print, outputs="step-*")  # type: ignore[arg-type]


def test_a_rerun_of_the_same_run_says_it_replaces_the_earlier_attempts_outputs(tmp_path: Path) -> None:
    """A second run of the same config into the folder replaced the first one's train.log,
    metrics.jsonl and TensorBoard events without a word (the first run had completed: 2 of 2)."""
    for _ in range(2):
        config = tiny_llama3(tmp_path, 2)
        config.metrics.enable_tensorboard = True
        train(config, get_registry())
    log = (tmp_path / "train.log").read_text()
    line = next(line for line in log.splitlines() if "replaces" in line)
    assert "[warning" in line and "the same run" in line
    assert "logged steps 1-2 of 2" in line and "metrics.jsonl" in line and "--dump-folder" in line
    assert log.index("replaces") < log.index("step 1/2")


@pytest.mark.parametrize("where", ["under a file", "in an unwritable folder"])
def test_a_checkpoint_folder_that_cannot_be_created_is_a_usage_error(tmp_path: Path, where: str) -> None:
    """An absolute ``checkpoint.folder`` under a file, or in a folder this user may not write, was
    a ``NotADirectoryError``/``PermissionError`` traceback from creating it; now one error naming
    the field, before anything is written."""
    import os

    config = tiny_llama3(tmp_path / "run", 2)
    config.checkpoint.enable = True
    if where == "under a file":
        (tmp_path / "afile").write_text("kept")
        config.checkpoint.folder = str(tmp_path / "afile" / "ckpt")
        expected = r"checkpoint.folder: cannot create .*afile' is not a folder"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into any folder")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        config.checkpoint.folder = str(locked / "ckpt")
        expected = r"checkpoint.folder: .*locked' is not writable"
    with pytest.raises(UsageError, match=expected):
        train(config, get_registry())
    assert not (tmp_path / "run" / "run.json").exists()  # refused before anything is written


def test_a_run_json_write_cut_short_keeps_the_earlier_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while a rerun recorded run.json left it half-written: the next attempt, after
    space was freed, refused the folder as `outputs of a run titan cannot identify`, and only
    --overwrite (deleting its checkpoints) got past it."""
    import builtins

    from titan_core import run_folder
    from titan_core.errors import TitanError

    def checkpointed() -> object:
        config = tiny_llama3(tmp_path, 4)
        config.checkpoint.enable = True
        config.checkpoint.interval = 2
        return config

    stopped = checkpointed()
    stopped.debug.max_steps = 2
    train(stopped, get_registry())
    before = (tmp_path / "run.json").read_text()
    real_open = builtins.open

    class CutShort:
        """A file whose writes stop after 10 bytes, as on a disk that fills up."""

        def __init__(self, file: object) -> None:
            self.file, self.left = file, 10

        def write(self, text: str) -> int:
            if len(text) > self.left:
                self.file.write(text[: self.left])
                self.file.flush()
                raise OSError(28, "No space left on device")
            self.left -= len(text)
            return self.file.write(text)

        def __getattr__(self, name: str) -> object:
            return getattr(self.file, name)

        def __enter__(self) -> CutShort:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

    def full_disk_open(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        file = real_open(path, mode, *args, **kwargs)
        return CutShort(file) if "w" in mode and "run.json" in str(path) else file

    monkeypatch.setattr(run_folder, "open", full_disk_open, raising=False)
    with pytest.raises(TitanError, match="No space left on device"):
        train(checkpointed(), get_registry())  # resumes: records run.json again
    monkeypatch.undo()
    assert (tmp_path / "run.json").read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("run.json.")]  # no temp left
    train(checkpointed(), get_registry())  # space freed: the resume goes on
    assert steps_in(tmp_path) == [1, 2, 3, 4]
