"""The ``titan`` command as users call it: listing, printing configs, errors and exit codes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import run_titan, step_rows, titan_env

TITAN = Path(sys.executable).parent / "titan"


def test_plugins_list_is_fast_and_does_not_import_torch() -> None:
    # "Fast" is measured in bench/; here: it answers and imports no torch (checked below).
    result = subprocess.run([str(TITAN), "plugins", "list"], capture_output=True, text=True, env=titan_env())
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert "0.1.0" in lines["core"] and "titan-core" in lines["core"] and "datasets" in lines["core"]
    assert "titan-plugins-llama3" in lines["llama3"]
    assert "models, recipes" in lines["llama3"] and "llama3_debugmodel" in lines["llama3"]
    probe = (
        "import sys; from titan_core.cli import main; main(['plugins', 'list']); "
        "main(['recipes', 'list']); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, env=titan_env())


def test_plugins_list_names_a_plugin_whose_import_is_slow(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin that took 2 s to import without torch (a network call, a big table at module
    level) showed `2001ms` in its row and nothing else, while every titan command paid for it."""
    from titan_core import _registry
    from titan_core._registry import PluginInfo, Registry
    from titan_core.cli import main

    registry = Registry().load_entry_points()
    registry.plugins["sluggish"] = PluginInfo(
        "sluggish", "titan-sluggish", "1.0", "sluggish", import_seconds=2.0
    )
    monkeypatch.setattr(_registry, "_default", registry)
    assert main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    assert "sluggish: its import took 2.00s, which every titan command pays" in out, out
    assert "hook bodies" in out
    assert out.count("its import took") == 1  # titan's own plugins import at once


def test_help_lists_operational_options_without_torch() -> None:
    probe = (
        "import sys\nfrom titan_core.cli import main\n"
        "try:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    for option in ("--recipe", "--config", "--module", "--print-config", "--comm-backend"):
        assert option in result.stdout
    top = subprocess.run([str(TITAN), "--help"], capture_output=True, text=True, check=True)
    assert "run" in top.stdout and "plugins" in top.stdout and "--disable-plugin" in top.stdout


def test_plugins_list_json() -> None:
    result = run_titan("plugins", "list", "--json")
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["llama3"]["status"] == "loaded"
    assert plugins["llama3"]["provides"]["models"] == ["llama3"]
    assert plugins["llama3"]["hooks"] == ["titan_models", "titan_recipes"]


def test_print_config_of_8b_is_fast_and_builds_nothing() -> None:
    result = subprocess.run(
        [str(TITAN), "run", "--recipe", "llama3_8b", "--print-config"],
        capture_output=True,
        text=True,
        env=titan_env(),
    )
    assert result.returncode == 0, result.stderr
    config = tomllib.loads(result.stdout)
    assert (config["model"]["name"], config["model"]["flavor"]) == ("llama3", "8B")
    assert config["recipe"] == "llama3_8b"
    # python -m titan_core.train accepts the same options (--config alias, json output).
    alias = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_core.train",
            "--config",
            "llama3_8b",
            "--print-config",
            "json",
            "--comm-backend",
            "fake",
        ],
        capture_output=True,
        text=True,
        env=titan_env(),
    )
    assert alias.returncode == 0, alias.stderr
    data = json.loads(alias.stdout)
    assert data["model"]["flavor"] == "8B" and data["comm"]["backend"] == "fake"
    probe = (
        "import sys; from titan_core.cli import main\n"
        "main(['run', '--recipe', 'llama3_405b', '--print-config'])\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)


def test_print_config_heads_its_output_with_the_models_parameter_counts() -> None:
    """``--print-config`` named the flavor but not its size: the total (and, for a model that
    routes tokens, active) count ``titan models list`` gives, here with the config's overrides;
    a TOML comment, so the output still loads, and beside JSON on stderr."""
    toml_run = run_titan("run", "--recipe", "deepseek_v3_671b", "--print-config")
    assert toml_run.returncode == 0, toml_run.stderr
    first = toml_run.stdout.splitlines()[0]
    assert first == "# model moe/deepseek_v3_671b: 671.03B parameters, 37.55B active per token"
    assert tomllib.loads(toml_run.stdout)["model"]["flavor"] == "deepseek_v3_671b"
    json_run = run_titan("run", "--recipe", "llama3_8b", "--print-config", "json")
    assert json.loads(json_run.stdout)["model"]["flavor"] == "8B"
    assert json_run.stderr == "titan: model llama3/8B: 8.03B parameters\n"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"n_heads": 5}, "dim=256 must be a multiple of n_heads=5"),
        ({"max_seq_len": 16}, "training.seq_len=256 exceeds the model's max_seq_len=16"),
    ],
)
def test_print_config_refuses_what_the_model_refuses_as_the_run_would(
    tmp_path: Path, overrides: dict, expected: str
) -> None:
    """--print-config exited 0 for arguments the run then refused (the model's own checks need
    no launch: they run under no parallelism, the layout's are the run's)."""
    (tmp_path / "ov.py").write_text(
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n\n"
        f"def ov():\n    c = llama3_debugmodel()\n    c.model.overrides = {overrides!r}\n    return c\n"
    )
    for extra in (("--print-config",), ()):
        result = run_titan(
            "run", "--module", "ov", "--recipe", "ov", *extra, cwd=tmp_path, TITAN_DEFAULT_MAX_STEPS="1"
        )
        assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]


def write_module(root: Path, body: str, name: str = "my_project") -> None:
    package = root / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "recipes.py").write_text(body)


def test_invalid_recipe_value_exits_2_with_path(tmp_path: Path) -> None:
    write_module(
        tmp_path,
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n"
        "def bad():\n    c = llama3_debugmodel()\n    c.training.steps = 'four'\n"
        "    c.parallelism.tp = 0\n    return c\n",
    )
    result = run_titan(
        "run", "--module", "my_project.recipes", "--recipe", "bad", "--print-config", cwd=tmp_path
    )
    assert result.returncode == 2
    # Checked where the recipe sets it: the first bad value stops the recipe, on its own line.
    assert "training.steps: expected int, got str 'four'" in result.stderr
    assert "recipes.py:5" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [("--module", "outputs/run/config.toml", "--recipe", "x"), ("--config", "config.toml")],
)
def test_a_config_file_given_for_a_recipe_says_titan_runs_recipes(args: tuple[str, ...]) -> None:
    result = run_titan("run", *args)
    assert (
        result.returncode == 2
        and "titan runs recipes (Python functions returning the config)" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_unknown_recipe_lists_known_ones() -> None:
    result = run_titan("run", "--recipe", "llama3_9b")
    assert result.returncode == 2
    assert "unknown recipe 'llama3_9b'" in result.stderr
    for name in ("llama3_debugmodel", "llama3_8b", "llama3_70b", "llama3_405b"):
        assert name in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--module", "no_such_module_xyz", "--recipe", "x"], "no module named 'no_such_module_xyz'"),
        (["--module", "my_project.recipes", "--recipe", "nope"], "recipes defined there: good, raises"),
        (
            ["--module", "my_project.recipes", "--recipe", "raises"],
            "training.stepz: no such field; training has steps,",
        ),
        (["--recipe", "llama3_debugmodel", "--comm-backend", "carrier_pigeon"], "unknown comm.backend"),
        # A file path where a module name belongs (a TypeError about packages for "./x.py").
        (["--module", "my_project/recipes.py", "--recipe", "good"], "give a module name, not a file path"),
        (["--module", "./recipes.py", "--recipe", "good"], "--module recipes (with '.' on PYTHONPATH"),
        (["--module", "my_project.broken", "--recipe", "good"], "SyntaxError at "),
        # Functions a module imports are recipes too: the list says so.
        (
            ["--module", "my_project.recipes", "--recipe", "nope"],
            "functions it imports, recipes too: llama3_debugmodel",
        ),
        # torchtitan-style field overrides: there are none, the recipe holds the settings.
        (
            ["--recipe", "llama3_debugmodel", "--training.lr", "3e-4"],
            "--training.lr: titan takes no config field",
        ),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], expected: str) -> None:
    write_module(
        tmp_path,
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n"
        "def good():\n    return llama3_debugmodel()\n\n"
        "def raises():\n    c = llama3_debugmodel()\n    c.training.stepz = 3\n    return c\n",
    )
    (tmp_path / "my_project" / "broken.py").write_text("def good(:\n    pass\n")
    result = run_titan("run", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3


def test_unknown_model_flavor_is_a_usage_error(tmp_path: Path) -> None:
    write_module(
        tmp_path,
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n"
        "def odd():\n    c = llama3_debugmodel()\n    c.model.flavor = '7B'\n    return c\n",
    )
    result = run_titan("run", "--module", "my_project.recipes", "--recipe", "odd", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "model.flavor: model 'llama3' has no flavor '7B'; known flavors: 405B, 70B, 8B, debugmodel"
        in result.stderr
    )


def test_disable_plugin_keeps_it_from_import() -> None:
    result = run_titan("--disable-plugin", "llama3", "plugins", "list", "--json")
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["llama3"]["status"] == "disabled"
    assert plugins["llama3"]["hooks"] == []
    result = run_titan("run", "--recipe", "llama3_debugmodel", TITAN_DISABLE_PLUGINS="llama3")
    assert result.returncode == 2
    assert "disabled plugins, not searched: llama3" in result.stderr


def test_recipes_list() -> None:
    result = run_titan("recipes", "list", "--json")
    recipes = {r["name"]: r for r in json.loads(result.stdout)}
    assert recipes["llama3_8b"]["source"] == "llama3"
    assert "8B" in recipes["llama3_8b"]["description"]


@pytest.mark.slow
def test_user_recipe_module_from_the_issue(tmp_path: Path) -> None:
    """The foundation issue's user module, unchanged, trains for 4 steps."""
    write_module(
        tmp_path,
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n"
        "def my_debug_recipe():\n"
        "    config = llama3_debugmodel()\n"
        "    config.training.steps = 4\n"
        "    config.parallelism.dp_shard = 1\n"
        "    return config\n",
    )
    result = run_titan(
        "run",
        "--module",
        "my_project.recipes",
        "--recipe",
        "my_debug_recipe",
        "--dump-folder",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = step_rows(result.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rank"] == 0 for r in rows)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ("{'layers': 2}", "model.overrides: llama3 arguments have no field 'layers'; fields: "),
        ("{'n_layers': '2'}", "model.overrides: llama3 argument 'n_layers' expects int, got '2'"),
        ("{'n_layers': [2]}", "model.overrides.n_layers: expected int or float or bool or str, got list"),
    ],
)
def test_bad_model_overrides(tmp_path: Path, overrides: str, expected: str) -> None:
    write_module(
        tmp_path,
        "from titan_plugins_llama3.recipes import llama3_debugmodel\n\n"
        f"def odd():\n    c = llama3_debugmodel()\n    c.model.overrides = {overrides}\n    return c\n",
    )
    result = run_titan("run", "--module", "my_project.recipes", "--recipe", "odd", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr


def test_models_list_reports_8b_size_without_torch() -> None:
    result = run_titan("models", "list", "--json")
    rows = {(r["model"], r["flavor"]): r for r in json.loads(result.stdout)}
    assert abs(rows[("llama3", "8B")]["params"] / 8.03e9 - 1) < 0.005
    assert rows[("llama3", "debugmodel")]["plugin"] == "llama3"
    assert "8.03B" in run_titan("models", "list").stdout


def test_an_empty_dump_folder_is_refused_not_ignored(tmp_path: Path) -> None:
    """``--dump-folder "$OUT"`` with OUT unset must not write into the recipe's folder unasked."""
    result = run_titan("run", "--recipe", "llama3_debugmodel", "--dump-folder", "", cwd=tmp_path)
    assert result.returncode == 2
    assert "--dump-folder: got an empty path" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_dump_folder_the_shell_did_not_expand_is_refused_not_made_in_the_current_folder(
    tmp_path: Path,
) -> None:
    """``--dump-folder=~/runs/a`` (bash expands no ``~`` after ``=``) wrote the run into
    ``./~/runs/a`` of the current folder, exit 0."""
    result = run_titan("run", "--recipe", "llama3_debugmodel", "--dump-folder=~/runs/a", cwd=tmp_path)
    assert result.returncode == 2
    assert "--dump-folder '~/runs/a': the shell did not expand '~'" in result.stderr
    assert "--dump-folder ~/runs/a (a space, no quotes)" in result.stderr
    assert not (tmp_path / "~").exists()


def test_a_recipe_that_calls_sys_exit_is_one_clear_error(tmp_path: Path) -> None:
    write_module(tmp_path, "import sys\n\ndef quits():\n    sys.exit(3)\n")
    result = run_titan(
        "run", "--module", "my_project.recipes", "--recipe", "quits", "--print-config", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "recipe 'quits' called sys.exit(3) instead of returning a config" in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["plugins", "list"],
            {"TITAN_LOG_FORMAT": "xml"},
            "TITAN_LOG_FORMAT='xml': expected one of json, console",
        ),
        (["--disable-plugin", "core", "plugins", "list"], {}, "plugin 'core' is titan's core"),
        (["recipes", "list"], {"TITAN_DISABLE_PLUGINS": "core"}, "cannot be disabled"),
        # A typo disabled nothing without a word (--disable-plugin of an unknown name is refused).
        (
            ["recipes", "list"],
            {"TITAN_DISABLE_PLUGINS": "memroy, profiler"},
            "TITAN_DISABLE_PLUGINS='memroy, profiler': no plugin named memroy; plugins: comm, core,",
        ),
        # torch raises its ValueError on `import torch`, deep inside the run or a strategy.
        (
            ["run", "--recipe", "llama3_debugmodel", "--print-config"],
            {"TORCH_DISTRIBUTED_DEBUG": "bogus"},
            "TORCH_DISTRIBUTED_DEBUG='bogus': torch accepts only OFF, INFO or DETAIL",
        ),
        (
            ["run", "--recipe", "llama3_debugmodel"],
            {"TORCH_DISTRIBUTED_DEBUG": ""},
            "TORCH_DISTRIBUTED_DEBUG=''",
        ),
    ],
)
def test_an_environment_or_option_titan_cannot_honour_is_refused(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    """An unknown log format was ignored without a word; disabling the core took titan's own
    commands away (argparse's "invalid choice: 'plugins'")."""
    result = run_titan(*args, **env)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and "invalid choice" not in result.stderr


@pytest.mark.parametrize("argv", [("--comm-b", "fake"), ("--print-conf",), ("--recip", "llama3_debugmodel")])
def test_abbreviated_options_are_refused(argv: tuple[str, ...]) -> None:
    """argparse took ``--comm-b fake`` for ``--comm-backend fake``, but run_train.sh (and any
    wrapper reading the arguments) sees no ``--comm-backend``: one spelling for every reader."""
    result = run_titan("run", "--recipe", "llama3_debugmodel", *argv, "--print-config")
    assert result.returncode == 2, result.stdout[-300:]
    assert f"unrecognized arguments: {argv[0]}" in result.stderr and "Traceback" not in result.stderr


def test_abbreviated_options_of_a_plugins_nested_subcommand_are_refused(tmp_path: Path) -> None:
    """Only the top parser and the command parsers refused them: ``titan memory compare A B --js``
    (a plugin's own subcommand, built by its ``configure``) still took ``--js`` for ``--json``."""
    from tests.conftest import plugin_module
    from titan_core import Command
    from titan_core._registry import Registry
    from titan_core.cli import build_parser

    def configure(parser: argparse.ArgumentParser) -> None:
        nested = parser.add_subparsers(dest="toy_command").add_parser("show")
        nested.add_argument("--verbose", action="store_true")

    registry = Registry()
    registry.register(plugin_module("toy", titan_commands=[Command("toy", "a toy", configure, print)]), "toy")
    parser = build_parser(registry)
    assert parser.parse_args(["toy", "show", "--verbose"]).verbose
    with pytest.raises(SystemExit):
        parser.parse_args(["toy", "show", "--verb"])
    result = run_titan("memory", "compare", "a.json", "b.json", "--js", cwd=tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --js" in result.stderr, result.stderr


def test_a_run_whose_stdout_reader_goes_away_trains_on_and_keeps_its_log(tmp_path: Path) -> None:
    """``titan run ... | head -3`` (or a ``tee`` that ended): the trainer stopped at its next log
    line with ``BrokenPipeError``, and titan, which ends ``titan models list | head`` quietly,
    exited 0, with nothing on stderr, after 1 step of 3 and no row in metrics.jsonl."""
    from tests.conftest import tiny_recipe_source

    (tmp_path / "pipe_recipes.py").write_text(
        tiny_recipe_source("tiny", 3, '    c.job.dump_folder = "out"\n')
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_core.cli", "run", "--module", "pipe_recipes", "--recipe", "tiny"],
        cwd=tmp_path,
        env=titan_env(TITAN_LOG_FORMAT="console"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()  # the reader takes one line, then goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "stdout was closed" in err and "train.log" in err and "Traceback" not in err
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    log = (tmp_path / "out" / "train.log").read_text()
    assert "step 3/3" in log and "run summary" in log and "training stopped" not in log


class _ClosedPipe:
    """A stream whose reader went away: every write raises ``BrokenPipeError``."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


def test_an_error_whose_stderr_reader_went_away_keeps_its_exit_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``titan run ... 2>&1 | head``: the error line could not be written, and the
    ``BrokenPipeError`` turned the failed command's exit status into 0."""
    from titan_core.cli import main

    monkeypatch.setattr(sys, "stderr", _ClosedPipe())
    assert main(["run", "--recipe", "no_such_recipe", "--print-config"]) == 2
