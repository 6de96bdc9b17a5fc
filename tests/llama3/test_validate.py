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
    validate(attrs.evolve(ARGS, document_mask=True, bos_id=0), dims(tp=2, pp=2))
    validate(attrs.evolve(ARGS, tie_embeddings=True), dims(tp=2, cp=2))
    validate(attrs.evolve(ARGS, document_mask=True, bos_id=0), dims(cp=2))  # each CP rank its rows
    validate(attrs.evolve(ARGS, document_mask=True, bos_id=0), dims(cp=2, pp=2))  # and within stages


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
        (attrs.evolve(ARGS, n_kv_heads=4), dims(), r"^model.overrides: n_heads=6 must be a multiple of n_kv"),
        (attrs.evolve(ARGS, dim=100), dims(), r"^model.overrides: dim=100 must be a multiple of n_heads=6"),
    ],
)
def test_unsupported_layouts(args: Llama3Args, layout: ParallelDims, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        validate(args, layout)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # Each of these built a broken model, or no model, without naming the field.
        ({"n_kv_heads": -1}, r"n_kv_heads: expected a positive integer, got -1"),  # negative tensor dimension
        ({"multiple_of": 0}, r"multiple_of: expected a positive integer, got 0"),  # ZeroDivisionError
        ({"norm_eps": -1.0}, r"norm_eps: expected a small positive number"),  # NaN at step 1
        ({"norm_eps": 0.0}, r"norm_eps: expected a small positive number"),
        ({"rope_theta": 0.0}, r"rope_theta: expected a positive number, got 0.0"),  # inf frequencies
        ({"rope_theta": float("nan")}, r"rope_theta: expected a positive number"),
        ({"max_seq_len": 0}, r"max_seq_len: expected a positive integer, got 0"),
        ({"ffn_dim_multiplier": -1.0}, r"ffn_dim_multiplier: expected a positive number"),
        ({"rope_scaling_factor": 0.0}, r"rope_scaling_factor: expected a positive number"),
        # ZeroDivisionError inside the model's build, reported as the plugin failing (exit 1).
        ({"rope_low_freq_factor": 0.0}, r"rope_low_freq_factor: expected a positive number, got 0.0"),
        ({"rope_high_freq_factor": 0.0}, r"rope_high_freq_factor: expected a positive number"),
        # Every frequency was divided by the scaling factor without a word (wavelengths > 0).
        ({"rope_original_max_len": 0}, r"rope_original_max_len: expected a positive integer, got 0"),
        # Equal or swapped factors: the interpolation between them divides by zero or inverts.
        ({"rope_high_freq_factor": 1.0}, r"rope_high_freq_factor: expected more than rope_low_freq_factor"),
        ({"rope_low_freq_factor": 8.0}, r"rope_high_freq_factor: expected more than rope_low_freq_factor"),
    ],
)
def test_impossible_sizes_are_one_usage_error_naming_the_field(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=rf"model\.overrides\.{message}"):
        validate(attrs.evolve(ARGS, **overrides), dims())


def test_rope_scaling_factor_is_not_checked_without_rope_scaling() -> None:
    validate(attrs.evolve(ARGS, rope_scaling=False, rope_scaling_factor=0.0), dims())
    unscaled = attrs.evolve(ARGS, rope_scaling=False, rope_low_freq_factor=0.0, rope_original_max_len=0)
    validate(unscaled, dims())


def test_an_odd_head_dim_is_refused_before_the_build() -> None:
    """RoPE rotates pairs of each head's features: dim=48 with n_heads=16 (head_dim 3) built the
    model and then failed at step 1 with a bare RuntimeError from inside attention."""
    with pytest.raises(UsageError, match=r"^model.overrides: head_dim = dim / n_heads = 48 / 16 = 3 is odd"):
        validate(attrs.evolve(ARGS, dim=48, n_heads=16, n_kv_heads=None), dims())
