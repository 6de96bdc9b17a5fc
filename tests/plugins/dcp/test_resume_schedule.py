"""Resuming with more steps: the LR stays at its floor (never negative) and the change is logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_titan, step_rows, tiny_recipe_source

EXTRA = (
    "    c.checkpoint.enable = True\n"
    "    c.checkpoint.interval = 2\n"
    "    c.training.warmup_steps = 1\n"
    "    c.training.decay_ratio = 1.0\n"
    "    c.training.min_lr_factor = 0.0\n"
)


@pytest.mark.slow
def test_resume_with_more_steps_warns_and_never_goes_below_the_floor(tmp_path: Path) -> None:
    (tmp_path / "sched.py").write_text(
        tiny_recipe_source("first", 4, EXTRA) + tiny_recipe_source("longer", 8, EXTRA)
    )
    first = run_titan("run", "--module", "sched", "--recipe", "first", "--dump-folder", "out", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert step_rows(first.stdout)[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the floor, not below
    longer = run_titan("run", "--module", "sched", "--recipe", "longer", "--dump-folder", "out", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert "resuming with another learning-rate schedule" in longer.stdout
    assert "training.steps: 4 -> 8" in longer.stdout
    rows = step_rows(longer.stdout)
    assert rows[0]["step"] == 5
    assert all(r["lr"] >= 0 for r in rows)
