"""Plugin loading and the registry of hook records.

Entry points of the ``titan`` group are read from package metadata; each is imported unless it
is disabled (``TITAN_DISABLE_PLUGINS=a,b`` or ``titan --disable-plugin NAME``), in which case
it is never imported. A plugin whose import or any hook fails is recorded as failed, entirely:
none of its records (of any kind) are offered. A run that asks for a name the failed plugin
provides fails with that plugin's error; one that asks for a name nobody provides lists the
failed plugins. Two plugins with one name both fail (each naming the other's distribution);
disabling the name disables both.

Hook records of every kind are gathered together, when the entry points are loaded (or on first
use after :meth:`Registry.register`), so that a plugin's failure in any hook is known before a
run uses any of its records. Records are keyed by lower-cased name. A name provided by two
plugins is a conflict: ``titan plugins list`` shows it, and only a run that asks for that name
fails, with a :class:`~titan_core.errors.PluginError` naming both distributions (disabling either
plugin resolves it). Config sections are the exception: every config holds every section, so a
section name provided twice fails every run (:meth:`Registry.config_sections`).

Hook results are checked strictly: a hook must return a list of its record type; a bare record,
``None`` or a ``titan_*`` function without ``@hookimpl`` fails the plugin with a message naming it.
Each plugin's import time is measured, and a plugin that imports torch at module level is flagged
(it makes ``titan --help`` and ``titan plugins list`` slow).
"""

from __future__ import annotations

import keyword
import os
import re
import sys
import time
from importlib import metadata
from typing import Any

import attrs
import pluggy

from titan_core import hookspecs
from titan_core.errors import PluginError, UsageError, describe
from titan_core.records import RECORD_TYPES, Callback, ConfigSection
from titan_core.stop_signals import STOPS

ENTRY_POINT_GROUP = "titan"
#: The module of titan's own plugin, which cannot be disabled (``cli._refuse_disabled_core``).
CORE_MODULE = "titan_core._builtin"
DISABLE_ENV = "TITAN_DISABLE_PLUGINS"
_CORE_DISTRIBUTION = "titan-core"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

# Record kind -> hook name.
_HOOKS = {kind: f"titan_{kind}" for kind in RECORD_TYPES}


@attrs.define
class PluginInfo:
    """What ``titan plugins list`` shows for one plugin."""

    name: str
    distribution: str
    version: str
    module: str
    status: str = "loaded"  # loaded | failed | disabled
    error: str | None = None
    hooks: list[str] = attrs.field(factory=list)
    provides: dict[str, list[str]] = attrs.field(factory=dict)
    #: Seconds spent importing the plugin module (entry points only).
    import_seconds: float = 0.0
    #: Whether importing the module imported torch (it should not: see docs/plugins.md).
    imported_torch: bool = False
    #: Names this plugin provides that another plugin provides too.
    conflicts: list[str] = attrs.field(factory=list)

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}".strip()


@attrs.frozen
class _Provided:
    record: Any
    plugin: PluginInfo
    #: Other plugins providing the same name (a conflict: using the name fails).
    rivals: tuple[PluginInfo, ...] = ()
    #: The records the rivals returned, in the same order (a run option's flag is its own).
    rival_records: tuple[Any, ...] = ()


#: A plugin's info and the records its hooks returned, by kind (before failures are known).
_Results = tuple[PluginInfo, dict[str, list[Any]]]


def disabled_from_env() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {n.strip() for n in raw.split(",") if n.strip()}


class Registry:
    """Loaded plugins and, per hook, the records they provide."""

    def __init__(self, disabled: set[str] | frozenset[str] = frozenset()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.disabled = set(disabled)
        #: Keyed by plugin name; a second plugin of the same name is kept under a longer key.
        self.plugins: dict[str, PluginInfo] = {}
        self._records: dict[str, dict[str, _Provided]] = {}
        #: (kind, lower-cased name) -> the failed plugin whose hook returned that record.
        self._withheld: dict[tuple[str, str], PluginInfo] = {}
        #: Plugins failed by one of their hooks: their other hooks are still called, to name them.
        self._hook_failed: set[int] = set()

    # -- loading ---------------------------------------------------------------------------------

    def load_entry_points(self) -> Registry:
        seen: set[tuple[str, str]] = set()
        found = []
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:  # the same distribution found twice on sys.path
                continue
            seen.add((ep.name, ep.value))
            found.append(ep)
        # A name two distributions declare fails both: decided before importing either, since
        # whichever was imported would run its import-time code for a plugin that never loads.
        names = [ep.name for ep in found]
        for ep in found:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "?"
            version = dist.version if dist is not None else ""
            info = PluginInfo(ep.name, dist_name, version, ep.value)
            if ep.name in self.disabled or names.count(ep.name) > 1:
                info.status = "disabled" if ep.name in self.disabled else "failed"
                self._add_info(info)
                continue
            had_torch = "torch" in sys.modules
            start = time.perf_counter()
            try:
                plugin = _load_entry_point(ep, dist_name)
            except _EntryPointError as exc:
                info.status, info.error = "failed", str(exc)
                self._add_info(info)
                continue
            except BaseException as exc:
                if isinstance(exc, STOPS):  # Ctrl-C or SIGTERM while it imported: not its failure
                    raise
                info.status, info.error = "failed", describe(exc)
                self._add_info(info)
                continue
            finally:
                info.import_seconds = time.perf_counter() - start
                info.imported_torch = not had_torch and "torch" in sys.modules
            if (problem := _unbound_hooks(ep, plugin, dist_name)) is not None:
                info.status, info.error = "failed", problem
                self._add_info(info)
                continue
            if not self._declared_once(plugin, info):
                continue
            self._register(plugin, info)
            if info.status == "loaded" and not info.hooks:
                # Loaded, offering nothing: its recipes and models were "unknown" with no word on
                # why (an entry point naming the package instead of its plugin module, or a hook
                # function instead of its module).
                self._withdraw(info, _no_hooks(ep, plugin, dist_name))
        self.gather_all()  # a failure in any hook is known before a run uses anything
        return self

    def register(
        self, plugin: Any, name: str, distribution: str = "(registered)", version: str = ""
    ) -> PluginInfo:
        """Register a plugin object directly (tests, notebooks, embedding titan)."""
        info = PluginInfo(name, distribution, version, getattr(plugin, "__name__", repr(plugin)))
        if name in self.disabled:
            info.status = "disabled"
            self._add_info(info)
            return info
        self._register(plugin, info)
        return info

    def _add_info(self, info: PluginInfo) -> bool:
        """Record ``info``; ``False`` when another plugin has its name (both are then failed)."""
        self._records.clear()
        same = [p for p in self.plugins.values() if p.name == info.name]
        key, n = info.name, 1
        while key in self.plugins:
            n += 1
            key = f"{info.name} ({n})"
        self.plugins[key] = info
        if not same or info.status == "disabled":  # disabled plugins of one name never clash
            return True
        clashing = [p for p in same if p.status != "disabled"] + [info]
        if len(clashing) == 1:
            return True
        listed = " and ".join(f"{p.origin} ({p.module})" for p in clashing)
        error = (
            f"{len(clashing)} plugins are named {info.name!r}: from {listed}; none of them is loaded. "
            f"Uninstall all but one of them, or disable the name ({DISABLE_ENV}={info.name} or "
            f"--disable-plugin {info.name}; that disables all of them)"
        )
        for p in clashing:
            self._withdraw(p, error)
        return False

    def _withdraw(self, info: PluginInfo, error: str) -> None:
        """Fail ``info``'s plugin with ``error``: unregistered, offering nothing."""
        if self.pm.has_plugin(info.name):
            self.pm.unregister(name=info.name)
        self._hook_failed.discard(id(info))
        info.status, info.error, info.provides = "failed", error, {}

    def _declared_once(self, plugin: Any, info: PluginInfo) -> bool:
        """Whether ``plugin`` (an entry point's object) is registered under no other entry point.

        pluggy registers an object once: the second entry point naming a module failed with its
        ``Plugin already registered under a different name`` and a dict of every plugin, while the
        first kept the records, credited to whichever distribution came first on ``sys.path``. As
        for two plugins of one name, both fail naming each other; titan's own plugin, which cannot
        be disabled, stays loaded, and only the other fails."""
        first_name = self.pm.get_name(plugin)
        if first_name is None:
            return True
        first = next(p for p in self.plugins.values() if p.name == first_name and p.status != "disabled")
        # Named in a fixed order: which one came first depends on sys.path, not on the user.
        one, two = sorted((first, info), key=lambda p: p.name)
        error = (
            f"entry points {one.name!r} ({one.origin}) and {two.name!r} ({two.origin}) both name "
            f"{info.module}; none of them is loaded. A plugin is declared once: remove one of the "
            "entry points, or uninstall one of the distributions"
        )

        def ours(p: PluginInfo) -> bool:  # titan's own entry point, not another naming its module
            return p.module == CORE_MODULE and p.distribution == _CORE_DISTRIBUTION

        if ours(first) or ours(info):
            error = error.replace("none of them is loaded", "titan's own plugin stays loaded")
        if ours(info):  # the core came second: the third party's goes, and the core registers
            self._withdraw(first, error)
            return True
        self._add_info(info)
        info.status, info.error = "failed", error
        if not ours(first):
            self._withdraw(first, error)
        return False

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        if not self._add_info(info):
            return
        try:
            self.pm.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:  # pluggy validates hook implementations here
            info.status, info.error = "failed", _invalid_hook(plugin, exc)
            return
        except Exception as exc:
            info.status, info.error = "failed", describe(exc)
            return
        info.hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])
        unknown = [h for h in info.hooks if not hasattr(hookspecs, h)]
        undecorated = [
            name
            for name in dir(plugin)
            if name.startswith("titan_")
            and callable(getattr(plugin, name, None))
            and name not in info.hooks
            and getattr(plugin, name).__module__ == getattr(plugin, "__name__", None)
        ]
        if unknown:  # a misspelt hook would otherwise be silently ignored
            self.pm.unregister(plugin)
            info.status = "failed"
            info.error = f"implements unknown hooks {', '.join(unknown)}; titan's hooks are " + ", ".join(
                f"titan_{k}" for k in RECORD_TYPES
            )
        elif undecorated:  # without @hookimpl pluggy never calls it
            self.pm.unregister(plugin)
            info.status = "failed"
            info.error = (
                f"{', '.join(undecorated)} {'is' if len(undecorated) == 1 else 'are'} not decorated "
                "with @titan_core.hookimpl, so titan would never call "
                f"{'it' if len(undecorated) == 1 else 'them'}; add the decorator"
            )

    # -- records ---------------------------------------------------------------------------------

    def unavailable(self, kind: str, name: str, what: str | None = None) -> str | None:
        """Why ``name`` of ``kind`` is not offered when a failed plugin's hook returned it, else ``None``;
        ``what`` names the record in the message (default: the kind, ``config section``).

        E.g. ``unavailable("config_sections", "zloss")`` for an error about ``config.zloss``.
        """
        self._gather(kind)
        info = self._withheld.get((kind, name.lower()))
        if info is None:
            return None
        what = what or kind.rstrip("s").replace("_", " ")
        return f"{what} {name!r} is provided by plugin {info.name!r} ({info.origin}), which failed: " + (
            info.error or ""
        )

    def records(self, kind: str) -> dict[str, Any]:
        """All records of one kind (``models``, ``recipes``, ...) keyed by lower-cased name.

        Conflicting names (two providers) are left out: using them fails in :meth:`get`.
        """
        return {name: p.record for name, p in self._gather(kind).items() if not p.rivals}

    def every(self, kind: str) -> dict[str, Any]:
        """All records of a kind that every run consults as a whole (``strategies``: each one's
        ``applies`` is asked; ``callbacks``: each one is built), keyed by lower-cased name.

        A name two plugins provide is a :class:`PluginError` naming both, not left out as in
        :meth:`records`: a run cannot avoid asking for it, and leaving both out would run without
        either (a third party's callback named ``metrics_file`` removed titan's metrics.jsonl).
        """
        found = self._gather(kind)
        for provided in found.values():
            if provided.rivals:
                raise PluginError(_conflict_message(_LABEL_WORDS.get(kind, kind), provided))
        return {name: p.record for name, p in found.items()}

    def conflicts(self, kind: str, what: str | None = None) -> dict[str, str]:
        """Names of ``kind`` that two plugins provide, each with the error naming both."""
        return {name: message for name, (_, message) in self.conflicting_records(kind, what).items()}

    def conflicting_records(self, kind: str, what: str | None = None) -> dict[str, tuple[list[Any], str]]:
        """As :meth:`conflicts`, with every provider's record of each name (first provider first):
        what a caller needs that refuses the name's uses, e.g. a run option's flags."""
        what = what or kind.rstrip("s").replace("_", " ")
        return {
            p.record.name: ([p.record, *p.rival_records], _conflict_message(what, p))
            for p in self._gather(kind).values()
            if p.rivals
        }

    def provider(self, kind: str, name: str) -> PluginInfo:
        return self._gather(kind)[name.lower()].plugin

    def providers(self, kind: str, name: str) -> list[PluginInfo]:
        """Every plugin providing ``name`` of ``kind``, the first first (one unless a conflict):
        what the list commands name in a conflicting name's row."""
        provided = self._gather(kind)[name.lower()]
        return [provided.plugin, *provided.rivals]

    def label(self, kind: str, name: str) -> str:
        """How errors name the record ``name`` of ``kind`` and the plugin behind it: ``strategy
        'fsdp' (plugin parallel, titan-plugins-parallel 0.1.0)``; ``(plugin NAME)`` for a plugin
        registered as an object (no distribution), ``(plugin unknown)`` when none provides it."""
        try:
            info = self.provider(kind, name)
        except KeyError:
            plugin = "plugin unknown"
        else:
            known = info.distribution and info.distribution != "(registered)"
            plugin = f"plugin {info.name}, {info.origin}" if known else f"plugin {info.name}"
        return f"{_LABEL_WORDS.get(kind, kind)} {name!r} ({plugin})"

    def get(self, kind: str, name: str, *, what: str | None = None) -> Any:
        """The record ``name`` of ``kind``; unknown names list the known ones and failed plugins."""
        found = self._gather(kind).get(name.lower())
        what = what or kind.rstrip("s").replace("_", " ")
        if found is not None and found.rivals:
            raise PluginError(_conflict_message(what, found))
        if found is not None:
            return found.record
        if (problem := self.unavailable(kind, name, what)) is not None:
            raise PluginError(problem)
        known = ", ".join(sorted(p.record.name for p in self._gather(kind).values())) or "(none)"
        message = f"unknown {what} {name!r}; known: {known}"
        message += f"\n({INSTALL_HINT}; titan plugins list shows what is installed)"
        failed = [p for p in self.plugins.values() if p.status == "failed"]
        if failed:
            message += "\n" + "\n".join(
                f"plugin {p.name!r} ({p.origin}) failed to load and may provide it: {p.error}" for p in failed
            )
            raise PluginError(message)
        disabled = [p.name for p in self.plugins.values() if p.status == "disabled"]
        if disabled:
            message += f"\n(disabled plugins, not searched: {', '.join(disabled)})"
        raise UsageError(message)

    def gather_all(self) -> None:
        """Gather every kind (all are gathered together, so one call to :meth:`_gather` does)."""
        self._gather(next(iter(RECORD_TYPES)))

    def config_sections(self) -> dict[str, type]:
        """Plugin config sections by name (a conflict is an error: a config cannot hold both). Each
        class's section name was registered for error paths when its record was checked."""
        sections = {}
        for provided in self._gather("config_sections").values():
            if provided.rivals:
                raise PluginError(_conflict_message("config section", provided))
            sections[provided.record.name] = provided.record.cls
        return sections

    def config_checks(self) -> list[tuple[ConfigSection, str]]:
        """The plugin config sections that have a cross-field check, each with how errors name
        it (``config section 'x' (plugin p, dist 1.0)``)."""
        return [
            (p.record, self.label("config_sections", p.record.name))
            for p in self._gather("config_sections").values()
            if p.record.check is not None and not p.rivals
        ]

    def _gather(self, kind: str) -> dict[str, _Provided]:
        if not self._records:
            self._gather_every_kind()
        return self._records[kind]

    def _gather_every_kind(self) -> None:
        """Call every hook of every loaded plugin, then offer the records of those that did not fail.

        A plugin fails as a whole: a bad result from any of its hooks withholds the records its
        other hooks returned, so a run never uses half of a plugin.
        """
        results: dict[str, _Results] = {}
        for kind, hook_name in _HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                info = self.plugins.get(impl.plugin_name)
                if info is None or (info.status != "loaded" and id(info) not in self._hook_failed):
                    continue
                by_kind = results.setdefault(impl.plugin_name, (info, {}))[1]
                try:
                    result = impl.function()
                    error = None
                except STOPS:
                    raise
                except BaseException as exc:  # a hook that raises fails its plugin, not the run
                    # SystemExit too (``sys.exit()`` in a hook), as at import: it ended every
                    # ``titan`` command, ``--help`` included, with the plugin's status and no word.
                    error = describe(exc)
                else:
                    try:
                        by_kind[kind] = _check_result(result, RECORD_TYPES[kind], hook_name)
                    except (TypeError, ValueError) as exc:  # the hook's result is wrong: point at it
                        error = f"{type(exc).__name__}: {exc} (the hook: {_where(impl.function)})"
                if error is not None and info.status == "loaded":  # the first problem is reported
                    info.status, info.error = "failed", error
                    self._hook_failed.add(id(info))
        self._withheld.clear()
        self._records = {kind: {} for kind in RECORD_TYPES}
        for info, by_kind in (results[key] for key in self.plugins if key in results):  # registration order
            info.provides, info.conflicts = {}, []
            for kind, result in by_kind.items():
                if info.status != "loaded":
                    for record in result:
                        self._withheld.setdefault((kind, record.name.lower()), info)
                    continue
                gathered = self._records[kind]
                for record in result:
                    key = record.name.lower()
                    info.provides.setdefault(kind, []).append(record.name)
                    if key in gathered:  # a conflict: recorded, fatal only for runs using the name
                        first = gathered[key]
                        gathered[key] = attrs.evolve(
                            first, rivals=(*first.rivals, info), rival_records=(*first.rival_records, record)
                        )
                        for p in (first.plugin, info):
                            p.conflicts.append(f"{kind}: {first.record.name}")
                        continue
                    gathered[key] = _Provided(record, info)


class _EntryPointError(Exception):
    """An entry point that names nothing: the message says which and what to change."""


def _fix_where(dist_name: str) -> str:
    return f"fix the entry point in the [project.entry-points.titan] table of {dist_name}'s pyproject.toml"


def _load_entry_point(ep: metadata.EntryPoint, dist_name: str) -> Any:
    """``ep.load()``, where an entry point naming a module that is not installed, or an object its
    module lacks, is an :class:`_EntryPointError` saying so (``ep.load`` reported it as an
    ``AttributeError`` or ``ModuleNotFoundError`` at a line of importlib, naming neither the entry
    point nor where to fix it). A module that is found but fails to import fails as it is."""
    import importlib

    module_name, attr = ep.module, ep.attr
    try:
        found: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
            raise  # a dependency the plugin imports, not the entry point's own module
        raise _EntryPointError(
            f"entry point '{ep.name} = {ep.value}' names module {module_name!r}, which is not "
            f"installed (no module named {missing!r}); {_fix_where(dist_name)}, or make the "
            "distribution include the package"
        ) from None
    owner = f"module {module_name!r}"
    for piece in attr.split(".") if attr else ():
        if not hasattr(found, piece):
            raise _EntryPointError(
                f"entry point '{ep.name} = {ep.value}' names no object: {owner} has no attribute "
                f"{piece!r}; {_fix_where(dist_name)} (module:object, or just the module)"
            )
        found = getattr(found, piece)
        owner = f"{module_name}:{attr[: attr.index(piece) + len(piece)]}"
    return found


def _unbound_hooks(ep: metadata.EntryPoint, plugin: Any, dist_name: str) -> str | None:
    """Why an entry point naming a class whose hooks are plain methods cannot work, else ``None``:
    pluggy registers the class itself, and every hook then failed with ``missing 1 required
    positional argument: 'self'`` at titan's line that calls it."""
    import inspect

    if not inspect.isclass(plugin):
        return None
    methods = [
        name
        for name in dir(plugin)
        if name.startswith("titan_") and inspect.isfunction(inspect.getattr_static(plugin, name, None))
    ]
    if not methods:  # staticmethods and classmethods are called fine without an instance
        return None
    return (
        f"entry point '{ep.name} = {ep.value}' names the class {plugin.__name__}, whose hooks "
        f"{', '.join(methods)} {'is a method' if len(methods) == 1 else 'are methods'}: titan would "
        f"call {'it' if len(methods) == 1 else 'them'} without an instance. Name a module, or an "
        f"instance (PLUGIN = {plugin.__name__}() in {ep.module}, and '{ep.module}:PLUGIN' in "
        f"{dist_name}'s entry point)"
    )


def _no_hooks(ep: metadata.EntryPoint, plugin: Any, dist_name: str) -> str:
    """Why an entry point whose object implements no titan hook is a mistake, and what to name."""
    import inspect

    named = f"entry point '{ep.name} = {ep.value}'"
    if inspect.ismodule(plugin):
        return (
            f"{named} names module {ep.module!r}, which defines no titan hook (a function named like "
            "titan_models or titan_recipes, decorated with @titan_core.hookimpl), so the plugin would "
            f"provide nothing; name the module that defines the hooks; {_fix_where(dist_name)}"
        )
    if inspect.isroutine(plugin):
        return (
            f"{named} names the function {ep.attr}, not a plugin: name the module that defines the "
            f"hooks ('{ep.name} = {ep.module}') or an object whose methods they are; "
            f"{_fix_where(dist_name)}"
        )
    return (
        f"{named} names {type(plugin).__name__} {plugin!r}, which implements no titan hook, so the "
        f"plugin would provide nothing; name a module, or an instance whose methods are the hooks; "
        f"{_fix_where(dist_name)}"
    )


#: Where to look up which distribution provides a name: one documented table, not code paths.
INSTALL_HINT = (
    "titan's own plugins and what each provides: docs/architecture.md, 'Plugins in this repository'"
)


#: The record a kind's error names (``label``): the kinds plugin code of the trainer runs.
_LABEL_WORDS = {
    "models": "model",
    "strategies": "strategy",
    "callbacks": "callback",
    "config_sections": "config section",
    "checkpointers": "checkpointer",
    "comm_backends": "comm backend",
    "datasets": "dataset",
    "run_options": "run option",
}


def _conflict_message(what: str, provided: _Provided) -> str:
    owners = [provided.plugin, *provided.rivals]
    if all(p is provided.plugin for p in owners):  # one plugin, two spellings of one name
        spellings = ", ".join(repr(r.name) for r in (provided.record, *provided.rival_records))
        return (
            f"{what} {provided.record.name!r} is provided twice by plugin {provided.plugin.name!r} "
            f"({provided.plugin.origin}), as {spellings}: names are compared without case; the "
            "plugin must rename one"
        )
    name = provided.record.name
    # Every remedy: which one the user wants is theirs to say; but titan's core cannot be disabled
    # (the CLI refuses it), so it is never offered.
    ways = " or ".join(
        f"{DISABLE_ENV}={p.name} (--disable-plugin {p.name})" for p in owners if p.module != CORE_MODULE
    )
    if len(owners) == 2:
        listed = " and ".join(f"plugin {p.name!r} ({p.origin})" for p in owners)
        return f"{what} {name!r} is provided twice: by {listed}; uninstall or disable one of them ({ways})"
    # Three or more: disabling one of them (as "twice" said) still left a conflict.
    listed = ", ".join(f"plugin {p.name!r} ({p.origin})" for p in owners)
    return (
        f"{what} {name!r} is provided by {len(owners)} plugins: {listed}; uninstall or disable all but "
        f"one of them ({ways})"
    )


def _where(function: Any) -> str:
    code = getattr(function, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(function)


def _invalid_hook(plugin: Any, exc: Exception) -> str:
    """pluggy's refusal of a hook implementation as one line at the plugin's function: its own
    message is several lines and points at pluggy's file."""
    import inspect

    for name in sorted(dir(plugin)):
        function = getattr(plugin, name, None)
        if not name.startswith("titan_") or not hasattr(hookspecs, name) or not callable(function):
            continue
        try:
            parameters = list(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            continue
        if parameters:  # titan's hooks have no arguments: pluggy would never pass these
            return (
                f"{name}({', '.join(parameters)}) takes arguments; titan calls its hooks with none: "
                f"define {name}() (at {_where(function)})"
            )
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _check_result(result: Any, record_type: type, hook: str) -> list[Any]:
    if result is None:
        raise TypeError(f"{hook}() returned None; return a list of {record_type.__name__} records")
    if isinstance(result, record_type):
        raise TypeError(
            f"{hook}() returned one {record_type.__name__}, not a list; return [{record_type.__name__}(...)]"
        )
    if not isinstance(result, (list, tuple)):
        raise TypeError(
            f"{hook}() returned {type(result).__name__}; return a list of {record_type.__name__} records"
        )
    for record in result:
        _check_record(record, record_type, hook)
    return list(result)


def _check_record(record: Any, record_type: type, hook: str) -> None:
    if not isinstance(record, record_type):
        raise TypeError(f"{hook}() returned {type(record).__name__}, expected {record_type.__name__}")
    if not isinstance(record.name, str) or not _NAME_RE.match(record.name):
        raise ValueError(f"{hook}() returned a {record_type.__name__} with invalid name {record.name!r}")
    if record_type is ConfigSection:
        _check_section(record, hook)
    if record_type is Callback and record.serves:
        from titan_core.config import served_fields

        unknown = [path for path in record.serves if path not in served_fields()]
        if unknown:
            raise ValueError(
                f"{hook}() returned callback {record.name!r} serving {', '.join(map(repr, unknown))}, "
                f"not a core field a plugin implements; those are: {', '.join(served_fields()) or '(none)'}"
            )


def _check_section(record: ConfigSection, hook: str) -> None:
    from titan_core.config import CORE_SECTIONS, TrainerConfig

    if not record.name.isidentifier() or keyword.iskeyword(record.name) or record.name.startswith("_"):
        suggestion = re.sub(r"\W+", "_", record.name).strip("_") or "my_section"
        raise ValueError(
            f"{hook}() returned config section {record.name!r}: recipes write it as config.<name>, so "
            f"its name must be a Python identifier not starting with '_' (e.g. {suggestion!r})"
        )
    taken = {*CORE_SECTIONS, *(a.name for a in attrs.fields(TrainerConfig))}
    if record.name.lower() in taken or hasattr(TrainerConfig, record.name):
        raise ValueError(
            f"{hook}() returned config section {record.name!r}, but config section {record.name!r} is "
            "titan's own; a plugin cannot replace it: rename the section (e.g. after the plugin)"
        )
    if not isinstance(record.cls, type) or not attrs.has(record.cls):
        raise TypeError(
            f"{hook}() returned config section {record.name!r} whose class {record.cls!r} is not a class "
            "made with titan_core.config.section"
        )
    unchecked = _unchecked_fields(record.cls)
    if unchecked:
        # A plain ``attrs.define`` class is an attrs class too, but nothing checks its fields:
        # ``config.x.count = "a"`` on an ``int`` field ran with the string, without a word.
        raise TypeError(
            f"{hook}() returned config section {record.name!r} whose class {record.cls.__name__} has "
            f"fields no one checks when a recipe sets them ({', '.join(map(repr, unchecked))}): its "
            "class (or a nested one) is a plain attrs class; decorate it with "
            "@titan_core.config.section"
        )
    # Every config holds every section, so a class that cannot be built with its defaults would
    # fail every run: found here, naming the plugin, instead (and the field by the section's name).
    from titan_core.config import register_section_name

    register_section_name(record.name, record.cls)
    try:
        record.cls()
    except Exception as exc:
        raise TypeError(
            f"{hook}() returned config section {record.name!r} whose class cannot be built with its "
            f"defaults ({type(exc).__name__}: {exc}); give every field a valid default"
        ) from None
    unwritable = _unwritable_fields(record.cls)
    if unwritable:
        raise TypeError(
            f"{hook}() returned config section {record.name!r}, which has fields titan cannot write to "
            f"config.toml and read back: {', '.join(unwritable)}; use bool, int, float, str, None, "
            "Literal[...], list[...], tuple[...] or dict[str, ...] of those (their items not None: TOML has "
            "no null), or a nested section class"
        )
    fields = {a.name for a in attrs.fields(record.cls)}
    unknown = [r for r in record.results if r not in fields]
    if unknown:
        raise ValueError(
            f"{hook}() returned config section {record.name!r} whose results name "
            f"{', '.join(map(repr, unknown))}, not fields of it; its fields: {', '.join(sorted(fields))}"
        )
    if record.check is not None and not callable(record.check):
        raise TypeError(f"{hook}() returned config section {record.name!r} whose check is not callable")


def _unchecked_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of the fields of ``cls`` (and of its nested attrs classes) that
    :func:`titan_core.config.section` did not put its type and value check on."""
    import typing

    from titan_core.config import _Checked

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: the field checks name them
        hints = {}
    found = []
    for a in attrs.fields(cls):
        if not isinstance(a.validator, _Checked):
            found.append(prefix + a.name)
            continue
        nested = hints.get(a.name, a.type)
        if isinstance(nested, type) and attrs.has(nested) and nested is not cls:
            found += _unchecked_fields(nested, f"{prefix}{a.name}.")
    return found


def _unwritable_fields(cls: type) -> list[str]:
    """``name (type)`` of each field of a section class whose type TOML cannot hold (a ``set`` was
    written to config.toml as the string ``"{'a'}"``; an ``object`` field made ``titan recipes
    copy config.toml`` end in a cattrs traceback). Annotations that do not resolve are left to
    the field checks, which name them."""
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return []
    found = []
    for a in attrs.fields(cls):
        if a.name not in hints:
            continue
        annotation = hints[a.name]
        if isinstance(annotation, type) and attrs.has(annotation):  # a nested section: its own fields
            if inner := _unwritable_fields(annotation):
                found.append(f"{a.name} ({_type_text(annotation)}: {', '.join(inner)})")
        elif not _writable(annotation):
            found.append(f"{a.name} ({_type_text(annotation)})")
        elif _allows_none(annotation) and a.default is not None:
            # TOML has no null: a None is recorded by leaving the key out (``# x = (unset)``),
            # which reads back as the default, so a run's config.toml (and --print-config) said
            # the default where the recipe had set None.
            default = "its factory's value" if isinstance(a.default, attrs.Factory) else repr(a.default)
            found.append(
                f"{a.name} ({_type_text(annotation)} with default {default}: TOML has no null, and a "
                f"None left out reads back as {default}; make None its default or drop None from it)"
            )
    return found


def _allows_none(annotation: Any) -> bool:
    """Whether ``annotation`` admits ``None`` (``int | None``, ``Literal["a", None]``, ``Any``)."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return True
    if origin is typing.Literal:
        return None in args
    if origin in (typing.Union, types.UnionType):
        return any(_allows_none(a) for a in args)
    return False


def _type_text(annotation: Any) -> str:
    """A bare class by its name (``object``); a generic as written (``set[str]``)."""
    import typing

    plain = isinstance(annotation, type) and not typing.get_args(annotation)
    return annotation.__name__ if plain else str(annotation)


def _writable(annotation: Any) -> bool:
    """Whether config.toml can hold a value of ``annotation`` and give it back as that type."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or annotation in (bool, int, float, str, type(None), list, tuple, dict):
        return True
    if origin is typing.Literal:
        return all(isinstance(a, (bool, int, float, str)) or a is None for a in args)
    if origin in (typing.Union, types.UnionType):
        return all(_writable(a) for a in args)
    # An item of a TOML array or inline table cannot be left out as a field can: a None there
    # was written as the string "None" (read back as that string, or refused).
    if origin in (list, tuple):
        return all(a is Ellipsis or (_writable(a) and not _allows_none(a)) for a in args)
    if origin is dict:
        return len(args) == 2 and args[0] is str and _writable(args[1]) and not _allows_none(args[1])
    if isinstance(annotation, type) and attrs.has(annotation):  # a nested section: a TOML table
        return not _unwritable_fields(annotation)
    return False


_default: Registry | None = None


def get_registry(disabled: set[str] | None = None) -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    if _default is None or (disabled is not None and disabled | disabled_from_env() != _default.disabled):
        _default = Registry((disabled or set()) | disabled_from_env()).load_entry_points()
    return _default


def reset_registry() -> None:
    global _default
    _default = None
