"""Settings only a strategy reads (``parallelism.fsdp_reshard_after_forward``: FSDP's;
``parallelism.loss_parallel``: TP's), changed from their defaults on a launch where that strategy
does not apply (one process without FSDP): ignored without a word. Whether the strategy applies
depends on the launch (the number of processes, the device), and one recipe serves several
launches, so the run says it in one warning rather than refusing (docs/config.md)."""

from __future__ import annotations

import pytest

from tests.parallel_harness import log_records, run_titan_train, tiny_config


def _warnings(overrides: dict, world_size: int) -> list[str]:
    from titan_core._registry import get_registry
    from titan_core.layout import check_layout
    from titan_core.parallel_dims import ParallelDims

    config = tiny_config(**overrides)
    said: list[str] = []
    dims = ParallelDims.from_config(config.parallelism, world_size)
    check_layout(config, get_registry(), dims, warn=said.append)
    return said


@pytest.mark.parametrize(
    ("overrides", "field", "strategy"),
    [
        (
            {"parallelism.fsdp_reshard_after_forward": "never"},
            "parallelism.fsdp_reshard_after_forward",
            "dp_shard",
        ),
        (
            {"parallelism.fsdp_reshard_after_forward": "always"},
            "parallelism.fsdp_reshard_after_forward",
            "dp_shard",
        ),
        ({"parallelism.loss_parallel": False}, "parallelism.loss_parallel", "tp"),
    ],
)
def test_a_setting_whose_strategy_does_not_apply_is_one_warning(
    overrides: dict, field: str, strategy: str
) -> None:
    (line,) = _warnings(overrides, world_size=1)
    assert line.startswith(f"{field} = "), line
    assert "has no effect in this run" in line and strategy in line


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        ({}, 1),  # defaults say nothing
        ({"parallelism.fsdp_reshard_after_forward": "default"}, 1),
        ({"parallelism.fsdp_reshard_after_forward": "never", "training.local_batch_size": 4}, 2),  # FSDP
        ({"parallelism.loss_parallel": False, "parallelism.tp": 2, "parallelism.dp_shard": 1}, 2),  # TP
    ],
)
def test_a_setting_that_applies_or_is_left_at_its_default_says_nothing(
    overrides: dict, world_size: int
) -> None:
    assert _warnings(overrides, world_size) == []


def test_the_run_logs_the_warning(tmp_path) -> None:
    result = run_titan_train(
        tmp_path,
        1,
        {"training.steps": 1, "parallelism.fsdp_reshard_after_forward": "never"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [r for r in log_records(result.stdout) if r.get("level") == "warning"]
    assert [r for r in warnings if "parallelism.fsdp_reshard_after_forward" in r.get("event", "")], warnings
