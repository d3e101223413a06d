"""The evictor: the store's safety rules applied to an eviction policy's order.

A policy (``policy/``) only *ranks*: it yields :class:`~hybridstore.policy.base.Victim`\\ s
in the order it would evict them.  This module decides what may really leave a
tier, and does it:

* never a pinned object (a live plan uses it) nor one whose copy is in flight;
* the last copy of an object is spilled one tier down first when the tier policy
  spills its kind; otherwise the last copy of a page that retained checkpoints
  need stays under a dependency-aware policy (the checkpoint goes first, and the
  pages only it needed follow at once);
* when that leaves a put without room because what remains is the last copy of KV
  that checkpoints held only in other tiers need (the tier's ranking never offers
  them), such a page moves one tier down if that tier takes it, else leaves with
  those checkpoints (:meth:`Evictor.unblock`); pinned objects still stay;
* runs of page victims are dropped as one batch (one ``delete_many``);
* in a large tier one ranking serves several evictions (:meth:`Evictor.evict`).

It is the :class:`~hybridstore.store.residency.RoomMaker` of the store's copies:
constructing an :class:`Evictor` binds it to them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import TypeVar

import numpy as np

from hybridstore.errors import CapacityError, ObjectTooLargeError
from hybridstore.index.trie import Checkpoint
from hybridstore.objects import (
    TIER_BITS,
    KeyBatch,
    ObjectKey,
    ObjectKind,
    key_kind,
    object_key,
)
from hybridstore.policy.base import EvictionPolicy, Victim
from hybridstore.store.copies import COPY_FAILURES, TierCopies
from hybridstore.store.residency import Residency

T = TypeVar("T")

REUSE_RANKING_OBJECTS = 512
"""Tiers holding at least this many objects reuse an eviction ranking (see :meth:`Evictor.evict`)."""

_NO_PAGES = np.zeros(0, np.int64)
_NO_PAGES.flags.writeable = False


class _Victims:
    """A policy's victim order that takes victims back: an eviction that took a run of
    pages and stopped inside it leaves the rest where a reused ranking resumes."""

    __slots__ = ("_it", "_back")

    def __init__(self, victims: Iterator[Victim]) -> None:
        self._it = victims
        self._back: list[Victim] = []

    def __iter__(self) -> _Victims:
        return self

    def __next__(self) -> Victim:
        if self._back:
            return self._back.pop()
        return next(self._it)

    def push_back(self, victims: Sequence[Victim]) -> None:
        """Return ``victims`` (in their order) to the front of the order."""
        self._back.extend(reversed(victims))


class Evictor:
    """Frees room in the tiers of one store, in a policy's order, under the safety rules.

    Args:
        residency: the store's record of who holds what.
        copies: the store's copies between tiers (spills go through them; objects
            whose copy is in flight stay); the evictor becomes their ``room``.
        policy: the eviction policy that ranks victims.
    """

    def __init__(self, residency: Residency, copies: TierCopies, policy: EvictionPolicy) -> None:
        self.res = residency
        self.copies = copies
        self.policy = policy
        self.evictions = 0
        """Objects evicted so far (a page or a checkpoint leaving one tier)."""
        self.relocations = 0
        """Windows of a fragmented tier emptied by moving their objects (compaction)."""
        self.demotions = 0
        """Pages moved one tier down by :meth:`unblock` (the last copy of KV that retained
        checkpoints need, in a tier that had to make room)."""
        self.dropped_checkpoints = 0
        """Checkpoints dropped (from every tier) by :meth:`unblock` with the last copy of
        KV they needed."""
        self._rankings: dict[tuple[str, ObjectKind | None], tuple[_Victims, int]] = {}
        self.leases: dict[str, Callable[[], AbstractContextManager[None]]] = {}
        """Per tier, what must be held to evict from it: a disk tier shared by several
        processes is evicted from by one at a time (``store/shared.py``)."""
        self.waits: dict[str, Callable[[], float]] = {}
        """Per shared tier, how long a put that eviction has made room for waits for that
        room to come back from the other processes' segments (0: no other process)."""
        copies.room = self

    # -- room -------------------------------------------------------------------------
    def make_room(self, tier: str, need: int, kind: ObjectKind | None = None, *,
                  last_resort: bool = True) -> None:
        """Evict from ``tier`` until ``need`` bytes of ``kind`` fit.

        Args:
            tier: the tier to make room in.
            need: bytes (as the tier charges them) that must fit.
            kind: the kind of the object(s) to fit (its partition, if the tier policy
                splits the tier); ``None``: any.
            last_resort: when the policy's order frees too little because what is left
                is the last copy of KV that retained checkpoints held in other tiers need,
                move such pages down, or drop them with those checkpoints
                (:meth:`unblock`).  Copies between tiers pass False: a best-effort copy
                never costs a checkpoint.

        Raises:
            ObjectTooLargeError: ``need`` exceeds the whole tier.
            CapacityError: what is left is pinned or needed.
        """
        lease = self.leases.get(tier)
        if lease is None:
            return self._make_room(tier, need, kind, last_resort)
        with lease():
            return self._make_room(tier, need, kind, last_resort)

    def _make_room(self, tier: str, need: int, kind: ObjectKind | None,
                   last_resort: bool) -> None:
        res = self.res
        t = res.tiers[tier]
        if need > t.capacity_bytes:
            raise ObjectTooLargeError(
                f"an object of {need} bytes is larger than the whole {tier} tier "
                f"({t.capacity_bytes} bytes); raise its budget")
        if res.room(tier, kind) >= need:
            return
        # Free a few percent of the tier (the policy's ``slack``) beyond the need, so
        # that one eviction pass serves many puts: a pass ranks every object of the tier.
        self.copies.drain()
        partition = kind if res.tiering.state_share is not None else None
        share = res.tiering.share(partition) if partition is not None else None
        slack = int((share or 1.0) * t.capacity_bytes * self.policy.slack(partition))
        self.evict(tier, need - res.room(tier, kind) + slack, partition)
        if res.room(tier, kind) < need and self.copies.pending:
            # Objects whose disk write is still in flight cannot leave DRAM yet.
            self.copies.wait_pending()
            self.evict(tier, need - res.room(tier, kind) + slack, partition)
        for _ in range(4):
            # More passes while they free something: the pages a checkpoint alone needed
            # become evictable only once it has left (the next ranking), and a partition
            # full of pages that retained checkpoints need frees nothing by itself: those
            # checkpoints (in the other partition) must go, and their pages with them.
            if res.room(tier, kind) >= need:
                break
            freed = self.evict(tier, need - res.room(tier, kind) + slack, partition)
            if partition is not None and res.room(tier, kind) < need:
                freed += self.evict(tier, need - res.room(tier, kind) + slack, None)
            if not freed:
                break
        if (res.room(tier, kind) < need and last_resort and self.policy.dependency_aware
                and partition != ObjectKind.STATE):
            # What is left is needed, maybe by checkpoints this tier's order never offers
            # (they live in other tiers): a state partition always frees itself.
            self.unblock(tier, need + slack, kind, partition)
        if res.room(tier, kind) < need:
            raise CapacityError(
                f"the {tier} tier cannot free {need} bytes: everything left is pinned by live "
                "plans or needed by retained checkpoints; release plans or raise its budget")

    def retry(self, tier: str, nbytes: int, attempt: Callable[[], T], *,
              each: int | None = None) -> T:
        """Run an allocation, evicting more of ``tier`` while it reports CapacityError.

        Free bytes can be split across size classes, so a tier with enough
        free bytes in total may still refuse a slot: the tier first moves the objects
        of one window elsewhere (compaction), else frees more and tries again.

        Args:
            tier: the tier allocated in.
            nbytes: the bytes the allocation needs in all.
            attempt: the allocation; raises CapacityError while refused.
            each: the size of one object when ``attempt`` allocates several (compaction
                makes a slot of that size; default ``nbytes``).
        """
        t = self.res.tiers[tier]
        lease = self.leases.get(tier)
        rounds = 5 if lease is None else 3
        for round_ in range(1, rounds + 1):
            try:
                return attempt()
            except ObjectTooLargeError:
                raise
            except CapacityError:
                if round_ == rounds:
                    raise
                self.copies.drain()
                if (t.free_bytes >= t.charge(nbytes)
                        and t.relocate_window(each or nbytes, self._may_move)):
                    # Refused with the bytes free: they are split. The objects of the
                    # cheapest window moved elsewhere in the tier (a tier that compacts; a
                    # shared one, in this process's own segments), nothing lost. (A window
                    # free already is no progress: evict.)
                    self.relocations += 1
                    continue
                if lease is not None:
                    # a shared tier: room freed in another process's segments comes back
                    # when its owner empties them (within its sync interval); evict one
                    # policy step, then give the owners a moment instead of evicting more
                    with lease():
                        self.evict(tier, t.charge(nbytes) + t.capacity_bytes // 16)
                    wait = self.waits.get(tier)
                    deadline = time.monotonic() + (wait() if wait is not None else 0.0)
                    while time.monotonic() < deadline:
                        try:
                            return attempt()
                        except CapacityError:
                            time.sleep(0.01)
                    continue
                fragmented = t.finds_windows and t.free_bytes >= t.charge(nbytes)
                if fragmented and round_ > 1:
                    # Still refused after a pass in the policy's order: more of that order
                    # frees bytes, not contiguity. Free the cheapest window of them.
                    freed = self.evict_window(tier, nbytes)
                    if freed is None and self.copies.pending:
                        self.copies.wait_pending()   # copies in flight become evictable
                        freed = self.evict_window(tier, nbytes)
                    if freed is None:
                        raise     # every window holds what must stay: evicting more is waste
                    if freed:
                        continue
                # the last round frees whatever the policy and pins allow: a put refused
                # for fragmentation costs more than an over-eager eviction
                want = (t.capacity_bytes if round_ == 4 else
                        t.charge(nbytes) + round_ * t.capacity_bytes // 16)
                if not self.evict(tier, want):
                    self.copies.wait_pending()
        raise AssertionError("unreachable")

    def evict_window(self, tier: str, nbytes: int) -> int | None:
        """Free one contiguous slot for ``nbytes`` in a fragmented tier: the evictable
        objects of the cheapest window the tier names (:meth:`Tier.window_victims`),
        under :meth:`evict_one`'s rules, whatever the policy's order (a put refused
        with enough bytes free costs more than evicting a few neighbours out of turn).

        Returns:
            Bytes freed; ``None`` when the tier names no window that can be freed (every
            one holds an object that must stay), or cannot tell.
        """
        keys = self.res.tiers[tier].window_victims(nbytes, partial(self._may_evict, tier))
        if keys is None:
            return None
        freed = 0
        for okey in keys:
            victim = self._victim_of(okey)
            if victim is not None:
                freed += self.evict_one(victim, tier)
        return freed

    def _victim_of(self, okey: ObjectKey) -> Victim | None:
        if key_kind(okey) == ObjectKind.STATE:
            return Victim(ObjectKind.STATE, bytes(okey[1:]))
        nid = self.res.index.find_node(bytes(okey[1:]))
        return None if nid < 0 else Victim(ObjectKind.PAGE, nid)

    def _may_move(self, okey: ObjectKey) -> bool:
        """Whether compaction may move ``okey`` within its tier: not while a copy of it
        between tiers is in flight (the tier itself keeps what is being read or written)."""
        return not self.copies.inflight[okey]

    def _may_evict(self, tier: str, okey: ObjectKey) -> bool:
        """Whether :meth:`evict_one` would evict ``okey`` from ``tier`` (no side effect)."""
        if self.copies.inflight[okey]:
            return False
        index, bit = self.res.index, TIER_BITS[tier]
        if key_kind(okey) == ObjectKind.STATE:
            ck = index.checkpoint(bytes(okey[1:]))
            return ck is not None and bool(ck.tiers & bit) and not ck.pins
        nid = index.find_node(bytes(okey[1:]))
        if nid < 0:
            return False
        tiers, deps, pins, _ = index.page_state(nid)
        if not tiers & bit or pins:
            return False
        last = not tiers & ~bit
        return not (last and deps > 0 and self.policy.dependency_aware
                    and not self.res.spills(ObjectKind.PAGE, tier))

    # -- eviction ---------------------------------------------------------------------
    def evict(self, tier: str, nbytes: int, kind: ObjectKind | None = None) -> int:
        """Evict in the policy's order until ``nbytes`` are freed (of ``kind`` only, if given).

        A ranking costs a pass over every object of the tier.  In a tier of at
        least ``REUSE_RANKING_OBJECTS`` objects one ranking serves later
        evictions too, for up to a quarter of the tier's objects in index
        operations; objects used since it was made are skipped (they are no
        longer where it ranked them).  Smaller tiers, and policies for which a use
        can move an object earlier in the order (``EvictionPolicy.ranks_used_later``
        False: predicted next uses), rank afresh every time.
        Consecutive page victims are taken as one batch (:meth:`_evict_pages`),
        about as many as the bytes still owed need.

        Returns:
            Bytes freed (may be less when pinned or needed objects remain).
        """
        freed = 0
        whole = self.policy.whole_leaves
        follow = self.policy.dependency_aware and (kind != ObjectKind.STATE or whole)
        other = 0                 # bytes of another kind than ``kind`` freed on the way
        for attempt in range(8):  # a fresh ranking may find more (pages made reclaimable)
            before = freed + other
            victims, made = self._ranking(tier, kind, fresh=attempt > 0)
            for victim in victims:
                if victim.kind == ObjectKind.PAGE:
                    freed += self._evict_page_run(victim, victims, made, tier, nbytes - freed)
                    if freed >= nbytes:
                        return freed
                    continue
                if made >= 0 and self._used_since(victim, made):
                    continue
                exclusive = self._exclusive_pages(victim) if follow else _NO_PAGES
                got = self.evict_one(victim, tier)
                if kind is None or victim.kind == kind:
                    freed += got
                else:   # a checkpoint evicted for page room frees pages only through its own
                    other += got
                if got and exclusive.size and whole:
                    # the policy's engine deletes a leaf whole, its KV with its state
                    pages = self._evict_pages(exclusive, tier, 1 << 62)[0]
                    if kind == ObjectKind.STATE:
                        other += pages
                    else:
                        freed += pages
                    exclusive = _NO_PAGES
                if freed >= nbytes:
                    return freed
                if got and exclusive.size:
                    # The pages only this checkpoint needed are reclaimable now, and a
                    # fresh ranking would offer them first; a reused one has passed them.
                    freed += self._evict_pages(exclusive, tier, nbytes - freed)[0]
                    if freed >= nbytes:
                        return freed
            self._rankings.pop((tier, kind), None)
            if freed + other == before and attempt:
                break
        return freed

    def _evict_page_run(self, victim: Victim, victims: _Victims, made: int, tier: str,
                        owed: int) -> int:
        """Evict ``victim`` and the page victims right after it, as many as ``owed`` bytes
        need; victims taken but not reached go back to ``victims``.  Returns bytes freed."""
        index = self.res.index
        want = max(1, min(4096, -(-owed // max(1, self.res.tiers[tier].charge(
            index.page_nbytes(int(victim.ref)))))))
        run, seen = [victim], {victim.ref}
        for nxt in victims:
            if nxt.kind != ObjectKind.PAGE:
                victims.push_back([nxt])
                break
            if nxt.ref in seen:        # named twice: the second time there is nothing to free
                continue
            seen.add(nxt.ref)
            run.append(nxt)
            if len(run) >= want:
                break
        ids = np.fromiter((int(v.ref) for v in run), np.int64, len(run))
        if made >= 0:
            keep = index.page_columns(ids, ("atime",))["atime"] <= made   # used since: skipped
            ids = ids[keep]
            run = [v for v, k in zip(run, keep.tolist()) if k]
        got, taken = self._evict_pages(ids, tier, owed)
        victims.push_back(run[taken:])
        return got

    def _evict_pages(self, ids: np.ndarray, tier: str, owed: int) -> tuple[int, int]:
        """:meth:`evict_one` of pages ``ids`` in order, vectorised, until ``owed`` bytes
        are freed.  Returns ``(bytes freed, how many of ids were considered)``.

        The same rules as :meth:`evict_one`: never a pinned page or one whose copy is
        in flight; the last copy of a page that retained checkpoints need stays under
        a dependency-aware policy.  When the last copy would be spilled to the tier
        below, the pages go one by one through :meth:`evict_one`.
        """
        if not ids.size:
            return 0, 0
        res = self.res
        index, t = res.index, res.tiers[tier]
        bit = TIER_BITS[tier]
        cols = index.page_columns(ids, ("tiers", "deps", "pins", "nbytes"))
        tiers, deps, pins, nbytes = cols["tiers"], cols["deps"], cols["pins"], cols["nbytes"]
        ok = ((tiers & bit) != 0) & (pins == 0)
        last = (tiers & (~bit & 0xFF)) == 0
        if res.spills(ObjectKind.PAGE, tier) and (ok & last).any():
            freed = 0
            for i, nid in enumerate(ids.tolist()):
                freed += self.evict_one(Victim(ObjectKind.PAGE, nid), tier)
                if freed >= owed:
                    return freed, i + 1
            return freed, len(ids)
        if self.policy.dependency_aware:
            ok &= ~last | (deps == 0)
        cand = np.flatnonzero(ok)
        okeys: Sequence[ObjectKey] | None = None   # built for what is evicted, unless needed here
        inflight = self.copies.inflight
        if inflight:
            batch = KeyBatch.of(ObjectKind.PAGE, index.page_keys_blob(ids[cand]))
            free_now = np.fromiter((not inflight[k] for k in batch), bool, len(batch))
            cand, okeys = cand[free_now], [k for k, f in zip(batch, free_now.tolist()) if f]
        sizes = nbytes[cand]
        if not sizes.size or sizes.min() == sizes.max():      # pages of one size: the usual case
            charges = np.full(sizes.size, t.charge(int(sizes[0])) if sizes.size else 0, np.int64)
        else:
            uniq, inv = np.unique(sizes, return_inverse=True)
            charges = np.array([t.charge(int(n)) for n in uniq], np.int64)[inv]
        cum = np.cumsum(charges)
        n = int(np.searchsorted(cum, owed)) + 1   # the first prefix that frees `owed`
        if n <= len(cand):
            cand, charges = cand[:n], charges[:n]
            considered = int(cand[-1]) + 1
        else:
            considered = len(ids)
        if not len(cand):
            return 0, considered
        sel = ids[cand]
        t.delete_many(okeys[:len(cand)] if okeys is not None
                      else KeyBatch.of(ObjectKind.PAGE, index.page_keys_blob(sel)))
        self._forget_pages(sel, tier, last[cand])
        freed = int(charges.sum())
        res.kind_bytes[tier][ObjectKind.PAGE] -= freed
        res.objects[tier] -= len(sel)
        self.evictions += len(sel)
        return freed, considered

    def _forget_pages(self, nids: np.ndarray, tier: str, last: np.ndarray) -> None:
        """The index side of dropping pages ``nids`` from ``tier`` (``last``: it held their
        only copy, so their residence ends)."""
        index = self.res.index
        if last.any():
            ages = index.now() - index.page_columns(nids[last], ("ctime",))["ctime"]
            self.res.residence.observe_many(ObjectKind.PAGE, ages)
        index.drop_pages_tier(nids, tier)

    def forget_rankings(self) -> None:
        """Rank afresh next time: objects whose rank changed other than by use (aged
        pages, :meth:`~hybridstore.index.trie.HybridIndex.age_pages`) are not where a
        reused ranking has them."""
        self._rankings.clear()

    def _ranking(self, tier: str, kind: ObjectKind | None, fresh: bool) -> tuple[_Victims, int]:
        """The policy's victim order for ``tier``, reused when the tier is large (see :meth:`evict`)."""
        n = self.res.objects[tier]
        if n < REUSE_RANKING_OBJECTS or not self.policy.ranks_used_later:
            return _Victims(self._victims(tier, kind)), -1
        now = self.res.index.now()
        entry = self._rankings.get((tier, kind))
        if fresh or entry is None or now - entry[1] > n // 4:
            entry = (_Victims(self._victims(tier, kind)), now)
            self._rankings[(tier, kind)] = entry
        return entry

    def _victims(self, tier: str, kind: ObjectKind | None) -> Iterator[Victim]:
        """The policy's order; it may leave out what :meth:`evict_one` would refuse anyway."""
        keep = self.policy.dependency_aware and not self.res.spills(ObjectKind.PAGE, tier)
        return self.policy.victims(self.res.index, tier, kind, keep_needed=keep)

    def _exclusive_pages(self, victim: Victim) -> np.ndarray:
        index = self.res.index
        ck = index.checkpoint(bytes(victim.ref)) if victim.kind == ObjectKind.STATE else None
        return _NO_PAGES if ck is None else index.exclusive_page_ids(ck)

    def _used_since(self, victim: Victim, t: int) -> bool:
        """Whether a checkpoint victim was used after ranking time ``t`` (pages: in a batch)."""
        ck = self.res.index.checkpoint(bytes(victim.ref))
        return ck is not None and ck.atime > t

    def evict_one(self, victim: Victim, tier: str) -> int:
        """Evict one object from ``tier`` if the safety rules allow; returns bytes freed.

        Never a pinned object or one whose SSD write is in flight.  The last
        copy of an object is written to SSD first when the tier policy spills
        its kind; otherwise the last copy of a page that retained checkpoints
        need stays (dependency-aware policies evict the checkpoint first).
        """
        res = self.res
        index = res.index
        bit = TIER_BITS[tier]
        if victim.kind == ObjectKind.PAGE:
            nid = int(victim.ref)
            tiers, deps, pins, nbytes = index.page_state(nid)   # a freed node holds no tier
            if not tiers & bit or pins:
                return 0
            okey = object_key(ObjectKind.PAGE, index.node_key(nid))
            elsewhere, needed = tiers & ~bit, deps > 0
        else:
            ck = index.checkpoint(bytes(victim.ref))
            if ck is None or not ck.tiers & bit or ck.pins:
                return 0
            okey = object_key(ObjectKind.STATE, ck.key)
            elsewhere, needed, nbytes = ck.tiers & ~bit, False, ck.nbytes
        if self.copies.inflight[okey]:
            return 0
        if not elsewhere:
            spilled = False
            below = res.below(tier)
            if below is not None and res.spills(victim.kind, tier):
                try:
                    self.copies.spill(okey, victim.kind, nbytes, tier, below)
                    spilled = True
                except COPY_FAILURES:
                    # The tier below is full of what it must keep, or its device is full
                    # or failing: the object is dropped instead (a checkpoint always may
                    # be; a page only when nothing needs it or the policy ignores
                    # dependencies).
                    self.copies.drain()
            if not spilled and needed and self.policy.dependency_aware:
                return 0
        return self._drop(okey, tier, nbytes)

    def _drop(self, okey: ObjectKey, tier: str, nbytes: int) -> int:
        """Drop ``okey`` from ``tier`` and count the eviction; returns the bytes it freed."""
        freed = self.res.tiers[tier].charge(nbytes)
        self.res.drop(okey, tier)
        self.evictions += 1
        return freed

    # -- the last resort --------------------------------------------------------------
    def unblock(self, tier: str, goal: int, kind: ObjectKind | None,
                partition: ObjectKind | None) -> int:
        """Free ``tier`` where the policy's order cannot: until ``goal`` bytes of ``kind`` fit.

        A dependency-aware policy keeps the last copy of a page that retained checkpoints
        need until those checkpoints go, and a tier's ranking offers only the checkpoints
        the tier holds.  A tier full of such pages whose checkpoints live in other tiers
        (a KV partition next to an empty state partition, SGLang-style split pools) then
        frees nothing.  Here the policy's order is read again with every page offered
        (``keep_needed=False``), and each such page, unless pinned or in flight:

        * is moved one tier down when that tier takes a copy (room made there by its own
          policy only, never by this last resort); the checkpoints keep their KV.  Tried
          where the tier policy does not spill pages (a spilling tier has tried already),
          and no more in this call once a move fails;
        * otherwise leaves with every checkpoint that needs it (:meth:`drop_checkpoint`,
          from every tier: they cannot resume without that KV, as SGLang deletes a node
          whose KV it evicts), then the pages only those checkpoints needed
          (:meth:`_evict_pages`: all of them under ``whole_leaves``); not when one of
          those checkpoints is pinned or its copy is in flight.

        Args:
            tier: the tier to free.
            goal: bytes of ``kind`` that should fit (the need plus the policy's slack).
            kind: the kind room is made for (:meth:`Residency.room`).
            partition: the partition ranked (``None``: the whole tier).

        Returns:
            Bytes freed in ``tier``.
        """
        res = self.res
        index = res.index
        bit = TIER_BITS[tier]
        below = res.below(tier)
        demote = below is not None and not res.spills(ObjectKind.PAGE, tier)
        freed = 0
        for victim in self.policy.victims(index, tier, partition, keep_needed=False):
            if res.room(tier, kind) >= goal:
                break
            if victim.kind != ObjectKind.PAGE:
                continue                       # the passes before offered every checkpoint
            nid = int(victim.ref)
            tiers, deps, pins, nbytes = index.page_state(nid)
            if not tiers & bit or pins:
                continue
            if tiers & ~bit or not deps:       # evictable under the usual rules
                freed += self.evict_one(victim, tier)
                continue
            okey = object_key(ObjectKind.PAGE, index.node_key(nid))
            if self.copies.inflight[okey]:
                continue
            if demote:
                assert below is not None
                moved = self._demote(okey, nid, nbytes, tier, below)
                if moved:
                    freed += moved
                    continue
                demote = False                 # the tier below is full of what it keeps
            freed += self._drop_with_dependents(nid, tier, max(0, goal - res.room(tier, kind)))
        return freed

    def _demote(self, okey: ObjectKey, nid: int, nbytes: int, tier: str, below: str) -> int:
        """Copy page ``nid`` (its last copy, in ``tier``) to ``below``, then drop it from
        ``tier``.  Returns bytes freed in ``tier`` (0: the copy found no room or failed)."""
        res = self.res
        if not self.copies.may_send(okey, below):
            return 0
        # Room below from its KV ranking only: making page room by evicting the lower
        # tier's checkpoints (``_make_room``'s pass over the whole tier) would cost the very
        # checkpoints the move is meant to keep.
        charge = res.tiers[below].charge(nbytes)
        owed = charge - res.room(below, ObjectKind.PAGE)
        if owed > 0:
            split = res.tiering.state_share is not None
            self.evict(below, owed, ObjectKind.PAGE if split else None)
            if res.room(below, ObjectKind.PAGE) < charge:
                return 0
        try:
            self.copies.spill(okey, ObjectKind.PAGE, nbytes, tier, below)
        except COPY_FAILURES:
            self.copies.drain()
            return 0
        tiers = res.index.page_tiers(nid)
        if not tiers & TIER_BITS[below] or not tiers & TIER_BITS[tier]:
            return 0          # the copy failed (drain reported it), or the page left meanwhile
        self.demotions += 1
        return self._drop(okey, tier, nbytes)

    def _drop_with_dependents(self, nid: int, tier: str, owed: int) -> int:
        """Drop the checkpoints that need page ``nid``, then the page and the pages only
        they needed from ``tier`` (``owed`` bytes of them; all under ``whole_leaves``).
        Nothing when one of those checkpoints is pinned or its copy is in flight.
        Returns bytes freed in ``tier``."""
        index = self.res.index
        cks = index.dependents(nid)
        if any(ck.pins or self.copies.inflight[object_key(ObjectKind.STATE, ck.key)]
               for ck in cks):
            return 0
        pages = [index.exclusive_page_ids(ck) for ck in cks]
        for ck in cks:
            self.drop_checkpoint(ck)
        freed = self.evict_one(Victim(ObjectKind.PAGE, nid), tier)
        rest = np.concatenate(pages) if pages else _NO_PAGES
        rest = rest[rest != nid]
        if rest.size:
            want = 1 << 62 if self.policy.whole_leaves else owed - freed
            if want > 0:
                first = np.unique(rest, return_index=True)[1]       # in order, once each
                freed += self._evict_pages(rest[np.sort(first)], tier, want)[0]
        return freed

    def drop_checkpoint(self, ck: Checkpoint) -> None:
        """Delete checkpoint ``ck`` from every tier that holds it (each tier's bytes, the
        disk tier's catalog record with them); the index forgets it with its last copy and
        releases the pages it needed."""
        okey = object_key(ObjectKind.STATE, ck.key)
        for name in [n for n in self.res.chain if ck.tiers & TIER_BITS[n]]:
            self._drop(okey, name, ck.nbytes)
        self.dropped_checkpoints += 1
