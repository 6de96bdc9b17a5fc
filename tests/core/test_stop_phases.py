"""SIGTERM (a cluster preempting the job, torchrun ending survivors) and Ctrl-C at each phase of a
run: plugin loading, config resolution, the build, the steps, after the last step, ``titan
export``. Each ends with one line and the exit status of its signal, or completes when nothing is
left to stop (docs/reliability.md). The signal is sent from inside the phase (a patched function
in the recipe module, a plugin's import, a callback), never after a sleep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_titan, tiny_llama3, titan_env
from tests.parallel_harness import REPO, child_env, torchrun_command
from titan_core import Callback, hookimpl
from titan_core._registry import Registry
from titan_core.trainer import train

#: A recipe module that sends ``STOP_SIGNAL`` (``STOP_TIMES`` times) to its own process at the
#: phase ``STOP_AT`` names; ``STOP_RANK`` limits it to one rank of several.
STOP_RECIPE = """
import os
import signal
import time

import titan_core.init
import titan_core.trainer
from tests.parallel_harness import tiny_config

PHASE = os.environ.get("STOP_AT")
SIGNAL = getattr(signal, os.environ.get("STOP_SIGNAL", "SIGTERM"))


def stop():
    if os.environ.get("STOP_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    for _ in range(int(os.environ.get("STOP_TIMES", "1"))):
        os.kill(os.getpid(), SIGNAL)
        time.sleep(0.2)  # the handler runs here


def sending(fn):
    def patched(*args, **kwargs):
        stop()
        return fn(*args, **kwargs)

    return patched


if PHASE == "build":
    titan_core.init.initialise = sending(titan_core.init.initialise)
elif PHASE == "start":  # built, before the loop (where a seed checkpoint is written)
    titan_core.trainer.Trainer.train = sending(titan_core.trainer.Trainer.train)
elif PHASE == "summary":
    titan_core.trainer.Trainer._log_summary = sending(titan_core.trainer.Trainer._log_summary)
elif PHASE == "close":
    titan_core.trainer.Trainer.close = sending(titan_core.trainer.Trainer.close)


def stopped():
    if PHASE == "config":
        stop()
    c = tiny_config(**{"training.steps": int(os.environ.get("STEPS", "4")), "metrics.log_freq": 1})
    c.model.overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    c.job.dump_folder = "out"
    c.checkpoint.enable, c.checkpoint.interval = True, 2
    if os.environ.get("WORLD_SIZE", "1") == "2":
        c.parallelism.dp_shard, c.training.local_batch_size = 2, 2
        c.comm.train_timeout_seconds = 20
    return c
"""

RUN = ("run", "--module", "stop_recipe", "--recipe", "stopped")


def _titan_run(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (folder / "stop_recipe.py").write_text(STOP_RECIPE)
    return run_titan(*RUN, cwd=folder, PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]), **env)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _steps_saved(folder: Path) -> list[str]:
    checkpoints = folder / "out" / "checkpoint"
    return (
        sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
        if checkpoints.exists()
        else []
    )


@pytest.mark.parametrize(
    ("phase", "where"),
    [("config", "before the run was built"), ("build", "during the build")],
)
def test_sigterm_before_the_first_step_is_one_line_and_exit_143(
    tmp_path: Path, phase: str, where: str
) -> None:
    """SIGTERM kept its default action outside the training loop: the process ended at once with
    nothing said (exit -15), however long the build had run."""
    result = _titan_run(tmp_path, STOP_AT=phase)
    assert result.returncode == 143, result.stderr[-3000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"titan: error: stopped by SIGTERM {where}: nothing was trained or saved; ")
    assert "run the same command" in lines[0]
    assert _steps_saved(tmp_path) == []
    if phase == "build":  # the same command then trains the run
        rerun = _titan_run(tmp_path)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert _steps_saved(tmp_path) == ["step-2", "step-4"]


def test_sigterm_between_the_build_and_the_first_step_saves_step_1(tmp_path: Path) -> None:
    """From the end of the build on, SIGTERM is the loop's flag: step 1 runs and is saved (it
    ended the process with nothing said, exit -15)."""
    result = _titan_run(tmp_path, STOP_AT="start", STEPS="6")
    assert result.returncode == 143, result.stderr[-3000:]
    assert _error_lines(result.stderr) == [
        "titan: error: stopped by SIGTERM at step 1 after saving a checkpoint; run the same command to resume"
    ]
    assert _steps_saved(tmp_path) == ["step-1"]


def test_sigterm_while_plugins_load_is_one_line_not_a_failed_plugin(tmp_path: Path) -> None:
    """A plugin's import under way when SIGTERM came: the process died (exit -15), or, once
    SIGTERM raised, the plugin counted as failed to load and the command went on without it."""
    site = tmp_path / "site"
    (site / "slow_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "slow_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: slow-plugin\nVersion: 0.1\n"
    )
    (site / "slow_plugin-0.1.dist-info" / "entry_points.txt").write_text("[titan]\nslow = slow_plugin\n")
    (site / "slow_plugin.py").write_text(
        "import os, signal, time\n\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\n"
    )
    result = run_titan("plugins", "list", PYTHONPATH=str(site))
    assert result.returncode == 143, result.stdout[-2000:] + result.stderr[-2000:]
    assert _error_lines(result.stderr) == [
        "titan: error: stopped by SIGTERM before `titan plugins` finished; run it again"
    ]


EXPORT_LAUNCH = """
import os
import signal
import sys
import time

import titan_plugins_dcp.export as export
from titan_core.cli import exit_process, main

write = export._write_safetensors


def stopped_while_writing(*args, **kwargs):
    files = write(*args, **kwargs)  # the shards are in the staging folder
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    return files


export._write_safetensors = stopped_while_writing
exit_process(main(sys.argv[1:]))
"""


def test_sigterm_during_titan_export_is_one_line_and_leaves_nothing_in_the_folder(tmp_path: Path) -> None:
    """A killed export left its staging folder behind (the next export removes it) and said
    nothing (exit -15)."""
    config = tiny_llama3(tmp_path / "run", steps=1)
    config.checkpoint.enable = True
    train(config, Registry().load_entry_points())
    (tmp_path / "launch.py").write_text(EXPORT_LAUNCH)
    out = tmp_path / "hf"
    result = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "launch.py"),
            "export",
            str(tmp_path / "run" / "checkpoint"),
            "--to",
            "hf",
            str(out),
        ],
        env=titan_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 143, result.stderr[-3000:]
    assert _error_lines(result.stderr) == [
        "titan: error: stopped by SIGTERM before `titan export` finished; run it again"
    ]
    assert not out.exists() or list(out.iterdir()) == []  # no staging folder, no partial export


@pytest.mark.parametrize(
    ("phase", "sig"),
    [("summary", "SIGTERM"), ("summary", "SIGINT"), ("close", "SIGTERM")],
)
def test_a_signal_after_the_last_step_lets_the_run_complete(tmp_path: Path, phase: str, sig: str) -> None:
    """After the last step (trained, logged and saved) a signal ended a run that had nothing left
    to lose as a failure: SIGTERM with no word (exit -15), Ctrl-C as `titan: interrupted (Ctrl-C)`
    (exit 130); with several processes the peers then failed in their closing collective. As a
    signal during the last step, it lets the run end: its summary, its files closed, exit 0."""
    result = _titan_run(tmp_path, STOP_AT=phase, STOP_SIGNAL=sig)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _error_lines(result.stderr) == []
    assert '"event": "run summary"' in result.stdout
    assert _steps_saved(tmp_path) == ["step-2", "step-4"]
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [1, 2, 3, 4]


def test_a_second_ctrl_c_after_the_last_step_says_the_run_completed(tmp_path: Path) -> None:
    """It said `titan: interrupted (Ctrl-C)` alone, as if the run had been cut short."""
    result = _titan_run(tmp_path, STOP_AT="summary", STOP_SIGNAL="SIGINT", STOP_TIMES="2")
    assert result.returncode == 130, result.stderr[-3000:]
    assert _error_lines(result.stderr) == [
        "titan: interrupted (Ctrl-C) after the last step (4): the run completed"
    ]
    assert _steps_saved(tmp_path) == ["step-2", "step-4"]


class _CtrlCAt:
    """Ctrl-C (``times`` of them) during ``step``, after its optimizer step."""

    def __init__(self, step: int, times: int = 1) -> None:
        self.step, self.times = step, times

    @hookimpl
    def titan_callbacks(self) -> list[Callback]:
        return [Callback("ctrl_c", lambda trainer: self)]

    def after_optimizer_step(self, step: int) -> None:
        if step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


def _checkpointed(tmp_path: Path, steps: int = 6) -> object:
    config = tiny_llama3(tmp_path, steps)
    config.metrics.log_freq = 10
    config.checkpoint.enable, config.checkpoint.interval = True, 2
    return config


def test_ctrl_c_at_a_step_the_interval_saves_says_it_is_saved(tmp_path: Path) -> None:
    """The step a Ctrl-C stopped after was an interval's save: the line said `after step 4,
    without saving it: the same command resumes from the checkpoint of step 4 and trains steps 5-4
    again`."""
    registry = Registry().load_entry_points()
    registry.register(_CtrlCAt(4), "ctrl_c")
    expected = r"^after step 4, which is saved: the same command resumes from step 5\n"
    with pytest.raises(KeyboardInterrupt, match=expected):
        train(_checkpointed(tmp_path), registry)
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == ["step-2", "step-4"]


def test_a_second_ctrl_c_says_what_the_step_in_flight_loses(tmp_path: Path) -> None:
    """A second Ctrl-C stops at once: the line was a bare `titan: interrupted (Ctrl-C)`, no word
    of what was lost and from where the same command goes on."""
    registry = Registry().load_entry_points()
    registry.register(_CtrlCAt(3, times=2), "ctrl_c")
    expected = (
        r"^during step 3, at once \(a second Ctrl-C\): the same command resumes from the checkpoint of "
        r"step 2 and trains steps 3-3 again\n"
    )
    with pytest.raises(KeyboardInterrupt, match=expected):
        train(_checkpointed(tmp_path), registry)
    registry = Registry().load_entry_points()
    registry.register(_CtrlCAt(1, times=2), "ctrl_c")
    with pytest.raises(KeyboardInterrupt, match=r"no checkpoint exists yet: the same command starts over"):
        train(_checkpointed(tmp_path / "early"), registry)


def _torchrun(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (folder / "stop_recipe.py").write_text(STOP_RECIPE)
    return subprocess.run(
        torchrun_command(2, *RUN[1:]),
        cwd=folder,
        env=child_env(folder, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rank_lines(stderr: str) -> list[str]:
    """The ranks' own titan lines, before torchrun's report (which repeats recorded ones)."""
    return [line for line in stderr.split("ChildFailedError")[0].splitlines() if "titan: " in line]


@pytest.mark.slow
def test_sigterm_on_one_rank_during_the_build_ends_every_rank_with_a_line(tmp_path: Path) -> None:
    """SIGTERM to rank 0 while it built the model: it died silently (exit -15), and torchrun's
    SIGTERM then ended rank 1 the same way: two `exitcode: -15` and no word from titan."""
    result = _torchrun(tmp_path, STOP_AT="build", STOP_RANK="0")
    assert result.returncode != 0
    assert "exitcode  : -15" not in result.stderr, result.stderr[-4000:]
    lines = _rank_lines(result.stderr)
    assert any("stopped by SIGTERM during the build: nothing was trained or saved" in line for line in lines)
    assert all(line.count("titan: ") == 1 for line in lines), lines
    assert _steps_saved(tmp_path) == []


CTRL_C_ON_RANK_0 = """

class _Slow:
    '''Rank 0 is slower to end than rank 1, and torchrun's SIGTERM (sent once rank 1 exits)
    reaches it while it is still unwinding.'''

    @titan_core.hookimpl
    def titan_callbacks(self):
        return [titan_core.Callback("slow", lambda trainer: self)]

    def after_optimizer_step(self, step):
        if step == 3 and os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGINT)

    def on_failure(self, step, exc):
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)


import titan_core  # noqa: E402
from titan_core._registry import get_registry  # noqa: E402

get_registry().register(_Slow(), "slow")
"""


@pytest.mark.slow
def test_ctrl_c_on_one_rank_ends_every_rank_with_its_line(tmp_path: Path) -> None:
    """Ctrl-C on rank 0: the ranks agreed to stop after step 4, rank 1 printed its line and exited,
    and torchrun's SIGTERM ended rank 0 before its own line (exit -15): SIGTERM was held back
    after a failure until its line was out, but not after a Ctrl-C."""
    (tmp_path / "stop_recipe.py").write_text(STOP_RECIPE + CTRL_C_ON_RANK_0)
    result = subprocess.run(
        torchrun_command(2, *RUN[1:]),
        cwd=tmp_path,
        env=child_env(tmp_path, STEPS="6"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "exitcode  : -15" not in result.stderr, result.stderr[-4000:]
    lines = _rank_lines(result.stderr)
    expected = (
        "titan: interrupted (Ctrl-C) after step 4, which is saved: the same command resumes from step 5"
    )
    assert sum(expected in line for line in lines) == 2, result.stderr[-4000:]
