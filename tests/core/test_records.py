"""ModelSpec flavor arguments with overrides, for attrs, dataclass and dict arguments."""

from __future__ import annotations

import dataclasses

import attrs
import pytest

from titan_core import ModelSpec


@attrs.frozen
class AttrsArgs:
    dim: int = 8
    eps: float = 1e-5


@dataclasses.dataclass(frozen=True)
class DataArgs:
    dim: int = 8


def spec(args: object) -> ModelSpec:
    return ModelSpec(
        "m", {"base": args}, build=lambda a: None, num_params=lambda a, e: 0, flops_per_token=lambda a, s: 0.0
    )


@pytest.mark.parametrize("args", [AttrsArgs(), DataArgs(), {"dim": 8}])
def test_overrides_apply_to_any_argument_kind(args: object) -> None:
    out = spec(args).flavor("base", {"dim": 16})
    assert (out["dim"] if isinstance(out, dict) else out.dim) == 16
    assert spec(args).flavor("base") is args


def test_int_is_accepted_for_float_fields() -> None:
    assert spec(AttrsArgs()).flavor("base", {"eps": 1}).eps == 1


def test_unknown_flavor_and_field() -> None:
    with pytest.raises(LookupError, match="no flavor 'big'; known flavors: base"):
        spec(AttrsArgs()).flavor("big")
    with pytest.raises(LookupError, match="no field 'width'; fields: dim, eps"):
        spec(AttrsArgs()).flavor("base", {"width": 3})


@attrs.frozen
class IntValuedFloatArgs:
    #: A float field a flavor filled with an int literal (``rope_theta=500000``).
    theta: float = 500000  # type: ignore[assignment]
    heads: int | None = None
    name: str = "x"


def test_the_declared_field_type_decides_not_the_flavor_value() -> None:
    """A float field is a float, whatever literal the flavor used; an unset optional field still
    takes its declared type."""
    s = spec(IntValuedFloatArgs())
    assert s.flavor("base", {"theta": 10000.5}).theta == 10000.5
    assert s.flavor("base", {"heads": 4}).heads == 4
    with pytest.raises(LookupError, match="argument 'heads' expects int, got '4'"):
        s.flavor("base", {"heads": "4"})
    with pytest.raises(LookupError, match="argument 'theta' expects float, got 'big'"):
        s.flavor("base", {"theta": "big"})
    with pytest.raises(LookupError, match="argument 'name' expects str, got 3"):
        s.flavor("base", {"name": 3})
    with pytest.raises(LookupError, match="argument 'heads' expects int, got True"):
        s.flavor("base", {"heads": True})


@dataclasses.dataclass(frozen=True)
class DataFloatArgs:
    eps: float = 1  # type: ignore[assignment]


def test_declared_types_of_dataclass_arguments() -> None:
    assert spec(DataFloatArgs()).flavor("base", {"eps": 0.5}).eps == 0.5
