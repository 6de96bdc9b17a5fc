"""A plugin's recipe that raises or builds a bad config: the error names the plugin and its
distribution beside the recipe's line (a recipe from ``--module`` is the user's own: no plugin).

The line said ``recipe 'x' raised ValueError: ... (at file:line)``: with several plugins
installed, which one to update or report to was left to guess from a site-packages path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import plugin_module, run_titan
from titan_core import Recipe, TrainerConfig, _registry
from titan_core._registry import Registry
from titan_core.cli import main


def _raises() -> TrainerConfig:
    raise ValueError("needs DATA_ROOT")


def _bad_value() -> TrainerConfig:
    config = TrainerConfig()
    config.training.steps = -1
    return config


def _not_a_config() -> TrainerConfig:
    return {"training": {}}  # type: ignore[return-value]


def _titan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str]:
    registry = Registry().load_entry_points()
    recipes = [
        Recipe("raises", _raises),
        Recipe("bad_value", _bad_value),
        Recipe("not_a_config", _not_a_config),
    ]
    registry.register(plugin_module("cookbook", titan_recipes=recipes), "cookbook", "titan-cookbook", "2.1")
    monkeypatch.setattr(_registry, "_default", registry)
    code = main(list(argv))
    return code, capsys.readouterr().err


PLUGIN = "plugin 'cookbook' (titan-cookbook 2.1)"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ("run", "--recipe", "raises", "--print-config"),
            rf"recipe 'raises' of {re.escape(PLUGIN)} raised ValueError: needs DATA_ROOT \(at .*"
            r"test_recipes_plugin_errors\.py:\d+\)",
        ),
        (
            ("run", "--recipe", "bad_value", "--print-config"),
            rf"invalid config from recipe 'bad_value' \(.*test_recipes_plugin_errors\.py:\d+; "
            rf"{re.escape(PLUGIN)}\): training\.steps",
        ),
        (
            ("run", "--recipe", "not_a_config", "--print-config"),
            rf"invalid config from recipe 'not_a_config' \({re.escape(PLUGIN)}\): <recipe>: expected a "
            "TrainerConfig, got dict",
        ),
        (
            ("recipes", "copy", "raises", "copied.py"),
            rf"recipe 'raises' of {re.escape(PLUGIN)} raised ValueError: needs DATA_ROOT",
        ),
    ],
)
def test_a_plugins_failing_recipe_names_the_plugin_and_distribution(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: tuple[str, ...],
    expected: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = _titan(monkeypatch, capsys, *argv)
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("titan: error:")]
    assert re.search(expected, line), line


def test_a_module_recipe_that_raises_names_no_plugin(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("def boom():\n    raise ValueError('mine')\n")
    result = run_titan("run", "--module", "mine", "--recipe", "boom", "--print-config", cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"recipe 'boom' raised ValueError: mine \(at .*mine\.py:2\)", result.stderr)
    assert "plugin" not in result.stderr
