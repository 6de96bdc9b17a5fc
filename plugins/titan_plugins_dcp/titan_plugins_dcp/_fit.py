"""Strict loads: a checkpoint must hold exactly the model's tensors, with the model's shapes.

DCP's own load is lenient in one direction: it reads the keys the model asks for and ignores the
rest, so a 6-layer checkpoint "loads" into a 3-layer model. Its errors for the other cases
(missing keys, other shapes) are a traceback per rank. This check compares the whole model's
keys and global shapes (gathered over every rank, so pipeline stages count together) with the
checkpoint's ``.metadata`` before anything is read, and names what differs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from titan_core.errors import UsageError

#: Keys (and shapes) named per kind of difference in the error.
_SHOWN = 3


def saved_shapes(metadata: Any, prefix: str) -> dict[str, tuple[int, ...] | None]:
    """Keys under ``prefix`` in a checkpoint's metadata, with their global shapes (``None``: not a
    tensor)."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            size = getattr(item, "size", None)
            shapes[key] = tuple(size) if size is not None else None
    return shapes


def check_fit(
    path: str, saved: Mapping[str, tuple[int, ...] | None], wanted: Mapping[str, tuple[int, ...] | None]
) -> None:
    """Raise one :class:`UsageError` naming the first few missing, unexpected and reshaped keys."""
    missing = _natural([k for k in wanted if k not in saved])
    unexpected = _natural([k for k in saved if k not in wanted])
    reshaped = _natural([k for k in wanted if k in saved and saved[k] != wanted[k]])
    if not (missing or unexpected or reshaped):
        return
    problems = []
    if missing:
        problems.append(f"{_count(missing)} of the model missing from it ({_names(missing)})")
    if unexpected:
        problems.append(f"{_count(unexpected)} in it that the model lacks ({_names(unexpected)})")
    if reshaped:
        shown = "; ".join(
            f"{k}: checkpoint {_shape(saved[k])}, model {_shape(wanted[k])}" for k in reshaped[:_SHOWN]
        )
        more = f"; and {len(reshaped) - _SHOWN} more" if len(reshaped) > _SHOWN else ""
        problems.append(f"{_count(reshaped)} with other shapes ({shown}{more})")
    raise UsageError(
        f"checkpoint {path} does not fit the model: {'; '.join(problems)}. It was saved from "
        "another model or flavor (model.name, model.flavor, model.overrides): resume it with the "
        "model it was written for, or give this model its own job.dump_folder or checkpoint.folder"
    )


def _count(keys: list[str]) -> str:
    return f"{len(keys)} tensor{'s' if len(keys) != 1 else ''}"


def _names(keys: list[str]) -> str:
    more = f", and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _shape(shape: tuple[int, ...] | None) -> str:
    return "not a tensor" if shape is None else f"[{', '.join(map(str, shape))}]"


def _natural(keys: Iterable[str]) -> list[str]:
    """Sorted with numbers as numbers: layers.2 before layers.10."""
    return sorted(keys, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)])
