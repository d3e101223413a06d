"""LRU with refresh-all: a hit also refreshes every checkpoint before it (HiState §2.3).

Refreshing the hit checkpoint *and* all preceding checkpoints on the matched
prefix propagates a session's activity to its historical states, so an early
checkpoint survives until the session forks there (HiState Fig. 3(a)).  The
price is cache competition: an active session keeps a growing set of
checkpoints recent and can displace the latest state of a slower session
(Fig. 3(b), Fig. 7).  Ranking is otherwise :class:`~hybridstore.policy.lru.LRUEviction`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import ObjectKind
from hybridstore.policy.base import Victim
from hybridstore.policy.lru import LRUEviction


class LRURefreshEviction(LRUEviction):
    """Dependency-aware LRU whose hits refresh the whole matched checkpoint chain."""

    name = "lru-refresh"

    def on_hit(self, index: HybridIndex, checkpoint: Checkpoint) -> None:
        for ck in index.ancestors(checkpoint):
            ck.atime = max(ck.atime, checkpoint.atime)

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """:class:`LRUEviction`'s order (only objects of ``kind``, when given)."""
        for victim in super().victims(index, tier, keep_needed=keep_needed):
            if kind is None or victim.kind == kind:
                yield victim


__all__ = ["LRURefreshEviction"]
