"""Loop callbacks bound once per loop point, so a point no callback implements costs nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CALLBACK_POINTS", "Callbacks"]


#: The loop points callbacks may implement (see :class:`titan_core.records.Callback`).
CALLBACK_POINTS = (
    "on_train_start",
    "before_forward_backward",
    "after_forward_backward",
    "after_optimizer_step",
    "metrics",
    "on_step_end",
    "on_train_end",
    "on_failure",
)


class Callbacks:
    """The built callbacks, bound once per loop point (a point nobody implements costs nothing)."""

    def __init__(
        self,
        objects: list[Any],
        labels: list[str],
        guard: Callable[[str, str, Callable[..., Any]], Callable[..., Any]] = lambda label, point, fn: fn,
    ) -> None:
        """``labels``: how errors name each object (``callback 'x' (plugin p)``), in order;
        ``guard(label, point, method)``: the method as the loop calls it (the trainer's turns an
        exception into one error naming the callback)."""
        self.objects = objects
        named = list(zip(objects, labels, strict=True))
        for point in CALLBACK_POINTS:
            if point == "metrics":
                continue  # metric_sources, below
            methods = [(label, getattr(o, point)) for o, label in named if callable(getattr(o, point, None))]
            setattr(self, point, [guard(label, point, fn) for label, fn in methods])
        #: ``(label, metrics)`` of the callbacks that report metrics: their values are checked,
        #: and the error names the callback.
        self.metric_sources = [
            (label, guard(label, "metrics", o.metrics))
            for o, label in named
            if callable(getattr(o, "metrics", None))
        ]
