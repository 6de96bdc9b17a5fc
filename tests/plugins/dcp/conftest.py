"""The checkpointer's log lines, recorded (``events``), for the tests of this folder."""

from __future__ import annotations

import pytest

from tests.plugins.dcp.checkpoint_kit import Events
from titan_plugins_dcp import checkpointer as checkpointer_module


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Events:
    recorder = Events()
    monkeypatch.setattr(checkpointer_module, "log", recorder)
    return recorder
