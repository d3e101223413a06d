"""Who holds what: the index's tier masks kept in step with the tiers, and the byte
counters the tier policy partitions by.

The lowest layer of the store (``residency < copies < evictor < landing / loader <
facade``): it knows the tiers, the index and the tier policy, and nothing of
copies in flight or eviction.  The layers above that need room in a tier ask for
it through :class:`RoomMaker` (the evictor is one), so that no module of the
store imports one above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from hybridstore.backends.base import Tier
from hybridstore.index.meta import encode_page, encode_state
from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import TIER_BITS, TIER_ORDER, ObjectKey, ObjectKind, key_kind
from hybridstore.policy.base import ResidenceStats
from hybridstore.policy.tiering import TierPolicy

T = TypeVar("T")


class RoomMaker(Protocol):
    """What copies between tiers need from the layer that evicts (:class:`~hybridstore.store.evictor.Evictor`)."""

    def make_room(self, tier: str, need: int, kind: ObjectKind | None = None, *,
                  last_resort: bool = True) -> None:
        """Evict from ``tier`` until ``need`` bytes of ``kind`` fit; ``CapacityError`` if they cannot.

        ``last_resort``: free the last copy of KV that checkpoints held elsewhere need (move
        it down, or drop it with them) when nothing else is left; copies pass False."""

    def retry(self, tier: str, nbytes: int, attempt: Callable[[], T], *,
              each: int | None = None) -> T:
        """Run an allocation in ``tier`` (``each``: one object's size when it allocates
        several), compacting or evicting more while it reports ``CapacityError``."""


class Residency:
    """Which tiers hold each object, and the bytes and objects held per tier and kind.

    Args:
        index: the store's index (its tier masks are the record).
        tiers: the store's tiers by name.
        tiering: the tier policy (write-through, spill, partition shares).
        block_size: tokens per block (for page metadata).
    """

    def __init__(self, index: HybridIndex, tiers: Mapping[str, Tier], tiering: TierPolicy,
                 block_size: int) -> None:
        self.index = index
        self.tiers = tiers
        self.tiering = tiering
        self.block_size = block_size
        self.chain = [name for name in TIER_ORDER if name in tiers]
        """This store's tiers, fastest first."""
        self.residence = ResidenceStats()
        self.kind_bytes = {name: dict.fromkeys(ObjectKind, 0) for name in tiers}
        self.objects = dict.fromkeys(tiers, 0)      # objects held per tier

    # -- the index side ---------------------------------------------------------------
    def mark(self, okey: ObjectKey, tier: str) -> bool:
        """Record that ``tier`` now holds ``okey``; False when the index forgot it."""
        kind = key_kind(okey)
        if kind == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            held = self.index.page_tiers(nid) if nid >= 0 else 0
            if not held:
                return False
            if not held & TIER_BITS[tier]:
                self.index.add_page_tier(nid, tier)
                self.kind_bytes[tier][kind] += self.tiers[tier].charge(self.index.page_info(nid)["nbytes"])
                self.objects[tier] += 1
            return True
        ck = self.index.checkpoint(okey[1:])
        if ck is None or not ck.tiers:
            return False
        if not ck.tiers & TIER_BITS[tier]:
            ck.tiers |= TIER_BITS[tier]
            self.kind_bytes[tier][kind] += self.tiers[tier].charge(ck.nbytes)
            self.objects[tier] += 1
        return True

    def added(self, tier: str, kind: ObjectKind, count: int, charged: int) -> None:
        """Count ``count`` new objects of ``kind`` landed in ``tier`` (``charged`` bytes)."""
        self.kind_bytes[tier][kind] += charged
        self.objects[tier] += count

    def drop(self, okey: ObjectKey, tier: str) -> None:
        """Delete ``okey`` from ``tier`` and record it."""
        t = self.tiers[tier]
        n = t.nbytes(okey)
        t.delete(okey)
        self.forget(okey, tier, n)

    def forget(self, okey: ObjectKey, tier: str, nbytes: int | None) -> None:
        """Record that ``tier`` no longer holds ``okey`` (of ``nbytes``)."""
        kind = key_kind(okey)
        bit = TIER_BITS[tier]
        if kind == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            held = self.index.page_tiers(nid) if nid >= 0 else 0
            if not held & bit:
                return
            if held == bit:
                self.residence.observe(kind, self.index.now() - self.index.page_ctime(nid))
            self.index.drop_page_tier(nid, tier)
        else:
            ck = self.index.checkpoint(okey[1:])
            if ck is None or not ck.tiers & bit:
                return
            if ck.tiers == bit:
                self.residence.observe(kind, self.index.now() - ck.created)
            self.index.drop_checkpoint_tier(okey[1:], tier)
        self.kind_bytes[tier][kind] -= self.tiers[tier].charge(nbytes or 0)
        self.objects[tier] -= 1

    @staticmethod
    def holder(tier_mask: int) -> str:
        """The fastest tier of a tier mask."""
        return next(t for t in TIER_ORDER if tier_mask & TIER_BITS[t])

    def state_meta(self, ck: Checkpoint) -> bytes:
        """The catalog metadata of a checkpoint (:mod:`hybridstore.index.meta`)."""
        base_key = self.index.root_key if ck.base == 0 else self.index.node_key(ck.base)
        return encode_state(ck.position, base_key, self.index.cover_keys(ck))

    def page_meta(self, okey: ObjectKey) -> bytes:
        """The catalog metadata of an indexed page."""
        nid = self.index.find_node(okey[1:])
        info = self.index.page_info(nid)
        return encode_page(info["block"], info["ntok"], self.index.parent_key(nid))

    # -- the tier policy --------------------------------------------------------------
    def room(self, tier: str, kind: ObjectKind | None) -> int:
        """Bytes ``kind`` may still take in ``tier`` (the tier policy may partition it)."""
        t = self.tiers[tier]
        share = self.tiering.share(kind) if kind is not None else None
        if share is None or kind is None:
            return t.free_bytes
        return min(t.free_bytes, int(share * t.capacity_bytes) - self.kind_bytes[tier][kind])

    def writes_through(self, kind: ObjectKind) -> bool:
        """Whether a new object of ``kind`` is copied to slower tiers as it lands."""
        return kind in self.tiering.write_through and len(self.chain) > 1

    def spills(self, kind: ObjectKind, tier: str) -> bool:
        """Whether the last copy of a ``kind`` object leaving ``tier`` is written one tier down."""
        return kind in self.tiering.spill and self.below(tier) is not None

    def below(self, tier: str) -> str | None:
        """The next slower tier of this store, or None."""
        i = self.chain.index(tier)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None
