"""A third party's ``titan run`` flag (``titan_run_options``) that fails or returns what is no
exit status: one ``titan: error:`` line naming the run option, its plugin and distribution,
exit 1, as a plugin command's (``cli.run_command_record``).

A run option raising anything but titan's own errors ended ``titan run`` in a full traceback; one
returning a string went to ``sys.exit("...")`` (the text printed bare, exit 1), and ``return 256``
exited 0 (the status is taken modulo 256).
"""

from __future__ import annotations

import re
import types
from typing import Any

import pytest

from tests.conftest import plugin_module
from titan_core import RunOption, _registry
from titan_core._registry import Registry
from titan_core.errors import PluginError, UsageError


def _cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], run: Any
) -> tuple[int, str, str]:
    """``titan run --recipe llama3_debugmodel --shout`` in this process, ``--shout`` being the
    run option of plugin ``loud`` (``dist-loud 1.0``) whose ``run`` is ``run``."""
    from titan_core.cli import main

    module: types.ModuleType = plugin_module(
        "loud", titan_run_options=[RunOption("shout", "--shout", "shout the config", run)]
    )
    registry = Registry().load_entry_points()
    registry.register(module, "loud", "dist-loud", "1.0")
    monkeypatch.setattr(_registry, "_default", registry)
    monkeypatch.setattr(_registry, "get_registry", lambda disabled=None: registry)
    code = main(["run", "--recipe", "llama3_debugmodel", "--shout"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _boom(config: Any, registry: Any, args: Any) -> int:
    raise ValueError("nothing to shout")


def test_a_run_option_that_raises_is_one_line_naming_it_its_plugin_and_place(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(monkeypatch, capsys, _boom)
    assert code == PluginError.exit_code == 1
    (line,) = err.splitlines()
    assert line.startswith(
        "titan: error: run option 'shout' (plugin loud, dist-loud 1.0) failed: "
        "ValueError: nothing to shout (at "
    ), line
    assert re.search(r"test_cli_run_options\.py:\d+\)$", line), line


@pytest.mark.parametrize(
    ("returned", "shown"),
    [("all done", "'all done' (str)"), (256, "256 (int)"), (-1, "-1 (int)"), (True, "True (bool)")],
)
def test_a_run_option_returning_no_exit_status_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], returned: Any, shown: str
) -> None:
    code, _, err = _cli(monkeypatch, capsys, lambda config, registry, args: returned)
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith(
        f"titan: error: run option 'shout' (plugin loud, dist-loud 1.0) returned {shown} from run; it "
        "must return an exit status (an int from 0 to 255, 0 for success) or None (success)"
    ), line


@pytest.mark.parametrize(("returned", "status"), [(None, 0), (0, 0), (3, 3), (255, 255)])
def test_a_run_options_exit_status_is_the_processs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], returned: Any, status: int
) -> None:
    def shout(config: Any, registry: Any, args: Any) -> Any:
        print(f"model {config.model.name}")
        return returned

    code, out, err = _cli(monkeypatch, capsys, shout)
    assert code == status and out == "model llama3\n" and err == ""


def test_a_run_options_own_titan_error_stays_its_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(config: Any, registry: Any, args: Any) -> int:
        raise UsageError("--shout needs a quiet room")

    code, _, err = _cli(monkeypatch, capsys, refuse)
    assert code == UsageError.exit_code
    assert err.splitlines() == ["titan: error: --shout needs a quiet room"]
