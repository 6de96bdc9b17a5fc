"""``bench/recompute_plan.py``: the meta-device plan of what a compiled block saves and recomputes."""

from __future__ import annotations

import itertools

import pytest

from bench.recompute_plan import measure


@pytest.mark.slow
def test_less_budget_saves_less_and_recomputes_more_and_the_op_policy_sits_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    none = measure("bench_debugmodel", "none")
    op = measure("bench_debugmodel", "op")
    budgets = {b: measure("bench_debugmodel", "budget", b) for b in (0.0, 0.3, 0.6, 1.0)}
    monkeypatch.setenv("TITAN_BENCH_FUSE_W13", "1")
    op_fused = measure("bench_debugmodel", "op")
    assert op["forward_tflop"] == pytest.approx(none["forward_tflop"])
    # Without checkpointing backward redoes only cheap elementwise work; the op policy redoes
    # every second matmul of the block: with the gate and up projections apart (the default)
    # that is wo and w3, for about half the saved bytes; with them fused only wo, whose output
    # is dim wide, for the fused output's hidden width kept.
    assert op["recompute_tflop"] > 0.1 * op["forward_tflop"] > none["recompute_tflop"]
    assert op["saved_gib"] < 0.6 * none["saved_gib"]
    assert op["recompute_tflop"] > 2 * op_fused["recompute_tflop"] > 0
    assert op["saved_gib"] < op_fused["saved_gib"] < 0.75 * none["saved_gib"]
    ordered = [budgets[b] for b in sorted(budgets)]
    for less, more in itertools.pairwise(ordered):
        assert less["saved_gib"] <= more["saved_gib"]
        assert less["recompute_tflop"] >= more["recompute_tflop"]
    assert budgets[0.0]["saved_gib"] < op["saved_gib"] < budgets[1.0]["saved_gib"]
    assert budgets[1.0]["saved_gib"] == pytest.approx(none["saved_gib"])
