"""SGLang's radix-tree LRU (``UnifiedRadixCache`` with FULL + MAMBA components, LRU).

What SGLang 0.5.23's tree core does (``unified_cache/unified_tree_core.py``,
``components/full.py`` and ``components/mamba.py``), and how this policy ranks it:

* **KV eviction** (the KV pool is short) takes the least recently used *leaf*:
  ``FullComponent`` keeps a heap of device leaves by ``last_access_time``; a match
  touches the matched path, an insert the whole inserted path, so a parent is never
  older than its child.  The leaf goes whole, with the Mamba state at its end
  (``_delete_unbacked_device_leaf``): SGLang never keeps a state without its KV.
  Here: pages in least-recently-used order, deepest first among equal times (a
  prompt's tail before its head, :func:`~hybridstore.policy.base.lru_order`); a page
  no retained checkpoint needs is offered itself, a page a checkpoint needs is
  offered as that checkpoint, which the store evicts together with ALL the pages only
  it needed (``whole_leaves``: the leaf back to where another retained state shares
  the path), but for a state on a page boundary only when its page ends a leaf: a
  page a deeper state needs too is inside the tree, and SGLang's KV eviction never
  takes an inner node's state (a reused ranking may reach such a page before the
  subtree below it; SGLang's leaf heap is always current).  A state inside a block
  shares its page with longer prompts' pages, so there the page cannot tell.
* **Mamba eviction** (the Mamba pool is short) takes the least recently used state
  (``MambaComponent``'s LRU list: a match refreshes only the state it resumes from,
  an insert the state it adds), whether it ends a leaf or sits inside the path.
* **No slack**: SGLang frees what the allocation needs (in whole leaves) and no more.

* A state evicted for Mamba room takes the pages only it needed with it
  (``whole_leaves``; SGLang deletes a leaf's KV with its state).

Where it differs from SGLang: the unit is a page (64 tokens in the replay), not a
token (with SGLang's default page of 64 and its extra buffer, ``sglang-extra``, the
units agree); SGLang's node boundaries also sit where an evicted state or a split
once left one.  On the bundled WEKA sample the token hit rate is within half a point
of SGLang's own cache without the extra buffer, and request for request the same with
it (``python -m benchmarks calibrate``, docs/replay.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np

from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import EvictionPolicy, Victim


class RadixLRUEviction(EvictionPolicy):
    """Least recently used leaf first, a leaf's state with it (SGLang's radix cache)."""

    name = "lru-radix"
    dependency_aware = True
    room_slack = 0.0
    states_free_pages = True
    whole_leaves = True

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """Objects of ``tier`` in SGLang's order: for the KV (``kind`` PAGE), leaves by last
        use, each with the state that needs it; for states (``kind`` STATE), the state LRU;
        for one shared pool (``kind`` None), both merged by last use."""
        bit = TIER_BITS[tier]
        held = [ck for ck in index.checkpoints() if ck.tiers & bit]
        states = sorted(((ck.atime, ObjectKind.STATE, ck.key) for ck in held),
                        key=lambda t: t[0])
        if kind == ObjectKind.STATE:
            for _, _, key in states:
                yield Victim(ObjectKind.STATE, key)
            return
        leaves = self._leaves(index, tier, held, keep_needed)
        if kind == ObjectKind.PAGE:
            for _, kind_, ref in leaves:
                yield Victim(kind_, ref)
            return
        seen: set[bytes] = set()
        for _, kind_, ref in heapq.merge(leaves, states, key=lambda t: t[0]):
            if kind_ == ObjectKind.STATE:
                if ref in seen:
                    continue
                seen.add(bytes(ref))
            yield Victim(kind_, ref)

    @staticmethod
    def _leaves(index: HybridIndex, tier: str, held: list[Checkpoint],
                keep_needed: bool) -> Iterator[tuple[int, ObjectKind, int | bytes]]:
        """``(time, kind, ref)`` of the KV ranking: pages by last use, deepest first, a
        page a retained checkpoint needs preceded by the checkpoints it ends (and left
        out when the store keeps needed pages anyway: ``keep_needed``)."""
        pages = index.page_table(tier)
        order = np.lexsort((-pages["block"], pages["atime"]))
        # A checkpoint leaves with the newest page of its block that holds its tokens: the
        # page of its own prompt's partial last block and the full page of a longer prompt
        # both do, and only the one a later path went through is SGLang's node boundary.
        covering: dict[int, list[Checkpoint]] = {}
        bit = TIER_BITS[tier]
        given: set[bytes] = set()
        for ck in held:
            if not ck.covers:
                continue
            cols = index.page_columns(np.asarray(ck.covers, np.int64), ("atime", "tiers"))
            live = np.flatnonzero(cols["tiers"] & bit)
            if live.size:
                newest = int(live[np.argmax(cols["atime"][live])])
                covering.setdefault(int(ck.covers[newest]), []).append(ck)
        elsewhere = ~bit & 0xFF
        for nid, t in zip(pages["ids"][order].tolist(), pages["atime"][order].tolist()):
            # read when reached: evicting a checkpoint frees the pages it alone needed
            tiers, deps = index.page_state(nid)[:2]
            if not deps:
                yield t, ObjectKind.PAGE, nid
                continue
            ends = covering.get(nid, ())
            # a deeper state needs this page too: the node is inside the tree, not a leaf,
            # and SGLang's KV eviction never takes its state (only its Mamba LRU does).
            # Told apart only for a state on a page boundary, whose last page is its node's
            # end; a state inside a block shares its page with longer prompts' pages.
            inner = deps > len(ends)
            for ck in sorted(ends, key=lambda c: c.atime):
                if inner and ck.offset == index.block_size:
                    continue
                if ck.key not in given and ck.tiers & bit:
                    given.add(ck.key)
                    yield t, ObjectKind.STATE, ck.key
            if not keep_needed or tiers & elsewhere:
                # then the page itself: the store keeps the last copy of a needed page
                yield t, ObjectKind.PAGE, nid


__all__ = ["RadixLRUEviction"]
