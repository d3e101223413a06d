"""LRU eviction, dependency-aware (vLLM's CPU offloading order, FlashStates' units).

Pages that no retained checkpoint needs (reclaimable: nothing can resume
through them) go first, oldest first; then pages and checkpoints together in
least-recently-used order; last the reclaimable pages touched after the newest
checkpoint put or hit, the KV of a request whose checkpoint is still to come
(:func:`~hybridstore.policy.base.reclaimable_pages`; offering them first would
evict a request's own KV to make room for its checkpoint, which then lands
without it).  When a checkpoint leaves its last tier, the pages only it needed
become reclaimable and follow it on the next pass.  The last copy of a page that
retained checkpoints need is not offered when the store says it keeps such
pages (``keep_needed``: nothing below to spill them to); offering them would
only make the store walk past the thousands of pages of a long prompt before
reaching its checkpoint.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import repeat

import numpy as np

from hybridstore.index.trie import HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import EvictionPolicy, Victim, lru_order, reclaimable_pages


class LRUEviction(EvictionPolicy):
    """Least recently used first; reclaimable pages before anything else, except
    those of a request whose checkpoint is still to come (last)."""

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
        old, young = reclaimable_pages(index, pages["atime"], pages["deps"])
        ids, atime = pages["ids"], pages["atime"]
        for nid in lru_order(pages, old):
            yield Victim(ObjectKind.PAGE, nid)
        # Merge the needed pages with the checkpoints lazily, by last use: eviction
        # usually stops long before the end of the list.
        needed = pages["deps"] > 0
        order = np.argsort(atime[needed], kind="stable")
        rest_pages = zip(atime[needed][order].tolist(), repeat(ObjectKind.PAGE),
                         ids[needed][order].tolist())
        states = [] if kind == ObjectKind.PAGE else sorted(
            (ck.atime, ObjectKind.STATE, ck.key) for ck in index.checkpoints() if ck.tiers & bit)
        for _, kind_, ref in heapq.merge(rest_pages, states, key=lambda t: t[0]):
            yield Victim(kind_, ref)
        for nid in lru_order(pages, young):
            yield Victim(ObjectKind.PAGE, nid)
