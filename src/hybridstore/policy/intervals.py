"""Interval placement: SGLang's fixed interval and HiState's adaptive interval (§3.2).

A new segment of ``L = length - cached`` tokens gets a checkpoint every ``I``
tokens.  HiState picks ``I`` per segment by trading the expected recomputation
of an internal prefix hit against checkpoint storage:

* eq. 3  ``C_recomp(I) = sum_{t=1}^{L-1} p_t (t - I floor(t/I))``, with
  ``p_t = 1/L`` (no prior on where a hit lands);
* eq. 4  ``C_mem(I) = (T_KV / T_state) (L / I) N_s``, ``N_s`` a checkpoint's
  size in KV-token equivalents, ``T_KV / T_state`` the residence-time ratio
  (:meth:`ResidenceStats.kv_state_ratio`): checkpoints that leave sooner than
  KV make storage dearer;
* eq. 5  ``I* = argmin_I C_mem(I) + C_recomp(I)`` over supported intervals;
* eq. 6  ``I*_cont = sqrt(2 L N_s T_KV / T_state)``, the continuous solution.

The segment's final state is always kept (append reuse), whatever ``I*``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.policy.base import PlacementPolicy, ResidenceStats

STATE_BYTES = 51_200_000
"""A ~9B hybrid's checkpoint across all recurrent layers (HiState §3.1: 0.8 ms at 64 GB/s)."""
KV_BYTES_PER_TOKEN = 32_800
"""Its BF16 KV per token (HiState §3.1: a 32K-token prefix loads in 16.8 ms at 64 GB/s)."""


def recompute_cost(length: int, intervals: np.ndarray | int) -> np.ndarray:
    """HiState eq. 3 with ``p_t = 1/L``: mean tokens from a hit back to its checkpoint.

    Exact: writing ``L = nI + r``, positions ``0..L-1`` run through ``n``
    full cycles of ``0..I-1`` and one partial cycle ``0..r-1``.
    """
    I = np.asarray(intervals, dtype=np.float64)
    n, r = np.floor_divide(length, I), np.mod(length, I)
    return (n * I * (I - 1) / 2 + r * (r - 1) / 2) / length


def memory_cost(length: int, intervals: np.ndarray | int, state_tokens: float,
                kv_state_ratio: float) -> np.ndarray:
    """HiState eq. 4: storage of the segment's checkpoints in token equivalents."""
    return kv_state_ratio * length / np.asarray(intervals, dtype=np.float64) * state_tokens


def best_interval(length: int, candidates: Sequence[int] | np.ndarray, state_tokens: float,
                  kv_state_ratio: float) -> int:
    """HiState eq. 5: the candidate interval of least ``C_mem + C_recomp``."""
    I = np.asarray(candidates, dtype=np.int64)
    if I.size == 0:
        raise ConfigError("best_interval needs at least one candidate interval")
    total = memory_cost(length, I, state_tokens, kv_state_ratio) + recompute_cost(length, I)
    return int(I[int(np.argmin(total))])


def continuous_interval(length: int, state_tokens: float, kv_state_ratio: float) -> float:
    """HiState eq. 6: ``sqrt(2 L N_s T_KV / T_state)``."""
    return math.sqrt(2.0 * length * state_tokens * kv_state_ratio)


class FixedInterval(PlacementPolicy):
    """SGLang's placement: a state at every multiple of ``interval`` in ``(cached, length]``.

    Args:
        interval: tokens between checkpoints (SGLang's default 256).
        end: also keep the request end (compose with
            :class:`~hybridstore.policy.placement.RequestEnd` for the same).
    """

    name = "interval"

    def __init__(self, *, interval: int = 256, end: bool = False) -> None:
        if interval < 1:
            raise ConfigError(f"interval must be positive, got {interval}")
        self.interval = interval
        self.end = end

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        I = self.interval
        picked = list(range((cached // I + 1) * I, length + 1, I))
        if self.end and length > cached and (not picked or picked[-1] != length):
            picked.append(length)
        return picked


class AdaptiveInterval(PlacementPolicy):
    """HiState's adaptive interval (§3.2, eq. 3–5), plus the segment's final state.

    Candidate intervals are the multiples of ``block_size`` from
    ``min_interval`` up to ``L``; positions are ``cached + k I*`` rounded down
    to a block boundary (so prompts given as block ids can take them), then
    the request end.  A segment shorter than ``min_interval`` gets only its
    end.

    Args:
        state_bytes: bytes of one checkpoint (all recurrent layers).
        kv_bytes_per_token: KV bytes per token; ``N_s = state_bytes / kv_bytes_per_token``.
        state_tokens: ``N_s`` directly (overrides the two above).
        block_size: the candidate grid (and position alignment), in tokens.
        min_interval: the smallest supported interval.
    """

    name = "adaptive"

    def __init__(self, *, state_bytes: int = STATE_BYTES, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
                 state_tokens: float | None = None, block_size: int = 16,
                 min_interval: int = 256) -> None:
        if state_tokens is None:
            if state_bytes <= 0 or kv_bytes_per_token <= 0:
                raise ConfigError("state_bytes and kv_bytes_per_token must be positive; "
                                  f"got {state_bytes}, {kv_bytes_per_token}")
            state_tokens = state_bytes / kv_bytes_per_token
        if state_tokens <= 0 or block_size < 1 or min_interval < 1:
            raise ConfigError("state_tokens, block_size and min_interval must be positive; "
                              f"got {state_tokens}, {block_size}, {min_interval}")
        self.state_tokens = float(state_tokens)
        self.block_size = block_size
        self.min_interval = min_interval

    def candidates(self, length: int) -> np.ndarray:
        """Supported intervals for a segment of ``length`` new tokens."""
        B = self.block_size
        return np.arange(-(-self.min_interval // B) * B, length + 1, B, dtype=np.int64)

    def interval(self, length: int, kv_state_ratio: float = 1.0) -> int | None:
        """``I*`` of eq. 5 for a segment of ``length`` tokens (``None``: too short for one)."""
        grid = self.candidates(length)
        if grid.size == 0:
            return None
        return best_interval(length, grid, self.state_tokens, kv_state_ratio)

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        if length <= cached:
            return []
        ratio = stats.kv_state_ratio() if stats is not None else 1.0
        I = self.interval(length - cached, ratio)
        B = self.block_size
        picked = []
        if I is not None:
            picked = [p for p in ((cached + k * I) // B * B for k in range(1, (length - cached) // I + 1))
                      if cached < p < length]
        return [*picked, length]


__all__ = ["AdaptiveInterval", "FixedInterval", "KV_BYTES_PER_TOKEN", "STATE_BYTES",
           "best_interval", "continuous_interval", "memory_cost", "recompute_cost"]
