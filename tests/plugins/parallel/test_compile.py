"""``compile.enable``: each block compiled in place; same losses as eager."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry
from titan_core.trainer import Trainer


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_losses(
    tmp_path: Path, seed_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo and AOTAutograd trace every block; the ``aot_eager`` backend skips inductor's C++
    code generation, which takes over a minute on two CPU cores and is not what is tested here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    runs = {}
    for enable in (False, True):
        config = tiny_config(
            **{
                "checkpoint.initial_load_path": str(seed_checkpoint),
                "job.dump_folder": str(tmp_path / str(enable)),
                "compile.enable": enable,
            }
        )
        trainer = Trainer(config, get_registry())
        try:
            runs[enable] = [row["loss"] for row in trainer.train()]
        finally:
            trainer.close()
        compiled = [b._compiled_call_impl is not None for b in trainer.parts[0].layers.values()]
        assert compiled == [enable] * len(compiled)
        assert list(trainer.parts[0].state_dict())[1] == "layers.0.attention.wq.weight"
    assert len(runs[True]) >= 5
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
