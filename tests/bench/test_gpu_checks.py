"""``bench/gpu_checks.py``: the GPU check scripts' runner (run here without a GPU)."""

from __future__ import annotations

import pytest

from bench import gpu_checks


def test_a_failing_check_is_reported_and_does_not_hide_the_others(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_checks, "RESULTS", [])

    def check_raises() -> None:
        raise RuntimeError("no kernel image")

    def check_passes() -> None:
        gpu_checks.report("the second", True, "fine")

    assert gpu_checks.run_checks([check_raises, check_passes]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "FAIL check_raises: RuntimeError: no kernel image" in out
    assert "PASS the second: fine" in out
    assert out[-1] == "1/2 checks passed"


def test_all_passing_checks_exit_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_checks, "RESULTS", [])
    assert gpu_checks.run_checks([lambda: gpu_checks.report("one", True, "")]) == 0
