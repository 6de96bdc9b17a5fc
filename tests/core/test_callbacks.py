"""Loop callbacks (titan_core/callbacks.py): what a callback's metrics may be named."""

from __future__ import annotations

from typing import Any

import pytest

from titan_core.callbacks import Callbacks
from titan_core.errors import PluginError


class _Reports:
    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def metrics(self, step: int) -> dict[str, float]:
        return self.values


def _metrics(*reports: dict[str, Any]) -> None:
    """Call every callback's ``metrics(1)`` as the loop does, in order."""
    labels = [f"callback '{chr(ord('a') + i)}' (plugin p)" for i in range(len(reports))]
    callbacks = Callbacks([_Reports(r) for r in reports], labels)
    for _, metrics in callbacks.metric_sources:
        metrics(1)


@pytest.mark.parametrize("key", ["train/loss", "train/lr", "train/grad_norm", "train/tps"])
def test_a_callback_metric_named_like_a_tensorboard_tag_of_titans_own_is_refused(key: str) -> None:
    """TensorBoard writes titan's ``loss`` as ``train/loss`` and a key holding a ``/`` as it is: a
    callback's ``train/loss`` was written to the same tag at the same step, so the loss curve held
    two values per step (metrics.jsonl kept them apart, as ``loss`` and ``train/loss``)."""
    with pytest.raises(PluginError, match=rf"^callback 'a' \(plugin p\): .*{key!r}.*titan's own"):
        _metrics({key: 123.0})


def test_two_callback_metrics_of_one_tensorboard_tag_are_refused() -> None:
    """``x`` of one callback and ``train/x`` of another are both TensorBoard's ``train/x``."""
    with pytest.raises(PluginError, match=r"^callback 'b' \(plugin p\): .*'train/x'.*callback 'a'"):
        _metrics({"x": 1.0}, {"train/x": 2.0})


def test_callback_metrics_of_other_tags_pass() -> None:
    _metrics({"x": 1.0, "train/y": 2.0, "mine/loss": 3.0}, {"other/x": 4.0, "train/z": 5.0})


class _Misspelt:
    """A callback written from memory of another framework's names: titan never called them."""

    def on_step_ended(self, step: int, metrics: Any, last: bool) -> None:
        raise AssertionError("never reached")


class _Lightning:
    def on_train_batch_end(self, step: int) -> None:
        raise AssertionError("never reached")


class _Fine:
    """Loop points, a helper of its own and a private method: all accepted."""

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None: ...

    def summarise(self) -> str:
        return ""

    def _on_step(self) -> None: ...


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (_Misspelt(), r"on_step_ended, which is no loop point, .*\(did you mean on_step_end\?\)"),
        (_Lightning(), r"on_train_batch_end, which is no loop point"),
    ],
    ids=["misspelt", "another-frameworks-name"],
)
def test_a_callback_method_that_is_no_loop_point_is_refused_not_ignored(callback: Any, expected: str) -> None:
    """A method named almost like a loop point (``on_step_ended``, ``metric``, Lightning's
    ``on_train_batch_end``) was bound to nothing: the callback built, the run trained, and the
    method was never called, without a word."""
    with pytest.raises(PluginError, match=rf"^callback 'a' \(plugin p\) has a method {expected}"):
        Callbacks([callback], ["callback 'a' (plugin p)"])


def test_a_method_named_almost_like_metrics_is_refused_too() -> None:
    with pytest.raises(PluginError, match=r"method metric, which is no loop point, .*did you mean metrics\?"):
        Callbacks([type("M", (), {"metric": lambda self, step: {}})()], ["callback 'a' (plugin p)"])


def test_loop_points_and_helpers_of_other_names_are_accepted() -> None:
    callbacks = Callbacks([_Fine()], ["callback 'a' (plugin p)"])
    assert len(callbacks.on_step_end) == 1


def test_a_callback_failing_in_on_failure_neither_hides_the_runs_error_nor_skips_the_others(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loop called the ``on_failure`` methods in a row: the first that raised replaced the
    run's own error with its own, and the later ones (the profiler's snapshot, the flight
    recorder's dump) never ran."""
    from tests.conftest import plugin_module, tiny_llama3
    from titan_core import Callback
    from titan_core._registry import Registry
    from titan_core.trainer import train

    seen: list[str] = []

    class Boom:
        def after_forward_backward(self, step: int) -> None:
            if step == 2:
                raise RuntimeError("the run's own failure")

    class BadCleanup:
        def on_failure(self, step: int, exc: BaseException) -> None:
            raise OSError("the cleanup's own failure")

    class Recorder:
        def on_failure(self, step: int, exc: BaseException) -> None:
            seen.append(str(exc))

    callbacks = [
        Callback("boom", lambda trainer: Boom()),
        Callback("bad_cleanup", lambda trainer: BadCleanup()),
        Callback("recorder", lambda trainer: Recorder()),
    ]
    registry = Registry().load_entry_points()
    registry.register(plugin_module("cbs", titan_callbacks=callbacks), "cbs", "dist-cbs", "1.0")
    own = r"callback 'boom' .*failed in after_forward_backward: RuntimeError"
    with pytest.raises(PluginError, match=own):
        train(tiny_llama3(tmp_path, 4), registry)
    assert len(seen) == 1 and "the run's own failure" in seen[0], seen
    out = capsys.readouterr().out
    assert "callback 'bad_cleanup'" in out and "the cleanup's own failure" in out, out[-2000:]
