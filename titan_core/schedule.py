"""The learning-rate schedule: linear warm-up, constant, linear decay, then constant at the floor.

Past ``training.steps`` (a resumed run given more steps) the factor stays at ``min_lr_factor``:
an unclamped linear decay would go negative and train by gradient ascent.
"""

from __future__ import annotations

from typing import Any

import attrs

from titan_core.log import get_logger

log = get_logger("titan.schedule")


@attrs.frozen
class WarmupStableDecay:
    steps: int
    warmup_steps: int
    decay_ratio: float
    min_lr_factor: float

    @classmethod
    def from_config(cls, training: Any) -> WarmupStableDecay:
        return cls(training.steps, training.warmup_steps, training.decay_ratio, training.min_lr_factor)

    @property
    def decay_steps(self) -> int:
        """Steps of the linear decay, the last of them ``steps``: ``decay_ratio`` of the steps after
        warm-up, rounded, and at least one when there is a decay to do (``decay_ratio > 0`` and
        steps after warm-up): a small ratio would otherwise round to none, and the run would end
        at the peak LR without a word instead of at ``min_lr_factor``."""
        after_warmup = max(self.steps - self.warmup_steps, 0)
        if self.decay_ratio <= 0 or after_warmup == 0:
            return 0
        return min(max(round(after_warmup * self.decay_ratio), 1), after_warmup)

    def __call__(self, index: int) -> float:
        """Factor of the peak LR for LambdaLR's ``index`` (0 for the first step)."""
        step = index + 1
        if step <= self.warmup_steps:
            return step / (self.warmup_steps + 1)
        decay_start = self.steps - self.decay_steps
        if step <= decay_start or self.decay_steps == 0:
            return 1.0
        progress = min((step - decay_start) / self.decay_steps, 1.0)
        return 1.0 - (1.0 - self.min_lr_factor) * progress

    def describe(self) -> dict[str, Any]:
        """What a checkpoint stores, to notice a resume that changes the schedule."""
        return attrs.asdict(self)

    def check_resume(self, saved: dict[str, Any] | None, step: int) -> None:
        """Warn when a resumed run's schedule differs from the checkpoint's (the LR jumps).

        ``step`` is the checkpoint's (the last finished one); the factors are those of the next
        step, the first under this run's schedule (LambdaLR index ``step``)."""
        if not saved:
            return
        changed = {k: (saved.get(k), v) for k, v in self.describe().items() if saved.get(k) != v}
        if changed:
            text = ", ".join(f"training.{k}: {old} -> {new}" for k, (old, new) in changed.items())
            log.warning(
                "resuming with another learning-rate schedule; the LR continues from this run's "
                f"schedule at step {step + 1}: {text}",
                lr_factor_checkpoint_schedule=_factor(saved, step),
                lr_factor_now=self(step),
            )


def _factor(saved: dict[str, Any], step: int) -> float | None:
    """The checkpoint schedule's factor at LambdaLR index ``step``, or ``None`` when its record
    cannot be rebuilt: a field missing (an earlier titan's), one this titan lacks (a later
    one's), or a value of another type (an edited ``meta.json``). The warning is what matters;
    rebuilding it raised TypeError from inside the resume."""
    names = [a.name for a in attrs.fields(WarmupStableDecay)]
    if not set(names) <= set(saved):
        return None
    try:
        return float(WarmupStableDecay(**{name: saved[name] for name in names})(step))
    except (TypeError, ValueError, ZeroDivisionError):
        return None
