"""A third-party plugin installed by pip works exactly like titan's own; a broken one is isolated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_titan, step_rows


def test_installed_plugin_is_listed_and_broken_one_is_reported(plugin_site: Path) -> None:
    result = run_titan("plugins", "list", "--json", PYTHONPATH=str(plugin_site))
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    toy = plugins["toy"]
    assert (toy["distribution"], toy["version"], toy["status"]) == ("titan-toy-plugin", "0.3.1", "loaded")
    assert toy["provides"] == {"models": ["toy"], "recipes": ["toy_tiny"]}
    broken = plugins["broken"]
    assert (broken["distribution"], broken["version"], broken["status"]) == (
        "titan-broken-plugin",
        "9.9.9",
        "failed",
    )
    assert "No module named 'titan_missing_dependency_for_tests'" in broken["error"]
    table = run_titan("plugins", "list", PYTHONPATH=str(plugin_site)).stdout
    assert "broken: failed: ModuleNotFoundError" in table


@pytest.mark.slow
def test_installed_plugin_trains_despite_a_broken_one(plugin_site: Path, tmp_path: Path) -> None:
    result = run_titan(
        "run", "--recipe", "toy_tiny", "--dump-folder", str(tmp_path), PYTHONPATH=str(plugin_site)
    )
    assert result.returncode == 0, result.stderr
    rows = step_rows(result.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_name_only_a_broken_plugin_could_provide_fails_with_its_error(plugin_site: Path) -> None:
    result = run_titan("run", "--recipe", "broken_recipe", PYTHONPATH=str(plugin_site))
    assert result.returncode == 1
    assert "unknown recipe 'broken_recipe'" in result.stderr
    assert "plugin 'broken' (titan-broken-plugin 9.9.9) failed to load" in result.stderr
    assert "titan_missing_dependency_for_tests" in result.stderr


def test_disabling_the_broken_plugin_never_imports_it(plugin_site: Path) -> None:
    result = run_titan(
        "plugins", "list", "--json", PYTHONPATH=str(plugin_site), TITAN_DISABLE_PLUGINS="broken,toy"
    )
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["broken"]["status"] == "disabled" and plugins["broken"]["error"] is None
    assert plugins["toy"]["status"] == "disabled"


def test_a_plugin_importing_torch_at_module_level_is_flagged(plugin_site: Path) -> None:
    plugins = {
        p["name"]: p
        for p in json.loads(run_titan("plugins", "list", "--json", PYTHONPATH=str(plugin_site)).stdout)
    }
    assert plugins["heavy"]["imported_torch"] is True
    assert not any(p["imported_torch"] for name, p in plugins.items() if name != "heavy")
    table = run_titan("plugins", "list", PYTHONPATH=str(plugin_site)).stdout
    assert "heavy: imported torch at module level" in table
