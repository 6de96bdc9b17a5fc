"""``titan recipes copy NAME FILE`` and ``titan recipes show NAME``."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from tests.conftest import run_titan
from titan_core.config import section


def printed_config(*args: str, cwd: Path) -> dict:
    result = run_titan("run", *args, "--print-config", "json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    config.pop("recipe")
    return config


def test_copy_writes_a_module_that_builds_the_same_config(tmp_path: Path) -> None:
    args = ("llama3_debugmodel", "my_recipes.py", "--function", "mine")
    result = run_titan("recipes", "copy", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "titan run --module my_recipes --recipe mine" in result.stdout
    source = (tmp_path / "my_recipes.py").read_text()
    assert "config.training.steps = 30" in source  # a field the recipe sets
    assert "# config.training.eps = 1e-08  (default)" in source  # and the others, in view
    copied = printed_config("--module", "my_recipes", "--recipe", "mine", cwd=tmp_path)
    assert copied == printed_config("--recipe", "llama3_debugmodel", cwd=tmp_path)


def test_copy_of_a_module_recipe_and_edits_take_effect(tmp_path: Path) -> None:
    (tmp_path / "base.py").write_text(
        "from titan_core.config import TrainerConfig\n\n\n"
        "def small():\n"
        "    c = TrainerConfig()\n"
        '    c.model.overrides = {"n_layers": 2}\n'
        "    c.training.lr = 1e-4\n"
        "    return c\n"
    )
    copy = run_titan("recipes", "copy", "small", "copied.py", "--module", "base", cwd=tmp_path)
    assert copy.returncode == 0, copy.stderr
    copied = printed_config("--module", "copied", "--recipe", "small", cwd=tmp_path)
    assert copied == printed_config("--module", "base", "--recipe", "small", cwd=tmp_path)
    assert copied["model"]["overrides"] == {"n_layers": 2}
    path = tmp_path / "copied.py"
    path.write_text(path.read_text().replace("config.training.lr = 0.0001", "config.training.lr = 0.002"))
    assert printed_config("--module", "copied", "--recipe", "small", cwd=tmp_path)["training"]["lr"] == 0.002


def test_copy_refuses_to_replace_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken.py").write_text("# mine\n")
    result = run_titan("recipes", "copy", "llama3_debugmodel", "taken.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "titan: error: FILE 'taken.py' exists" in result.stderr and "--force" in result.stderr
    assert (tmp_path / "taken.py").read_text() == "# mine\n"
    shadowing = run_titan("recipes", "copy", "llama3_debugmodel", "json.py", cwd=tmp_path)
    assert shadowing.returncode == 2 and "hide a standard-library module" in shadowing.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # The printed `titan run --module torch` would import this file instead of torch.
        (("torch.py",), "FILE 'torch.py': 'torch' would hide the installed module of that name"),
        (("class.py",), "FILE 'class.py': 'class' is a Python keyword"),
        (("mine.py", "--function", "class"), "--function 'class': not a Python function name"),
        # def TrainerConfig(): config = TrainerConfig() ... recursed forever.
        (("mine.py", "--function", "TrainerConfig"), "--function 'TrainerConfig': the module imports a name"),
    ],
)
def test_copy_refuses_a_module_or_function_name_that_cannot_run(
    tmp_path: Path, args: tuple[str, ...], expected: str
) -> None:
    result = run_titan("recipes", "copy", "llama3_debugmodel", *args, cwd=tmp_path)
    assert result.returncode == 2 and f"titan: error: {expected}" in result.stderr
    assert not list(tmp_path.glob("*.py"))


def test_show_names_plugin_distribution_function_file_and_docstring(tmp_path: Path) -> None:
    result = run_titan("recipes", "show", "llama3_debugmodel", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "plugin:" in out and "llama3" in out
    assert "distribution:  titan-plugins-llama3" in out
    assert "function:      titan_plugins_llama3.recipes:llama3_debugmodel" in out
    assert "titan_plugins_llama3/recipes.py:" in out
    assert "Llama 3 debug model" in out
    unknown = run_titan("recipes", "show", "nope", cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown recipe 'nope'" in unknown.stderr


def _tiny_run_module(folder: Path) -> None:
    from tests.conftest import tiny_recipe_source

    # A plugin section's Literal, a small float, an optional set: the copy gives them back exactly.
    extra = (
        '    c.training.eps, c.activation_checkpoint.mode = 1e-07, "full"\n'
        '    c.training.global_batch_size, c.job.dump_folder = 4, "first"\n'
    )
    (folder / "orig_recipes.py").write_text(tiny_recipe_source("tiny", 2, extra))


def test_a_runs_config_toml_copied_into_a_recipe_reruns_the_same_run(tmp_path: Path) -> None:
    """The run folder's config.toml was a dead end: `--config config.toml` was refused, and the
    recipe it names may since have changed (or come from a --module the file does not record)."""
    _tiny_run_module(tmp_path)
    first = run_titan("run", "--module", "orig_recipes", "--recipe", "tiny", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "orig_recipes.py").unlink()  # the recipe is gone; the run folder remains
    copy = run_titan("recipes", "copy", "first", "rerun.py", cwd=tmp_path)
    assert copy.returncode == 0, copy.stderr
    wrote = "wrote rerun.py (recipe tiny, from first/config.toml); run it with:\n"
    assert copy.stdout == wrote + "  titan run --module rerun --recipe tiny\n"
    again = run_titan("run", "--module", "rerun", "--recipe", "tiny", "--dump-folder", "second", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    rows = [
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("first", "second")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    configs = [(tmp_path / run / "config.toml").read_text() for run in ("first", "second")]
    assert configs[0] == configs[1].replace('dump_folder = "second"', 'dump_folder = "first"')
    # The file itself, as torchtitan users hand it over, the same.
    by_file = run_titan("recipes", "copy", "first/config.toml", "rerun2.py", cwd=tmp_path)
    assert by_file.returncode == 0, by_file.stderr
    assert (tmp_path / "rerun2.py").read_text().replace("rerun2", "rerun") == (
        tmp_path / "rerun.py"
    ).read_text()


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_print_config_output_copied_into_a_recipe_prints_the_same_config(tmp_path: Path, fmt: str) -> None:
    _tiny_run_module(tmp_path)
    printed = run_titan(
        "run", "--module", "orig_recipes", "--recipe", "tiny", "--print-config", fmt, cwd=tmp_path
    )
    assert printed.returncode == 0, printed.stderr
    (tmp_path / f"printed.{fmt}").write_text(printed.stdout)
    copy = run_titan("recipes", "copy", f"printed.{fmt}", "from_print.py", "--function", "mine", cwd=tmp_path)
    assert copy.returncode == 0, copy.stderr
    copied = printed_config("--module", "from_print", "--recipe", "mine", cwd=tmp_path)
    assert copied == printed_config("--module", "orig_recipes", "--recipe", "tiny", cwd=tmp_path)
    assert copied["training"]["eps"] == 1e-07 and copied["activation_checkpoint"]["mode"] == "full"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[training]\nsteps = 'many'\n", "training.steps: expected an integer, got str 'many'"),
        ("[trainingg]\nsteps = 3\n", "trainingg: no config section of that name"),
        ("[training\n", "not a TOML file"),
    ],
)
def test_copying_a_config_file_titan_cannot_read_is_one_error_naming_it(
    tmp_path: Path, content: str, expected: str
) -> None:
    (tmp_path / "bad.toml").write_text(content)
    result = run_titan("recipes", "copy", "bad.toml", "out.py", "--function", "f", cwd=tmp_path)
    assert result.returncode == 2 and expected in result.stderr and "bad.toml" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out.py").exists()


def test_a_copy_of_numbers_computed_with_numpy_runs_without_numpy() -> None:
    """A recipe's LR from numpy (``np.float64`` is a float, accepted) was copied as
    ``config.training.lr = np.float64(0.001)``: the copied module failed with NameError."""
    import numpy as np

    from titan_core.config import TrainerConfig, to_dict
    from titan_core.recipes import recipe_module_source
    from titan_core.records import Recipe

    def computed() -> TrainerConfig:
        config = TrainerConfig()
        config.training.lr = np.float64(1e-3) * np.sqrt(4.0)
        config.model.overrides = {"ffn_dim_multiplier": np.float64(1.5)}
        return config

    source = recipe_module_source(Recipe("computed", computed), "a test", "copied", "titan run ...")
    assert "np." not in source
    namespace: dict = {}
    exec(compile(source, "copied.py", "exec"), namespace)
    assert to_dict(namespace["copied"]()) == to_dict(computed())


@section
class _Inner:
    label: str | None = None
    n: int = 1


@section
class _Opts:
    freq: int = 1
    inner: _Inner = attrs.Factory(_Inner)


def test_a_copy_of_a_nested_plugin_section_sets_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """A nested section class of a plugin's section was copied as the dict it prints as,
    ``config.opts.inner = {'label': None, 'n': 4}``: the copied module failed with
    ``opts.inner: expected a _Inner section, got dict``."""
    from tests.conftest import plugin_module
    from titan_core import ConfigSection, _registry
    from titan_core._registry import Registry
    from titan_core.config import TrainerConfig, to_dict
    from titan_core.recipes import recipe_module_source
    from titan_core.records import Recipe

    registry = Registry().load_entry_points()
    module = plugin_module("opts", titan_config_sections=[ConfigSection("opts", _Opts)])
    registry.register(module, "opts", "dist-opts", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)

    def nested() -> TrainerConfig:
        config = TrainerConfig()
        config.opts.inner.n = 4
        return config

    source = recipe_module_source(Recipe("nested", nested), "a test", "copied", "titan run ...")
    assert "    config.opts.inner.n = 4\n" in source
    assert "    # config.opts.inner.label = None  (default)\n" in source
    namespace: dict = {}
    exec(compile(source, "copied.py", "exec"), namespace)
    assert to_dict(namespace["copied"]()) == to_dict(nested())
