"""A third party's ``titan <command>`` (``titan_commands``) that fails or returns what is no exit
status: one ``titan: error:`` line naming the command, its plugin and distribution, exit 1.

A plugin command raising anything but titan's own errors ended ``titan`` in a full traceback; one
returning a string went to ``sys.exit("...")`` (the text printed bare, exit 1), and ``return 256``
exited 0 (the status is taken modulo 256).
"""

from __future__ import annotations

import argparse
import json
import re
import types
from typing import Any

import pytest

from tests.conftest import plugin_module
from titan_core import Command, _registry, hookimpl
from titan_core._registry import Registry
from titan_core.errors import PluginError


def _cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *argv: str,
    **plugins: types.ModuleType,
) -> tuple[int, str, str]:
    """``titan ARGV`` in this process, with titan's plugins and ``plugins`` (as ``dist-NAME 1.0``)."""
    from titan_core.cli import main

    registry = Registry().load_entry_points()
    for name, module in plugins.items():
        registry.register(module, name, f"dist-{name}", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: registry)
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _hello(run: Any, configure: Any = None) -> types.ModuleType:
    command = Command("hello", "say hello", configure or (lambda parser: None), run)
    return plugin_module("greeter", titan_commands=[command])


def _boom(args: argparse.Namespace) -> int:
    raise ValueError("no greeting configured")


def test_a_plugin_command_that_raises_is_one_line_naming_the_command_plugin_and_place(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(monkeypatch, capsys, "hello", greeter=_hello(_boom))
    assert code == PluginError.exit_code == 1
    (line,) = err.splitlines()
    assert line.startswith(
        "titan: error: command 'hello' of plugin 'greeter' (dist-greeter 1.0) failed: "
        "ValueError: no greeting configured (at "
    ), line
    assert re.search(r"test_cli_plugin_commands\.py:\d+\)$", line), line


@pytest.mark.parametrize(
    ("returned", "shown"),
    [("all done", "'all done' (str)"), (256, "256 (int)"), (-1, "-1 (int)"), (True, "True (bool)")],
)
def test_a_plugin_command_returning_no_exit_status_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], returned: Any, shown: str
) -> None:
    code, _, err = _cli(monkeypatch, capsys, "hello", greeter=_hello(lambda args: returned))
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith(
        f"titan: error: command 'hello' of plugin 'greeter' (dist-greeter 1.0) returned {shown} from "
        "run; it must return an exit status (an int from 0 to 255, 0 for success) or None (success)"
    ), line


@pytest.mark.parametrize(("returned", "code"), [(None, 0), (0, 0), (3, 3)])
def test_a_plugin_commands_exit_status_is_titans(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], returned: Any, code: int
) -> None:
    assert _cli(monkeypatch, capsys, "hello", greeter=_hello(lambda args: returned))[0] == code


def test_a_plugin_command_whose_configure_failed_is_refused_when_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its ``configure`` failing only warned (``titan --help`` must still work), and the command then
    ran with the arguments it never added: an ``AttributeError`` in the plugin's ``run``."""

    def configure(parser: argparse.ArgumentParser) -> None:
        raise RuntimeError("argparse misuse")

    greeter = _hello(lambda args: print(args.name), configure)
    code, out, err = _cli(monkeypatch, capsys, "hello", greeter=greeter)
    assert code == 1 and "AttributeError" not in out + err  # its run was not called
    assert (
        "titan: error: command 'hello' of plugin 'greeter' (dist-greeter 1.0) failed to set up its "
        "arguments (configure): RuntimeError: argparse misuse (at "
    ) in err, err
    assert "Traceback" not in err
    code, out, err = _cli(monkeypatch, capsys, "plugins", "list", greeter=greeter)
    assert code == 0 and "warning: command 'hello' of plugin 'greeter' (dist-greeter 1.0)" in err


# -- list commands and names two plugins provide --------------------------------------------------


def _recipe_and_model(name: str) -> types.ModuleType:
    """A plugin providing recipe ``llama3_debugmodel`` and model ``llama3`` (titan's names)."""
    from titan_core import Recipe, TrainerConfig

    llama3 = Registry().load_entry_points().get("models", "llama3")
    return plugin_module(
        name,
        titan_recipes=[Recipe("llama3_debugmodel", TrainerConfig, "")],
        titan_models=[llama3],
    )


CONFLICT = (
    "{what} {name!r} is provided twice: by plugin 'llama3' (titan-plugins-llama3 0.1.0) and plugin "
    "'rival' (dist-rival 1.0); uninstall or disable one of them"
)


@pytest.mark.parametrize(
    ("argv", "what", "name"),
    [(("recipes", "list"), "recipe", "llama3_debugmodel"), (("models", "list"), "model", "llama3")],
)
def test_list_commands_show_a_name_two_plugins_provide_and_exit_1(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    what: str,
    name: str,
) -> None:
    """The name was left out of the table, exit 0: only ``titan plugins list`` said why."""
    rival = _recipe_and_model("rival")
    code, out, err = _cli(monkeypatch, capsys, *argv, rival=rival)
    assert code == 1
    rows = [line for line in out.splitlines() if line.split()[:1] == [name]]
    assert rows and all("conflict" in row for row in rows), out
    assert f"titan: error: {CONFLICT.format(what=what, name=name)}" in err, err
    assert err.count("provided twice") == 1  # one line per name, not one per flavor
    code, out, err = _cli(monkeypatch, capsys, *argv, "--json", rival=rival)
    assert code == 1
    listed = [r for r in json.loads(out) if r.get("name", r.get("model")) == name]
    assert listed and all(CONFLICT.format(what=what, name=name) in r["error"] for r in listed)
    # The other names are listed as ever.
    assert len(json.loads(out)) > len(listed)


@pytest.mark.parametrize("argv", [("recipes", "list"), ("models", "list")])
def test_list_commands_name_a_failed_plugin_whose_names_are_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    """A plugin whose hook fails offers nothing: its recipes and models were missing from the
    lists without a word (``titan run`` warns of it; ``titan plugins list`` shows it)."""

    def broken() -> list:
        raise ImportError("No module named 'sentencepiece'")

    failing = types.ModuleType("failing")
    failing.titan_models = hookimpl(broken)  # type: ignore[attr-defined]
    code, out, err = _cli(monkeypatch, capsys, *argv, failing=failing)
    assert code == 0 and "llama3" in out
    assert "titan: warning: plugin 'failing' (dist-failing 1.0) failed to load" in err, err
    assert "No module named 'sentencepiece'" in err
