"""The trainer's guards against silent wrong training and lost work (issue: trustworthy training)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_titan, tiny_llama3, tiny_recipe_source, titan_env
from titan_core import Callback, hookimpl
from titan_core._registry import Registry
from titan_core.config import ConfigError, validate
from titan_core.errors import UsageError
from titan_core.trainer import Diverged, Trainer, train


def tiny(tmp_path: Path, steps: int = 6) -> object:
    config = tiny_llama3(tmp_path, steps)
    config.metrics.log_freq = 10
    return config


class _PoisonGradAt:
    """A callback that makes one gradient NaN at ``step`` (what a diverging run looks like)."""

    def __init__(self, step: int, seen: list[int]) -> None:
        self.step, self.seen, self.trainer = step, seen, None

    @hookimpl
    def titan_callbacks(self) -> list[Callback]:
        def build(trainer: object) -> object:
            self.trainer = trainer
            return self

        return [Callback("poison", build)]

    def after_forward_backward(self, step: int) -> None:
        self.seen.append(step)
        if step == self.step:
            next(self.trainer.parts[0].parameters()).grad.fill_(float("nan"))


def test_a_non_finite_grad_norm_stops_the_run_naming_its_step(tmp_path: Path) -> None:
    registry = Registry().load_entry_points()
    seen: list[int] = []
    registry.register(_PoisonGradAt(3, seen), "poison")
    with pytest.raises(Diverged, match=r"became non-finite .* at step 3; stopped at step 6"):
        train(tiny(tmp_path), registry)  # log_freq 10: the flag is read at the last step only
    assert seen == [1, 2, 3, 4, 5, 6]


def test_an_lr_too_large_for_adamw_is_one_config_error_before_anything_is_built(tmp_path: Path) -> None:
    """lr / (1 - beta1) beyond float32: the optimizer step raised torch's overflow RuntimeError at
    step 1 (a traceback); a Python caller that skips validate() gets validate()'s error too."""
    config = tiny(tmp_path, steps=2)
    config.training.lr, config.training.warmup_steps = 1e38, 0
    with pytest.raises(ConfigError, match=r"^invalid config: training\.lr: 1e\+38 is too large: AdamW's"):
        train(config, Registry().load_entry_points())
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_lr_too_large_for_adamw_is_one_error_line_from_titan_run(tmp_path: Path) -> None:
    """Was torch's traceback from the optimizer step of step 1 (no warm-up: the peak LR at once)."""
    extra = "    c.training.lr, c.training.warmup_steps = 1e38, 0\n"
    (tmp_path / "lr_recipes.py").write_text(tiny_recipe_source("huge", 3, extra))
    result = run_titan("run", "--module", "lr_recipes", "--recipe", "huge", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("titan: error: invalid config from recipe 'huge'") and "training.lr: 1e+38" in line


def test_a_huge_finite_lr_that_makes_the_loss_diverge_is_the_non_finite_loss_error(tmp_path: Path) -> None:
    """An lr AdamW can apply, whose update overflows the weights: the trainer's own check, not a
    traceback from deeper in (a NaN loss, a NaN router, a NaN checkpoint)."""
    config = tiny(tmp_path, steps=3)
    config.training.lr, config.training.warmup_steps = 1e30, 0
    # Weight decay off: lr x weight_decay >= 1 is refused before the run (it zeroes the weights).
    config.training.weight_decay = 0.0
    validate(config)
    with pytest.raises(
        Diverged, match=r"became non-finite \(NaN or inf\) at step 2; stopped at step 3 .* Lower training\.lr"
    ):
        train(config, Registry().load_entry_points())


def test_a_second_run_in_one_dump_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    registry = Registry().load_entry_points()
    first = Trainer(tiny(tmp_path, steps=1), registry)
    try:
        with pytest.raises(UsageError, match=rf"is in use by another run \(host .*, pid {os.getpid()}\)"):
            Trainer(tiny(tmp_path, steps=1), registry)
    finally:
        first.close()
    Trainer(tiny(tmp_path, steps=1), registry).close()  # released: the folder is free again


def test_two_runs_sharing_a_checkpoint_folder_outside_their_dump_folders_are_refused(tmp_path: Path) -> None:
    """Run B saving into run A's absolute checkpoint folder replaced A's steps (and resumed from
    them): the second is refused while the first holds the folder, and nothing of it is written."""
    registry = Registry().load_entry_points()

    def run_in(name: str) -> Any:
        config = tiny(tmp_path / name, steps=2)
        config.checkpoint.enable, config.checkpoint.folder = True, str(tmp_path / "shared_ck")
        return config

    first = Trainer(run_in("a"), registry)
    try:
        holder = rf"\(host .*, pid {os.getpid()}\)"
        expected = rf"checkpoint.folder '{tmp_path}/shared_ck' is in use by another run {holder}"
        with pytest.raises(UsageError, match=expected):
            Trainer(run_in("b"), registry)
        assert not (tmp_path / "b" / "run.json").exists()
        first.train()
    finally:
        first.close()
    assert sorted(p.name for p in (tmp_path / "shared_ck").iterdir() if not p.name.startswith(".")) == [
        "step-2"
    ]
    second = Trainer(run_in("b"), registry)  # released: a later run may use it (and resumes from it)
    second.close()


def test_a_dump_folder_under_a_file_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    config = tiny(tmp_path / "file" / "out", steps=1)
    with pytest.raises(UsageError, match=r"job\.dump_folder: cannot create"):
        Trainer(config, Registry().load_entry_points())


def test_pure_fake_under_torchrun_is_a_launch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NGPU", "4")
    config = tiny(tmp_path, steps=1)
    config.comm.backend = "fake"
    with pytest.raises(
        UsageError, match=r"comm.backend = 'fake' runs as ONE process .*, but 2 processes are launched"
    ):
        Trainer(config, Registry().load_entry_points())


LONG = tiny_recipe_source("long", 100000)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code", "expected"),
    [(signal.SIGINT, 130, r"interrupted \(Ctrl-C\) after step \d+; checkpointing is off, so nothing was")],
)
def test_a_signal_ends_the_run_with_one_line(tmp_path: Path, sig: int, code: int, expected: str) -> None:
    (tmp_path / "long_recipe.py").write_text(LONG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", "long_recipe", "--recipe", "long"],
        cwd=tmp_path,
        env=titan_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # wait for the first step
        if '"event": "step"' in line:
            break
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert re.search(expected, stderr) and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1


class _SignalAt:
    """Sends this process ``signum`` during ``step`` (SIGTERM: what SLURM/Kubernetes do before
    preemption; SIGINT: a Ctrl-C)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step = step
        self.signum = signum

    @hookimpl
    def titan_callbacks(self) -> list[Callback]:
        return [Callback("sigterm", lambda trainer: self)]

    def after_optimizer_step(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigterm_finishes_the_step_then_stops_with_one_error(tmp_path: Path) -> None:
    from titan_core.trainer import Terminated

    registry = Registry().load_entry_points()
    registry.register(_SignalAt(2), "sigterm")
    # Without checkpointing nothing is saved: the message must not promise a resume.
    expected = (
        r"stopped by SIGTERM at step 2; checkpointing is off \(checkpoint.enable = False\), so no step "
        r"was saved: the same command starts over from step 1\n"
    )
    with pytest.raises(Terminated, match=expected):
        train(tiny(tmp_path), registry)
    assert Terminated.exit_code == 143
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # steps 1 and 2 were logged: the step in flight completed


def test_ctrl_c_finishes_the_step_and_leaves_every_writer_whole(tmp_path: Path) -> None:
    # A KeyboardInterrupt raised at a random line can cut a writer off half-way (a TensorBoard
    # writer thread left unable to stop hung the run's exit); the first Ctrl-C stops at the step end.
    registry = Registry().load_entry_points()
    registry.register(_SignalAt(2, signal.SIGINT), "sigint")
    config = tiny(tmp_path)
    config.metrics.enable_tensorboard = True
    with pytest.raises(KeyboardInterrupt, match=r"^after step 2\b"):
        train(config, registry)
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]  # the step in flight completed and logged
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored


def test_recipes_list_finds_a_module_in_the_current_folder(tmp_path: Path) -> None:
    (tmp_path / "here_recipes.py").write_text(
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n\n"
        "def mine():\n    return llama3_debugmodel()\n"
    )
    result = run_titan("recipes", "list", "--module", "here_recipes", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # The imported plugin recipe runs with `--module here_recipes` as well: listed, with its origin.
    assert {r["name"]: r["source"] for r in json.loads(result.stdout)} == {
        "mine": "here_recipes",
        "llama3_debugmodel": "here_recipes (imported from plugin llama3)",
    }


def test_piping_into_head_ends_quietly() -> None:
    titan = Path(sys.executable).parent / "titan"
    result = subprocess.run(
        f"'{titan}' models list | head -1", shell=True, capture_output=True, text=True, env=titan_env()
    )
    assert result.stdout.startswith("MODEL") and result.stderr == ""


@pytest.mark.parametrize("command", ["plugins", "models", "recipes"])
def test_a_group_command_alone_shows_its_help(command: str) -> None:
    result = run_titan(command)
    assert result.returncode == 0
    assert "list" in result.stdout and "usage:" in result.stdout


def test_seq_len_beyond_the_models_max_is_one_error(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=1)
    config.training.seq_len = 4096
    config.model.overrides = {**config.model.overrides, "max_seq_len": 2048}
    with pytest.raises(UsageError, match=r"training\.seq_len=4096 exceeds the model's max_seq_len=2048"):
        Trainer(config, Registry().load_entry_points())


def test_print_config_of_an_unknown_flavor_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "flavor_recipes.py").write_text(
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n\n"
        "def odd():\n    c = llama3_debugmodel()\n    c.model.flavor = '9B'\n    return c\n"
    )
    result = run_titan("run", "--module", "flavor_recipes", "--recipe", "odd", "--print-config", cwd=tmp_path)
    assert result.returncode == 2
    assert "model.flavor: model 'llama3' has no flavor '9B'; known flavors:" in result.stderr


@pytest.mark.parametrize("deeper", [True, False])
def test_initial_weights_of_another_depth_are_refused(tmp_path: Path, deeper: bool) -> None:
    """A .pt state dict of a 3-block model into a 2-block one (and back) used to load silently."""
    from titan_core.initial_weights import load_initial_weights

    registry = Registry().load_entry_points()
    spec = registry.get("models", "llama3")
    small = spec.flavor("debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 4})
    big = spec.flavor("debugmodel", {"dim": 64, "n_layers": 3, "n_heads": 4})
    saved, target = (big, small) if deeper else (small, big)
    torch.save(spec.build(saved).state_dict(), tmp_path / "w.pt")
    model = spec.build(target)
    expected = "tensors the model lacks (layers.2." if deeper else "tensors of the model missing (layers.2."
    with pytest.raises(UsageError, match=re.escape(expected)):
        load_initial_weights([model], str(tmp_path / "w.pt"), spec, target)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"n_layers": 0}, "model.overrides.n_layers: expected a positive integer, got 0"),
        ({"n_heads": 5}, "dim=64 must be a multiple of n_heads=5"),
    ],
)
def test_model_arguments_that_cannot_build_are_one_error(
    tmp_path: Path, overrides: dict, expected: str
) -> None:
    config = tiny(tmp_path, steps=1)
    config.model.overrides = {**config.model.overrides, **overrides}
    with pytest.raises(UsageError, match=re.escape(expected)):
        Trainer(config, Registry().load_entry_points())


def test_ctrl_c_with_checkpointing_says_the_step_is_not_saved_and_how_to_save_it(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=6)
    config.checkpoint.enable, config.checkpoint.interval = True, 2
    registry = Registry().load_entry_points()
    registry.register(_SignalAt(3, signal.SIGINT), "sigint")
    expected = r"after step 3, without saving it: the same command resumes from the checkpoint of step 2 and"
    with pytest.raises(KeyboardInterrupt, match=expected + r" trains steps 3-3 again"):
        train(config, registry)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [".titan.lock", "step-2"]
    # Before any checkpoint: nothing to resume from, and the line says so.
    config = tiny(tmp_path / "early", steps=6)
    config.checkpoint.enable, config.checkpoint.interval = True, 5
    registry = Registry().load_entry_points()
    registry.register(_SignalAt(2, signal.SIGINT), "sigint")
    with pytest.raises(KeyboardInterrupt, match=r"no checkpoint exists yet: the same command starts over"):
        train(config, registry)


class _SigtermAtWithCheckpoint(_SignalAt):
    pass


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_a_resume_loses_nothing(tmp_path: Path) -> None:
    from titan_core.trainer import Terminated

    def config(steps: int = 6) -> object:
        c = tiny(tmp_path / "run", steps)
        c.checkpoint.enable = True
        c.checkpoint.interval = 100  # only the SIGTERM save and the last step
        c.metrics.log_freq = 1
        return c

    registry = Registry().load_entry_points()
    registry.register(_SigtermAtWithCheckpoint(3), "sigterm")
    with pytest.raises(Terminated, match="at step 3 after saving a checkpoint"):
        train(config(), registry)
    assert (tmp_path / "run" / "checkpoint" / "step-3").is_dir()
    resumed = train(config(), Registry().load_entry_points())
    assert [r["step"] for r in resumed] == [4, 5, 6]
    straight_config = tiny(tmp_path / "straight", 6)
    straight_config.metrics.log_freq = 1
    straight = train(straight_config, Registry().load_entry_points())
    by_step = {r["step"]: r["loss"] for r in straight}
    assert all(abs(r["loss"] - by_step[r["step"]]) < 1e-4 * abs(by_step[r["step"]]) for r in resumed)


def test_the_signal_handlers_only_set_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # A signal can arrive while the main thread is inside the logger's write (holding its lock):
    # a handler that logged there waited for that lock forever (a Ctrl-C'd run hung at exit).
    from titan_core import trainer
    from titan_core.stop_signals import StopSignals

    class NoLogging:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"a signal handler called log.{name}")

    monkeypatch.setattr(trainer, "log", NoLogging())
    with StopSignals() as flags:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert flags.terminated and flags.interrupted
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C stops at once
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it() -> None:
    """``nohup`` and background jobs start with SIGINT ignored, as Python itself leaves it: the
    run took a first SIGINT as a stop anyway, then ignored the second (the one that stops at once)."""
    from titan_core.stop_signals import StopSignals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as flags:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert not flags.interrupted
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("scoped", [True, False], ids=["cli", "library"])
def test_a_failing_run_holds_sigterm_until_its_error_line_only_under_the_clis_scope(scoped: bool) -> None:
    """torchrun's SIGTERM to a survivor that was saying why it failed ended it with nothing said;
    a library caller of train (no scope) gets its own handler back as the run fails."""
    from titan_core.stop_signals import StopSignals, sigterm_waits_for_the_error_line

    mine = []
    previous = signal.signal(signal.SIGTERM, lambda *a: mine.append("theirs"))
    try:
        scope = sigterm_waits_for_the_error_line() if scoped else contextlib.nullcontext()
        with scope:
            with pytest.raises(RuntimeError), StopSignals():
                raise RuntimeError("a collective failed")
            signal.raise_signal(signal.SIGTERM)  # while the error line is being made
            assert mine == ([] if scoped else ["theirs"])
            with StopSignals():  # a run that ends well restores at once
                pass
            with pytest.raises(KeyboardInterrupt), StopSignals():  # Ctrl-C is not a failure
                raise KeyboardInterrupt
        signal.raise_signal(signal.SIGTERM)  # the line is out: the caller's handler is back
        assert mine[-1] == "theirs"
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("default_backend", ["gloo", "nccl"])
def test_processes_agree_on_a_signal_one_step_after_it_is_posted_without_the_device(
    monkeypatch: pytest.MonkeyPatch, default_backend: str
) -> None:
    """Every step posts the flags and reads the previous step's (CPU tensors: no device sync);
    under a default group without gloo (NCCL alone) they go over a gloo group of their own."""
    import torch.distributed as dist

    from titan_core.stop_signals import AgreedStop, StopSignals

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        created = []
        if default_backend == "nccl":
            new_group = dist.new_group
            monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
            monkeypatch.setattr(dist, "new_group", lambda **kw: created.append(kw) or new_group(**kw))
        signals = StopSignals()
        agree = AgreedStop(signals)
        assert created == ([{"backend": "gloo"}] if default_backend == "nccl" else [])
        assert agree.step(post=True) == (False, False)  # step 1 posts nothing raised
        signals.terminated = True  # arrives during step 2, before its post
        assert agree.step(post=True) == (False, False)  # step 2 reads step 1's flags
        assert agree.step(post=True) == (True, False)  # step 3 reads step 2's: every rank stops here
        assert agree._posted is None  # nothing left in flight once the run stops
        signals.terminated, signals.interrupted = False, True
        assert agree.step(post=False) == (False, False)  # the last step posts nothing
        assert agree._posted is None
    finally:
        dist.destroy_process_group()


NO_CHECKPOINTS = tiny_recipe_source(
    "plain", 40, '    c.job.dump_folder = "outputs"\n    c.metrics.enable_tensorboard = False\n'
)


def _file_size_limit(limit: int) -> Any:
    """A ``preexec_fn``: the child's files cannot grow past ``limit`` bytes (``ulimit -f``), which
    its writes meet as a full disk (Python ignores SIGXFSZ, so they fail with EFBIG)."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return apply


@pytest.mark.parametrize(
    ("limit", "file"),
    [(0, r"\.titan\.lock"), (1500, r"config\.toml"), (4000, r"(metrics\.jsonl|train\.log)")],
    ids=["the lock at the start", "config.toml", "mid-run"],
)
def test_a_full_disk_under_the_run_folder_is_one_error_line(tmp_path: Path, limit: int, file: str) -> None:
    """A full disk under job.dump_folder: an OSError traceback from the lock or config.toml; mid-run,
    `callback 'metrics_file' (plugin core) failed` chained to the traceback of the next log call,
    which could not write train.log either (and closing the log raised again at exit)."""
    (tmp_path / "plain_recipe.py").write_text(NO_CHECKPOINTS)
    result = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", "plain_recipe", "--recipe", "plain"],
        cwd=tmp_path,
        env=titan_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_file_size_limit(limit),
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.match(rf"titan: error: cannot write .* to outputs/{file}: File too large", line), line
    assert "Raise the file-size limit (ulimit -f)" in line and "plugin" not in line


class _FillTheLogsDiskAt:
    """From ``step`` on, train.log cannot grow: its open file becomes /dev/full (every write
    fails with ENOSPC, as on a full disk), the other files stay as they are."""

    def __init__(self, step: int, log: Path) -> None:
        self.step, self.log = step, log

    @hookimpl
    def titan_callbacks(self) -> list[Callback]:
        return [Callback("fill", lambda trainer: self)]

    def after_optimizer_step(self, step: int) -> None:
        if step != self.step:
            return
        full = os.open("/dev/full", os.O_WRONLY)
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == str(self.log):
                    os.dup2(full, int(fd))
        os.close(full)


@pytest.mark.skipif(not os.path.exists("/dev/full") or not os.path.isdir("/proc/self/fd"), reason="Linux")
def test_a_log_file_that_cannot_grow_ends_the_run_after_the_step_with_one_error(tmp_path: Path) -> None:
    """The OSError came out of whichever log call met the full disk, one in the run's failure
    handling too (the failure callbacks were then skipped), and again from closing the log."""
    from titan_core.errors import TitanError

    config = tiny(tmp_path, steps=6)
    config.metrics.log_freq = 1
    registry = Registry().load_entry_points()
    registry.register(_FillTheLogsDiskAt(3, tmp_path / "train.log"), "fill")
    with pytest.raises(TitanError) as caught:
        train(config, registry)
    assert type(caught.value) is TitanError
    assert str(caught.value).startswith(f"cannot write the log to {tmp_path / 'train.log'}: the disk is full")
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]  # the step completed; no later one ran


class _DeleteDumpFolderAt:
    """Deletes the run's dump folder during ``step`` (a cleanup script, a mistaken ``rm -r``)."""

    def __init__(self, step: int, folder: Path) -> None:
        self.step, self.folder = step, folder

    @hookimpl
    def titan_callbacks(self) -> list[Callback]:
        return [Callback("delete", lambda trainer: self)]

    def after_optimizer_step(self, step: int) -> None:
        if step == self.step:
            import shutil

            shutil.rmtree(self.folder)


def test_a_dump_folder_deleted_during_the_run_stops_it(tmp_path: Path) -> None:
    """The run went on logging into deleted files and ended with exit 0; its checkpoint saves
    recreated the folder with checkpoints alone (no run.json, metrics.jsonl or train.log)."""
    from titan_core.errors import TitanError

    dump = tmp_path / "run"
    config = tiny(dump, steps=6)
    config.metrics.log_freq = 1
    config.checkpoint.enable, config.checkpoint.interval = True, 2
    registry = Registry().load_entry_points()
    registry.register(_DeleteDumpFolderAt(3, dump), "delete")
    with pytest.raises(TitanError, match=r"metrics\.jsonl was deleted or replaced while this run wrote it"):
        train(config, registry)
    assert not dump.exists()  # nothing recreated: no checkpoint of step 4 alone in a new folder
