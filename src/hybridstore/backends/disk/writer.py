"""The disk tier's write path: ``put``/``put_many``, the write jobs, the committer.

A put allocates an extent and hands its bytes to a write job (one per object,
or one per run of adjacent slots); the committer thread then ``fdatasync``s
the segments of what has landed and commits their catalog entries in one
transaction, and only then completes the futures (the durability order of
``backends/disk/__init__.py``).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridstore.backends.alloc import Extent
from hybridstore.backends.catalog import CatalogRecord
from hybridstore.backends.disk.objects import (
    _COMMIT_BATCH,
    _EMPTY,
    _STOP,
    COALESCE_BYTES,
    COMMIT_GATHER_S,
    checksum,
    _check_key,
    _full_error,
    _Object,
    _PendingWrite,
    _TierState,
    _with_key,
)
from hybridstore.backends.engines import buffer_address
from hybridstore.errors import CapacityError
from hybridstore.objects import ObjectKey, aligned_empty, byte_view


class _WritePath(_TierState):
    """Part of :class:`~hybridstore.backends.disk.DiskTier`: puts and their commits."""

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Write an object; the future completes (yielding ``nbytes``) once it is durable.

        The bytes are written from ``data`` without a copy: keep ``data``
        unchanged until the future completes.  The future completes on the
        tier's commit thread: its callbacks must not block on locks held by a
        thread that waits for another disk write.

        The future fails with :class:`~hybridstore.errors.DiskFullError` when the
        file system fills up under the write, its ``fdatasync`` or its catalog commit
        (``ENOSPC``/``EDQUOT``: a file system that cannot reserve a segment's blocks up
        front), with another error when the I/O fails otherwise; either way nothing
        of the object is visible and its slot is free again.

        Raises:
            ObjectTooLargeError: it can never fit.
            CapacityError: the budget is short now; evict and retry
                (:class:`~hybridstore.errors.DiskFullError`: no room on the device for
                a new segment file).
        """
        self._check_open()
        key = _check_key(key)
        view = byte_view(data, nbytes, what="data")
        extents = self._alloc_run(nbytes, 1)
        self._maybe_grow_ahead()
        if extents is None:
            raise CapacityError(f"the disk tier at {self.path} has no room for {nbytes} bytes "
                                f"(a {self.charge(nbytes)}-byte slot; {self.free_bytes} of "
                                f"{self._capacity} bytes free); evict objects and retry")
        extent = extents[0]
        with self._lock:
            if self._closed:
                self._alloc.free(self._local(extent))
                self._check_open()
            pending = self._begin_write(key, extent, view, nbytes, bytes(meta))
        self._jobs.submit(self._write_job, pending)
        return pending.future

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None,
                 written: Sequence[Future] | None = None) -> list[Future]:
        """:meth:`put` of a run of objects of one size, neighbours in one write.

        The slots are allocated together (adjacent where the allocator's slabs
        allow), and the objects of each run of adjacent slots are gathered into
        one aligned buffer and written with one request of up to
        :data:`COALESCE_BYTES` (write-through of a request's pages costs a few
        large writes instead of one per page).  Each object keeps its own
        checksum, catalog record and future.

        ``written``: one future per key, completed (``None``) as soon as the tier no
        longer reads that object's data buffer, i.e. when its write returned, before
        it is durable (or with the put's error when it failed first): a caller that
        writes from memory it must give back (vLLM's primary tier) frees it then.

        Raises:
            ObjectTooLargeError: an object can never fit.
            CapacityError: the budget is short for all of them (none is written).
        """
        self._check_open()
        keys = [_check_key(key) for key in keys]
        if datas is None or len(set(keys)) != len(keys) or len(datas) != len(keys):
            raise ValueError("put_many needs distinct keys and one data buffer per key")
        if written is not None and len(written) != len(keys):
            raise ValueError("put_many needs one written future per key")
        metas = [b""] * len(keys) if metas is None else [bytes(m) for m in metas]
        views = [byte_view(data, nbytes, what="data") for data in datas]
        extents = self._alloc_run(nbytes, len(keys))
        self._maybe_grow_ahead()
        if extents is None:
            raise CapacityError(f"the disk tier at {self.path} has no room for {len(keys)} x "
                                f"{nbytes} bytes ({self.free_bytes} of {self._capacity} bytes "
                                "free); evict objects and retry")
        with self._lock:
            if self._closed:
                for extent in extents:
                    self._alloc.free(self._local(extent))
                self._check_open()
            pending = [self._begin_write(key, extent, view, nbytes, meta)
                       for key, extent, view, meta in zip(keys, extents, views, metas)]
            if written is not None:
                for p, w in zip(pending, written):
                    p.written = w
        runs: list[list[_PendingWrite]] = []
        for p in sorted(pending, key=lambda p: (p.extent.arena, p.extent.offset)):
            if runs:
                q, head = runs[-1][-1], runs[-1][0]
                if (p.extent.arena == q.extent.arena
                        and p.extent.offset == q.extent.offset + q.extent.length
                        and p.extent.offset + nbytes - head.extent.offset <= COALESCE_BYTES):
                    runs[-1].append(p)
                    continue
            runs.append([p])
        for run in runs:
            if len(run) == 1:
                self._jobs.submit(self._write_job, run[0])
            else:
                self._jobs.submit(self._write_run, run)
        return [p.future for p in pending]

    def _begin_write(self, key: bytes, extent: Extent, view: np.ndarray, nbytes: int,
                     meta: bytes) -> _PendingWrite:
        """A write of ``key``'s next version at ``extent`` (lock held): the newest put of the
        key from now on, in flight until it lands; the caller submits its job."""
        pending = _PendingWrite(key, next(self._seq), extent, view, nbytes, meta)
        self._latest[key] = pending.seq
        self._writing += 1
        return pending

    def _alloc_run(self, nbytes: int, n: int) -> list[Extent] | None:
        """``n`` slots of this process's segments (global ids), or ``None``; in a shared
        directory a refusal first takes back what the others' changes freed
        (:meth:`DiskTier.sync`) and tries again."""
        extents = self._alloc.alloc_many(nbytes, n)
        if extents is None and self._shared is not None:
            self.sync()
            self._reclaim()
            extents = self._alloc.alloc_many(nbytes, n)
        return None if extents is None else [self._own(e) for e in extents]

    # -- write path ---------------------------------------------------------------
    def _write_job(self, p: _PendingWrite) -> None:
        engine = self.engine
        try:
            file = self._files[p.extent.arena]
            if p.nbytes <= engine.stream_piece_bytes:
                p.checksum = checksum(p.view)
                engine.write(file, p.view, p.nbytes, p.extent.offset)
            else:  # checksum while the engine's threads write (both only read p.view)
                written = engine.pwrite(file, p.view, p.nbytes, p.extent.offset)
                try:
                    p.checksum = checksum(p.view)
                finally:
                    written.exception()  # wait for the write whatever happened here
                written.result()
        except BaseException as e:  # noqa: BLE001 - reported through the future
            self._landed(1)
            self._abandon([p], _full_error(_with_key(e, p.key), self.path, "a write"))
            return
        _released([p])
        self._landed(1)
        self._commits.put(p)

    def _write_run(self, run: list[_PendingWrite]) -> None:
        """One write for objects in adjacent slots (see :meth:`put_many`): straight from
        the sources when they lie in one buffer spaced like the slots (pool slots of a
        run reserved together do), else gathered into a bounce buffer whose slot
        padding is zeroed."""
        first, last = run[0].extent, run[-1].extent
        span = last.offset + run[-1].nbytes - first.offset
        try:
            buf = _spanning_view([p.view for p in run], [p.extent.offset - first.offset for p in run],
                                 span)
            if buf is None:
                buf = aligned_empty(span)
                end = 0
                for p in run:
                    at = p.extent.offset - first.offset
                    buf[end:at] = 0
                    buf[at:at + p.nbytes] = p.view
                    end = at + p.nbytes
            for p in run:
                p.checksum = checksum(p.view)
            self.engine.write(self._files[first.arena], buf, span, first.offset)
        except BaseException as e:  # noqa: BLE001 - reported through the futures
            self._landed(len(run))
            self._abandon(run, _full_error(_with_key(e, run[0].key), self.path, "a write"))
            return
        _released(run)
        self._landed(len(run))
        for p in run:
            self._commits.put(p)

    def _landed(self, n: int) -> None:
        """``n`` writes returned (or failed): no longer in flight for the committer."""
        with self._lock:
            self._writing -= n

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._commits.get()]
            deadline = time.monotonic() + COMMIT_GATHER_S
            while len(batch) < _COMMIT_BATCH and _STOP not in batch:
                try:
                    batch.append(self._commits.get_nowait())
                    continue
                except queue.Empty:
                    pass
                wait = deadline - time.monotonic()
                if self._writing <= 0 or wait <= 0 or self._urgent:
                    break          # nothing else in flight, or a caller waits: commit now
                try:
                    batch.append(self._commits.get(timeout=min(wait, 0.005)))
                except queue.Empty:
                    pass
            stop = _STOP in batch
            pending = [p for p in batch if p is not _STOP]
            if pending:
                self._commit(pending)

    def _commit(self, batch: list[_PendingWrite]) -> None:
        """fdatasync the segments of ``batch``, then commit their entries in one txn."""
        try:
            for segment in {p.extent.arena for p in batch}:
                self.engine.fsync(self._files[segment])
        except BaseException as e:  # noqa: BLE001
            self._abandon(batch, _full_error(e, self.path, "fdatasync"))
            return
        with self._catalog_lock:
            with self._lock:
                live = [p for p in batch if self._latest.get(p.key) == p.seq]
                stale = [p for p in batch if self._latest.get(p.key) != p.seq]
            records = {id(p): CatalogRecord(p.extent.arena, p.extent.offset, p.nbytes,
                                            p.extent.length, p.checksum, p.meta) for p in live}
            moves = [p for p in live if p.replaces is not None]
            puts = [p for p in live if p.replaces is None] if moves else live
            moved: BaseException | None = None
            try:
                last = self.catalog.put_many(((p.key, records[id(p)]) for p in puts),
                                             log=self._log())
            except BaseException as e:  # noqa: BLE001
                failure: BaseException | None = e
            else:
                failure = None
                self._publish(puts, stale, records, last - len(puts) + 1 if last else 0)
                if moves:
                    moved = self._commit_moves(moves, records)
        # Futures complete outside the catalog lock: their callbacks may call delete().
        if failure is not None:
            self._abandon(batch, _full_error(failure, self.path, "the catalog commit"))
            return
        if moved is not None:      # the puts are committed; only the moves failed
            self._abandon(moves, _full_error(moved, self.path, "the catalog commit"))
            gone = {id(p) for p in moves}
            batch = [p for p in batch if id(p) not in gone]
        self._reclaim()           # what these writes replaced, where nobody reads it
        for p in batch:
            p.view = _EMPTY
            p.future.set_result(p.nbytes)

    def _commit_moves(self, moves: list[_PendingWrite], records: dict[int, CatalogRecord]
                      ) -> BaseException | None:
        """Commit a shared directory's moves (catalog lock held), each only where the
        catalog still holds the record it read: another process's put or delete of the key
        meanwhile wins, and the move is then stale (its new slot goes back).  Returns the
        catalog's error, if the transaction failed."""
        try:
            done, last = self.catalog.replace_many(
                ((p.key, records[id(p)], p.replaces) for p in moves if p.replaces is not None),
                log=self._log())
        except BaseException as e:  # noqa: BLE001 - the caller abandons the moves
            return e
        kept = set(done)
        lost = [p for p in moves if p.key not in kept]
        self._publish([p for p in moves if p.key in kept], lost, records,
                      last - len(kept) + 1 if last else 0)
        with self._lock:          # the key stays as this view holds it
            for p in lost:
                if self._latest.get(p.key) == p.seq:
                    del self._latest[p.key]
        return None

    def _publish(self, live: list[_PendingWrite], stale: list[_PendingWrite],
                 records: dict[int, CatalogRecord], first_seq: int) -> None:
        """Make committed writes visible; free what they replaced and stale writes.

        ``first_seq``: the change-log number of ``live[0]`` (the others follow it), 0
        when the directory is not shared."""
        with self._lock:
            for i, p in enumerate(live):
                seq = first_seq + i if first_seq else 0
                old = self._objects.get(p.key)
                self._objects[p.key] = _Object(p.extent, records[id(p)], seq)
                if self._latest.get(p.key) == p.seq:
                    del self._latest[p.key]
                if old is not None:
                    self._release(old.extent, seq)
                self._counters["writes"] += 1
                self._counters["bytes_written"] += p.nbytes
            for p in stale:  # replaced or deleted while in flight
                self._release(p.extent)

    def _abandon(self, batch: list[_PendingWrite], exc: BaseException) -> None:
        with self._lock:
            for p in batch:
                if self._latest.get(p.key) == p.seq:
                    del self._latest[p.key]
                self._release(p.extent)
        for p in batch:
            p.view = _EMPTY
            if p.written is not None and not p.written.done():
                p.written.set_exception(exc)
            p.future.set_exception(exc)


def _released(run: list[_PendingWrite]) -> None:
    """The writes of ``run`` returned: their data buffers are free (``written``)."""
    for p in run:
        if p.written is not None and not p.written.done():
            p.written.set_result(None)


def _spanning_view(views: list[np.ndarray], at: list[int], span: int) -> np.ndarray | None:
    """One uint8 view of ``span`` bytes covering ``views`` when they lie in one buffer with
    ``views[k]`` at byte ``at[k]`` of it (``at[0] == 0``); None otherwise."""
    root = views[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    if root.dtype != np.uint8 or root.ndim != 1:     # e.g. vLLM's (chunks, bytes) int8 rows
        root = root.reshape(-1).view(np.uint8)
    base = buffer_address(root)
    start = buffer_address(views[0]) - base
    if start < 0 or start + span > root.nbytes:
        return None
    for view, offset in zip(views, at):
        if buffer_address(view) - base != start + offset:
            return None
    return root[start:start + span]
