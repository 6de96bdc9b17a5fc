"""flavors.validate (ModelSpec.validate): model arguments against the parallel layout, one error each."""

from __future__ import annotations

import attrs
import pytest

from titan_core.errors import UsageError
from titan_core.parallel_dims import ParallelDims
from titan_plugins_llama3.flavors import FLAVORS, Llama3Args, validate

ARGS = Llama3Args(dim=96, n_heads=6, n_kv_heads=2, vocab_size=2048, multiple_of=32)


def dims(tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=pp, ep=1, world_size=tp * pp * cp)


def test_valid_layouts_pass() -> None:
    validate(ARGS, dims())
    validate(ARGS, dims(tp=2, pp=2))
    validate(attrs.evolve(FLAVORS["8B"], document_mask=True, bos_id=0), dims(tp=8))
    validate(attrs.evolve(ARGS, tie_embeddings=True), dims(tp=2, cp=2))


def test_tp_that_does_not_divide_the_vocabulary_is_refused() -> None:
    args = attrs.evolve(ARGS, vocab_size=2049)  # heads and FFN divide by 2, the vocabulary does not
    with pytest.raises(UsageError, match=r"^parallelism.tp=2 must divide the model's vocab_size=2049 \("):
        validate(args, dims(tp=2))


def test_tp_names_heads_and_kv_heads() -> None:
    with pytest.raises(UsageError, match=r"parallelism.tp=4 must divide the model's n_heads=6, n_kv_heads=2"):
        validate(ARGS, dims(tp=4))


@pytest.mark.parametrize(
    ("args", "layout", "message"),
    [
        (attrs.evolve(ARGS, tie_embeddings=True), dims(pp=2), r"^model.overrides.tie_embeddings: .*pp=2"),
        (attrs.evolve(ARGS, document_mask=True), dims(cp=2), r"^model.overrides.document_mask: context"),
        (attrs.evolve(ARGS, document_mask=True), dims(pp=2), r"^model.overrides.document_mask: .*pp=2"),
        (attrs.evolve(ARGS, n_kv_heads=4), dims(), r"^model.overrides: n_heads=6 must be a multiple of n_kv"),
        (attrs.evolve(ARGS, dim=100), dims(), r"^model.overrides: dim=100 must be a multiple of n_heads=6"),
    ],
)
def test_unsupported_layouts(args: Llama3Args, layout: ParallelDims, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        validate(args, layout)
