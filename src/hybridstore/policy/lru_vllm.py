"""Plain per-object LRU, not dependency-aware (vLLM's CPU offloading order).

Pages and checkpoints are offered strictly by last access, each on its own:
the store may drop the last copy of a page that a retained checkpoint still
needs, leaving that checkpoint without its KV.  Such dependency misses are
what FlashStates measures for vLLM; this policy is the baseline that shows
them.  Use :class:`~hybridstore.policy.lru.LRUEviction` for the
dependency-aware order.
"""

from __future__ import annotations

from collections.abc import Iterator

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
        """Objects of ``tier`` by last access (only those of ``kind``, when given)."""
        bit = TIER_BITS[tier]
        if kind == ObjectKind.STATE:
            pages = {"ids": np.zeros(0, np.int64), "atime": np.zeros(0, np.int64)}
        else:
            pages = index.page_table(tier)
        cks = ([] if kind == ObjectKind.PAGE
               else [ck for ck in index.checkpoints() if ck.tiers & bit])
        ids = pages["ids"].tolist()
        n = len(ids)
        atime = np.concatenate([pages["atime"],
                                np.fromiter((ck.atime for ck in cks), np.int64, len(cks))])
        page, state = ObjectKind.PAGE, ObjectKind.STATE
        for i in np.argsort(atime, kind="stable").tolist():
            yield Victim(page, ids[i]) if i < n else Victim(state, cks[i - n].key)


__all__ = ["PlainLRUEviction"]
