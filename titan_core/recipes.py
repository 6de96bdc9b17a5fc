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
    if module.endswith(".py") or "/" in module or "\\" in module or module.startswith("."):
        # A file path, not a module name: importlib would look for a submodule named "py", or
        # fail on a relative name with a TypeError about packages.
        stem = module.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].removesuffix(".py")
        folder = module.replace("\\", "/").rsplit("/", 1)[0] if "/" in module.replace("\\", "/") else "."
        raise UsageError(
            f"--module {module!r}: give a module name, not a file path: --module {stem} "
            f"(with {folder!r} on PYTHONPATH, or run from that folder)"
        )
    try:
        return importlib.import_module(module)
    except SyntaxError as exc:
        raise UsageError(
            f"--module {module!r} failed to import: SyntaxError at {exc.filename}:{exc.lineno}: {exc.msg}"
        ) from None
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
    for given, flag in ((module, "--module"), (name, "--recipe/--config")):
        if given and given.endswith((".toml", ".json")):
            raise UsageError(
                f"{flag} {given!r}: titan runs recipes (Python functions returning the config), not "
                "config files; a run's config.toml records what it ran: `titan recipes copy "
                f"{given} my_rerun.py` writes a recipe module building exactly that config, to run "
                "(or edit) with `titan run --module my_rerun --recipe NAME`"
            )
    if module:
        mod = import_module(module)
        fn = getattr(mod, name, None)
        if inspect.isfunction(fn) and not name.startswith("_"):
            return Recipe(name, fn, _first_line(fn.__doc__))
        defined = module_recipes(mod)
        known = ", ".join(sorted(defined)) or "(none)"
        imported = sorted(
            n
            for n, fn in vars(mod).items()
            if inspect.isfunction(fn) and not n.startswith("_") and n not in defined
        )
        also = f"; functions it imports, recipes too: {', '.join(imported)}" if imported else ""
        raise UsageError(
            f"unknown recipe {name!r} in module {module!r}; recipes defined there: {known}{also}"
        )
    recipe: Recipe = registry.get("recipes", name, what="recipe")
    info = registry.provider("recipes", name)
    _FROM_PLUGIN[id(recipe)] = (recipe, f"plugin {info.name!r} ({info.origin})")
    return recipe


#: The plugin each recipe :func:`find_recipe` took from a plugin came from, by the record's id
#: (the record is kept: an id is unique only while its object lives): :func:`call_recipe`'s
#: errors name it, since the recipe's file (a site-packages path) alone does not say which plugin
#: to update or report to. Not for a recipe of ``--module``: that is the user's own code.
_FROM_PLUGIN: dict[int, tuple[Recipe, str]] = {}


def _plugin_of(recipe: Recipe) -> str | None:
    """``plugin 'p' (dist 1.0)`` when :func:`find_recipe` took ``recipe`` from a plugin."""
    found = _FROM_PLUGIN.get(id(recipe))
    return found[1] if found is not None and found[0] is recipe else None


def call_recipe(recipe: Recipe) -> TrainerConfig:
    """Call a recipe and check its result; errors name the recipe, the field and the line.

    Fields are checked where the recipe sets them (a bad value raises ``ConfigError`` there);
    the checks across fields run once, by the caller (:func:`titan_core.config.validate`).
    """
    from titan_core.config import CORE_SECTIONS, ConfigError, TrainerConfig

    fn: Callable[[], object] = recipe.fn
    plugin = _plugin_of(recipe)
    who = f"recipe {recipe.name!r}" + (f" of {plugin}" if plugin else "")

    def where(line: str) -> str:  # ConfigError's place: the recipe's line, and its plugin
        return "; ".join(part for part in (line, plugin) if part)

    needed = _required_arguments(fn)
    if needed:
        code = getattr(fn, "__code__", None)
        at = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise UsageError(
            f"{who} takes arguments ({', '.join(needed)}){at}, and titan calls a "
            "recipe with none: give them defaults, or write a recipe that calls it with them"
        )
    try:
        config = fn()
    except ConfigError as exc:
        raise ConfigError(exc.problems, recipe.name, where(_where(exc))) from None
    except AttributeError as exc:
        problem = _unknown_attribute(exc)
        if problem is None:
            raise UsageError(f"{who} raised {describe(exc)}") from None
        raise ConfigError([problem], recipe.name, where(_where(exc))) from None
    except Exception as exc:
        raise UsageError(f"{who} raised {describe(exc)}") from None
    except SystemExit as exc:  # a recipe is a function returning a config, not a program
        raise UsageError(
            f"{who} called sys.exit({exc.code!r}) instead of returning a config; "
            "return titan's config from it (raise an exception to refuse a setting)"
        ) from None
    if not isinstance(config, TrainerConfig):
        problem = f"<recipe>: expected a TrainerConfig, got {type(config).__name__}"
        raise ConfigError([problem], recipe.name, where(""))
    deleted = [name for name in CORE_SECTIONS if name not in vars(config)]
    if deleted:  # ``del config.training``: every later reader would fail with an AttributeError
        raise ConfigError(
            [
                f"{name}: the recipe deleted this config section; change its fields instead"
                for name in deleted
            ],
            recipe.name,
            where(""),
        )
    config.recipe = recipe.name
    return config


def _required_arguments(fn: Callable[..., object]) -> list[str]:
    """The parameters of ``fn`` without a default (a recipe is called with no arguments)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        return []
    kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind in kinds]


def _where(exc: BaseException) -> str:
    """``file.py:12``: the recipe's own line that raised, not titan's or attrs'."""
    import traceback

    skip = ("/titan_core/", "/attr/", "/attrs/", "/cattrs/")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(s in f.filename for s in skip)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _unknown_attribute(exc: AttributeError) -> str | None:
    """``section.field: no such field ...`` for a typo on a config object, else ``None``."""
    import attrs

    from titan_core.config import _SECTION_NAMES, TrainerConfig

    obj, name = getattr(exc, "obj", None), getattr(exc, "name", None)
    if isinstance(obj, TrainerConfig):
        return str(exc)
    if obj is None or name is None:
        # Slotted attrs classes raise on assignment without naming the object: parse the message.
        import re

        match = re.match(r"'(\w+)' object has no attribute '(\w+)'", str(exc))
        if not match:
            return None
        cls = next((c for c in _SECTION_NAMES if c.__name__ == match.group(1)), None)
        if cls is None:
            return None
        name = match.group(2)
    else:
        cls = type(obj)
        if cls not in _SECTION_NAMES:
            return None
    section = _SECTION_NAMES[cls]
    fields = ", ".join(a.name for a in attrs.fields(cls))
    return f"{section}.{name}: no such field; {section} has {fields}"


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0]


# -- titan recipes show / copy --------------------------------------------------------------------


def describe_recipe(registry: Registry, name: str, module: str | None = None) -> dict[str, str]:
    """Where recipe ``name`` comes from: plugin and distribution, ``module:function``, file, docstring."""
    recipe = find_recipe(registry, name, module)
    fn = inspect.unwrap(recipe.fn)
    info: dict[str, str] = {"recipe": recipe.name}
    if module:
        info["from"] = f"--module {module}"
    else:
        plugin = registry.provider("recipes", name)
        info["plugin"] = plugin.name
        info["distribution"] = plugin.origin or "(not installed as a distribution)"
    info["function"] = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', recipe.name)}"
    try:
        file = inspect.getsourcefile(fn) or "?"
        line = inspect.getsourcelines(fn)[1]
        info["file"] = f"{file}:{line}"
    except (OSError, TypeError):
        info["file"] = "(source not available)"
    info["doc"] = inspect.cleandoc(fn.__doc__ or "") or "(no docstring)"
    return info


def config_source(name: str, registry: Registry) -> str | None:
    """The config file ``titan recipes copy NAME`` reads when NAME names one rather than a recipe:
    a ``.toml``/``.json`` file (a run's ``config.toml``, ``--print-config`` output), a path, or a
    run folder holding ``config.toml`` (unless a recipe has that name); else ``None``."""
    import os

    run_folder = os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.toml"))
    if run_folder and ("/" in name or name not in registry.records("recipes")):
        return os.path.join(name, "config.toml")
    if name.endswith((".toml", ".json")) or "/" in name or os.sep in name:
        return name
    return None


def config_file_recipe(path: str, function: str | None) -> Recipe:
    """A recipe returning the config ``path`` holds (a run's ``config.toml`` or ``--print-config``
    output, TOML or JSON), checked as a recipe's (:func:`titan_core.config.from_dict`): what
    ``titan recipes copy`` turns into a recipe module that reruns that run. ``function``: the
    recipe's name, by default the one the file records (``recipe = ...``)."""
    import json
    import keyword
    import os

    import tomllib

    from titan_core.config import ConfigError, from_dict

    if os.path.isdir(path):
        raise UsageError(
            f"{path!r}: a folder without config.toml; give a run's job.dump_folder or config file"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UsageError(
            f"{path!r}: cannot be read ({exc.strerror or exc}); give a run's config.toml"
        ) from None
    try:
        text = raw.decode()
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise UsageError(f"{path!r}: not a {kind} file ({exc}); give a run's config.toml") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path!r}: not a config (a table of sections), got {type(data).__name__}")
    try:
        config = from_dict(data)
    except ConfigError as exc:
        problems = "\n".join(f"  {p}" for p in exc.problems)
        raise UsageError(f"{path!r} is not a config titan accepts:\n{problems}") from None
    recorded = data.get("recipe")
    name = function or (recorded if isinstance(recorded, str) else "")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(
            f"{path!r} records the recipe {recorded!r}, not a Python function name; pass --function NAME"
        )

    def from_file() -> TrainerConfig:
        return config

    from_file.__doc__ = f"The config of {path} (recipe {recorded!r} as it ran)."
    return Recipe(name, from_file, _first_line(from_file.__doc__))


def _literal(value: object) -> str:
    """``value`` as Python source (config values: None, bool, int, float, str, dicts of them)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    # As the plain number: a subclass's repr (numpy's ``np.float64(0.001)``, an IntEnum's
    # ``<Steps.SHORT: 7>``) is no source the copied module can run without its imports.
    if isinstance(value, int) and not isinstance(value, bool):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    return repr(value)


def recipe_module_source(recipe: Recipe, origin: str, function: str, run_command: str) -> str:
    """A user recipe module that builds the same config as ``recipe``, field by field.

    Fields the recipe changed from titan's defaults are assignments (with their documentation
    above); the others are listed commented out with their default, so every field of a core
    section is in view. Plugin sections appear when the recipe changed one of their fields.
    """
    from titan_core.config import CORE_SECTIONS, TrainerConfig, to_dict

    config = call_recipe(recipe)
    mine, defaults = to_dict(config), to_dict(TrainerConfig())

    doc = _first_line(recipe.fn.__doc__) or f"A copy of recipe {recipe.name!r}."
    lines = [
        f'"""{function}: a copy of recipe {recipe.name!r} ({origin}), written by `titan recipes copy`.',
        "",
        "Edit the values and run it:",
        "",
        f"    {run_command}",
        '"""',
        "",
        "from titan_core.config import TrainerConfig",
        "",
        "",
        f"def {function}() -> TrainerConfig:",
        f'    """{doc}"""',
        "    config = TrainerConfig()",
    ]
    for name, section in config.sections().items():
        values, base = mine[name], defaults.get(name, {})
        changed = [k for k in values if values[k] != base.get(k)]
        if name not in CORE_SECTIONS and not changed:
            continue
        lines += ["", f"    # [{name}]"]
        lines += _field_lines(f"config.{name}", section, values, base)
    lines += ["    return config", ""]
    return "\n".join(lines)


def _field_lines(path: str, section: object, values: dict, base: dict) -> list[str]:
    """One assignment per field of ``section`` (``values``: its unstructured data, ``base``: the
    defaults'), commented out where it is the default. A nested section class is written field by
    field (``config.x.inner.n = 4``): assigning it the dict it unstructures to is refused."""
    import textwrap

    import attrs

    from titan_core.config import field_docs

    docs = field_docs(type(section))
    lines = []
    for a in attrs.fields(type(section)):
        key = a.name
        value, default = values[key], base.get(key)
        child = getattr(section, key)
        if attrs.has(type(child)) and isinstance(value, dict):
            lines += _field_lines(f"{path}.{key}", child, value, default if isinstance(default, dict) else {})
            continue
        assignment = f"{path}.{key} = {_literal(value)}"
        if value != default:
            lines += [f"    # {text}" for text in textwrap.wrap(docs.get(key, ""), 96)]
            lines.append(f"    {assignment}")
        else:
            lines.append(f"    # {assignment}  (default)")
    return lines
