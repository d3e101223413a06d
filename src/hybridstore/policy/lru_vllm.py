"""Plain per-object LRU, not dependency-aware (vLLM's CPU offloading order).

Pages and checkpoints are offered strictly by last access, each on its own:
the store may drop the last copy of a page that a retained checkpoint still
needs, leaving that checkpoint without its KV.  Such dependency misses are
what FlashStates measures for vLLM; this policy is the baseline that shows
them.  Use :class:`~hybridstore.policy.lru.LRUEviction` for the
dependency-aware order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import repeat

import numpy as np

from hybridstore.index.trie import HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import EvictionPolicy, Victim


class PlainLRUEviction(EvictionPolicy):
    """Least recently used object first, pages and checkpoints alike."""

    name = "lru-vllm"
    dependency_aware = False

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """Objects of ``tier`` by last access (only those of ``kind``, when given); pages
        used at the same time go deepest first (the order of :func:`~hybridstore.policy.base.lru_order`:
        vLLM's block pool frees a request's blocks in reverse, so its tail is evicted
        before its head, without which the tail is useless)."""
        bit = TIER_BITS[tier]
        page_ids: list[int] = []
        page_atime: list[int] = []
        if kind != ObjectKind.STATE:
            pages = index.page_table(tier)
            order = np.lexsort((-pages["block"], pages["atime"]))   # lru_order's ranking
            page_ids = pages["ids"][order].tolist()
            page_atime = pages["atime"][order].tolist()
        states: list[tuple[int, ObjectKind, int | bytes]] = [] if kind == ObjectKind.PAGE \
            else sorted(((ck.atime, ObjectKind.STATE, ck.key) for ck in index.checkpoints()
                         if ck.tiers & bit), key=lambda t: t[0])
        ranked: Iterator[tuple[int, ObjectKind, int | bytes]] = zip(
            page_atime, repeat(ObjectKind.PAGE), page_ids)
        for _, kind_, ref in heapq.merge(ranked, states, key=lambda t: t[0]):
            yield Victim(kind_, ref)


__all__ = ["PlainLRUEviction"]
