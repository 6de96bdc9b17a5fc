"""Entry points as third-party authors get them wrong: each is one error naming the entry point,
its distribution and what to change in its metadata, and the other plugins keep working.

Written from the outside, with distributions on ``PYTHONPATH`` (metadata and a module, as pip
leaves them): an entry point naming an object its module lacks was reported as an
``AttributeError`` "at .../importlib/metadata/__init__.py"; one naming a module that does not exist
"at <frozen importlib._bootstrap>"; one naming a class whose hooks are methods as a ``TypeError``
"missing 1 required positional argument: 'self'" at titan's registry line; and two entry points
naming one module loaded it under whichever came first and failed the other with pluggy's
``Plugin already registered under a different name`` and a dict of every plugin.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import run_titan

PLUGIN = textwrap.dedent(
    """
    from titan_core import Recipe, TrainerConfig, hookimpl


    def ep_recipe():
        return TrainerConfig()


    @hookimpl
    def titan_recipes():
        return [Recipe("ep_recipe", ep_recipe, "")]


    class ClassPlugin:
        @hookimpl
        def titan_recipes(self):
            return [Recipe("ep_class_recipe", ep_recipe, "")]
    """
)


def _site(tmp_path: Path, dists: dict[str, str]) -> Path:
    """A site folder: ``ep_plugin.py`` and one distribution per ``{name: entry_points lines}``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "ep_plugin.py").write_text(PLUGIN)
    for name, lines in dists.items():
        info = site / f"{name.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[titan]\n{lines}\n")
    return site


def _listed(site: Path) -> dict[str, dict]:
    result = run_titan("plugins", "list", "--json", PYTHONPATH=str(site))
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def _others_work(site: Path, plugins: dict[str, dict], *ours: str) -> None:
    assert {p["status"] for name, p in plugins.items() if name not in ours} == {"loaded"}
    shown = run_titan("run", "--recipe", "llama3_debugmodel", "--print-config", PYTHONPATH=str(site))
    assert shown.returncode == 0 and "[training]" in shown.stdout, shown.stderr


def test_an_entry_point_naming_a_missing_object_says_so_and_what_to_fix(tmp_path: Path) -> None:
    site = _site(tmp_path, {"ep-dist": "ep_missing = ep_plugin:missing"})
    plugins = _listed(site)
    assert plugins["ep_missing"]["status"] == "failed"
    assert plugins["ep_missing"]["error"] == (
        "entry point 'ep_missing = ep_plugin:missing' names no object: module 'ep_plugin' has no "
        "attribute 'missing'; fix the entry point in the [project.entry-points.titan] table of "
        "ep-dist's pyproject.toml (module:object, or just the module)"
    )
    _others_work(site, plugins, "ep_missing")


def test_an_entry_point_naming_a_missing_module_says_so_and_what_to_fix(tmp_path: Path) -> None:
    site = _site(tmp_path, {"ep-dist": "ep_nomod = ep_plugins.plugin"})
    plugins = _listed(site)
    assert plugins["ep_nomod"]["error"] == (
        "entry point 'ep_nomod = ep_plugins.plugin' names module 'ep_plugins.plugin', which is not "
        "installed (no module named 'ep_plugins'); fix the entry point in the "
        "[project.entry-points.titan] table of ep-dist's pyproject.toml, or make the distribution "
        "include the package"
    )
    ran = run_titan("run", "--recipe", "ep_recipe", PYTHONPATH=str(site))
    assert ran.returncode == 1 and "plugin 'ep_nomod' (ep-dist 0.1) failed to load" in ran.stderr
    _others_work(site, plugins, "ep_nomod")


def test_an_entry_point_naming_a_class_whose_hooks_are_methods_says_to_name_an_instance(
    tmp_path: Path,
) -> None:
    site = _site(tmp_path, {"ep-dist": "ep_class = ep_plugin:ClassPlugin"})
    plugins = _listed(site)
    assert plugins["ep_class"]["status"] == "failed"
    assert plugins["ep_class"]["error"] == (
        "entry point 'ep_class = ep_plugin:ClassPlugin' names the class ClassPlugin, whose hooks "
        "titan_recipes is a method: titan would call it without an instance. Name a module, or an "
        "instance (PLUGIN = ClassPlugin() in ep_plugin, and 'ep_plugin:PLUGIN' in ep-dist's entry point)"
    )
    _others_work(site, plugins, "ep_class")


def test_two_entry_points_naming_one_module_fail_both_naming_each_other(tmp_path: Path) -> None:
    site = _site(tmp_path, {"ep-dist": "ep_one = ep_plugin", "ep-copy": "ep_two = ep_plugin"})
    plugins = _listed(site)
    for name in ("ep_one", "ep_two"):
        assert plugins[name]["status"] == "failed", plugins[name]
        error = plugins[name]["error"]
        assert error.startswith(
            "entry points 'ep_one' (ep-dist 0.1) and 'ep_two' (ep-copy 0.1) both name "
        ), error
        assert "ep_plugin" in error and "none of them is loaded" in error and "Plugin already" not in error
    ran = run_titan("run", "--recipe", "ep_recipe", PYTHONPATH=str(site))
    assert ran.returncode == 1 and "both name" in ran.stderr and "Traceback" not in ran.stderr
    _others_work(site, plugins, "ep_one", "ep_two")


def test_an_entry_point_naming_titans_own_plugin_fails_alone(tmp_path: Path) -> None:
    """titan's own plugin cannot be disabled, so it stays loaded: only the other entry point fails."""
    site = _site(tmp_path, {"ep-dist": "ep_core = titan_core._builtin"})
    plugins = _listed(site)
    assert plugins["core"]["status"] == "loaded", plugins["core"]
    assert plugins["ep_core"]["status"] == "failed"
    assert "titan's own plugin stays loaded" in plugins["ep_core"]["error"]
    _others_work(site, plugins, "ep_core")
