"""LRU eviction, dependency-aware (vLLM's CPU offloading order, FlashStates' units).

Pages that no retained checkpoint needs (reclaimable: nothing can resume
through them) go first, oldest first; then pages and checkpoints together in
least-recently-used order.  When a checkpoint leaves its last tier, the pages
only it needed become reclaimable and follow it on the next pass.  The last
copy of a page that retained checkpoints need is not offered when the store
says it keeps such pages (``keep_needed``: nothing below to spill them to);
offering them would only make the store walk past the thousands of pages of a
long prompt before reaching its checkpoint.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import repeat

import numpy as np

from hybridstore.backends.base import ObjectKind
from hybridstore.index.trie import TIER_BITS, HybridIndex
from hybridstore.policy.base import EvictionPolicy, Victim


class LRUEviction(EvictionPolicy):
    """Least recently used first; reclaimable pages before anything else."""

    name = "lru"

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        bit = TIER_BITS[tier]
        pages = index.page_table(tier)
        if kind == ObjectKind.STATE:
            pages = {name: col[:0] for name, col in pages.items()}
        if keep_needed:
            # Needed pages held by this tier only stay (the store's rule): not offered.
            offer = (pages["deps"] == 0) | ((pages["tiers"] & (~bit & 0xFF)) != 0)
            pages = {name: col[offer] for name, col in pages.items()}
        order = np.lexsort((pages["atime"], pages["deps"] > 0))
        ids = pages["ids"][order]
        reclaimable = int(np.count_nonzero(pages["deps"] == 0))
        for nid in ids[:reclaimable].tolist():
            yield Victim(ObjectKind.PAGE, nid)
        # Merge the (already sorted) pages with the checkpoints lazily: eviction
        # usually stops long before the end of the list.
        atimes = pages["atime"][order][reclaimable:].tolist()
        rest_pages = zip(atimes, repeat(ObjectKind.PAGE), ids[reclaimable:].tolist())
        states = [] if kind == ObjectKind.PAGE else sorted(
            (ck.atime, ObjectKind.STATE, ck.key) for ck in index.checkpoints() if ck.tiers & bit)
        for _, kind, ref in heapq.merge(rest_pages, states, key=lambda t: t[0]):
            yield Victim(kind, ref)
