"""Semantic anchor placement: checkpoints at the boundaries agent harnesses edit at (seed 003).

Agent harnesses truncate and rewrite history at semantic boundaries —
thinking blocks, tool calls and results, turn transitions — marked by special
tokens.  A checkpoint exactly there stays valid after such an edit: the
unedited prefix ends on it, attention reuses its KV up to the boundary and the
recurrent layers resume from the anchor state, so only the new suffix is
prefilled.  Checkpoints at arbitrary offsets past the edit are invalidated.

The engine (or the trace) knows the anchors; this policy only keeps the ones
inside the new segment.  Compose it with an interval or request-end policy
(:class:`~hybridstore.policy.placement.Compose`) for append reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridstore.policy.base import PlacementPolicy, ResidenceStats


class SemanticAnchors(PlacementPolicy):
    """A checkpoint at every anchor in ``(cached, length]``.

    Args:
        end: also keep the request end (a turn transition of its own).
    """

    name = "anchors"

    def __init__(self, *, end: bool = False) -> None:
        self.end = end

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        picked = {int(p) for p in anchors if cached < p <= length}
        if self.end and length > cached:
            picked.add(length)
        return sorted(picked)


__all__ = ["SemanticAnchors"]
