"""``run_train.sh``: the launcher's environment contract (NGPU, LOG_RANK, MODULE, CONFIG, COMM_BACKEND)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel_harness import REPO, child_env, log_records, write_recipe_module

SCRIPT = REPO / "run_train.sh"


def launch(folder: Path, overrides: dict, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``./run_train.sh`` with the recipe ``overrides`` (over the tiny config) as MODULE/CONFIG."""
    module = write_recipe_module(folder, {"training.steps": 2, **overrides})
    full_env = child_env(folder, **{"MODULE": module, "CONFIG": "layout", **env})
    # This interpreter's python and torchrun come first, as in an activated environment.
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    return subprocess.run(
        [str(SCRIPT)], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.slow
def test_log_rank_shows_only_that_ranks_output(tmp_path: Path) -> None:
    layout = {"parallelism.dp_shard": 2, "training.local_batch_size": 2}
    result = launch(tmp_path, layout, NGPU="2", LOG_RANK="1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = log_records(result.stdout)
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == 2
    assert {r.get("rank") for r in records} == {1}
    assert "[rank1]:" in result.stdout and "[rank0]:" not in result.stdout


def one_error_line(result: subprocess.CompletedProcess, prefix: str = "titan: error: ") -> str:
    """The launch stopped before torchrun with exit 2 and one error line; returns that line."""
    assert result.returncode == 2, (
        f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]  # no traceback, no torchrun report
    assert lines[0].startswith(prefix), lines[0]
    assert not [r for r in log_records(result.stdout) if r.get("event") == "built"]
    return lines[0]


def test_bad_layout_stops_with_the_degree_error_before_torchrun(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 3}, NGPU="4", LOG_RANK="0,1,2,3")
    line = one_error_line(result)
    assert "dp_shard=3" in line and "world size 4" in line and "Fix:" in line


@pytest.mark.parametrize("ngpu", ["0", "-1", "two", "1.5", "2 ", "01"])
def test_ngpu_must_be_a_positive_integer(tmp_path: Path, ngpu: str) -> None:
    line = one_error_line(launch(tmp_path, {}, NGPU=ngpu), "run_train.sh: error: ")
    assert f"NGPU='{ngpu}' is not a positive integer" in line


@pytest.mark.parametrize(
    ("log_rank", "expected"),
    [
        ("2", "names local rank 2, but NGPU=2 starts ranks 0..1"),
        ("0,3", "names local rank 3, but NGPU=2"),
        ("0,,1", "is not a comma-separated list of local ranks"),
        ("rank0", "is not a comma-separated list of local ranks"),
        ("-1", "is not a comma-separated list of local ranks"),
        ("99999999999999999999", "names local rank 99999999999999999999"),
    ],
)
def test_log_rank_must_name_existing_local_ranks(tmp_path: Path, log_rank: str, expected: str) -> None:
    line = one_error_line(launch(tmp_path, {}, NGPU="2", LOG_RANK=log_rank), "run_train.sh: error: ")
    assert expected in line


def test_an_ngpu_too_large_is_not_called_a_non_integer(tmp_path: Path) -> None:
    line = one_error_line(launch(tmp_path, {}, NGPU="1000000", COMM_BACKEND="fake"), "run_train.sh: error: ")
    assert "NGPU=1000000 is too large" in line and "not a positive integer" not in line


@pytest.mark.parametrize("log_rank", ["1", "2,3"])
def test_log_rank_without_rank_0_under_pure_fake_is_refused(tmp_path: Path, log_rank: str) -> None:
    """Pure fake mode is one process (local rank 0) standing for logical rank FAKE_PP_RANK*NGPU/pp:
    LOG_RANK=1 neither shows another rank nor picks the represented one, and was ignored without a
    word (LOG_RANK=5 was refused as if NGPU=4 started four processes)."""
    result = launch(tmp_path, {"parallelism.dp_shard": 4}, NGPU="4", COMM_BACKEND="fake", LOG_RANK=log_rank)
    line = one_error_line(result, "run_train.sh: error: ")
    assert f"LOG_RANK={log_rank}" in line and "one process" in line and "FAKE_PP_RANK" in line
    assert "starts ranks" not in line


@pytest.mark.slow
def test_log_rank_naming_rank_0_under_pure_fake_runs(tmp_path: Path) -> None:
    """A LOG_RANK kept from real runs (0,1 or 0,5 beyond NGPU) still shows the one process."""
    result = launch(tmp_path, {"parallelism.dp_shard": 4}, NGPU="4", COMM_BACKEND="fake", LOG_RANK="0,5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in log_records(result.stdout) if r.get("event") == "step"] == [1]


def test_module_without_config_is_an_error(tmp_path: Path) -> None:
    env = child_env(tmp_path, MODULE="my_recipes", NGPU="1")
    env.pop("CONFIG", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run([str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    line = one_error_line(result, "run_train.sh: error: ")
    assert "MODULE=my_recipes is set but CONFIG is not" in line


@pytest.mark.parametrize("flag", [["--config", "layout"], ["--config=layout"], ["--recipe", "layout"]])
def test_module_with_the_recipe_given_as_a_flag_runs_it(tmp_path: Path, flag: list[str]) -> None:
    """``MODULE=m ./run_train.sh --config r`` names the recipe on the command line (the flag
    the usage text and titan take): it was refused as 'MODULE is set but CONFIG is not'."""
    module = write_recipe_module(tmp_path, {"training.steps": 2, "training.lr": 0.000125})
    env = child_env(tmp_path, MODULE=module, NGPU="1")
    env.pop("CONFIG", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), *flag, "--print-config", "json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = "\n".join(line.removeprefix("[rank0]:") for line in result.stdout.splitlines())
    assert json.loads(printed[printed.index("{") :])["training"]["lr"] == 0.000125  # the module's recipe


def test_unknown_recipe_and_bad_config_stop_before_torchrun(tmp_path: Path) -> None:
    unknown = launch(tmp_path / "a", {}, NGPU="2", CONFIG="no_such_recipe")
    assert "unknown recipe 'no_such_recipe'" in one_error_line(unknown)
    invalid = launch(tmp_path / "b", {"training.lr": -1.0}, NGPU="2")
    assert "training.lr" in one_error_line(invalid)


@pytest.mark.parametrize(
    ("ngpu", "env", "expected"),
    [
        ("4", {}, "real_pp_fake_spmd needs one process per pipeline rank, but 4 processes are launched"),
        ("2", {"FAKE_PP_RANK": "1"}, "FAKE_PP_RANK='1' is set, but real_pp_fake_spmd takes the pipeline"),
    ],
)
def test_hybrid_launch_contract_errors_exit_2(tmp_path: Path, ngpu: str, env: dict, expected: str) -> None:
    module = write_recipe_module(tmp_path, {"training.steps": 2, "parallelism.pp": 2})
    full_env = child_env(tmp_path, MODULE=module, CONFIG="layout", NGPU=ngpu, **env)
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), "--comm-backend", "real_pp_fake_spmd"],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert expected in one_error_line(result)


def test_pure_fake_under_torchrun_is_a_launch_contract_error(tmp_path: Path) -> None:
    result = launch(tmp_path, {"comm.backend": "fake"}, NGPU="2")
    line = one_error_line(result)
    assert "comm.backend = 'fake' runs as ONE process" in line and "but 2 processes are launched" in line


def test_comm_backend_fake_and_another_backend_flag_disagree(tmp_path: Path) -> None:
    module = write_recipe_module(tmp_path, {"training.steps": 2})
    env = child_env(tmp_path, MODULE=module, CONFIG="layout", NGPU="2", COMM_BACKEND="fake")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), "--comm-backend=real_pp_fake_spmd"], cwd=REPO, env=env, capture_output=True, text=True
    )
    line = one_error_line(result, "run_train.sh: error: ")
    assert "COMM_BACKEND=fake and --comm-backend real_pp_fake_spmd ask for two different backends" in line


def test_fake_backend_bad_layout_exits_2(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 3}, NGPU="4", COMM_BACKEND="fake")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "do not fit the world size 4" in result.stderr
    assert not [r for r in log_records(result.stdout) if r.get("event") == "built"]


@pytest.mark.slow
def test_fake_backend_runs_one_process_for_one_step(tmp_path: Path) -> None:
    result = launch(tmp_path, {"parallelism.dp_shard": 2}, NGPU="2", COMM_BACKEND="fake")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in log_records(result.stdout) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1]  # the recipe asks for 2; pure fake stops after 1


@pytest.mark.slow
def test_pure_fake_keeps_a_step_limit_given_in_the_environment(tmp_path: Path) -> None:
    """``TITAN_DEFAULT_MAX_STEPS`` set by the user is the pure fake run's limit (as under
    ``--all-pp-ranks``): the launcher's one step is only the default. It was replaced by 1
    without a word, so a recipe snapshotting every 2 steps wrote no snapshot."""
    result = launch(
        tmp_path, {"parallelism.dp_shard": 2}, NGPU="2", COMM_BACKEND="fake", TITAN_DEFAULT_MAX_STEPS="2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in log_records(result.stdout) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1, 2]


def launch_args(folder: Path, overrides: dict, *args: str, **env: str | None) -> subprocess.CompletedProcess:
    """``./run_train.sh ARGS`` with the tiny recipe; an ``env`` value of ``None`` unsets it."""
    module = write_recipe_module(folder, {"training.steps": 2, **overrides})
    full_env = child_env(folder, MODULE=module, CONFIG="layout")
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run(
        [str(SCRIPT), *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [((), {"COMM_BACKEND": "fake"}), (("--comm-backend", "fake"), {}), (("--comm-backend=fake",), {})],
)
def test_pure_fake_without_ngpu_is_refused(tmp_path: Path, args: tuple[str, ...], env: dict) -> None:
    """NGPU is the logical world size there: the launcher's default (visible GPUs, or 1) would
    size another job than the recipe's without a word."""
    result = launch_args(tmp_path, {"parallelism.dp_shard": 2}, *args, NGPU=None, **env)
    line = one_error_line(result, "run_train.sh: error: ")
    assert "the fake comm backend needs NGPU, the logical world size" in line


@pytest.mark.slow
def test_comm_backend_flag_fake_runs_as_comm_backend_fake_does(tmp_path: Path) -> None:
    """``--comm-backend fake`` through the launcher is the pure fake mode: one plain process
    (not torchrun) for one step, as with COMM_BACKEND=fake."""
    result = launch_args(tmp_path, {"parallelism.dp_shard": 2}, "--comm-backend", "fake", NGPU="2")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in log_records(result.stdout) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1]
    assert "torchrun" not in result.stderr and "ChildFailedError" not in result.stderr


def test_other_comm_backend_values_point_to_the_hybrid_flag(tmp_path: Path) -> None:
    result = launch(tmp_path, {}, COMM_BACKEND="real_pp_fake_spmd")
    assert result.returncode == 2
    assert "--comm-backend real_pp_fake_spmd' under torchrun" in result.stderr
    assert result.stdout == ""


def _docs_recipe_module(name: str) -> str:
    """The ``python`` block of docs/parallelism.md that defines recipe ``name``."""
    text = (REPO / "docs" / "parallelism.md").read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if f"def {name}(" in b]
    return block


@pytest.mark.parametrize(
    ("recipe", "section", "expected"),
    [
        ("llama3_debug_fsdp_tp", "parallelism", {"dp_shard": 2, "tp": 2}),
        (
            "llama3_debug_memory_budget",
            "activation_checkpoint",
            {"mode": "memory_budget", "memory_budget": 0.7},
        ),
    ],
)
def test_docs_recipe_resolves_through_the_launcher(
    tmp_path: Path, recipe: str, section: str, expected: dict[str, object]
) -> None:
    """The recipe modules of docs/parallelism.md, launched as the docs show (config printed only)."""
    (tmp_path / "my_recipes.py").write_text(_docs_recipe_module(recipe))
    env = child_env(tmp_path, NGPU="1", MODULE="my_recipes", CONFIG=recipe)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), "--print-config", "json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # torchrun's --tee prefixes each line of rank 0 with "[rank0]:".
    lines = [line.removeprefix("[rank0]:") for line in result.stdout.splitlines()]
    printed = "\n".join(lines)
    config = json.loads(printed[printed.index("{") :])
    assert {k: config[section][k] for k in expected} == expected


def test_a_model_argument_error_stops_before_torchrun(tmp_path: Path) -> None:
    """The model's own check (tied embeddings cannot be split over pipeline stages) runs in the
    launcher's check, not first in the workers (whose error LOG_RANK may hide)."""
    layout = {
        "parallelism.pp": 2,
        "parallelism.dp_shard": 1,
        "model.overrides": {"dim": 64, "n_layers": 2, "n_heads": 4, "tie_embeddings": True},
    }
    line = one_error_line(launch(tmp_path, layout, NGPU="2"))
    assert "tie_embeddings" in line and "pp = 1" in line


def test_a_layout_a_strategy_refuses_stops_before_torchrun(tmp_path: Path) -> None:
    """pp_microbatches not dividing the local batch: the pipeline strategy refused it in each
    worker (torchrun's ChildFailedError report, exit 1; once rank 0 was ended by torchrun before
    it printed the reason). The launcher's check runs the strategy's check (Strategy.check)."""
    layout = {
        "training.local_batch_size": 4,
        "parallelism.dp_shard": 1,
        "parallelism.pp": 2,
        "parallelism.pp_microbatches": 3,
    }
    result = launch(tmp_path, layout, NGPU="2")
    line = one_error_line(result)
    assert "parallelism.pp_microbatches=3 must divide training.local_batch_size=4" in line
    assert "[rank" not in result.stdout + result.stderr  # torchrun started no worker
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--training.steps", "5"], {}, "--training.steps: titan takes no config field overrides"),
        ([], {"TITAN_LOG_FORMAT": "xml"}, "TITAN_LOG_FORMAT='xml': expected one of json, console"),
    ],
)
def test_what_titan_refuses_on_its_command_line_stops_before_torchrun(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    """A torchtitan-style override got argparse's bare "unrecognized arguments"; an unknown log
    format was refused by every worker after torchrun started them (ChildFailedError, exit 1)."""
    module = write_recipe_module(tmp_path, {"training.steps": 2})
    full_env = child_env(tmp_path, **{"MODULE": module, "CONFIG": "layout", "NGPU": "2", **env})
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT), *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300
    )
    assert expected in one_error_line(result)
    assert "[rank" not in result.stdout + result.stderr  # torchrun started no worker


def test_a_core_field_whose_plugin_is_disabled_stops_before_torchrun(tmp_path: Path) -> None:
    """debug.memory_report with the memory plugin disabled: each worker refused it, after torchrun
    started them (torchrun's failure report, exit 1); the launcher's check refuses it first."""
    result = launch(tmp_path, {"debug.memory_report": True}, NGPU="2", TITAN_DISABLE_PLUGINS="memory")
    line = one_error_line(result)
    assert "debug.memory_report = True: no loaded plugin implements it" in line
    assert "leave debug.memory_report at its default" in line


def test_a_dump_folder_holding_another_run_stops_before_torchrun(tmp_path: Path) -> None:
    first = launch(tmp_path, {})
    assert first.returncode == 0, first.stderr[-3000:]
    line = one_error_line(launch(tmp_path, {"training.lr": 1e-3}))
    assert "holds the outputs of another run" in line and "training.lr: 0.003 -> 0.001" in line


def test_a_recipe_module_that_prints_a_brace_line_still_launches(tmp_path: Path) -> None:
    module = write_recipe_module(tmp_path, {"training.steps": 1})
    path = tmp_path / f"{module}.py"
    path.write_text(
        'import json\nprint(json.dumps({"training": {"steps": 99}}))\nprint("{not json")\n' + path.read_text()
    )
    full_env = child_env(tmp_path, MODULE=module, CONFIG="layout")
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
    result = subprocess.run(
        [str(SCRIPT)], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len([r for r in log_records(result.stdout) if r.get("event") == "step"]) == 1


def test_all_pp_ranks_without_the_fake_backend_stops_before_torchrun(tmp_path: Path) -> None:
    """``--all-pp-ranks`` is one process running the pure fake mode per coordinate: without
    ``COMM_BACKEND=fake`` the launcher started NGPU torchrun workers, each refusing it (torchrun's
    ChildFailedError traceback, exit 1)."""
    layout = {"parallelism.pp": 2, "training.local_batch_size": 2}
    result = launch_args(tmp_path, layout, "--all-pp-ranks", NGPU="2")
    line = one_error_line(result)
    assert "--all-pp-ranks runs the pure fake backend" in line and "--comm-backend fake" in line
    assert "[rank" not in result.stdout + result.stderr  # torchrun started no worker


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("CONFIG", "unset it to run llama3_debugmodel"),
        ("MODULE", "unset it to look the recipe up among the installed plugins'"),
        ("NGPU", "unset it for one process per visible GPU"),
        ("LOG_RANK", "unset it to show local rank 0"),
        ("COMM_BACKEND", "unset it to launch torchrun"),
        ("FAKE_PP_RANK", "unset it"),
    ],
)
@pytest.mark.parametrize("blank", ["", " "])
def test_a_contract_variable_set_empty_is_one_error(tmp_path: Path, name: str, fix: str, blank: str) -> None:
    """``CONFIG= ./run_train.sh`` (a variable of the script's contract set but empty, as
    ``CONFIG=$RECIPE`` with RECIPE unset gives) silently ran the default recipe, NGPU/LOG_RANK took
    their defaults, COMM_BACKEND launched torchrun: an empty value is a mistake, named once."""
    env: dict[str, str | None] = {"MODULE": None, "CONFIG": None, name: blank}
    result = launch_args(tmp_path, {}, "--print-config", "json", **env)
    line = one_error_line(result, "run_train.sh: error: ")
    assert f"{name} is set but empty" in line and fix in line
    assert result.stdout == ""  # nothing printed, nothing run


def test_module_in_the_environment_and_another_module_flag_are_refused(tmp_path: Path) -> None:
    """``MODULE=a ./run_train.sh --module b`` took b (argparse's last value) without a word."""
    result = launch_args(tmp_path, {}, "--module", "other_recipes", "--print-config", NGPU="1")
    line = one_error_line(result, "run_train.sh: error: ")
    assert "MODULE=layout_recipes" in line and "--module other_recipes" in line


@pytest.mark.parametrize("flag", [["--config", "other"], ["--recipe=other"]])
def test_config_in_the_environment_and_another_recipe_flag_are_refused(
    tmp_path: Path, flag: list[str]
) -> None:
    """``CONFIG=a ./run_train.sh --config b`` took b without a word."""
    result = launch_args(tmp_path, {}, *flag, "--print-config", NGPU="1")
    line = one_error_line(result, "run_train.sh: error: ")
    assert "CONFIG=layout" in line and "other" in line


def test_the_same_recipe_in_the_environment_and_as_a_flag_runs(tmp_path: Path) -> None:
    result = launch_args(
        tmp_path,
        {"training.lr": 0.000125},
        "--module",
        "layout_recipes",
        "--config",
        "layout",
        "--print-config",
        "json",
        NGPU="1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = "\n".join(line.removeprefix("[rank0]:") for line in result.stdout.splitlines())
    assert json.loads(printed[printed.index("{") :])["training"]["lr"] == 0.000125
