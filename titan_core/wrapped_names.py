"""Parameter names under wrappers.

A strategy may put a wrapper module around a model or a block: activation checkpointing's
``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``, or a plugin's own (``inner``, say).
Each inserts pieces into the names of every parameter below it, anywhere in the path. A name of
the plain model (``layers.1.attention.wq.weight``) is found again under wrappers as the one name
that holds all of its pieces in order, with the same parameter name last
(``inner.layers.1._checkpoint_wrapped_module.attention.wq.weight``): wrappers add pieces, they do
not remove or rename them.
"""

from __future__ import annotations

from collections.abc import Iterable


def _within(plain: list[str], wrapped: list[str]) -> bool:
    """``plain``'s pieces appear in ``wrapped`` in order, and both end in the same parameter."""
    if plain[-1] != wrapped[-1]:
        return False
    pieces = iter(wrapped)
    return all(piece in pieces for piece in plain)


def _pick(found: list[str], *, fewest: bool) -> str | None:
    """The one name with the fewest (or most) pieces; ``None`` when there is none or a tie (never
    a guess)."""
    if not found:
        return None
    size = (min if fewest else max)(len(n.split(".")) for n in found)
    best = [n for n in found if len(n.split(".")) == size]
    return best[0] if len(best) == 1 else None


def find_wrapped(plain: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` (a wrapped model's) that ``plain`` (the plain model's) became:
    among several, the one with the fewest pieces added."""
    names = list(names)
    if plain in names:
        return plain
    pieces = plain.split(".")
    return _pick([n for n in names if _within(pieces, n.split("."))], fewest=True)


def find_unwrapped(wrapped: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` (the plain model's) that ``wrapped`` (a wrapped model's) was:
    among several, the most specific (the most of the wrapped name's pieces)."""
    names = list(names)
    if wrapped in names:
        return wrapped
    pieces = wrapped.split(".")
    return _pick([n for n in names if _within(n.split("."), pieces)], fewest=False)
