"""Finding and calling recipes.

A recipe is a plain Python function that returns a :class:`~titan_core.config.TrainerConfig`.
Recipes come from plugins (the ``titan_recipes`` hook) or from any importable module given with
``--module``: there, every public function is a recipe, including ones it imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from titan_core.errors import UsageError, describe
from titan_core.records import Recipe

if TYPE_CHECKING:
    from titan_core._registry import Registry
    from titan_core.config import TrainerConfig


def import_module(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise UsageError(
                f"--module {module!r}: no module named {exc.name!r}; check the name and that its "
                "folder is on PYTHONPATH (or the package is installed)"
            ) from None
        raise UsageError(f"--module {module!r} failed to import: {describe(exc)}") from None
    except Exception as exc:
        raise UsageError(f"--module {module!r} failed to import: {describe(exc)}") from None


def module_recipes(module: ModuleType) -> dict[str, Recipe]:
    """Public functions defined in ``module`` (what ``titan recipes list --module`` shows)."""
    found: dict[str, Recipe] = {}
    for name, fn in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        if fn.__module__ != module.__name__:
            continue
        found[name] = Recipe(name, fn, _first_line(fn.__doc__))
    return found


def find_recipe(registry: Registry, name: str, module: str | None = None) -> Recipe:
    """The recipe ``name``: from ``module`` if given (any public function there), else plugins."""
    if module:
        mod = import_module(module)
        fn = getattr(mod, name, None)
        if inspect.isfunction(fn) and not name.startswith("_"):
            return Recipe(name, fn, _first_line(fn.__doc__))
        known = ", ".join(sorted(module_recipes(mod))) or "(none)"
        raise UsageError(f"unknown recipe {name!r} in module {module!r}; recipes defined there: {known}")
    return registry.get("recipes", name, what="recipe")


def call_recipe(recipe: Recipe) -> TrainerConfig:
    """Call a recipe and validate its result; errors name the recipe and the failing line."""
    from titan_core.config import validate

    fn: Callable[[], object] = recipe.fn
    try:
        config = fn()
    except Exception as exc:
        raise UsageError(f"recipe {recipe.name!r} raised {describe(exc)}") from None
    config = validate(config, source=recipe.name)
    config.recipe = recipe.name
    return config


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0]
