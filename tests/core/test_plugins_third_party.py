"""A third-party author's plugins, as found by writing them from docs/plugins.md and the public
API alone: what the docs promise holds for a plugin that is not titan's own."""

from __future__ import annotations

import copy
import json
import textwrap
import types
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import pip_install, plugin_module, run_titan, step_rows
from titan_core import ConfigSection, ModelSpec, hookimpl
from titan_core._registry import Registry
from titan_core.callbacks import Callbacks
from titan_core.config import section


@attrs.define
class PlainAttrs:
    """An attrs class, not made with ``titan_core.config.section``: nothing checks its fields."""

    x: int = 1


@attrs.define
class PlainInner:
    amount: float = 0.0


@section
class WithPlainInner:
    #: A nested class that is not a section.
    inner: PlainInner = attrs.field(factory=PlainInner)


def test_a_plain_attrs_section_class_fails_its_plugin() -> None:
    """``config.plain.x = "a"`` on an int field went through without a word (no field check)."""
    registry = Registry()
    info = registry.register(
        plugin_module("plain", titan_config_sections=[ConfigSection("plain", PlainAttrs)]), "plain"
    )
    assert registry.config_sections() == {}
    assert info.status == "failed"
    assert "titan_core.config.section" in (info.error or "") and "'x'" in (info.error or "")


def test_a_nested_plain_attrs_class_fails_its_plugin() -> None:
    registry = Registry()
    info = registry.register(
        plugin_module("nested", titan_config_sections=[ConfigSection("nested", WithPlainInner)]), "nested"
    )
    assert registry.config_sections() == {}
    assert info.status == "failed"
    assert "inner.amount" in (info.error or "") and "titan_core.config.section" in (info.error or "")


class _Rewrites:
    """A metrics sink that tidies the row it is given, in place."""

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        metrics["loss"] = round(metrics["loss"])


class _Copies:
    """A sink that copies the row before changing it, as it may."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        mine = dict(metrics) | copy.deepcopy(metrics)
        mine["loss"] = 0.0
        self.rows.append(mine)
        json.dumps(metrics)  # a writer serialises it as a dict


def test_a_callback_cannot_change_the_row_the_metric_writers_read() -> None:
    """A callback before titan's writers (order 80) that rewrote ``metrics`` in ``on_step_end``
    changed metrics.jsonl and TensorBoard without a word (``loss`` 0.0, ``grad_norm`` gone)
    while the console showed the real values."""
    row = {"step": 1, "loss": 7.25, "grad_norm": 1.5}
    callbacks = Callbacks([_Rewrites()], ["callback 'tidy' (plugin p)"])
    with pytest.raises(TypeError, match=r"read-only.*metrics\(step\).*dict\(metrics\)"):
        for fn in callbacks.on_step_end:
            fn(1, row, False)
    assert row == {"step": 1, "loss": 7.25, "grad_norm": 1.5}


def test_a_callback_may_copy_the_row_and_change_its_copy() -> None:
    row = {"step": 1, "loss": 7.25}
    first, second = _Copies(), _Copies()
    callbacks = Callbacks([first, second], ["callback 'a' (plugin p)", "callback 'b' (plugin p)"])
    for fn in callbacks.on_step_end:
        fn(1, row, False)
    assert first.rows == second.rows == [{"step": 1, "loss": 0.0}]
    assert row == {"step": 1, "loss": 7.25}


def _count(args: Any, include_embedding: bool = True) -> int:
    return 1


def test_flavor_names_that_are_not_strings_fail_the_plugin() -> None:
    """``ModelSpec(..., flavors={1: {...}})``: ``config.model.flavor`` (a string) could never
    select it, and ``titan models list`` ended in ``TypeError: object of type 'int' has no len()``
    for every plugin's models."""
    with pytest.raises(TypeError, match=r"ModelSpec\.flavors: .*flavor names.*strings.*1"):
        ModelSpec("m", {1: {"dim": 2}}, dict, _count, _count)
    with pytest.raises(TypeError, match=r"ModelSpec\.flavors: .*''"):
        ModelSpec("m", {"": {"dim": 2}}, dict, _count, _count)
    module = types.ModuleType("intflavor")
    module.titan_models = hookimpl(lambda: [ModelSpec("m", {1: {}}, dict, _count, _count)])  # type: ignore[attr-defined]
    registry = Registry()
    info = registry.register(module, "intflavor")
    assert registry.records("models") == {}
    assert info.status == "failed" and "ModelSpec.flavors" in (info.error or "")


def _site(tmp_path: Path, entry_points: str, modules: dict[str, str]) -> Path:
    """A site folder as pip leaves it: a distribution ``nohooks-dist`` and its modules."""
    site = tmp_path / "site"
    info = site / "nohooks_dist-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nohooks-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[titan]\n{entry_points}\n")
    for name, text in modules.items():
        path = site / name.replace(".", "/")
        if name.count("."):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".py").write_text(textwrap.dedent(text))
    return site


def test_an_entry_point_whose_object_has_no_hooks_fails_naming_what_to_fix(tmp_path: Path) -> None:
    """``my_model = "my_pkg"`` (the package, not ``my_pkg.plugin``), or ``"my_pkg.plugin:titan_recipes"``
    (a hook, not its module): the plugin was listed as loaded, offered nothing, and its recipe was
    an unknown recipe."""
    hooks = """
        from titan_core import Recipe, TrainerConfig, hookimpl

        @hookimpl
        def titan_recipes():
            return [Recipe("nohooks_recipe", TrainerConfig, "")]
        """
    site = _site(
        tmp_path,
        "pkg = nohooks_pkg\nfn = nohooks_pkg.plugin:titan_recipes",
        {
            "nohooks_pkg.__init__": "# the package: its plugin module is nohooks_pkg.plugin\n",
            "nohooks_pkg.plugin": hooks,
        },
    )
    listed = run_titan("plugins", "list", "--json", PYTHONPATH=str(site))
    assert listed.returncode == 0, listed.stderr
    plugins = {p["name"]: p for p in json.loads(listed.stdout)}
    assert plugins["pkg"]["status"] == plugins["fn"]["status"] == "failed"
    assert "names module 'nohooks_pkg', which defines no titan hook" in plugins["pkg"]["error"]
    assert "names the function titan_recipes" in plugins["fn"]["error"]
    for p in (plugins["pkg"], plugins["fn"]):
        assert "nohooks-dist's pyproject.toml" in p["error"]
    assert {p["status"] for name, p in plugins.items() if name not in ("pkg", "fn")} == {"loaded"}
    run = run_titan("run", "--recipe", "nohooks_recipe", "--print-config", PYTHONPATH=str(site))
    assert run.returncode != 0 and "plugin 'pkg' (nohooks-dist 0.1) failed to load" in run.stderr


@pytest.fixture(scope="module")
def tidy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/fixtures/titan_tidy_plugin`` really installed by pip (put it on PYTHONPATH)."""
    return pip_install(tmp_path_factory.mktemp("tidy_site"), "titan_tidy_plugin")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_installed_sink_rounding_the_row_in_place_is_refused_naming_it(
    tidy_site: Path, tmp_path: Path
) -> None:
    """The sink's ``in_place`` mode rounded titan's row: metrics.jsonl held the rounded loss
    (one decimal) while the console line showed the real one."""
    out = tmp_path / "in_place"
    result = run_titan(
        "run", "--recipe", "tidy_in_place", "--dump-folder", str(out), PYTHONPATH=str(tidy_site)
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "callback 'tidy_sink' (plugin tidy, titan-tidy-plugin 0.1.0) failed in on_step_end" in errors[0]
    assert "read-only" in errors[0]
    for row in _jsonl(out / "metrics.jsonl"):  # what was written is titan's, unrounded
        assert row["loss"] != round(row["loss"], 1)


def test_an_installed_sink_rounding_a_copy_leaves_titans_row(tidy_site: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    result = run_titan("run", "--recipe", "tidy_tiny", "--dump-folder", str(out), PYTHONPATH=str(tidy_site))
    assert result.returncode == 0, result.stderr[-2000:]
    logged = step_rows(result.stdout)
    written = _jsonl(out / "metrics.jsonl")
    tidy = _jsonl(out / "tidy_rows.jsonl")
    assert [r["step"] for r in written] == [r["step"] for r in tidy] == [1, 2]
    for console, row, rounded in zip(logged, written, tidy, strict=True):
        assert row["loss"] == console["loss"] != rounded["loss"] == round(row["loss"], 1)
