"""Which runs take shape-only steps (``debug.fake_tensors``), and the zero batches they read."""

from __future__ import annotations

import pytest
import torch

from titan_core.errors import UsageError
from titan_core.fake_tensors import ZeroBatches, fake_mode, is_fake, wanted
from titan_core.records import ModelSpec
from titan_core.topology import Topology

CPU = torch.device("cpu")


def spec(runs_on_fake_tensors: bool = True) -> ModelSpec:
    return ModelSpec(
        name="m",
        flavors={"f": {}},
        build=lambda args: torch.nn.Linear(1, 1),
        num_params=lambda args, emb: 1,
        flops_per_token=lambda args, seq: 1.0,
        runs_on_fake_tensors=runs_on_fake_tensors,
    )


def topology(simulated: frozenset[str] = frozenset()) -> Topology:
    return Topology(world_size=8, rank=0, local_rank=0, device=CPU, backend="sim", simulated=simulated)


SIMULATED = topology(frozenset({"dp_shard"}))


def test_auto_takes_fake_tensors_only_for_simulated_peers_on_the_cpu() -> None:
    assert wanted("auto", SIMULATED, spec(), CPU)
    assert not wanted("auto", topology(), spec(), CPU)  # real peers: values matter
    assert not wanted("auto", SIMULATED, spec(), torch.device("cuda"))  # the allocator's figures
    assert not wanted("auto", SIMULATED, spec(runs_on_fake_tensors=False), CPU)
    assert not wanted("off", SIMULATED, spec(), CPU)
    # One dimension real (a real PP group between processes): values cross it.
    hybrid = Topology(
        world_size=8,
        rank=0,
        local_rank=0,
        device=CPU,
        backend="hybrid",
        simulated=frozenset({"dp_shard"}),
        groups={"pp": object()},
    )
    assert not wanted("auto", hybrid, spec(), CPU)
    with pytest.raises(UsageError, match=r"'hybrid' backend has real pp peers"):
        wanted("on", hybrid, spec(), CPU)


def test_on_where_it_cannot_be_is_one_error_naming_the_field() -> None:
    assert wanted("on", SIMULATED, spec(), torch.device("cuda"))
    with pytest.raises(UsageError, match=r"debug\.fake_tensors = 'on' needs a comm backend that simulates"):
        wanted("on", topology(), spec(), CPU)
    with pytest.raises(UsageError, match=r"model 'm' has shapes that depend on values"):
        wanted("on", SIMULATED, spec(runs_on_fake_tensors=False), CPU)


def test_zero_batches_have_the_shape_of_the_real_ones() -> None:
    inputs, labels = next(iter(ZeroBatches(3, 16)))
    assert inputs.shape == labels.shape == (3, 16)
    assert inputs.dtype == torch.long and not inputs.any()


def test_a_module_materialised_under_the_mode_is_fake_and_costs_nothing() -> None:
    with torch.device("meta"):
        layer = torch.nn.Linear(4096, 4096)
    with fake_mode():
        layer.to_empty(device="cpu")
        out = layer(torch.zeros(2, 4096))
    assert is_fake(layer.weight) and is_fake(out) and out.shape == (2, 4096)
    assert not is_fake(torch.zeros(1))
