"""Probe a plugin config field as a user does: a recipe module setting it, run with ``titan run
--module M --recipe probe --print-config`` in this process; the exit code and what stderr shows.
Tests use the ``config_probe`` fixture (``tests/conftest.py``): ``config_probe(settings,
expected, base)`` runs :func:`print_config` and :func:`assert_probe`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

#: The base recipe of a probe: (module, function).
BASES = {
    "llama3": ("titan_plugins_llama3.recipes", "llama3_debugmodel"),
    "moe": ("titan_plugins_moe.recipes", "moe_debugmodel"),
}
_COUNTER = itertools.count()

#: The ``config_probe`` fixture: ``(settings, expected, base="llama3") -> None``.
ConfigProbe = Callable[..., None]


def print_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    settings: dict[str, str],
    base: str = "llama3",
) -> tuple[int, str]:
    """``settings``: field path -> Python expression (``nan`` and ``inf`` are defined) set in the
    recipe. Returns the exit code and stderr (stripped)."""
    from titan_core._registry import reset_registry
    from titan_core.cli import main

    monkeypatch.delenv("TITAN_DISABLE_PLUGINS", raising=False)
    reset_registry()
    module, function = BASES[base]
    name = f"config_probe_{next(_COUNTER)}"
    lines = [
        "from math import inf, nan",
        f"from {module} import {function}",
        "",
        "",
        "def probe():",
        f"    config = {function}()",
        f"    config.job.dump_folder = {str(tmp_path / 'out')!r}",
        *(f"    config.{path} = {value}" for path, value in settings.items()),
        "    return config",
    ]
    (tmp_path / f"{name}.py").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(["run", "--module", name, "--recipe", "probe", "--print-config"])
    finally:
        sys.modules.pop(name, None)
    return code, capsys.readouterr().err.strip()


def assert_probe(code: int, err: str, expected: str | None) -> None:
    """``expected`` ``None``: accepted (exit 0); else one ``titan: error:`` line (exit 2)
    containing ``expected`` (the field path and what to change), no traceback."""
    if expected is None:
        assert code == 0, err
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("titan: error:"), err
    assert expected in lines[0], err
