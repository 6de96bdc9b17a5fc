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
