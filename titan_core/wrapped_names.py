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


def _unique(candidates: list[str]) -> str | None:
    """The one candidate left; ``None`` when there is none or a tie (never a guess)."""
    return candidates[0] if len(candidates) == 1 else None


def find_wrapped(plain: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` (a wrapped model's) that ``plain`` (the plain model's) became."""
    names = list(names)
    if plain in names:
        return plain
    pieces = plain.split(".")
    found = [n for n in names if _within(pieces, n.split("."))]
    if len(found) > 1:  # wrappers nested differently: the one with the fewest extra pieces
        shortest = min(len(n.split(".")) for n in found)
        found = [n for n in found if len(n.split(".")) == shortest]
    return _unique(found)


def find_unwrapped(wrapped: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` (the plain model's) that ``wrapped`` (a wrapped model's) was."""
    names = list(names)
    if wrapped in names:
        return wrapped
    pieces = wrapped.split(".")
    found = [n for n in names if _within(n.split("."), pieces)]
    if len(found) > 1:  # the most specific plain name: the most of the wrapped name's pieces
        longest = max(len(n.split(".")) for n in found)
        found = [n for n in found if len(n.split(".")) == longest]
    return _unique(found)
