"""Sharded initialisation: distinct shards, equal to the one-process initialisation, any layout.

torch's DTensor RNG does not cover CPU meshes: before titan initialised like one process, every
rank of FSDP 2, TP 2 and FSDP 2 x TP 2 on gloo drew the same numbers, so every shard of a matrix
was equal. Without a seed checkpoint, each layout's per-step losses must now equal one process's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_titan_train, step_losses

LAYOUTS = {
    "fsdp2": (2, {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2}),
    "tp2": (2, {"parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "fsdp2_tp2": (
        4,
        {"parallelism.dp_shard": 2, "parallelism.tp": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
    ),
    "pp2": (2, {"parallelism.pp": 2, "parallelism.dp_shard": 1}),
}


def _losses(folder: Path, nproc: int, overrides: dict) -> list[float]:
    result = run_titan_train(folder, nproc, {"debug.seed": 7, **overrides})
    assert result.returncode == 0, result.stderr[-3000:]
    return step_losses(result.stdout)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses(tmp_path_factory.mktemp("one"), 1, {})


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_without_seed_checkpoint_matches_one_process(
    tmp_path: Path, one_process: list[float], layout: str
) -> None:
    nproc, overrides = LAYOUTS[layout]
    assert_losses_close(_losses(tmp_path, nproc, overrides), one_process)


def test_shards_of_a_matrix_differ_and_equal_the_full_init() -> None:
    """In one process over a fake 2-rank mesh: each shard is its slice of the full matrix."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_core._registry import get_registry
    from titan_core.init import init_like_one_process

    spec = get_registry().get("models", "llama3")
    args = spec.flavor("debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 4})
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = spec.build(args)
        model.to_empty(device="cpu")
        weight = model.layers["0"].attention.wq.weight
        full_shape = weight.shape
        sharded = distribute_tensor(torch.zeros(full_shape), mesh, [Shard(0)])
        model.layers["0"].attention.wq.weight = torch.nn.Parameter(sharded)
        init_like_one_process([model], spec, args, seed=3)
        torch.manual_seed(3)
        with torch.device("meta"):
            reference = spec.build(args)
        reference.to_empty(device="cpu")
        torch.manual_seed(3)
        with torch.no_grad():
            reference.init_weights(buffer_device=torch.device("cpu"))
        full = reference.layers["0"].attention.wq.weight
        local = model.layers["0"].attention.wq.weight.to_local()
        assert torch.equal(local, full[full_shape[0] // 2 :])  # rank 1 holds the second half
        assert not torch.equal(local, full[: full_shape[0] // 2])  # and it differs from rank 0's
    finally:
        dist.destroy_process_group()


def test_no_dtensor_rng_warning_where_the_one_process_values_replace_the_shards() -> None:
    """torch warns that "DTensor random operators may not have complete support on cpu device
    mesh" when the model's ``init_weights`` draws into CPU DTensors. On the path that then copies
    every shard out of a one-process build, those draws are thrown away: the warning told every
    multi-process CPU run (FSDP, TP, CP, EP, PP) that its weights may be wrong when they are not."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_core._registry import get_registry
    from titan_core.init import initialise

    spec = get_registry().get("models", "llama3")
    args = spec.flavor("debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 4})
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = spec.build(args)
        model.to_empty(device="cpu")
        embedding = model.tok_embeddings
        sharded = distribute_tensor(torch.zeros(embedding.weight.shape), mesh, [Shard(0)])
        embedding.weight = torch.nn.Parameter(sharded)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            how = initialise(
                [model],
                spec,
                args,
                3,
                device=torch.device("cpu"),
                simulated=False,
                max_full_gib=8.0,
                pp_coordinate=0,
                world_size=2,
            )
        assert how == "one_process"
        assert not [w for w in seen if "DTensor random operators" in str(w.message)]
    finally:
        dist.destroy_process_group()
