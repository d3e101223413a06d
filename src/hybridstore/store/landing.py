"""The put path: new pages and checkpoints land in the fastest tier and are indexed.

Objects are written into the fastest tier first (the pinned host pool in a
data-plane store): a run of new pages at a time, staged together and filled
with one scatter per layout entry when the caller gave a page-major batch.
Under ``write-through`` every object is then copied to the slower tiers in the
background (:mod:`~hybridstore.store.copies`); HiState §3.1 moves a checkpoint
that stopped being terminal to SSD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hybridstore.backends.base import Slots
from hybridstore.backends.gather import scatter_rows
from hybridstore.backends.transfer import to_host_rows
from hybridstore.errors import (
    CatalogError,
    CapacityError,
    HybridStoreError,
    InvalidArgumentError,
    InvalidTokensError,
    MisalignedPageError,
    ObjectTooLargeError,
)
from hybridstore.index.meta import encode_page
from hybridstore.index.prefix import PrefixKeys
from hybridstore.layout import Layout, Target
from hybridstore.objects import KeyBatch, ObjectKey, ObjectKind, object_key
from hybridstore.policy.base import AdmissionPolicy
from hybridstore.store.copies import TierCopies
from hybridstore.store.evictor import Evictor
from hybridstore.store.residency import Residency

LAYOUT_INFO = {ObjectKind.PAGE: "layout.page", ObjectKind.STATE: "layout.state"}
"""The names under which a durable tier keeps the store's two layouts."""


def take_layouts(tier: Any, layouts: dict[ObjectKind, Layout], kinds: Any,
                 warn: Callable[[str], None]) -> None:
    """A store that has not fixed its layout of a kind yet takes the one ``tier`` records
    (what the objects another store put there need); a damaged record is ``warn``-ed."""
    for kind in kinds:
        if kind in layouts:
            continue
        raw = tier.get_info(LAYOUT_INFO[kind])
        if raw is None:
            continue
        try:
            layouts[kind] = Layout.from_json(raw)
        except CatalogError as e:
            warn(f"the {kind.name.lower()} layout record is damaged: {e}")


Pack = Callable[[int, np.ndarray], None]
"""``pack(i, slot)``: write page ``i`` of a put into one slot."""

Scatter = Callable[[int, int, Slots], None]
"""``scatter(i0, i1, (buffers, which, offsets))``: pages ``i0..i1-1`` of a put into staged slots."""


class Landing:
    """Puts of one store: pages and checkpoints into the fastest tier, then the copies.

    Args:
        residency: the store's record of who holds what.
        copies: the store's copies between tiers (write-through, moves to SSD).
        evictor: makes room in the fastest tier.
        admission: the checkpoint admission policy.
        layouts: the store's page and checkpoint layouts (shared with the loader).
    """

    def __init__(self, residency: Residency, copies: TierCopies, evictor: Evictor,
                 admission: AdmissionPolicy, layouts: dict[ObjectKind, Layout]) -> None:
        self.res = residency
        self.copies = copies
        self.evictor = evictor
        self.reserved: set[ObjectKey] = set()
        """Page keys a :meth:`~hybridstore.HybridStore.put_kv_many` in progress has reserved
        slots for (:mod:`~hybridstore.store.staged`): other puts leave them to it."""
        self.admission = admission
        self.layouts = layouts

    # -- pages ------------------------------------------------------------------------
    def first_block(self, prompt: PrefixKeys, npages: int) -> int:
        """The block of the first of ``npages`` pages that end at the prompt's end."""
        if prompt.length == 0:
            raise MisalignedPageError("put_kv got an empty prefix; pass the tokens up to the page's end")
        first = prompt.nblocks - npages
        if first < 0:
            raise MisalignedPageError(
                f"{npages} pages do not fit in {prompt.length} tokens of {self.res.block_size}-token "
                "blocks; pass the tokens up to the end of the last page")
        return first

    def put_pages(self, prompt: PrefixKeys, first: int, nbytes: int, pack: Pack | None,
                  scatter: Scatter | None = None) -> int:
        """Store blocks ``first..`` of ``prompt``: runs of held pages are touched, runs of
        new pages land together (:meth:`_land_pages`).  Returns the pages newly stored.

        ``pack(i, slot)`` writes page ``i`` (block ``first + i``) into one slot;
        ``scatter(i0, i1, slots)``, when given, writes pages ``i0..i1-1`` into the
        slots ``slots`` (the tier's ``stage_many``) at once."""
        if pack is None:
            self._sized_only()
        index = self.res.index
        stop = prompt.nblocks
        pos, stored = first, 0
        # 0: new, 1: held (touched), 2: reserved by a put_kv_many in progress (it stores them)
        state = (index.held_tiers(prompt, first, stop) != 0).astype(np.int8)
        self._mark_reserved(prompt, first, state)
        while pos < stop:
            rest = state[pos - first:]
            change = np.flatnonzero(rest != rest[0])
            end = pos + (int(change[0]) if change.size else stop - pos)
            if rest[0] == 1:
                index.add_pages(prompt, pos, end, None, nbytes)
            elif rest[0] == 0:
                evictions = self.evictor.evictions
                stored += self._land_pages(prompt, pos, end, nbytes, pack, first, scatter)
                if self.evictor.evictions != evictions and end < stop:
                    # Making room may have evicted pages of the runs still to come.
                    state[end - first:] = index.held_tiers(prompt, end, stop) != 0
                    self._mark_reserved(prompt, end, state[end - first:])
            pos = end
        return stored

    def _mark_reserved(self, prompt: PrefixKeys, first: int, state: np.ndarray) -> None:
        """Mark (2) the blocks ``first..`` whose pages a ``put_kv_many`` has reserved."""
        if not self.reserved:
            return
        for i in np.flatnonzero(state == 0).tolist():
            k = first + i
            if object_key(ObjectKind.PAGE, prompt.block_key(k)) in self.reserved:
                state[i] = 2

    def _land_pages(self, prompt: PrefixKeys, a: int, b: int, nbytes: int, pack: Pack | None,
                    first: int, scatter: Scatter | None = None) -> int:
        """Land the new pages of blocks ``a..b-1`` in the fastest tier and index them.

        Room is made for a run at a time (at most an eighth of the tier, so that
        one eviction pass serves it); an accounting tier records the run in one
        call, a byte tier stages it in one reservation and one ``scatter`` when
        the caller gave one.  Pages landed before a failure are indexed before it
        propagates.
        """
        res, room = self.res, self.evictor
        name = res.chain[0]
        tier = res.tiers[name]
        if pack is None and tier.stores_bytes:
            raise HybridStoreError("sized puts (no bytes) need accounting tiers; pass the tensors")
        charge = tier.charge(nbytes)
        okeys = KeyBatch.of(ObjectKind.PAGE, prompt.keys[a:b].astype("<u8", copy=False).tobytes())
        run = max(1, min(b - a, tier.capacity_bytes // 8 // max(charge, 1)))
        c = a
        while c < b:
            d = min(c + run, b)
            try:
                # The same room check for byte and accounting tiers, so that data mode
                # and the simulator evict alike (docs/replay.md: equal by construction).
                room.make_room(name, charge * (d - c), ObjectKind.PAGE)
            except CapacityError:
                if d - c == 1:
                    raise
                # Only room page by page: evicting may take this run's own
                # earlier pages (reclaimable until their checkpoint lands).
                run = 1
                continue
            landed = 0
            try:
                if pack is not None and scatter is not None and tier.stores_bytes:
                    keys = okeys[c - a:d - a].keys()
                    slots = room.retry(name, nbytes * len(keys), lambda: tier.stage_many(keys, nbytes),
                                       each=nbytes)
                    try:
                        scatter(c - first, d - first, slots)
                    except BaseException:
                        tier.abort_many(keys)
                        raise
                    self._commit(name, keys, nbytes)
                    landed = d - c
                    res.added(name, ObjectKind.PAGE, landed, charge * landed)
                elif pack is not None and tier.stores_bytes:
                    for k in range(c, d):
                        self.land(okeys[k - a], ObjectKind.PAGE, nbytes, partial(pack, k - first))
                        landed += 1
                else:
                    batch = okeys[c - a:d - a]
                    room.retry(name, nbytes * len(batch),
                               lambda: tier.put_many(batch, None, nbytes=nbytes), each=nbytes)
                    landed = d - c
                    res.added(name, ObjectKind.PAGE, landed, charge * landed)
            finally:
                if landed:
                    res.index.add_pages(prompt, c, c + landed, name, nbytes)
                    if res.writes_through(ObjectKind.PAGE):
                        B = res.block_size
                        metas = [encode_page(k, prompt.block_end(k) - k * B, prompt.key_before(k))
                                 for k in range(c, c + landed)]
                        for dst in res.chain[1:]:
                            self.copies.write_through_many(okeys[c - a:c - a + landed].keys(),
                                                           ObjectKind.PAGE, nbytes, metas, name,
                                                           dst)
            c = d
        return b - a

    @staticmethod
    def batch_scatter(targets: list[Target]) -> Scatter:
        """The ``scatter`` of a page-major batch matched to the page layout: rows of every
        entry into staged slots (a GPU batch is copied to host one run at a time first)."""

        def scatter(i0: int, i1: int, slots: Slots) -> None:
            arenas, which, offsets = slots
            for target in targets:
                src, at = target.host, np.arange(i0, i1, dtype=np.int64)
                if src is None:        # a GPU batch: this run's rows to host first
                    src = to_host_rows(target.buffer, i0, i1)
                    at = at - i0
                scatter_rows(arenas, which, offsets, at, target.spec.offset,
                             target.spec.nbytes, src)

        return scatter

    # -- checkpoints ------------------------------------------------------------------
    @staticmethod
    def state_position(prompt: PrefixKeys, position: int | None) -> int:
        """The checkpoint position of a put (``len(prompt)`` by default), checked."""
        p = prompt.length if position is None else position
        if not 0 < p <= prompt.length:
            raise InvalidTokensError(f"position {p} must be in 1..{prompt.length} (the prompt's length)")
        if prompt.key_at(p) is None:
            raise InvalidTokensError(
                f"position {p} is inside a block of a prompt given as block ids; pass token ids")
        return p

    def put_state(self, prompt: PrefixKeys, p: int, nbytes: int,
                  pack: Callable[[np.ndarray], None] | None) -> bool:
        """Store the checkpoint at ``p``; False when the admission policy declines it."""
        if pack is None:
            self._sized_only()
        res = self.res
        key16 = prompt.key_at(p)
        assert key16 is not None
        existing = res.index.checkpoint(key16)
        if existing is not None and existing.tiers:
            res.index.add_checkpoint(prompt, p, res.holder(existing.tiers), nbytes)
            return True
        if not self.admission.admit(res.index, p, nbytes, prompt=prompt):
            return False
        okey = object_key(ObjectKind.STATE, key16)
        self.land(okey, ObjectKind.STATE, nbytes, pack)
        ck = res.index.add_checkpoint(prompt, p, res.chain[0], nbytes)
        self.evictor.policy.on_checkpoint(res.index, prompt, ck)
        if res.writes_through(ObjectKind.STATE):
            self.copies.placed(okey, ObjectKind.STATE, nbytes, res.state_meta(ck))
        if res.tiering.historical_to_ssd and ck.parent is not None:
            self.copies.to_ssd(ck.parent)
        return True

    # -- both -------------------------------------------------------------------------
    def _sized_only(self) -> None:
        """Refuse a put by size only (no bytes) unless the fastest tier keeps sizes only,
        before anything is touched (objects already held would take the size given)."""
        if self.res.tiers[self.res.chain[0]].stores_bytes:
            raise InvalidArgumentError("sized puts (no bytes) need accounting tiers; pass the "
                                       "tensors to put_kv / put_state")

    def layout(self, kind: ObjectKind, value: Any, what: str, more: Sequence[Any] = ()) -> Layout:
        """The store's layout of ``kind``, fixed by the first object put (and recorded in a
        durable tier); later objects must match it.

        ``more`` are further objects of the same call: all are checked before a first
        layout is fixed, so a rejected call leaves the store without one.
        """
        layout = self.layouts.get(kind)
        fresh = layout is None
        if layout is None:
            layout = Layout.of(value)
        else:
            layout.check(value, what)
        for other in more:
            layout.check(other, what)
        if fresh:
            for tier in self.res.tiers.values():
                if tier.stores_bytes and layout.nbytes > tier.capacity_bytes:
                    raise ObjectTooLargeError(
                        f"a {what} of {layout.nbytes} bytes is larger than the {tier.name} tier "
                        f"({tier.capacity_bytes} bytes); raise its budget")
            disk = self.res.tiers.get("disk")
            if disk is not None and disk.durable:
                disk.put_info(LAYOUT_INFO[kind], layout.to_json())
            remote = self.res.tiers.get("remote")
            if remote is not None:          # for stores that adopt this one's objects
                remote.put_info(LAYOUT_INFO[kind], layout.to_json())
            self.layouts[kind] = layout
        return layout

    def land(self, okey: ObjectKey, kind: ObjectKind, nbytes: int,
             pack: Callable[[np.ndarray], None] | None) -> None:
        """Write a new object into the fastest tier (the pinned DRAM pool in a data-plane store)."""
        res, room = self.res, self.evictor
        name = res.chain[0]
        tier = res.tiers[name]
        if pack is None and tier.stores_bytes:
            raise HybridStoreError("sized puts (no bytes) need accounting tiers; pass the tensors")
        room.make_room(name, tier.charge(nbytes), kind)
        if pack is not None and tier.stores_bytes:
            slot = room.retry(name, nbytes, lambda: tier.stage(okey, nbytes))
            try:
                pack(slot)
            except BaseException:
                tier.abort(okey)
                raise
            self._commit(name, [okey], nbytes)
        else:
            room.retry(name, nbytes, lambda: tier.put(okey, None, nbytes=nbytes)).result()
        res.added(name, kind, 1, tier.charge(nbytes))

    def commit(self, name: str, keys: Sequence[ObjectKey], nbytes: int) -> None:
        """Commit objects staged in tier ``name`` (given back if it never finds room)."""
        self._commit(name, keys, nbytes)

    def _commit(self, name: str, keys: Sequence[ObjectKey], nbytes: int) -> None:
        """Commit objects staged in tier ``name``, evicting more while it reports no room
        (a tier whose staging defers the allocation to the commit); they are given back
        if it never finds room."""
        tier = self.res.tiers[name]
        try:
            self.evictor.retry(name, nbytes * len(keys), lambda: tier.commit_many(keys),
                               each=nbytes)
        except BaseException:
            tier.abort_many(keys)
            raise
