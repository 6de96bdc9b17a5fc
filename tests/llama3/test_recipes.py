"""Which Llama 3 recipes train with document masking, and that each recipe's layout accepts it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import tiny_llama3
from titan_core._registry import get_registry
from titan_core.parallel_dims import ParallelDims
from titan_core.trainer import Trainer
from titan_plugins_llama3 import recipes
from titan_plugins_llama3.flavors import validate


def resolved_args(config: object, bos_id: int = 0) -> object:
    """The model arguments the trainer builds from ``config`` (it fills ``bos_id`` the same way)."""
    spec = get_registry().get("models", "llama3", what="model")
    overrides = {**config.model.overrides, "bos_id": bos_id}  # type: ignore[attr-defined]
    return spec.flavor(config.model.flavor, overrides)  # type: ignore[attr-defined]


def layout(config: object, world_size: int) -> ParallelDims:
    return ParallelDims.from_config(config.parallelism, world_size)  # type: ignore[attr-defined]


@pytest.mark.parametrize("recipe", [recipes.llama3_70b, recipes.llama3_405b])
def test_large_tp_recipes_mask_documents_and_their_layouts_accept_it(recipe: object) -> None:
    config = recipe()  # type: ignore[operator]
    args = resolved_args(config)
    assert args.document_mask is True  # type: ignore[attr-defined]
    validate(args, layout(config, 64))  # FSDP 8 x TP 8: no error
    config.parallelism.pp = 2  # TP 8 x PP 2 x FSDP 4: the later stage masks from the token ids
    validate(resolved_args(config), layout(config, 64))
    config.parallelism.pp, config.parallelism.cp = 1, 2  # each CP rank masks its rows
    validate(resolved_args(config), layout(config, 64))
    config.parallelism.pp = 2  # CP x PP: every stage's CP rank masks its rows of its microbatch
    validate(resolved_args(config), layout(config, 64))


@pytest.mark.parametrize("recipe", [recipes.llama3_debugmodel, recipes.llama3_8b])
def test_recipes_the_documented_pipeline_layouts_build_on_accept_the_mask(recipe: object) -> None:
    config = recipe()  # type: ignore[operator]
    assert resolved_args(config).document_mask is False  # type: ignore[attr-defined]
    config.parallelism.pp = 2  # as docs/debugging.md and the 64-rank fake job do
    config.parallelism.dp_shard = 2
    config.model.overrides = {**config.model.overrides, "document_mask": True}
    validate(resolved_args(config), layout(config, 4))


def test_a_document_masked_run_takes_the_bos_id_from_the_tokenizer_and_learns(tmp_path: Path) -> None:
    config = tiny_llama3(tmp_path, steps=6)
    config.model.overrides = {**config.model.overrides, "document_mask": True}
    config.training.seq_len = 128  # several bundled documents per sequence
    config.training.lr = 3e-3
    trainer = Trainer(config, get_registry())
    try:
        losses = [row["loss"] for row in trainer.train()]
    finally:
        trainer.close()
    assert trainer.model_args.document_mask is True
    assert trainer.model_args.bos_id == trainer.tokenizer.bos_id is not None
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
