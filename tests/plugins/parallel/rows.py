"""Step records (loss *and* gradient norm) of layout runs, for the PP, CP and EP tests.

Losses alone are a weak check of gradient scaling: AdamW normalises the gradient, so a layout
whose gradients are off by a constant factor still reproduces the losses closely. The gradient
norm (logged with 4 decimals) exposes such a factor from the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.parallel_harness import STEPS, assert_losses_close, log_records, run_titan_train

#: Gradient norms are logged rounded to 4 decimals: two roundings apart at most 1e-4.
GRAD_NORM_ABS = 1.5e-4


def layout_rows(
    folder: Path, nproc: int, seed: Path, overrides: Mapping[str, Any], rank: int = 0
) -> list[dict[str, Any]]:
    """``rank``'s step records of a run from ``seed``; fails the test when the run fails."""
    overrides = {"checkpoint.initial_load_path": str(seed), **overrides}
    result = run_titan_train(folder, nproc, overrides)
    rows = [r for r in log_records(result.stdout) if r.get("event") == "step" and r.get("rank", 0) == rank]
    if result.returncode != 0 or len(rows) < STEPS:
        raise AssertionError(
            f"layout {dict(overrides)} on {nproc} processes failed (exit {result.returncode}, "
            f"{len(rows)} steps)\n--- stdout tail\n{result.stdout[-3000:]}\n"
            f"--- stderr tail\n{result.stderr[-5000:]}"
        )
    return rows


def assert_rows_close(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Losses within 1e-4 relative and gradient norms equal up to the log's rounding."""
    assert_losses_close([r["loss"] for r in actual], [r["loss"] for r in expected])
    norms = [(r["grad_norm"], e["grad_norm"]) for r, e in zip(actual, expected, strict=False)]
    assert [a for a, _ in norms] == pytest.approx([e for _, e in norms], abs=GRAD_NORM_ABS), norms


_REFERENCE: dict[Path, list[dict[str, Any]]] = {}


def one_process_rows(tmp_path_factory: pytest.TempPathFactory, seed: Path) -> list[dict[str, Any]]:
    """Step records of one process on the tiny Llama 3 from ``seed``, run once per session."""
    if seed not in _REFERENCE:
        _REFERENCE[seed] = layout_rows(tmp_path_factory.mktemp("rows_reference"), 1, seed, {})
    return _REFERENCE[seed]
