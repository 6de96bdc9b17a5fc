"""A Hugging Face folder as the initial weights of multi-process layouts (gloo, CPU).

Each rank reads only the tensors of its own model parts and ``set_model_state_dict`` shards them
(FSDP, TP) or keeps them whole (a pipeline stage holds only its blocks); the per-step losses
equal those of one process started from the same folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf.conftest import TITAN_OVERRIDES, save_hf
from tests.parallel_harness import GLOBAL_BATCH, assert_losses_close, run_layout

_MODEL = {"model.overrides": TITAN_OVERRIDES}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    save_hf(folder, max_shard_size="100KB")  # several files: each rank opens the ones it needs
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, hf_folder: Path) -> list[float]:
    return run_layout(tmp_path_factory.mktemp("one"), 1, hf_folder, _MODEL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"parallelism.dp_shard": 2, "training.local_batch_size": GLOBAL_BATCH // 2},
        {"parallelism.tp": 2},
        {"parallelism.pp": 2},
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_layouts_start_from_the_same_weights(
    tmp_path: Path, hf_folder: Path, reference: list[float], layout: dict
) -> None:
    assert_losses_close(run_layout(tmp_path, 2, hf_folder, {**_MODEL, **layout}), reference)
