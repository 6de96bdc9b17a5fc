"""ModelSpec flavor arguments with overrides, for attrs, dataclass and dict arguments."""

from __future__ import annotations

import dataclasses

import attrs
import pytest

from titan_core import ModelSpec, hookimpl


@attrs.frozen
class AttrsArgs:
    dim: int = 8
    eps: float = 1e-5


@dataclasses.dataclass(frozen=True)
class DataArgs:
    dim: int = 8


def spec(args: object) -> ModelSpec:
    return ModelSpec(
        "m", {"base": args}, build=lambda a: None, num_params=lambda a, e: 0, flops_per_token=lambda a, s: 0.0
    )


@pytest.mark.parametrize("args", [AttrsArgs(), DataArgs(), {"dim": 8}])
def test_overrides_apply_to_any_argument_kind(args: object) -> None:
    out = spec(args).flavor("base", {"dim": 16})
    assert (out["dim"] if isinstance(out, dict) else out.dim) == 16
    assert spec(args).flavor("base") is args


def test_int_is_accepted_for_float_fields() -> None:
    assert spec(AttrsArgs()).flavor("base", {"eps": 1}).eps == 1


def test_unknown_flavor_and_field() -> None:
    with pytest.raises(LookupError, match="no flavor 'big'; known flavors: base"):
        spec(AttrsArgs()).flavor("big")
    with pytest.raises(LookupError, match="no field 'width'; fields: dim, eps"):
        spec(AttrsArgs()).flavor("base", {"width": 3})


@attrs.frozen
class IntValuedFloatArgs:
    #: A float field a flavor filled with an int literal (``rope_theta=500000``).
    theta: float = 500000  # type: ignore[assignment]
    heads: int | None = None
    name: str = "x"


def test_the_declared_field_type_decides_not_the_flavor_value() -> None:
    """A float field is a float, whatever literal the flavor used; an unset optional field still
    takes its declared type."""
    s = spec(IntValuedFloatArgs())
    assert s.flavor("base", {"theta": 10000.5}).theta == 10000.5
    assert s.flavor("base", {"heads": 4}).heads == 4
    with pytest.raises(LookupError, match="argument 'heads' expects int, got '4'"):
        s.flavor("base", {"heads": "4"})
    with pytest.raises(LookupError, match="argument 'theta' expects float, got 'big'"):
        s.flavor("base", {"theta": "big"})
    with pytest.raises(LookupError, match="argument 'name' expects str, got 3"):
        s.flavor("base", {"name": 3})
    with pytest.raises(LookupError, match="argument 'heads' expects int, got True"):
        s.flavor("base", {"heads": True})


@dataclasses.dataclass(frozen=True)
class DataFloatArgs:
    eps: float = 1  # type: ignore[assignment]


def test_declared_types_of_dataclass_arguments() -> None:
    assert spec(DataFloatArgs()).flavor("base", {"eps": 0.5}).eps == 0.5


# -- records of the wrong types fail where the plugin makes them ---------------------------------


def _f(*args: object) -> None:
    return None


@attrs.define
class _Section:
    enable: bool = False


def _bad_records() -> list[tuple[object, str]]:
    from titan_core import (
        Callback,
        Checkpointer,
        Command,
        CommBackend,
        ConfigSection,
        Dataset,
        Recipe,
        RunOption,
    )

    return [
        # A str order sorted against titan's own callbacks' ints: every run ended in a TypeError.
        (lambda: Callback("c", _f, order="10"), r"Callback\.order: expected an int, got str '10'"),
        (lambda: Callback("c", None), r"Callback\.build: expected a function, got NoneType"),
        # A list of flavor names: `titan models list` ended in an AttributeError traceback.
        (lambda: ModelSpec("m", ["tiny"], _f, _f, _f), r"ModelSpec\.flavors: expected a mapping .* got list"),
        (lambda: ModelSpec("m", {"t": {}}, None, _f, _f), r"ModelSpec\.build: expected a function"),
        (
            lambda: ModelSpec("m", {"t": {}}, _f, _f, _f, tp_plan=3),
            r"ModelSpec\.tp_plan: expected a function",
        ),
        # ("tok_embeddings") is a str: converted to its letters, each a "module" PP looked for.
        (
            lambda: ModelSpec("m", {"t": {}}, _f, _f, _f, first_stage_modules="tok_embeddings"),
            r"ModelSpec\.first_stage_modules: expected a tuple of module names, got 'tok_embeddings'",
        ),
        (lambda: Recipe("r", None), r"Recipe\.fn: expected a function"),
        (lambda: Dataset("d", "docs"), r"Dataset\.documents: expected a function, got str 'docs'"),
        (lambda: Command("c", "h", _f, None), r"Command\.run: expected a function"),
        (lambda: RunOption("o", "--o", "h", None), r"RunOption\.run: expected a function"),
        (lambda: CommBackend("b", None), r"CommBackend\.init: expected a function"),
        (lambda: CommBackend("b", _f, sets=[("a.b", 1)]), r"CommBackend\.sets: expected a mapping"),
        (lambda: Checkpointer("c", None), r"Checkpointer\.build: expected a function"),
        (lambda: ConfigSection("s", _Section, results="enable"), r"ConfigSection\.results: expected a tuple"),
        (lambda: ConfigSection("s", _Section, check=3), r"ConfigSection\.check: expected a function"),
    ]


@pytest.mark.parametrize(("make", "expected"), _bad_records())
def test_a_record_of_the_wrong_types_is_refused_where_it_is_made(make: object, expected: str) -> None:
    with pytest.raises((TypeError, ValueError), match=expected):
        make()  # type: ignore[operator]


def test_a_plugin_making_a_bad_record_fails_alone_and_the_rest_keeps_working() -> None:
    from tests.conftest import plugin_module
    from titan_core import Callback
    from titan_core._registry import Registry

    def callbacks() -> list[Callback]:
        return [Callback("late", _f, order="10")]  # type: ignore[arg-type]

    bad = plugin_module("bad")
    bad.titan_callbacks = hookimpl(callbacks)  # type: ignore[attr-defined]
    registry = Registry().load_entry_points()
    registry.register(bad, "bad", "dist-bad", "1.0")
    registry.gather_all()
    assert registry.plugins["bad"].status == "failed"
    assert "Callback.order: expected an int, got str '10'" in (registry.plugins["bad"].error or "")
    records = registry.records("callbacks").values()
    assert sorted(records, key=lambda r: (r.order, r.name))  # titan's own still sort (every run does)


def test_tuples_of_module_names_and_results_are_kept() -> None:
    from titan_core import ConfigSection

    made = ModelSpec("m", {"t": {}}, _f, _f, _f, first_stage_modules=["tok_embeddings", "pos"])
    assert made.first_stage_modules == ("tok_embeddings", "pos")
    assert ConfigSection("s", _Section, results=["enable"]).results == ("enable",)


def test_a_recipe_without_a_docstring_is_listed() -> None:
    """``Recipe(name, fn, fn.__doc__)`` of a function without a docstring gave a description of
    None, and ``titan recipes list`` ended in a TypeError traceback for every plugin's recipes."""
    from titan_core.cli import print_table
    from titan_core.records import Recipe

    def undocumented() -> None:
        pass

    recipe = Recipe("undocumented", undocumented, undocumented.__doc__)
    assert recipe.description == ""
    print_table([("RECIPE", "FROM", "DESCRIPTION"), (recipe.name, "plugin", recipe.description)])


def test_a_description_that_is_no_text_is_refused_where_the_plugin_makes_it() -> None:
    from titan_core.records import Recipe

    with pytest.raises(TypeError, match=r"Recipe.description: expected a string, got int 3"):
        Recipe("r", lambda: None, 3)
