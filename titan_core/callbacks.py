"""Loop callbacks bound once per loop point, so a point no callback implements costs nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from titan_core.errors import PluginError

__all__ = ["CALLBACK_POINTS", "CORE_METRICS", "Callbacks", "ReadOnlyRow", "metric_tag", "reserved_metric"]


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


#: The names of titan's own row of a logging step (``titan_core.metrics.MetricsLogger``: the loss,
#: the schedule, throughput, memory on CPU and CUDA, timing) and the fields every log line
#: carries: a callback's metric of one of these names would replace titan's value in the log line,
#: ``metrics.jsonl`` and TensorBoard (or end the run inside the logger). ``validation/`` is the
#: trainer's too.
CORE_METRICS = frozenset(
    {
        *("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct", "step_time_s"),
        *("max_rss_gib", "max_allocated_gib", "max_reserved_gib", "max_reserved_pct"),
        *("of", "eta", "event", "level", "timestamp", "rank"),
    }
)
_CORE_PREFIXES = ("validation/",)


def metric_tag(name: str) -> str:
    """The TensorBoard tag of the row's key ``name``: ``train/<name>``, or ``name`` as it is when it
    holds a ``/`` (``validation/loss``, ``moe/aux_loss``)."""
    return name if "/" in name else f"train/{name}"


def reserved_metric(name: str) -> bool:
    """Whether ``name`` is titan's own in a logged row (:data:`CORE_METRICS`, ``validation/...``),
    or names the TensorBoard tag of one (``train/loss``)."""
    # A callback's ``train/loss`` is written to TensorBoard as it is, onto the tag of titan's
    # ``loss``: the curve got two values per step though metrics.jsonl kept them apart.
    own_tag = name.startswith("train/") and name[len("train/") :] in CORE_METRICS
    return name in CORE_METRICS or name.startswith(_CORE_PREFIXES) or own_tag


def _named_apart(
    label: str, metrics: Callable[[int], Any], owners: dict[str, tuple[str, str]]
) -> Callable[[int], Any]:
    """``metrics`` of the callback ``label``, refusing a name titan's row has or another callback
    reports (``owners``: TensorBoard tag -> the label of the callback that reported it first and
    its name): the row is one dict, so either would replace a value without a word. Types are
    checked by the trainer."""

    def checked(step: int) -> Any:
        values = metrics(step)
        if not isinstance(values, Mapping):
            return values
        for key in values:
            if not isinstance(key, str):
                continue
            if reserved_metric(key):
                raise PluginError(
                    f"{label}: metrics(step) returned {key!r}, a name of titan's own row (the loss, "
                    "schedule, throughput and memory, validation/*, and the log line's fields), whose "
                    "value it would replace; give the metric a name of its own, such as "
                    f"'my_plugin/{key.split('/')[-1]}'"
                )
            # By tag: ``x`` of one callback and ``train/x`` of another are one TensorBoard curve.
            first, its_key = owners.setdefault(metric_tag(key), (label, key))
            if first != label:
                also = "" if its_key == key else f" as {its_key!r} (both TensorBoard's {metric_tag(key)!r})"
                raise PluginError(
                    f"{label}: metrics(step) returned {key!r}, which {first} reports too{also}: one "
                    "value would replace the other in the log line, metrics.jsonl or TensorBoard; one "
                    "of them must rename it (a prefix naming the plugin), or disable one plugin"
                )
        return values

    return checked


class ReadOnlyRow(dict):
    """The logged row as ``on_step_end`` gets it: a dict (``json.dumps``, ``dict(row)``,
    ``copy.deepcopy`` give plain ones) that refuses changes.

    Every callback gets the same values in turn, titan's metric writers (``metrics.jsonl``,
    TensorBoard, order 80) after the others: a callback that rewrote the row in place (a sink
    tidying values, popping keys) changed what the writers wrote, while the console line showed
    the real values.
    """

    __slots__ = ()

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise TypeError(
            "on_step_end's metrics is titan's logged row, which the other callbacks and the metric "
            "writers (metrics.jsonl, TensorBoard) read after this one, so it is read-only; report "
            "values of your own from metrics(step), or change a copy (dict(metrics))"
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        # ``copy.copy``, ``copy.deepcopy`` and pickle rebuild a plain (changeable) dict.
        return dict, (dict(self),)


def _read_only_row(on_step_end: Callable[..., Any]) -> Callable[..., Any]:
    def call(step: int, metrics: Mapping[str, Any], last: bool) -> Any:
        return on_step_end(step, ReadOnlyRow(metrics), last)

    return call


def _stray_methods(callback: Any) -> list[tuple[str, str | None]]:
    """``(name, the loop point it is closest to or None)`` for each public method of ``callback``
    named like a loop point that is none (``on_step_ended``, ``metric``, another framework's
    ``on_train_batch_end``): the loop binds the points by name, so such a method was never
    called, without a word."""
    import difflib
    import inspect

    names = {n for n in dir(type(callback)) if not n.startswith("_")}
    names |= {n for n in getattr(callback, "__dict__", {}) if not n.startswith("_")}
    stray = []
    for name in sorted(names - set(CALLBACK_POINTS)):
        # Static lookup: a property of the callback is not run just to see what it holds.
        if not callable(inspect.getattr_static(callback, name, None)):
            continue
        close = difflib.get_close_matches(name, CALLBACK_POINTS, n=1, cutoff=0.8)
        if close or name.startswith(("on_", "before_", "after_")):
            stray.append((name, close[0] if close else None))
    return stray


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
        for callback, label in named:
            if stray := _stray_methods(callback):
                name, close = stray[0]  # the first is enough to show what is wrong
                raise PluginError(
                    f"{label} has a method {name}, which is no loop point, so titan would never call "
                    f"it{f' (did you mean {close}?)' if close else ''}; the loop points: "
                    f"{', '.join(CALLBACK_POINTS)} (titan_core.records.Callback)"
                )
        for point in CALLBACK_POINTS:
            if point == "metrics":
                continue  # metric_sources, below
            methods = [(label, getattr(o, point)) for o, label in named if callable(getattr(o, point, None))]
            if point == "on_step_end":
                methods = [(label, _read_only_row(fn)) for label, fn in methods]
            setattr(self, point, [guard(label, point, fn) for label, fn in methods])
        #: ``(label, metrics)`` of the callbacks that report metrics: their values are checked,
        #: and the error names the callback.
        owners: dict[str, tuple[str, str]] = {}
        self.metric_sources = [
            (label, _named_apart(label, guard(label, "metrics", o.metrics), owners))
            for o, label in named
            if callable(getattr(o, "metrics", None))
        ]
