"""Plain per-object LRU, not dependency-aware (vLLM's CPU offloading order).

Pages and checkpoints are offered strictly by last access, each on its own:
the store may drop the last copy of a page that a retained checkpoint still
needs, leaving that checkpoint without its KV.  Such dependency misses are
what FlashStates measures for vLLM; this policy is the baseline that shows
them.  Use :class:`~hybridstore.policy.lru.LRUEviction` for the
dependency-aware order.

With ``running_state=True`` it follows vLLM 0.33's GPU block pool in
``mamba_cache_mode="align"`` (``v1/core/single_type_kv_cache_manager.py``,
``MambaManager``): a request keeps one running Mamba state, and the state
block its prefill has moved past (a chunk end's, or the one it resumed from)
goes back to the free queue at the next chunk, *before* the request's KV
blocks, which return when it finishes (tail first), followed by its last
state.  So among what one request stored, its chunk-end states are evicted
first, then its pages from the tail, then its last state.

That order is the GPU block pool's.  In the tiers named ``offload_tiers`` (vLLM's CPU
offloading tier behind the GPU, ``v1/kv_offload/cpu/policies/lru.py``) it ranks as vLLM's
offloading LRU does: every key a request stored or used gets the request's rank, its tail before its head
(``(request, -position)``, committed when it finishes), a Mamba state at a block boundary
just before the KV block ending there; a state that a later request did not itself use
keeps its older rank while the KV it shares moves on (:func:`_offload_rank`).
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Iterator

import numpy as np

from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import EvictionPolicy, Victim


def _released_at(ck: Checkpoint, page_atime: dict[int, int]) -> float:
    """When vLLM's free queue got ``ck``'s block (the rank of :class:`PlainLRUEviction`
    with ``running_state``).

    A state that the request which last used it continued past (a checkpoint on its
    path created after that use) went back while that request ran, before the
    request's pages.  Last used by a hit: the hit touched it before the request's put
    touched the pages, so its last use ranks it.  Last used by its own put: that put
    touched the pages first (``page_atime``: its base page, when not touched since),
    so it ranks just before them.  Any other state ranks at its last use (the state
    at a prompt's last block boundary, released after the prompt's pages)."""
    if ck.hits or not any(c.created > ck.atime for c in ck.children):
        return float(ck.atime)
    t = page_atime.get(ck.base)
    return (t if t is not None and t < ck.created else ck.created) - 0.5


def _offload_rank(ck: Checkpoint, page_atime: dict[int, int]) -> float:
    """When vLLM's CPU offloading LRU last ranked ``ck`` (its request's turn): the turn of
    the request that put the pages it sits on, if that request also put or used the state
    (the state's last use is not older than those pages'), else the state's own last use."""
    t = page_atime.get(ck.base)
    return float(ck.atime if t is None or ck.atime < t else t)


def _unneeded_first(pages: dict[str, np.ndarray], order: np.ndarray
                    ) -> Generator[Victim, None, np.ndarray]:
    """Yield, in ``order``, the pages of an earlier prompt that no state needs (its tail past
    its last state, a partial last block): vLLM never caches that KV, so it goes first.  The
    newest pages belong to the prompt being stored, its states still to come.  Returns the
    rest of ``order``."""
    if not len(order):
        return order
    atime = pages["atime"]
    first = ((pages["deps"] == 0) & (atime < atime.max()))[order]
    yield from (Victim(ObjectKind.PAGE, i) for i in pages["ids"][order[first]].tolist())
    return order[~first]


class PlainLRUEviction(EvictionPolicy):
    """Least recently used object first, pages and checkpoints alike.

    Args:
        running_state: rank the states a request's prefill moved past before that
            request's pages, as vLLM's align mode releases them (module docstring).
        offload_tiers: tiers ranked as vLLM's CPU offloading LRU ranks its chunks (module
            docstring), not as its GPU block pool; e.g. ``("host", "disk")`` behind a
            ``device`` tier.
    """

    name = "lru-vllm"
    dependency_aware = False

    def __init__(self, *, running_state: bool = False,
                 offload_tiers: tuple[str, ...] = ()) -> None:
        self.running_state = running_state
        self.offload_tiers = frozenset(offload_tiers)
        if running_state:
            self.room_slack = 0.0   # vLLM's block pool evicts a block when it needs one

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """Objects of ``tier`` by last access (only those of ``kind``, when given); pages
        used at the same time go deepest first (the order of :func:`~hybridstore.policy.base.lru_order`:
        vLLM's block pool frees a request's blocks in reverse, so its tail is evicted
        before its head, without which the tail is useless).  With ``running_state``,
        KV no state needs first, and states ranked by :func:`_released_at`."""
        bit = TIER_BITS[tier]
        pages = index.page_table(tier)
        if tier in self.offload_tiers:
            yield from self._offload_victims(index, tier, kind, pages)
            return
        ranked: list[tuple[float, int, int, ObjectKind, int | bytes]] = []
        if kind != ObjectKind.STATE:
            order = np.lexsort((-pages["block"], pages["atime"]))   # lru_order's ranking
            if self.running_state:
                order = yield from _unneeded_first(pages, order)
            ranked = [(float(t), 0, 0, ObjectKind.PAGE, i) for t, i in
                      zip(pages["atime"][order].tolist(), pages["ids"][order].tolist())]
        states: list[tuple[float, int, int, ObjectKind, int | bytes]] = []
        if kind != ObjectKind.PAGE:
            if self.running_state:
                page_atime = dict(zip(pages["ids"].tolist(), pages["atime"].tolist()))
                states = [(_released_at(ck, page_atime), 1, ck.position, ObjectKind.STATE, ck.key)
                          for ck in index.checkpoints() if ck.tiers & bit]
            else:
                states = [(float(ck.atime), 1, ck.position, ObjectKind.STATE, ck.key)
                          for ck in index.checkpoints() if ck.tiers & bit]
            states.sort(key=lambda t: t[:3])
        for *_, kind_, ref in heapq.merge(ranked, states, key=lambda t: t[:3]):
            yield Victim(kind_, ref)

    def _offload_victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None,
                         pages: dict[str, np.ndarray]) -> Iterator[Victim]:
        """The order of vLLM's CPU offloading LRU (module docstring): by the turn of the
        request that last ranked an object, then tail first (a page by its end, a state by
        its position, the state before the page ending there).  KV that no state needs
        goes first, as on the device: vLLM never offloads a prompt's partial block."""
        bit = TIER_BITS[tier]
        B = index.block_size
        ranked: Iterator[tuple[float, int, int, ObjectKind, int | bytes]] = iter(())
        if kind != ObjectKind.STATE and len(pages["ids"]):
            atime = pages["atime"]
            order = np.lexsort((-pages["block"], atime))     # by turn, then tail first
            rest = yield from _unneeded_first(pages, order)
            ranked = zip(atime[rest].astype(np.float64).tolist(),
                         (-(pages["block"][rest] + 1) * B).tolist(), [1] * len(rest),
                         [ObjectKind.PAGE] * len(rest), pages["ids"][rest].tolist())
        states: list[tuple[float, int, int, ObjectKind, int | bytes]] = []
        if kind != ObjectKind.PAGE:
            page_atime = dict(zip(pages["ids"].tolist(), pages["atime"].tolist()))
            states = sorted(((_offload_rank(ck, page_atime), -ck.position, 0, ObjectKind.STATE,
                              ck.key) for ck in index.checkpoints() if ck.tiers & bit),
                            key=lambda t: t[:3])
        for *_, kind_, ref in heapq.merge(ranked, states, key=lambda t: t[:3]):
            yield Victim(kind_, ref)

__all__ = ["PlainLRUEviction"]
