"""A dataset plugin's failure names the plugin behind the dataset, as a model's, a strategy's or
a checkpointer's does (``Registry.label``): the messages said ``data.dataset 'x' failed reading
document 1 ...`` alone, leaving the user to find which installed distribution provides ``x``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import plugin_module, tiny_llama3
from titan_core import Dataset
from titan_core._registry import Registry
from titan_core.errors import PluginError
from titan_core.trainer import train

_TEXT = [f"The river falls {i} times and the market opens at dawn." for i in range(40)]


def _registry(name: str, documents: Any) -> Registry:
    registry = Registry().load_entry_points()
    record = Dataset(name, documents, reads_path=False)
    registry.register(plugin_module("shards", titan_datasets=[record]), "shards_plugin")
    return registry


def _failing_on_call(failing: int) -> Any:
    """Documents that raise on the ``failing``-th read (1: the build's first read)."""
    calls = {"n": 0}

    def documents(data: object) -> Iterator[str]:
        calls["n"] += 1
        if calls["n"] >= failing:
            raise ConnectionError("the shard server went away")
        yield from _TEXT

    return documents


def _run(config: Any, registry: Registry) -> str:
    with pytest.raises(PluginError) as info:
        train(config, registry)
    return str(info.value)


def test_a_dataset_failing_while_the_run_builds_names_its_plugin(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=2)
    config.data.dataset = "flaky"
    message = _run(config, _registry("flaky", _failing_on_call(1)))
    assert message.startswith(
        "data.dataset 'flaky' (plugin shards_plugin) failed reading document 1 of pass 1 over the data: "
    ), message
    assert "ConnectionError: the shard server went away" in message


def test_a_dataset_failing_on_a_later_read_names_its_plugin(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=30)  # several passes over the 40 short documents
    config.data.dataset = "flaky"
    message = _run(config, _registry("flaky", _failing_on_call(4)))
    assert message.startswith(
        "data.dataset 'flaky' (plugin shards_plugin) failed reading document 1 of pass "
    )
    assert "ConnectionError: the shard server went away" in message


def test_a_dataset_returning_no_documents_names_its_plugin(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=2)
    config.data.dataset = "none"
    message = _run(config, _registry("none", lambda data: None))
    assert message.startswith("data.dataset 'none' (plugin shards_plugin) returned None where an iterable")


def test_a_validation_dataset_failing_names_its_plugin(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=2)
    config.validation.enable = True
    config.validation.dataset = "remote"
    message = _run(config, _registry("remote", _failing_on_call(1)))
    assert message.startswith(
        "validation.dataset 'remote' (plugin shards_plugin) failed reading document 1 of pass 1 "
    ), message
