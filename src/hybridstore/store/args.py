"""Checks of the public API's arguments: a wrong type or range is a typed error
(:class:`~hybridstore.errors.InvalidArgumentError`) that says what to pass, raised before
anything changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridstore.errors import InvalidArgumentError, UnknownTierError
from hybridstore.index.trie import ResumePlan
from hybridstore.objects import TIER_BITS


def whole(value: Any, what: str, *, low: int = 0, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (a Python or numpy integer, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__} "
                                   f"{value!r:.40}")
    n = int(value)
    if n < low or (high is not None and n > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidArgumentError(f"{what} must be {span}, got {n}")
    return n


def optional_whole(value: Any, what: str, *, low: int = 0) -> int | None:
    """:func:`whole`, or ``None``."""
    return None if value is None else whole(value, what, low=low)


def seconds(value: Any, what: str) -> float:
    """``value`` as a float >= 0 (a real number, not a bool; ``math.inf`` allowed, NaN not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got "
                                   f"{type(value).__name__} {value!r:.40}")
    x = float(value)
    if not x >= 0:      # NaN too
        raise InvalidArgumentError(f"{what} must be >= 0 seconds, got {x}")
    return x


def plan(value: Any) -> ResumePlan:
    """A :class:`ResumePlan` (what :meth:`~hybridstore.HybridStore.match` returns)."""
    if not isinstance(value, ResumePlan):
        raise InvalidArgumentError(f"expected a ResumePlan from match() or match_pages(), got "
                                   f"{type(value).__name__}")
    return value


def tier_name(value: Any, tiers: Sequence[str], what: str = "tier") -> str:
    """A tier name this store has."""
    if not isinstance(value, str) or value not in tiers:
        raise UnknownTierError(f"this store has no {what} {value!r:.40}; it has {list(tiers)}")
    return value


def tier_names(value: Any, what: str) -> tuple[str, ...]:
    """A sequence of known tier names (of any store)."""
    if isinstance(value, str) or not isinstance(value, (Sequence, set, frozenset)):
        raise InvalidArgumentError(f"{what} must be a sequence of tier names, got "
                                   f"{type(value).__name__}")
    for name in value:
        tier_name(name, list(TIER_BITS), f"tier in {what}")
    return tuple(value)


def is_sequence(value: Any) -> bool:
    """A list-like: a sequence or a numpy array of at least one dimension, not a str/bytes."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def positions(value: Any, what: str) -> list[int]:
    """A sequence of token positions (ints >= 0)."""
    if not is_sequence(value):
        raise InvalidArgumentError(f"{what} must be a sequence of token positions, got "
                                   f"{type(value).__name__}")
    return [whole(v, f"{what}[{i}]") for i, v in enumerate(value)]


def indices(value: Any, what: str, high: int) -> list[int]:
    """A sequence of ints in ``[0, high)`` (row numbers), checked at once."""
    if not is_sequence(value):
        raise InvalidArgumentError(f"{what} must be a sequence of row numbers, got "
                                   f"{type(value).__name__}")
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):     # bool is kind "b"
        raise InvalidArgumentError(f"{what} must be a flat sequence of ints, got {arr.dtype} "
                                   f"of shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= high):
        raise InvalidArgumentError(f"{what} must lie in 0..{high - 1}, got "
                                   f"{int(arr.min())}..{int(arr.max())}")
    return arr.tolist()


def key_list(value: Any, what: str) -> list[Any]:
    """A sequence of engine page hashes (each checked where it is hashed)."""
    if not is_sequence(value):
        raise InvalidArgumentError(f"{what} must be a sequence of page hashes (str or bytes), "
                                   f"got {type(value).__name__}")
    return list(value)
