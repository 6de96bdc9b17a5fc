"""The ``float8`` config section: float8 training of the model's linear layers, off by default."""

from typing import Any, Literal

import attrs

from titan_core.config import field, section


def _names(_inst: Any, _attr: Any, value: str) -> None:
    if any(not name.strip() for name in value.split(",")) and value.strip():
        raise ValueError(f"expected comma-separated module names such as 'output,router', got {value!r}")


def filter_names(value: str) -> list[str]:
    """``float8.filter_fqns`` as a list of names (empty string: none)."""
    return [name.strip() for name in value.split(",") if name.strip()]


@section
class Float8:
    #: Train the model's linear layers in float8 with torchao (``convert_to_float8_training``):
    #: matmuls in float8 with dynamic scales, weights, gradients and optimizer state as before.
    #: Needs torchao and a GPU with float8 tensor cores (CUDA compute capability 8.9+: H100/H200).
    enable: bool = False
    #: torchao's scaling recipe: ``tensorwise`` (one scale per tensor, fastest) or ``rowwise``
    #: (one scale per row, more accurate; needs ``training.dtype = "bfloat16"`` on CUDA).
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    #: Comma-separated module names: a linear layer whose fully qualified name contains one stays
    #: in high precision (``output``: the final projection, as torchtitan). Layers whose input
    #: or output width is not a multiple of 16 (float8 matmul's tile) also stay.
    filter_fqns: str = field(default="output", validator=_names)
    #: Emulate the float8 matmuls in high precision (any device, e.g. CPU tests); numerics of
    #: float8 casts, no speed-up.
    emulate: bool = False


def check(config: Any) -> list[str]:
    """The other fields do nothing with ``float8.enable = False``: a recipe setting them would
    believe it changed a run it did not change."""
    f8 = config.float8
    if f8.enable:
        return []
    return [
        f"float8.{f.name}: {getattr(f8, f.name)!r} does nothing with float8.enable = False; remove it "
        "from the recipe, or set float8.enable = True"
        for f in attrs.fields(type(f8))
        if f.name != "enable" and getattr(f8, f.name) != f.default
    ]
