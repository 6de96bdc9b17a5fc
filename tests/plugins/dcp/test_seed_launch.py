"""A seed checkpoint launched on several processes: one clear error before anything starts.

``checkpoint.create_seed_checkpoint`` writes the initial weights from one process; the dcp
checkpointer's ``launch_check`` says so (``Checkpointer.launch_check``, run by
``titan_core.run.check_launch``). ``NGPU=2 ./run_train.sh`` stops in its launch check, before
torchrun starts: one ``titan: error:`` line, exit 2. Launched under torchrun directly with two
ranks (gloo, CPU), each rank refuses before its process group starts, with the same line, writes
nothing, and no titan traceback reaches the launcher's output (torchrun's own summary of the
failed children stays; it may stop a slower rank before that rank prints).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, child_env, run_titan_train, write_recipe_module
from titan_core.cli import main
from titan_core.errors import UsageError
from titan_plugins_dcp.launch import check_seed_launch

#: The tiny recipe, as a seed run: no training step is needed to reach the refusal.
SEED = {"checkpoint.create_seed_checkpoint": True, "training.steps": 1}

#: The whole line a rank prints for a seed run of world size 2 with the default degrees.
EXPECTED = (
    "titan: error: checkpoint.create_seed_checkpoint: a seed checkpoint is written by one process, "
    "got world size 2; run the recipe as one process: NGPU=1 ./run_train.sh, or torchrun "
    "--nproc_per_node 1, or titan run without torchrun. Runs with other layouts then load the seed "
    "checkpoint through DCP resharding"
)


def error_lines(text: str) -> list[str]:
    """The ``titan: error:`` lines of ``text``, without torchrun's ``[rankN]:`` prefixes. Ranks
    share one stderr pipe and a line's newline is written apart from it, so two ranks' lines can
    run together: each ``titan: error:`` starts a line of its own."""
    found = []
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]:", "", line)
        found += re.findall(r"titan: error: .*?(?=titan: error: |$)", line)
    return found


def child_exit_codes(stderr: str) -> list[int]:
    """The exit code of every child in torchrun's failure summary."""
    return [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]


def assert_no_titan_traceback(text: str) -> None:
    """No frame of titan's code in the output: torchrun's own ChildFailedError report is allowed."""
    frames = re.findall(r'File "[^"]*(?:titan_core|titan_plugins)[^"]*"', text)
    assert not frames, text[-6000:]


def test_the_message_names_one_process_and_what_to_run() -> None:
    class Degrees:
        dp_replicate, dp_shard, tp, cp, pp, ep = 1, -1, 1, 1, 1, 1

    with pytest.raises(UsageError) as info:
        check_seed_launch(Degrees(), 2)
    assert f"titan: error: {info.value}" == EXPECTED
    check_seed_launch(Degrees(), 1)  # one process, every degree 1 (dp_shard -1 fills one rank)


def test_the_degrees_to_change_are_named_with_the_world_size() -> None:
    class Degrees:
        dp_replicate, dp_shard, tp, cp, pp, ep = 1, 2, 1, 1, 2, 1

    with pytest.raises(UsageError) as info:
        check_seed_launch(Degrees(), 4)
    text = str(info.value)
    assert "got parallelism.dp_shard=2, parallelism.pp=2, world size 4;" in text
    assert "set parallelism.dp_shard and parallelism.pp to 1 in the recipe and run it as one process" in text
    assert "NGPU=1 ./run_train.sh" in text and "--nproc_per_node 1" in text


def test_the_check_imports_no_torch() -> None:
    """run_train.sh's launch check (one cheap process before torchrun) can call it."""
    code = "import sys, titan_plugins_dcp.launch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env()).returncode == 0


def test_refused_before_the_process_group_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of two, in this process: refused before init_process_group could wait for rank 1."""
    import torch.distributed as dist

    calls: list[object] = []

    def no_process_group(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise RuntimeError("init_process_group was called")

    monkeypatch.setattr(dist, "init_process_group", no_process_group)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    module = write_recipe_module(tmp_path, SEED, name="seed_launch_recipes")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "--module", module, "--config", "layout"]) == 2
    assert not calls
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_processes_under_torchrun_fail_with_one_line_each(tmp_path: Path) -> None:
    result = run_titan_train(tmp_path, 2, SEED, timeout=240)
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode != 0, output[-4000:]
    lines = error_lines(result.stderr)
    # A rank exits 2 (a usage error); torchrun may stop a slower peer with SIGTERM first, which
    # that peer says (exit 143), naming the other rank's error as the cause (-15: it had not
    # started titan yet).
    stopped = "titan: error: stopped by SIGTERM before the run was built: "
    assert EXPECTED in lines and all(line == EXPECTED or line.startswith(stopped) for line in lines), output
    assert all("torchrun's SIGTERM ending the rest" in line for line in lines if line.startswith(stopped))
    codes = child_exit_codes(result.stderr)
    assert codes and set(codes) <= {2, 143, -15} and 2 in codes, result.stderr[-4000:]
    assert_no_titan_traceback(output)
    assert not (tmp_path / "out").exists()  # nothing written: no dump folder, no checkpoint


@pytest.mark.slow
def test_run_train_sh_with_two_processes_shows_the_one_line(tmp_path: Path) -> None:
    module = write_recipe_module(tmp_path, SEED)
    env = child_env(tmp_path, MODULE=module, CONFIG="layout", NGPU="2")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    result = subprocess.run(
        [str(REPO / "run_train.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 2, output[-4000:]
    assert error_lines(result.stderr) == [EXPECTED], output[-4000:]
    assert "[rank" not in result.stderr and "ChildFailedError" not in output  # torchrun never started
    assert_no_titan_traceback(output)
    assert not (tmp_path / "out").exists()
