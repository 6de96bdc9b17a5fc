"""``titan recipes copy NAME FILE`` and ``titan recipes show NAME``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_titan


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
