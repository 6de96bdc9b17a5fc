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


@pytest.mark.slow
def test_blocks_share_one_graph_and_never_recompile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four blocks, four steps, selective AC and a new document mask every batch: every graph is
    compiled in step 1 and there are fewer graphs than blocks (the blocks share theirs)."""
    compiled_at: list[int] = []
    trainer: Trainer | None = None

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiled_at.append(trainer.step)
        return gm.forward  # run the captured graph as is: dynamo's guards are what is tested

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting_backend))
    torch._dynamo.reset()
    config = tiny_config(
        **{
            "job.dump_folder": str(tmp_path),
            "compile.enable": True,
            "activation_checkpoint.mode": "selective",
            "training.steps": 4,
        }
    )
    config.model.overrides.update(document_mask=True, bos_id=0)  # the bundled tokenizer's BOS
    trainer = Trainer(config, get_registry())
    try:
        losses = [row["loss"] for row in trainer.train()]
    finally:
        trainer.close()
    assert len(losses) == 4
    n_blocks = len(trainer.parts[0].layers)
    assert n_blocks == 4
    assert compiled_at and set(compiled_at) == {1}, compiled_at
    assert len(compiled_at) < n_blocks
