"""Plugin failures found by review: a failure in any hook fails the whole plugin up front, a core
config-section name and an entry-point name clash fail only the plugins involved, a model whose
parameter count raises does not take down ``titan models list``."""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path

import attrs
import pytest

from tests.conftest import plugin_module, run_titan, tiny_llama3
from tests.conftest import recipe_record as recipe
from titan_core import (
    Callback,
    ConfigSection,
    ModelSpec,
    Strategy,
    _registry,
    hookimpl,
)
from titan_core._registry import Registry
from titan_core.config import section
from titan_core.errors import PluginError, UsageError
from titan_core.trainer import Trainer


@section
class Extra:
    #: A field.
    value: int = 1


def strategy(name: str) -> Strategy:
    return Strategy(name, 50, lambda config, dims: True, lambda parts, ctx: parts)


# -- 1. a bad hook fails the whole plugin, up front ------------------------------------------------


@pytest.mark.parametrize(
    ("hook", "bad", "problem"),
    [
        ("titan_strategies", strategy("solo"), "titan_strategies() returned one Strategy, not a list"),
        ("titan_callbacks", None, "titan_callbacks() returned None"),
    ],
)
def test_a_bad_hook_fails_the_whole_plugin_before_anything_is_used(
    hook: str, bad: object, problem: str
) -> None:
    registry = Registry()
    hooks = {
        "titan_recipes": [recipe("half_recipe")],
        "titan_config_sections": [ConfigSection("half", Extra)],
        hook: bad,
    }
    info = registry.register(plugin_module("half", **hooks), "half", "dist-half", "0.2")
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good", "dist-good")
    # The first kind asked for (recipes, as a run does) already knows the plugin failed.
    assert set(registry.records("recipes")) == {"fine"}
    assert info.status == "failed" and problem in (info.error or "")
    # None of its records are offered: not its recipe, not its config section.
    assert "half" not in registry.config_sections()
    assert registry.records("strategies") == {} and registry.records("callbacks") == {}
    assert info.provides == {}
    # Using one of them is one error naming the plugin, its distribution and the problem.
    with pytest.raises(PluginError) as raised:
        registry.get("recipes", "half_recipe", what="recipe")
    message = str(raised.value)
    assert "'half_recipe'" in message and "plugin 'half' (dist-half 0.2)" in message and problem in message
    # Runs using nothing of it keep working.
    assert registry.get("recipes", "fine").name == "fine"


def test_a_failed_plugins_name_is_reported_where_config_sections_are_looked_up() -> None:
    registry = Registry()
    registry.register(
        plugin_module("half", titan_config_sections=[ConfigSection("half", Extra)], titan_callbacks=None),
        "half",
        "dist-half",
        "0.2",
    )
    problem = registry.unavailable("config_sections", "half")
    assert problem is not None
    assert "plugin 'half' (dist-half 0.2)" in problem and "titan_callbacks() returned None" in problem
    assert registry.unavailable("config_sections", "nobody") is None


def test_a_hook_that_raises_in_a_later_kind_withholds_earlier_kinds() -> None:
    module = plugin_module("late", titan_recipes=[recipe("late_recipe")])

    @hookimpl
    def titan_callbacks() -> list[Callback]:
        raise RuntimeError("callback hook broke")

    module.titan_callbacks = titan_callbacks  # type: ignore[attr-defined]
    registry = Registry()
    registry.register(module, "late", "dist-late", "1")
    assert registry.records("recipes") == {}
    with pytest.raises(PluginError, match=r"plugin 'late' \(dist-late 1\).*callback hook broke"):
        registry.get("recipes", "late_recipe", what="recipe")


def test_a_failed_plugin_causes_no_conflict() -> None:
    registry = Registry()
    registry.register(plugin_module("a", titan_recipes=[recipe("same")], titan_callbacks=None), "a")
    registry.register(plugin_module("b", titan_recipes=[recipe("same")]), "b")
    assert registry.get("recipes", "same").name == "same"
    assert registry.plugins["b"].conflicts == []


def test_entry_points_are_gathered_when_the_registry_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = Registry.gather_all
    monkeypatch.setattr(Registry, "gather_all", lambda self: (calls.append("all"), original(self))[1])
    Registry().load_entry_points()
    assert calls == ["all"]


# -- 2. a config section named like a core section ---------------------------------------------------


def test_a_section_named_like_a_core_section_fails_only_its_plugin() -> None:
    registry = Registry()
    info = registry.register(
        plugin_module("takeover", titan_config_sections=[ConfigSection("training", Extra)]),
        "takeover",
        "dist-takeover",
        "1.0",
    )
    registry.register(plugin_module("good", titan_config_sections=[ConfigSection("extra", Extra)]), "good")
    assert set(registry.config_sections()) == {"extra"}  # runs are unaffected
    assert info.status == "failed"
    assert "'training' is titan's own" in (info.error or "") and "rename" in (info.error or "")


def test_a_section_class_not_made_with_section_fails_its_plugin() -> None:
    registry = Registry()
    info = registry.register(
        plugin_module("plain", titan_config_sections=[ConfigSection("plain", dict)]), "plain"
    )
    assert registry.config_sections() == {}
    assert info.status == "failed" and "titan_core.config.section" in (info.error or "")


# -- 3. two plugins with one entry-point name ------------------------------------------------------


def test_two_plugins_with_one_name_fail_both_and_nothing_else() -> None:
    registry = Registry()
    first = registry.register(plugin_module("x", titan_recipes=[recipe("from_a")]), "dup", "dist-a", "1")
    second = registry.register(plugin_module("y", titan_recipes=[recipe("from_b")]), "dup", "dist-b", "2")
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good")
    assert set(registry.records("recipes")) == {"fine"}
    for info in (first, second):
        assert info.status == "failed"
        assert "dist-a 1" in (info.error or "") and "dist-b 2" in (info.error or "")
    listed = [p for p in registry.plugins.values() if p.name == "dup"]
    assert len(listed) == 2
    with pytest.raises(PluginError, match=r"'dup'.*dist-a 1.*dist-b 2"):
        registry.get("recipes", "from_a", what="recipe")


def test_disabling_a_clashing_name_disables_both_without_error() -> None:
    registry = Registry(disabled={"dup"})
    registry.register(plugin_module("x", titan_recipes=[recipe("from_a")]), "dup", "dist-a", "1")
    registry.register(plugin_module("y", titan_recipes=[recipe("from_b")]), "dup", "dist-b", "2")
    assert [p.status for p in registry.plugins.values()] == ["disabled", "disabled"]
    with pytest.raises(UsageError, match="disabled plugins, not searched: dup"):
        registry.get("recipes", "from_a")


def _clashing_site(tmp_path: Path) -> Path:
    """A distribution declaring entry point ``llama3``, the name of titan's own Llama 3 plugin."""
    site = tmp_path / "site"
    info = site / "clash_llama-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clash-llama\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[titan]\nllama3 = clash_llama_plugin\n")
    (site / "clash_llama_plugin.py").write_text(
        textwrap.dedent(
            """
            import pathlib

            pathlib.Path(__file__).with_suffix(".imported").touch()  # side effects of an import

            from titan_core import Recipe, TrainerConfig, hookimpl

            @hookimpl
            def titan_recipes():
                return [Recipe("clash_recipe", TrainerConfig, "")]
            """
        )
    )
    return site


def test_an_entry_point_name_clash_leaves_the_cli_working(tmp_path: Path) -> None:
    site = str(_clashing_site(tmp_path))
    listing = run_titan("plugins", "list", "--json", PYTHONPATH=site)
    assert listing.returncode == 0, listing.stderr
    clashing = [p for p in json.loads(listing.stdout) if p["name"] == "llama3"]
    assert len(clashing) == 2 and {p["status"] for p in clashing} == {"failed"}
    for p in clashing:
        assert "clash-llama 0.1" in p["error"] and "titan-plugins-llama3" in p["error"]
    assert {p["status"] for p in json.loads(listing.stdout) if p["name"] != "llama3"} <= {"loaded"}
    helped = run_titan("--help", PYTHONPATH=site)
    assert helped.returncode == 0 and "plugins" in helped.stdout, helped.stderr
    # The remedy the error suggests works: disabling the name removes the error.
    for how in ({"TITAN_DISABLE_PLUGINS": "llama3"}, {}):
        args = (
            ("plugins", "list", "--json")
            if how
            else ("--disable-plugin", "llama3", "plugins", "list", "--json")
        )
        result = run_titan(*args, PYTHONPATH=site, **how)
        assert result.returncode == 0, result.stderr
        statuses = {p["status"] for p in json.loads(result.stdout) if p["name"] == "llama3"}
        assert statuses == {"disabled"}
    # Neither clashing plugin is imported: which one's import side effects would run is unknown.
    assert not (Path(site) / "clash_llama_plugin.imported").exists()


# -- 5. titan models list with a count that raises --------------------------------------------------


def _broken_count(*args: object) -> int:
    raise ZeroDivisionError("count broke")


def test_models_list_survives_a_count_that_raises(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from titan_core.cli import main

    monkeypatch.delenv(_registry.DISABLE_ENV, raising=False)
    registry = Registry().load_entry_points()
    bad = ModelSpec("zz_broken", {"tiny": {}}, print, _broken_count, print)
    active = ModelSpec(
        "zz_active", {"tiny": {}}, print, lambda a, e: 10, print, num_active_params=_broken_count
    )
    registry.register(plugin_module("counts", titan_models=[bad, active]), "counts", "dist-counts", "3")
    monkeypatch.setattr(_registry, "_default", registry)
    code = main(["models", "list"])
    out = capsys.readouterr().out
    assert code != 0
    lines = out.splitlines()
    broken = [line for line in lines if line.startswith("zz_broken")]
    assert len(broken) == 1 and "counts" in broken[0] and "num_params failed" in broken[0]
    assert "ZeroDivisionError: count broke" in broken[0]
    assert any(line.startswith("zz_active") and "num_active_params failed" in line for line in lines)
    assert any(line.startswith("llama3") for line in lines)  # the other models are listed
    code = main(["models", "list", "--json"])
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert code != 0
    assert rows["zz_broken"]["params"] is None and "count broke" in rows["zz_broken"]["error"]
    assert rows["zz_active"]["params"] == 10 and rows["zz_active"]["active_params"] is None


def test_models_list_marks_a_count_that_is_no_count(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``num_params`` returning a string ended ``titan models list`` in a TypeError traceback
    from the table's formatting, listing no model."""
    from titan_core.cli import main

    monkeypatch.delenv(_registry.DISABLE_ENV, raising=False)
    registry = Registry().load_entry_points()
    text = ModelSpec("zz_text", {"tiny": {}}, print, lambda a, e: "6.2M", print)
    registry.register(plugin_module("counts", titan_models=[text]), "counts", "dist-counts", "3")
    monkeypatch.setattr(_registry, "_default", registry)
    code = main(["models", "list"])
    out = capsys.readouterr().out
    assert code == 1
    (row,) = [line for line in out.splitlines() if line.startswith("zz_text")]
    assert "returned str '6.2M' from num_params" in row
    assert any(line.startswith("llama3") for line in out.splitlines())


# -- 4. one config-section name from two plugins ---------------------------------------------------


def test_a_config_section_provided_twice_fails_every_config_naming_both() -> None:
    registry = Registry()
    registry.register(plugin_module("a", titan_config_sections=[ConfigSection("both", Extra)]), "a", "dist-a")
    registry.register(plugin_module("b", titan_config_sections=[ConfigSection("both", Extra)]), "b", "dist-b")
    with pytest.raises(PluginError, match=r"config section 'both' is provided twice.*dist-a.*dist-b"):
        registry.config_sections()
    fixed = Registry(disabled={"b"})
    fixed.register(plugin_module("a", titan_config_sections=[ConfigSection("both", Extra)]), "a", "dist-a")
    fixed.register(plugin_module("b", titan_config_sections=[ConfigSection("both", Extra)]), "b", "dist-b")
    assert set(fixed.config_sections()) == {"both"}


def test_a_recipe_setting_a_failed_plugins_section_names_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own recipe (not the failed plugin's) that sets the section gets the plugin's
    failure, not "no config section of that name"."""
    import titan_core._registry as registry_module
    from titan_core.config import TrainerConfig

    registry = Registry().load_entry_points()
    registry.register(
        plugin_module("half", titan_config_sections=[ConfigSection("half", Extra)], titan_callbacks=None),
        "half",
        "dist-half",
        "0.2",
    )
    monkeypatch.setattr(registry_module, "_default", registry)
    config = TrainerConfig()
    with pytest.raises(AttributeError) as read:
        config.half  # noqa: B018
    assert "half: config section 'half' is provided by plugin 'half' (dist-half 0.2), which failed" in str(
        read.value
    )
    with pytest.raises(AttributeError, match="titan_callbacks\\(\\) returned None"):
        config.half = Extra()
    assert "no config section of that name" in _unknown("nothing_like_it")


def _unknown(name: str) -> str:
    from titan_core.config import _unknown_section

    return _unknown_section(name)


# -- 6. a run beside a failed plugin ---------------------------------------------------------------


def test_a_run_beside_a_failed_plugin_warns_that_its_names_may_come_from_another(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With titan's own plugin failed (an entry-point clash, say), a name it provides can resolve
    to another plugin's record of that name: the run says which plugins are out of play."""
    from titan_core.cli import main

    registry = Registry().load_entry_points()
    registry.register(
        plugin_module("half", titan_recipes=[recipe("fine")], titan_callbacks=None),
        "half",
        "dist-half",
        "0.2",
    )
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good", "dist-good", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    assert main(["run", "--recipe", "fine", "--print-config"]) == 0
    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("titan: warning:")]
    assert (
        "plugin 'half' (dist-half 0.2) failed to load" in warning
        and "titan_callbacks() returned None" in warning
    )
    assert "titan plugins list" in warning
    assert "[training]" in captured.out  # the config is still printed, on stdout alone
    registry = Registry().load_entry_points()
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good", "dist-good", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    assert main(["run", "--recipe", "fine", "--print-config"]) == 0
    assert "warning" not in capsys.readouterr().err  # nothing failed, nothing said


# -- 7. strategies and callbacks two plugins provide; hooks that end the process -------------------


def test_a_strategy_two_plugins_provide_fails_the_runs_it_would_apply_to_not_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run asks every strategy whether it applies: leaving a conflicting name out of the
    records ran without either strategy, exit 0 (the conflict only listed by `plugins list`)."""
    applied: list[str] = []

    def apply(parts: list, ctx: object) -> list:
        applied.append("twice")
        return parts

    twice = Strategy("twice", 45, lambda config, dims: True, apply)
    registry = Registry().load_entry_points()
    registry.register(plugin_module("sa", titan_strategies=[twice]), "sa", "dist-sa", "1.0")
    registry.register(plugin_module("sb", titan_strategies=[twice]), "sb", "dist-sb", "2.0")
    monkeypatch.setattr(_registry, "_default", registry)
    with pytest.raises(
        PluginError, match=r"strategy 'twice' is provided twice: by plugin 'sa' \(dist-sa 1.0\)"
    ):
        Trainer(tiny_llama3(tmp_path, 1), registry)
    assert applied == []


def test_a_callback_named_like_titans_own_fails_the_run_instead_of_removing_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third party's callback named `metrics_file` made every run write no metrics.jsonl (the
    core's writer and the plugin's callback both left out), exit 0."""
    registry = Registry().load_entry_points()
    mine = Callback("metrics_file", lambda trainer: None)
    registry.register(plugin_module("mine", titan_callbacks=[mine]), "mine", "dist-mine", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    with pytest.raises(
        PluginError, match=r"callback 'metrics_file' is provided twice: .*plugin 'mine'"
    ) as raised:
        Trainer(tiny_llama3(tmp_path, 1), registry)
    assert not (tmp_path / "metrics.jsonl").exists()
    # titan's core cannot be disabled (the CLI refuses it): only the third party's remedy is offered.
    assert "--disable-plugin mine" in str(raised.value) and "--disable-plugin core" not in str(raised.value)


def test_a_name_three_plugins_provide_says_three_and_to_keep_one() -> None:
    registry = Registry()
    for name in ("a", "b", "c"):
        registry.register(plugin_module(name, titan_recipes=[recipe("same")]), name, f"dist-{name}", "1.0")
    with pytest.raises(PluginError) as raised:
        registry.get("recipes", "same")
    message = str(raised.value)
    assert "recipe 'same' is provided by 3 plugins: plugin 'a' (dist-a 1.0), plugin 'b'" in message
    assert "uninstall or disable all but one of them" in message


@pytest.mark.parametrize("code", [3, 0, "bye"])
def test_a_hook_calling_sys_exit_fails_its_plugin_not_every_titan_command(code: object) -> None:
    """`sys.exit()` in a hook ended every `titan` command (`--help` and `plugins list` too) with
    the plugin's status and no word."""

    def leave() -> list:
        raise SystemExit(code)

    module = types.ModuleType("leaves")
    module.titan_recipes = hookimpl(leave)  # type: ignore[attr-defined]
    registry = Registry()
    info = registry.register(module, "leaves", "dist-leaves", "0.1")
    registry.register(plugin_module("good", titan_recipes=[recipe("fine")]), "good", "dist-good")
    assert set(registry.records("recipes")) == {"fine"}
    assert info.status == "failed" and f"SystemExit: {code}" in (info.error or "")


def test_a_hook_taking_arguments_is_one_line_at_the_plugins_function() -> None:
    """pluggy's validation error was three lines and pointed at pluggy's own file."""

    def titan_recipes(config: object) -> list:
        return []

    module = types.ModuleType("args")
    module.titan_recipes = hookimpl(titan_recipes)  # type: ignore[attr-defined]
    info = Registry().register(module, "args", "dist-args", "0.1")
    assert info.status == "failed"
    error = info.error or ""
    assert "\n" not in error and "pluggy" not in error
    assert error.startswith("titan_recipes(config) takes arguments; titan calls its hooks with none")
    assert f"(at {__file__}:" in error


@section
class Unwritable:
    #: Written to config.toml as the string "{'a'}", read back as that string (or refused).
    tags: set[str] = attrs.Factory(set)
    #: Fine.
    names: list[str] = attrs.Factory(list)
    #: cattrs has no hook for it: `titan recipes copy config.toml` ended in a traceback.
    anything: object = None


def test_a_section_field_titan_cannot_write_and_read_back_fails_its_plugin() -> None:
    registry = Registry()
    section_record = ConfigSection("unwritable", Unwritable)
    info = registry.register(
        plugin_module("unw", titan_config_sections=[section_record]), "unw", "dist-unw", "0.1"
    )
    registry.gather_all()
    assert info.status == "failed"
    assert (
        "config section 'unwritable', which has fields titan cannot write to config.toml and read back: "
        "tags (set[str]), anything (object)"
    ) in (info.error or "")
    assert "unwritable" not in registry.config_sections()
