"""torchtitan 0.3.0's 8B-shape peer run with its ``memory_budget`` activation checkpointing.

``bench/perf.sh peer_budget`` runs it (``--module bench.peer_budget --config llama3_8b_l8_v2k``)
with the budget of ``TITAN_BENCH_MEMORY_BUDGET``, so that titan's memory-budget runs are also
compared with torchtitan under the same recomputation choice, not only with its selective
policy. Everything else is the peer kit's own recipe (``.peer/pkg/peer_llama_configs.py``).
"""

from __future__ import annotations

import os
from typing import Any


def llama3_8b_l8_v2k() -> Any:
    """The peer kit's 8B shape (8 layers) with ``MemoryBudgetAC`` at the environment's budget."""
    from peer_llama_configs import llama3_8b_l8_v2k as selective
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

    config = selective()
    budget = float(os.environ["TITAN_BENCH_MEMORY_BUDGET"])
    config.activation_checkpoint = MemoryBudgetAC.Config(memory_budget=budget)
    return config
