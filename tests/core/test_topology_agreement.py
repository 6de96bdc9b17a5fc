"""What the processes of one job must agree on (``titan_core.topology.config_differences``)."""

from __future__ import annotations

import math

from titan_core.topology import config_differences


def test_a_nan_setting_every_rank_holds_is_no_difference() -> None:
    """NaN is not equal to itself: a plugin section's NaN (allowed there) read as a difference
    between ranks that hold the same config, and every multi-process run of it stopped."""
    same = {"my_section.threshold": math.nan, "training.steps": 4}
    assert config_differences([dict(same), dict(same)]) == []


def test_differences_name_the_field_and_each_ranks_value() -> None:
    configs = [{"training.steps": 6, "debug.seed": 1}, {"training.steps": 4, "debug.seed": 1}]
    configs.append({"training.steps": 4, "debug.seed": 1})
    assert config_differences(configs) == ["training.steps: rank 0 has 6, ranks 1, 2 have 4"]
