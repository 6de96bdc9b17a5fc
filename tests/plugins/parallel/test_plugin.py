"""The plugin's records: names, order slots, and no torch import until a strategy is used."""

from __future__ import annotations

import subprocess
import sys

from titan_core._registry import get_registry
from titan_core.parallelize import ORDER


def test_strategies_sit_in_their_order_slots() -> None:
    strategies = get_registry().records("strategies")
    for name in ("tp", "activation_checkpoint", "compile", "fsdp"):
        assert strategies[name].order == ORDER[name]


def test_plugin_module_does_not_import_torch() -> None:
    code = (
        "import sys, titan_plugins_parallel.plugin as p; p.titan_strategies(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
