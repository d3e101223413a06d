"""Checkpoint placement: request end plus engine-given anchors.

The request end inside its block (FlashStates ASC) is where the next turn of
an agent most often resumes; anchors are positions the engine knows to be
semantic boundaries (turn starts, tool calls and results).  Richer placement
(fixed and adaptive intervals) plugs in through :class:`PlacementPolicy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridstore.policy.base import PlacementPolicy, ResidenceStats


class RequestEnd(PlacementPolicy):
    """Checkpoint at the request end and at every anchor of the new segment."""

    name = "request-end"

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        picked = {p for p in anchors if cached < p <= length}
        if length > cached:
            picked.add(length)
        return sorted(picked)
