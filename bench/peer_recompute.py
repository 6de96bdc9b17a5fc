"""torchtitan 0.3.0's peer runs in another activation-checkpointing mode than the kit's selective one.

``bench/perf.sh`` runs them (``--module bench.peer_recompute --config NAME``) so that titan's runs
in a mode other than selective AC are compared with torchtitan in the same mode:
``TITAN_BENCH_AC=full`` (torchtitan's ``FullAC``), ``none`` (no checkpointing) or
``memory_budget`` at ``TITAN_BENCH_MEMORY_BUDGET`` (``MemoryBudgetAC``; the ``peer_budget``
stage). Everything else is the peer kit's own recipe (``.peer/pkg/peer_llama_configs.py``).
"""

from __future__ import annotations

import os
from typing import Any


def _in_mode(config: Any) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC

    mode = os.environ.get("TITAN_BENCH_AC", "memory_budget")
    if mode == "full":
        config.activation_checkpoint = FullAC.Config()
    elif mode == "none":
        config.activation_checkpoint = None
    elif mode == "memory_budget":
        budget = float(os.environ["TITAN_BENCH_MEMORY_BUDGET"])
        config.activation_checkpoint = MemoryBudgetAC.Config(memory_budget=budget)
    else:
        raise SystemExit(f"TITAN_BENCH_AC={mode!r}: bench.peer_recompute runs full, none or memory_budget")
    return config


def llama3_1b_v2k() -> Any:
    """The peer kit's 1B shape in the environment's activation-checkpointing mode."""
    from peer_llama_configs import llama3_1b_v2k as selective

    return _in_mode(selective())


def llama3_8b_l8_v2k() -> Any:
    """The peer kit's 8B shape (8 layers) in the environment's activation-checkpointing mode."""
    from peer_llama_configs import llama3_8b_l8_v2k as selective

    return _in_mode(selective())
