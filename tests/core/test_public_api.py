"""What plugins may use: ``titan_core``'s public names, never its private modules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import titan_core

REPO = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = [
    p
    for root in ("plugins", "titan_plugins_llama3", "titan_plugins_moe")
    for p in (REPO / root).rglob("*.py")
    if "build" not in p.parts and "tests" not in p.parts
]


def test_titans_own_plugins_import_no_private_titan_core_module() -> None:
    """A third-party plugin has only the public surface; titan's own plugins must manage with it."""
    private = re.compile(r"^\s*(from|import)\s+titan_core\._\w+", re.M)
    offenders = [str(p.relative_to(REPO)) for p in PLUGIN_SOURCES if private.search(p.read_text())]
    assert PLUGIN_SOURCES and offenders == []


def test_the_registry_and_the_usage_error_are_public() -> None:
    from titan_core._registry import get_registry
    from titan_core.errors import UsageError

    assert titan_core.get_registry() is get_registry()
    assert titan_core.UsageError is UsageError
    assert {"get_registry", "UsageError", "TitanError"} <= set(titan_core.__all__)


def test_importing_titan_core_and_getting_the_registry_does_not_import_torch() -> None:
    code = "import sys, titan_core; titan_core.get_registry(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
