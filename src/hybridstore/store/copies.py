"""Copies between tiers: write-through, write-back spills and HiState §3.1 moves to SSD.

A copy starts under the store lock and completes on the target tier's thread (for
the disk tier: once durable); the index learns of it only then, in
:meth:`TierCopies.drain` under the store lock.  Until then the object's copy is
*in flight*: the evictor never drops an object whose copy is in flight, and a
source slot on a ``zero_copy`` tier stays pinned.

Room in the target tier comes from a :class:`~hybridstore.store.residency.RoomMaker`
(the evictor binds itself as :attr:`TierCopies.room`), so this module imports
nothing above :mod:`~hybridstore.store.residency`.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from functools import partial

import numpy as np

from hybridstore.backends.base import done_future
from hybridstore.errors import BackendIOError, CapacityError, CatalogError
from hybridstore.index.trie import Checkpoint
from hybridstore.objects import TIER_BITS, ObjectKey, ObjectKind, object_key
from hybridstore.store.residency import Residency, RoomMaker

log = logging.getLogger("hybridstore.store")

_DONE: Future = done_future()

COPY_FAILURES = (CapacityError, BackendIOError, CatalogError)
"""What a copy to a lower tier may fail with (no room, a full file system, an I/O error):
the object then stays where it was, and the call that started the copy goes on."""


class TierCopies:
    """Copies of objects between the tiers of one store, and those still in flight.

    Args:
        residency: the store's record of who holds what.
    """

    room: RoomMaker
    """Makes room in a target tier (set by the :class:`~hybridstore.store.evictor.Evictor`)."""

    def __init__(self, residency: Residency) -> None:
        self.res = residency
        self.pending: dict[tuple[ObjectKey, str], Future] = {}   # (key, target tier) -> copy
        self.inflight: Counter[ObjectKey] = Counter()             # copies in flight per key
        self._completed: deque[tuple[ObjectKey, str, Future]] = deque()
        self.closed = False
        """Set when the store closes: completions are then no longer applied."""
        self.skipped_copies = 0
        """Write-through copies dropped for want of room below (:meth:`skipped`)."""
        self._warned_skip = False
        self.remote_gate: Callable[[ObjectKey], bool] | None = None
        """Whether an object may go to the ``remote`` tier (``store/remote.py``); set when
        the store has one."""

    def may_send(self, okey: ObjectKey, dst: str) -> bool:
        """Whether a copy of ``okey`` to ``dst`` is wanted: always, except to a ``remote``
        tier that is down or when the remote rule declines the object."""
        if dst != "remote":
            return True
        if not getattr(self.res.tiers[dst], "available", True):
            return False
        return self.remote_gate is None or self.remote_gate(okey)

    def placed(self, okey: ObjectKey, kind: ObjectKind, nbytes: int, meta: bytes) -> None:
        """After a put that writes through: copy to every slower tier (best effort)."""
        chain = self.res.chain
        for name in chain[1:]:
            if not self.may_send(okey, name):
                continue
            try:
                self.copy(okey, kind, nbytes, meta, chain[0], name)
            except CapacityError as e:
                self.skipped(name, 1, e)

    def write_through_many(self, okeys: list[ObjectKey], kind: ObjectKind, nbytes: int,
                           metas: list[bytes], src: str, dst: str) -> None:
        """:meth:`copy_many` of a write-through, best effort (see :meth:`skipped`)."""
        if okeys and not self.may_send(okeys[0], dst):
            return
        try:
            self.copy_many(okeys, kind, nbytes, metas, src, dst)
        except CapacityError as e:
            self.skipped(dst, len(okeys), e)

    def skipped(self, dst: str, n: int, error: CapacityError) -> None:
        """A write-through copy found no room below (everything there pinned or needed by
        retained checkpoints, or the file system full under the write): the put already
        succeeded in the fast tier, so the copy is dropped, counted and logged (once), never
        raised into the put."""
        self.skipped_copies += n
        if not self._warned_skip:
            self._warned_skip = True
            log.warning("write-through copies to the %s tier are being skipped: %s", dst, error)

    def copy(self, okey: ObjectKey, kind: ObjectKind, nbytes: int, meta: bytes, src: str,
             dst: str) -> Future:
        """Start copying an object between tiers; the index learns of the copy once it is done
        (for the disk tier: once durable)."""
        source, target = self.res.tiers[src], self.res.tiers[dst]
        self.room.make_room(dst, target.charge(nbytes), kind, last_resort=False)
        if not target.stores_bytes:
            # Accounting tiers (simulation) complete at once: no future bookkeeping.
            self.room.retry(dst, nbytes, lambda: target.put(okey, None, nbytes=nbytes, meta=meta))
            if not self.res.mark(okey, dst):
                target.delete(okey)
            return _DONE
        data: np.ndarray | None
        if source.zero_copy:
            source.pin_many([okey])
            data = source.view(okey)
        else:
            data = source.get(okey) if source.stores_bytes else None
        try:
            fut = self.room.retry(dst, nbytes, lambda: target.put(okey, data, nbytes=nbytes, meta=meta))
        except BaseException:
            if source.zero_copy:
                source.unpin_many([okey])
            raise
        self._track(okey, src, dst, fut)
        if fut.done():
            self.drain()
        return fut

    def copy_many(self, okeys: list[ObjectKey], kind: ObjectKind, nbytes: int, metas: list[bytes],
                  src: str, dst: str) -> None:
        """:meth:`copy` of a run of objects of one size: from a ``zero_copy`` tier (the
        pinned pool) to one that ``coalesces_writes`` (the disk tier) they go as one
        ``put_many`` per chunk of at most an eighth of the target (neighbours in one
        write); otherwise one by one."""
        source, target = self.res.tiers[src], self.res.tiers[dst]
        if not (source.zero_copy and target.coalesces_writes):
            for okey, meta in zip(okeys, metas):
                self.copy(okey, kind, nbytes, meta, src, dst)
            return
        charge = target.charge(nbytes)
        step = max(1, target.capacity_bytes // 8 // max(charge, 1))
        for i in range(0, len(okeys), step):
            keys, chunk_metas = okeys[i:i + step], metas[i:i + step]
            self.room.make_room(dst, charge * len(keys), kind, last_resort=False)
            source.pin_many(keys)
            try:
                datas = [source.view(okey) for okey in keys]
                futs = self.room.retry(dst, nbytes * len(keys), lambda: target.put_many(
                    keys, datas, nbytes=nbytes, metas=chunk_metas), each=nbytes)
            except BaseException:
                source.unpin_many(keys)
                raise
            for okey, fut in zip(keys, futs):
                self._track(okey, src, dst, fut)
            if any(fut.done() for fut in futs):
                self.drain()

    def _track(self, okey: ObjectKey, src: str, dst: str, fut: Future) -> None:
        """Count a copy in flight until its future completes (then :meth:`drain` applies it)."""
        self.pending[(okey, dst)] = fut
        self.inflight[okey] += 1
        fut.add_done_callback(partial(self._done, okey, src, dst))

    def _done(self, okey: ObjectKey, src: str, dst: str, fut: Future) -> None:
        """Runs on the target tier's thread: only queue the completion (no store lock here,
        so that a caller holding the lock may wait on copies)."""
        source = self.res.tiers[src]
        if source.zero_copy:
            source.unpin_many([okey])
        self._completed.append((okey, dst, fut))

    def drain(self) -> None:
        """Apply finished copies to the index (under the store lock)."""
        while self._completed:
            okey, dst, fut = self._completed.popleft()
            if self.pending.get((okey, dst)) is fut:
                del self.pending[(okey, dst)]
                self.inflight[okey] -= 1
                if not self.inflight[okey]:
                    del self.inflight[okey]
            error = fut.exception()
            if isinstance(error, CapacityError):      # the device filled up under the write
                self.skipped(dst, 1, error)
            elif error is not None:
                log.warning("copy of %s to %s failed: %s", okey.hex(), dst, error)
            elif not self.closed and getattr(self.res.tiers[dst], "shared", None) is not None \
                    and not self.res.tiers[dst].contains(okey):
                pass        # another process sharing the tier deleted it since it landed
            elif not self.closed and not self.res.mark(okey, dst):
                # The object was forgotten while its copy was in flight.
                self.res.tiers[dst].delete(okey)

    def urgent(self) -> ExitStack:
        """Every tier's :meth:`~hybridstore.backends.base.Tier.urgent` at once: a caller
        is about to wait for copies to become durable."""
        stack = ExitStack()
        for tier in self.res.tiers.values():
            urgent = getattr(tier, "urgent", None)     # tiers outside Tier's hierarchy: none
            if urgent is not None:
                stack.enter_context(urgent())
        return stack

    def wait_pending(self) -> None:
        """Wait for every in-flight copy, then apply them."""
        with self.urgent():
            for fut in list(self.pending.values()):
                try:
                    fut.result()
                except Exception:  # reported by drain
                    pass
        self.drain()

    def spill(self, okey: ObjectKey, kind: ObjectKind, nbytes: int, src: str, dst: str) -> None:
        """Write-back: copy the last copy of an object one tier down before ``src`` drops it.

        Raises:
            CapacityError: no room below, or the object is not wanted there (a remote tier
                down, or a state whose pages are not remote): the caller drops it.
        """
        if not self.may_send(okey, dst):
            raise CapacityError(f"{okey.hex()} is not sent to the {dst} tier")
        if kind == ObjectKind.PAGE:
            meta = self.res.page_meta(okey)
        else:
            ck = self.res.index.checkpoint(okey[1:])
            assert ck is not None
            meta = self.res.state_meta(ck)
        fut = self.copy(okey, kind, nbytes, meta, src, dst)
        with self.urgent():
            fut.result()
        self.drain()

    def to_ssd(self, ck: Checkpoint) -> None:
        """HiState §3.1: a checkpoint that stopped being terminal leaves fast memory for SSD."""
        res = self.res
        disk_bit = TIER_BITS["disk"]
        if "disk" not in res.tiers or ck.pins or not ck.tiers & ~disk_bit:
            return
        okey = object_key(ObjectKind.STATE, ck.key)
        if not ck.tiers & disk_bit:
            try:
                fut = self.pending.get((okey, "disk")) or self.copy(
                    okey, ObjectKind.STATE, ck.nbytes, res.state_meta(ck), res.holder(ck.tiers),
                    "disk")
                with self.urgent():
                    fut.result()
            except COPY_FAILURES:
                return               # it stays in fast memory (drain counts or logs why)
            finally:
                self.drain()
        if res.index.checkpoint(ck.key) is ck and ck.tiers & disk_bit and not self.inflight[okey]:
            for name in res.chain[:res.chain.index("disk")]:   # the tiers above the SSD
                if ck.tiers & TIER_BITS[name]:
                    res.drop(okey, name)
