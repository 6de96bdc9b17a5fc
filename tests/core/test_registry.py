"""The registry: direct registration, conflicts, failures and disabling (no entry points)."""

from __future__ import annotations

import re
import types

import pytest

from tests.conftest import plugin_module
from tests.conftest import recipe_record as recipe
from titan_core import CommBackend, Dataset, ModelSpec, Recipe, TrainerConfig, hookimpl
from titan_core._registry import Registry
from titan_core.errors import PluginError, UsageError


def test_records_are_gathered_with_provenance() -> None:
    registry = Registry()
    info = registry.register(
        plugin_module("a", titan_recipes=[recipe("one"), recipe("Two")]), "a", "dist-a", "1.0"
    )
    assert set(registry.records("recipes")) == {"one", "two"}
    assert registry.get("recipes", "TWO").name == "Two"  # names match case-insensitively
    assert registry.provider("recipes", "one") is info
    assert info.hooks == ["titan_recipes"]
    assert info.provides == {"recipes": ["one", "Two"]}


def test_duplicate_name_names_both_distributions() -> None:
    registry = Registry()
    registry.register(plugin_module("a", titan_recipes=[recipe("same")]), "a", "dist-a", "1.0")
    registry.register(plugin_module("b", titan_recipes=[recipe("SAME")]), "b", "dist-b", "2.5")
    # Only the runs that use the name fail; listing still works and shows the conflict.
    assert "same" not in registry.records("recipes")
    assert registry.plugins["a"].conflicts == ["recipes: same"] == registry.plugins["b"].conflicts
    with pytest.raises(PluginError) as info:
        registry.get("recipes", "same")
    message = str(info.value)
    assert "dist-a 1.0" in message and "dist-b 2.5" in message and "'same'" in message.lower()
    assert "--disable-plugin" in message


def test_one_plugin_giving_a_name_twice_is_named_once() -> None:
    registry = Registry()
    registry.register(plugin_module("a", titan_recipes=[recipe("dup"), recipe("DUP")]), "a", "dist-a", "1.0")
    with pytest.raises(PluginError) as info:
        registry.get("recipes", "dup")
    assert str(info.value) == (
        "recipe 'dup' is provided twice by plugin 'a' (dist-a 1.0), as 'dup', 'DUP': names are "
        "compared without case; the plugin must rename one"
    )


def test_two_plugins_with_one_name_both_fail() -> None:
    registry = Registry()
    registry.register(plugin_module("x"), "dup", "dist-a", "1")
    info = registry.register(plugin_module("y"), "dup", "dist-b", "2")
    assert info.status == "failed"
    assert re.search(r"2 plugins are named 'dup'.*dist-a 1.*dist-b 2", info.error or "")
    assert "TITAN_DISABLE_PLUGINS=dup" in (info.error or "")


def test_unknown_name_lists_known_ones() -> None:
    registry = Registry()
    registry.register(plugin_module("a", titan_recipes=[recipe("alpha"), recipe("beta")]), "a")
    with pytest.raises(UsageError, match="unknown recipe 'gamma'; known: alpha, beta"):
        registry.get("recipes", "gamma", what="recipe")


def test_hook_that_raises_fails_only_its_plugin() -> None:
    bad = types.ModuleType("bad")

    @hookimpl
    def titan_recipes() -> list[Recipe]:
        raise RuntimeError("boom")

    bad.titan_recipes = titan_recipes  # type: ignore[attr-defined]
    registry = Registry()
    registry.register(bad, "bad", "dist-bad", "0.1")
    registry.register(plugin_module("good", titan_recipes=[recipe("ok")]), "good")
    assert list(registry.records("recipes")) == ["ok"]
    assert registry.plugins["bad"].status == "failed"
    assert "RuntimeError: boom" in registry.plugins["bad"].error
    # A name nobody provides now points at the failed plugin and its error.
    with pytest.raises(PluginError, match=r"plugin 'bad' \(dist-bad 0.1\) failed to load .*boom"):
        registry.get("recipes", "missing", what="recipe")


def test_wrong_record_type_and_bad_names_fail_the_plugin() -> None:
    registry = Registry()
    registry.register(plugin_module("w", titan_recipes=["not a record"]), "w")
    registry.register(plugin_module("n", titan_datasets=[Dataset("has space", lambda d: [])]), "n")
    registry.gather_all()
    assert "returned str, expected Recipe" in registry.plugins["w"].error
    assert "invalid name 'has space'" in registry.plugins["n"].error


def test_unknown_hook_in_plugin_is_reported() -> None:
    module = types.ModuleType("typo")

    @hookimpl
    def titan_modelz() -> list[ModelSpec]:
        return []

    module.titan_modelz = titan_modelz  # type: ignore[attr-defined]
    registry = Registry()
    info = registry.register(module, "typo")
    assert info.status == "failed"
    assert "unknown hooks titan_modelz" in info.error
    assert "titan_models" in info.error


def test_disabled_plugin_is_not_registered() -> None:
    registry = Registry(disabled={"off"})
    info = registry.register(
        plugin_module("off", titan_comm_backends=[CommBackend("x", lambda c: None)]), "off"
    )
    assert info.status == "disabled"
    with pytest.raises(UsageError, match=r"disabled plugins, not searched: off"):
        registry.get("comm_backends", "x")


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (None, "titan_recipes() returned None; return a list of Recipe records"),
        (
            Recipe("solo", TrainerConfig, ""),
            "titan_recipes() returned one Recipe, not a list; return [Recipe(...)]",
        ),
        ({"solo": 1}, "titan_recipes() returned dict; return a list of Recipe records"),
        ([ModelSpec("m", {}, print, print, print)], "titan_recipes() returned ModelSpec, expected Recipe"),
    ],
)
def test_a_hook_result_that_is_not_a_list_of_records_fails_its_plugin(result: object, expected: str) -> None:
    module = types.ModuleType("odd")
    module.__dict__["titan_recipes"] = hookimpl(lambda: result)
    registry = Registry()
    info = registry.register(module, "odd")
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good")
    assert set(registry.records("recipes")) == {"fine"}  # the others still work
    assert info.status == "failed" and expected in (info.error or "")


def test_an_undecorated_hook_fails_its_plugin_by_name() -> None:
    module = types.ModuleType("forgetful")
    module.__dict__["titan_recipes"] = lambda: [recipe("never")]  # no @hookimpl: pluggy ignores it
    module.titan_recipes.__module__ = "forgetful"
    info = Registry().register(module, "forgetful")
    assert info.status == "failed"
    assert "titan_recipes is not decorated with @titan_core.hookimpl" in (info.error or "")


def test_a_conflict_is_resolved_by_disabling_either_plugin() -> None:
    for disabled in ("a", "b"):
        registry = Registry(disabled={disabled})
        registry.register(plugin_module("a", titan_recipes=[recipe("same")]), "a")
        registry.register(plugin_module("b", titan_recipes=[recipe("same")]), "b")
        assert registry.get("recipes", "same").name == "same"


def test_entry_point_import_time_and_torch_import_are_recorded(tmp_path: object) -> None:
    import subprocess
    import sys

    probe = (
        "import sys; from titan_core._registry import Registry\n"
        "r = Registry().load_entry_points()\n"
        "assert 'torch' not in sys.modules, 'a plugin imported torch'\n"
        "assert all(p.import_seconds >= 0 and not p.imported_torch for p in r.plugins.values())\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
