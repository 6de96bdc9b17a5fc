"""The LR schedule step by step: the factor of each step is what the training config asks for.

``WarmupStableDecay(i)`` is the factor of the peak LR for step ``i + 1`` (LambdaLR's index).
"""

from __future__ import annotations

import itertools
import math

import pytest

from titan_core.config import TrainerConfig
from titan_core.schedule import WarmupStableDecay


def schedule(steps: int, warmup: int, ratio: float, floor: float = 0.1) -> WarmupStableDecay:
    training = TrainerConfig().training
    training.steps, training.warmup_steps = steps, warmup
    training.decay_ratio, training.min_lr_factor = ratio, floor
    return WarmupStableDecay.from_config(training)


@pytest.mark.parametrize(
    ("steps", "warmup", "ratio"),
    [
        (10, 2, 0.05),  # 8 x 0.05 = 0.4 steps of decay
        (10, 2, 0.0625),  # 8 x 0.0625 = 0.5: round-half-even makes it 0
        (4, 3, 0.3),  # 1 step after warm-up x 0.3
        (100, 0, 0.001),
    ],
)
def test_a_small_decay_ratio_still_decays_to_the_floor_on_the_last_step(
    steps: int, warmup: int, ratio: float
) -> None:
    """decay_ratio > 0 asks for a decay: it rounded to 0 steps, and the run ended at the peak LR."""
    s = schedule(steps, warmup, ratio)
    factors = [s(i) for i in range(steps)]
    assert s.decay_steps == 1
    assert factors[warmup:-1] == [1.0] * (steps - warmup - 1)
    assert factors[-1] == pytest.approx(0.1)


def test_each_step_of_warmup_stable_decay() -> None:
    s = schedule(10, 2, 0.5, floor=0.2)
    assert s.decay_steps == 4
    expected = [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]
    assert [s(i) for i in range(10)] == pytest.approx(expected)
    assert [s(i) for i in range(10, 14)] == pytest.approx([0.2] * 4)  # past the last step: the floor


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_warmup_of_all_steps_never_decays(ratio: float) -> None:
    """warmup_steps >= steps (the trainer warns): the LR rises for every step and stays below the peak."""
    s = schedule(3, 5, ratio)
    assert s.decay_steps == 0
    assert [s(i) for i in range(6)] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0])


def test_no_decay_ratio_keeps_the_peak() -> None:
    s = schedule(6, 1, 0.0)
    assert s.decay_steps == 0
    assert [s(i) for i in range(8)] == pytest.approx([0.5] + [1.0] * 7)


RATIOS = (0.0, 0.01, 0.05, 0.0625, 0.1, 0.125, 0.25, 1 / 3, 0.5, 0.8, 0.99, 1.0)


@pytest.mark.parametrize("floor", [0.0, 0.1, 1.0])
def test_every_small_config_gives_a_schedule_that_is_what_it_asks(floor: float) -> None:
    """Over a grid of small configs (warm-up longer than the run included): every factor is finite
    and within [0, 1], nothing divides by zero; warm-up rises to the peak; a decay happens
    exactly when one is asked for, ends on the last step at the floor, and never goes up."""
    for steps, warmup, ratio in itertools.product(range(1, 13), range(0, 15), RATIOS):
        s = schedule(steps, warmup, ratio, floor)
        where = f"steps={steps} warmup={warmup} decay_ratio={ratio} min_lr_factor={floor}"
        factors = [s(i) for i in range(steps + 5)]  # and past the end (a resume given more steps)
        assert all(math.isfinite(f) and 0.0 <= f <= 1.0 for f in factors), where
        run = factors[:steps]
        assert run[: min(warmup, steps)] == pytest.approx(
            [(i + 1) / (warmup + 1) for i in range(min(warmup, steps))]
        )
        after_warmup = max(steps - warmup, 0)
        decays = ratio > 0 and after_warmup > 0
        assert (s.decay_steps >= 1) == decays, where
        assert s.decay_steps <= after_warmup, where
        assert s.decay_steps == (max(1, round(after_warmup * ratio)) if decays else 0), where
        stable = run[warmup : steps - s.decay_steps]
        assert stable == [1.0] * len(stable), where
        if decays:
            assert run[-1] == pytest.approx(floor), where
            tail = factors[steps - s.decay_steps :]
            assert all(a >= b for a, b in itertools.pairwise(tail)), where
            assert factors[steps:] == pytest.approx([floor] * 5), where
        else:
            assert factors[max(warmup, 0) :] == [1.0] * len(factors[warmup:]), where


@pytest.mark.parametrize(
    "extra",
    [{"kind": "cosine"}, {"warmup_steps": "2"}],
    ids=["a field this titan does not know", "a value of another type"],
)
def test_a_checkpoints_schedule_record_this_titan_cannot_rebuild_is_compared_not_a_traceback(
    extra: dict[str, object],
) -> None:
    """A resume compared the checkpoint's schedule record and rebuilt its schedule for the
    warning's factor: a record with a field of another titan (a newer schedule's) or an edited
    value raised TypeError from inside the resume, a traceback instead of the warning."""
    from titan_core import schedule as module

    warned: list[tuple[str, dict[str, object]]] = []

    class Log:
        def warning(self, event: str, **values: object) -> None:
            warned.append((event, values))

    now = schedule(10, 2, 0.5)
    saved = {**schedule(20, 2, 0.5).describe(), **extra}
    real = module.log
    module.log = Log()  # type: ignore[assignment]
    try:
        now.check_resume(saved, 4)
    finally:
        module.log = real
    (event, values), *_ = warned
    assert "resuming with another learning-rate schedule" in event and "training.steps: 20 -> 10" in event
    assert values["lr_factor_now"] == now(4)
