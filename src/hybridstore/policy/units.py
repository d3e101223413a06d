"""Hybrid-state units and the cost-ranked eviction they share (FlashStates, HiState, Marconi).

A checkpoint is useless without the KV before it, and the KV that only this
checkpoint needs cannot resume anything without it (FlashStates' dependency-
aware hybrid state; HiState's eviction unit, Fig. 6).  A :class:`HybridUnit`
is therefore a checkpoint plus :meth:`~hybridstore.index.trie.HybridIndex.exclusive_pages`
— for a terminal checkpoint its trajectory's last KV segment (HiState's
terminal bundle), for an intermediate one usually nothing, or the partial page
that ends at it.

:class:`UnitEviction` ranks such units by a policy-specific score (lowest
first) and offers them to the store as the checkpoint followed by its pages.
A pass over a tier yields:

1. reclaimable pages (no retained checkpoint needs them), oldest first —
   except those touched after the newest checkpoint put or hit: they are most
   likely the KV of a request whose checkpoint the engine is about to put, and
   go last;
2. units, lowest score first — those whose checkpoint this tier holds
   before those whose checkpoint lives in another tier (their pages can only
   move down).  After each unit the store has applied (or refused) the
   eviction; when its checkpoint left the index, the neighbours
   whose score depends on it (tree parent and children) are scored again
   ("affected costs are updated after eviction", HiState §3.3);
3. the remaining pages (shared by several checkpoints) by LRU: the store can
   only drop copies that another tier also holds; then the young reclaimable
   pages of step 1.

Each object is offered at most once per pass, and only objects ``tier`` holds.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import EvictionPolicy, Victim, lru_order, reclaimable_pages


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillCost:
    """Per-model prefill cost: a per-token term plus an attention term growing with context.

    Prefilling token ``i`` (0-based) costs ``per_token + per_context_token * i``
    (projections, MLPs and recurrent layers are linear; attention reads the
    ``i`` earlier keys), so tokens ``[a, b)`` cost
    ``per_token * (b - a) + per_context_token * (b² - a²) / 2``.
    The unit is whatever the caller prices in: FLOPs (Marconi) or seconds
    (FlashStates).
    """

    per_token: float
    per_context_token: float = 0.0

    def __post_init__(self) -> None:
        if self.per_token < 0 or self.per_context_token < 0 or not (self.per_token or self.per_context_token):
            raise ConfigError("a prefill cost needs non-negative terms, at least one positive; "
                              f"got per_token={self.per_token}, per_context_token={self.per_context_token}")

    def between(self, start: float, end: float) -> float:
        """Cost of prefilling tokens ``[start, end)`` with ``start`` tokens of context before them."""
        return self.per_token * (end - start) + self.per_context_token * (end * end - start * start) / 2


class HybridUnit:
    """A checkpoint and the pages only it needs, restricted to what one tier holds.

    Attributes:
        ck: the checkpoint.
        held: whether the tier holds the checkpoint itself (else only pages).
        pages: ids of its exclusive pages the tier holds (nearest the checkpoint first).
        nbytes: bytes the tier frees when the unit leaves it.
        state_bytes: the part of ``nbytes`` that is the checkpoint (0 when not held).
    """

    __slots__ = ("ck", "held", "pages", "nbytes", "state_bytes")

    def __init__(self, ck: Checkpoint, held: bool, pages: np.ndarray, nbytes: int,
                 state_bytes: int = 0) -> None:
        self.ck = ck
        self.held = held
        self.pages = pages
        self.nbytes = nbytes
        self.state_bytes = state_bytes

    def freed(self, kind: ObjectKind | None) -> int:
        """Bytes of ``kind`` the unit's eviction gives back (``None``: all of :attr:`nbytes`)."""
        if kind == ObjectKind.PAGE:
            return self.nbytes - self.state_bytes
        if kind == ObjectKind.STATE:
            return self.state_bytes
        return self.nbytes

    def __repr__(self) -> str:
        return (f"HybridUnit(position={self.ck.position}, held={self.held}, "
                f"pages={len(self.pages)}, nbytes={self.nbytes})")


def units_of(index: HybridIndex, tier: str, cks: list[Checkpoint] | None = None) -> list[HybridUnit]:
    """The hybrid-state units of ``tier`` (of ``cks``, or of every retained checkpoint).

    A checkpoint forms a unit when the tier holds it or one of its exclusive
    pages.  Page tiers and sizes are read in one vectorised call.
    """
    bit = TIER_BITS[tier]
    cks = list(index.checkpoints()) if cks is None else cks
    owned = [index.exclusive_page_ids(ck) for ck in cks]
    counts = np.fromiter((len(o) for o in owned), dtype=np.int64, count=len(owned))
    flat = np.concatenate(owned) if owned else np.zeros(0, np.int64)
    cols = index.page_columns(flat)
    here = (cols["tiers"] & bit) != 0
    page_bytes = np.where(here, cols["nbytes"], 0)
    owner = np.repeat(np.arange(len(cks)), counts)
    owner_bytes = np.bincount(owner, weights=page_bytes, minlength=len(cks)).astype(np.int64)
    ends = np.cumsum(counts).tolist()
    units = []
    for i, ck in enumerate(cks):
        e = ends[i]
        s = e - int(counts[i])
        held = bool(ck.tiers & bit)
        pages = flat[s:e][here[s:e]]
        state = ck.nbytes if held else 0
        if held or pages.size:
            units.append(HybridUnit(ck, held, pages, int(owner_bytes[i]) + state, state))
    return units


def kv_bytes_per_token(index: HybridIndex, pages: dict[str, np.ndarray]) -> float:
    """KV bytes per token, estimated from the page sizes of a page table (1.0 when it is empty)."""
    if not pages["nbytes"].size:
        return 1.0
    return max(float(np.median(pages["nbytes"])) / index.block_size, 1e-9)


class UnitEviction(EvictionPolicy):
    """Dependency-aware eviction of hybrid-state units, lowest :meth:`score` first.

    Subclasses implement :meth:`prepare` (per-pass constants) and
    :meth:`score` (a unit's rank; lower is evicted earlier).
    """

    dependency_aware = True

    @abstractmethod
    def prepare(self, index: HybridIndex, tier: str, pages: dict[str, np.ndarray],
                units: list[HybridUnit], kind: ObjectKind | None = None) -> Any:
        """Constants of one pass (normalisers, clocks), computed once per :meth:`victims` call;
        ``kind``: the partition the pass makes room in (``None``: the whole tier)."""

    @abstractmethod
    def score(self, index: HybridIndex, unit: HybridUnit, ctx: Any) -> float:
        """Rank of ``unit`` in this pass; the lowest is evicted first."""

    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """Objects of ``tier`` in eviction order (only those of ``kind``, when given; for
        pages also the units' checkpoints when :attr:`states_free_pages`)."""
        units_for_pages = kind == ObjectKind.PAGE and self.states_free_pages
        for victim in self._ranked(index, tier, kind):
            if kind is None or victim.kind == kind or units_for_pages:
                yield victim

    def _ranked(self, index: HybridIndex, tier: str, kind: ObjectKind | None) -> Iterator[Victim]:
        pages = index.page_table(tier)
        atime, deps = pages["atime"], pages["deps"]
        free, young = reclaimable_pages(index, atime, deps)   # young: offered last
        if kind == ObjectKind.STATE:    # pages are not wanted: skip the page-only phases
            free[:] = young[:] = False
        for nid in lru_order(pages, free):
            yield Victim(ObjectKind.PAGE, nid)

        units = units_of(index, tier)
        ctx = self.prepare(index, tier, pages, units, kind)
        version: dict[bytes, int] = {}
        heap: list[tuple[bool, float, int, int, bytes, HybridUnit]] = []
        seq = 0
        for unit in units:
            heap.append((not unit.held, self.score(index, unit, ctx), seq, 0, unit.ck.key, unit))
            version[unit.ck.key] = 0
            seq += 1
        heapq.heapify(heap)
        offered: set[int] = set()
        done: set[bytes] = set()
        while heap:
            _, _, _, ver, key, unit = heapq.heappop(heap)
            if version.get(key) != ver or key in done:
                continue
            done.add(key)
            ck = unit.ck
            neighbours = ([ck.parent] if ck.parent is not None else []) + list(ck.children)
            if unit.held and (kind != ObjectKind.PAGE or unit.pages.size):
                # for page room only a unit that frees pages: a checkpoint whose KV other
                # checkpoints still need frees none
                yield Victim(ObjectKind.STATE, key)
            for nid in unit.pages.tolist():
                if nid not in offered:
                    offered.add(nid)
                    yield Victim(ObjectKind.PAGE, nid)
            if index.checkpoint(key) is not None:
                continue
            # The checkpoint left the index: its neighbours' costs (and a parent
            # that became terminal, its bundle) change.
            live = [n for n in neighbours if index.checkpoint(n.key) is n and n.key not in done]
            for fresh in units_of(index, tier, live):
                fresh.pages = np.asarray([n for n in fresh.pages.tolist() if n not in offered],
                                         dtype=np.int64)
                self.rescored(index, fresh, ctx)
                v = version.get(fresh.ck.key, -1) + 1
                version[fresh.ck.key] = v
                heapq.heappush(heap, (not fresh.held, self.score(index, fresh, ctx), seq, v,
                                      fresh.ck.key, fresh))
                seq += 1

        shared = deps > 0 if kind != ObjectKind.STATE else np.zeros_like(free)
        for nid in lru_order(pages, shared):
            if nid not in offered:
                yield Victim(ObjectKind.PAGE, nid)
        for nid in lru_order(pages, young):
            yield Victim(ObjectKind.PAGE, nid)

    def rescored(self, index: HybridIndex, unit: HybridUnit, ctx: Any) -> None:  # noqa: B027
        """Hook: ``unit`` is about to be scored again after a neighbour left (update ``ctx``)."""


__all__ = ["HybridUnit", "PrefillCost", "UnitEviction", "kv_bytes_per_token", "units_of"]
