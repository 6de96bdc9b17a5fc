"""Parallel degrees: resolution of dp_shard=-1, and one clear error per layout that does not fit."""

from __future__ import annotations

import re

import pytest

from titan_core.config import Parallelism
from titan_core.errors import UsageError
from titan_core.parallel_dims import ParallelDims


def dims(world_size: int, **degrees: int) -> ParallelDims:
    return ParallelDims.from_config(Parallelism(**degrees), world_size)


def test_dp_shard_fills_remaining_ranks() -> None:
    d = dims(16, dp_replicate=2, tp=2, pp=2)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp) == (2, 2, 1, 2, 2)
    assert d.dp == 4 and d.fsdp_enabled


def test_coordinates_are_row_major_over_mesh_dims() -> None:
    d = dims(8, dp_shard=2, tp=2, pp=2)
    assert d.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert d.coordinates(1)["tp"] == 1
    assert d.coordinates(2)["dp_shard"] == 1
    assert d.coordinates(7) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}


def error_of(world_size: int, **degrees: int) -> str:
    with pytest.raises(UsageError) as info:
        dims(world_size, **degrees)
    message = str(info.value)
    assert "\n" not in message  # one message, one line
    return message


@pytest.mark.parametrize(
    ("world_size", "degrees", "problem"),
    [
        (4, {"dp_shard": 3}, "product is 3"),
        (4, {"dp_shard": 2, "tp": 4}, "product is 8"),
        (4, {"tp": 3}, "dp_replicate*cp*tp*pp = 3 does not divide"),
        (6, {"pp": 4}, "= 4 does not divide"),
        (4, {"dp_shard": 2, "ep": 4, "tp": 2}, "ep=4 does not divide dp_shard*cp = 2"),
    ],
)
def test_degree_error_names_degrees_world_size_and_fix(world_size: int, degrees: dict, problem: str) -> None:
    message = error_of(world_size, **degrees)
    assert problem in message
    assert f"world size {world_size}" in message
    for name, value in degrees.items():
        assert re.search(rf"\b{name}={value}\b", message), (name, message)
    assert "Fix:" in message
    if "ep" not in degrees:  # the world size is part of the fix: launch another NGPU
        assert "NGPU" in message


def test_ep_error_says_which_axes_it_borrows() -> None:
    message = error_of(8, dp_shard=2, cp=2, tp=2, ep=3)
    assert "data-sharding and context axes" in message
    assert "pick an ep that divides 4" in message


def test_mesh_views_without_slicing_flattened_dims() -> None:
    """Every view has its size, and none is sliced out of the world mesh (deprecated in torch 2.11)."""
    import warnings

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    d = dims(16, pp=2, dp_replicate=2, dp_shard=2, cp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            meshes = d.build_mesh("cpu")
            sizes = {name: meshes[name].size() for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
            sizes.update({name: meshes[name].size() for name in ("dp", "dp_shard_cp", "dp_cp")})
    finally:
        dist.destroy_process_group()
    assert sizes == {
        "pp": 2,
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 2,
        "tp": 1,
        "dp": 4,
        "dp_shard_cp": 4,
        "dp_cp": 8,
    }
