"""The SSD tier: objects packed into segment files, a durable lmdb catalog.

Directory layout (``path``)::

    LOCK              fcntl.flock'ed by the one process that has the tier open
    catalog/          lmdb environment (see backends/catalog.py)
    seg-000000.dat    segment files: the SlabAllocator's arenas, one file each;
    seg-000001.dat    objects sit at 4 KiB-aligned offsets (O_DIRECT / GDS)

Write path (``put``): allocate an extent, write the caller's bytes straight
from its buffer (the engine bounces only what is unaligned), ``fdatasync`` the
segment, *then* commit the catalog entry.  An object is visible
(``contains``/``entries``/``get``) only once its bytes are durable and its
entry committed, so a crash never exposes a torn object.  A committer thread
groups the completions that arrive together: one ``fdatasync`` per segment and
one lmdb transaction per group.

Read path (``get_into``): read the extent into ``out`` (host numpy buffer or a
torch tensor, device tensors too), verify its xxh3_64 checksum; on mismatch the
object is dropped from the catalog, a warning is logged, and
:class:`~hybridstore.errors.CorruptObjectError` is raised.  Extents being read
are pinned: a concurrent delete or replacement frees them after the read.

Reopen: the catalog is the truth.  Every entry whose segment file exists and
is long enough is reserved in a fresh allocator and visible again; others are
dropped with a logged reason.  Segment files no surviving entry uses are
removed.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import queue
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import xxhash

from hybridstore.backends.alloc import Extent, SlabAllocator, SlabBudget
from hybridstore.backends.base import ObjectKey, Tier
from hybridstore.backends.catalog import Catalog, CatalogRecord
from hybridstore.backends.engines import (ALIGN, Engine, buffer_address, fsync_path, round_up,
                                          select_engine)
from hybridstore.errors import (
    BackendIOError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
    DiskPathError,
)
from hybridstore.objects import OBJECT_KEY_BYTES, aligned_empty, byte_view

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
CATALOG_DIR = "catalog"
_GEOMETRY = struct.Struct("<Q")  # segment_bytes, stored as catalog info "disk.geometry"
_COMMIT_BATCH = 256
COALESCE_BYTES = 8 << 20
"""Longest I/O :meth:`DiskTier.read_many_into` makes of neighbouring objects."""
_STOP = object()


def segment_name(segment: int) -> str:
    """File name of a segment: ``seg-000042.dat``."""
    return f"seg-{segment:06d}.dat"


@dataclass(slots=True)
class _Object:
    """A visible (committed) object: where it lives and its catalog record."""

    extent: Extent
    record: CatalogRecord


@dataclass(slots=True, eq=False)
class _PendingWrite:
    """A ``put`` between its call and its catalog commit."""

    key: bytes
    seq: int
    extent: Extent
    view: np.ndarray
    nbytes: int
    meta: bytes
    future: Future = field(default_factory=Future)
    checksum: int = 0


class DiskTier(SlabBudget, Tier):
    """Durable SSD tier over segment files; see the module docstring.

    Args:
        path: directory of the tier (created if missing).
        capacity_bytes: hard budget of the segment files.
        engine: ``"auto"``, ``"kvikio"``, ``"posix"``, or an :class:`Engine`
            (the tier then owns it and closes it).
        segment_bytes: size of one segment file (an existing tier keeps the
            size it was created with).
        io_threads: threads of the I/O pool (and of the engine).
        ssd_gbps, h2d_gbps: bandwidths of the restore-time model.
        verify_checksums: check every object read back.

    Raises:
        ConfigError: a size or bandwidth is out of range.
        DiskPathError: ``path`` cannot be created or written, or another
            process has it open.
        CatalogError: the catalog is unreadable or of another format.
    """

    name = "disk"
    durable = True
    coalesces_writes = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 engine: str | Engine = "auto", segment_bytes: int = 256 << 20,
                 io_threads: int = 8, ssd_gbps: float = 5.0, h2d_gbps: float = 64.0,
                 verify_checksums: bool = True) -> None:
        super().__init__()
        _validate(capacity_bytes, segment_bytes, io_threads, ssd_gbps, h2d_gbps)
        self.path = os.fspath(path)
        self._capacity = capacity_bytes
        self._ssd_bps = ssd_gbps * 1e9
        self._h2d_bps = h2d_gbps * 1e9
        self._verify = verify_checksums
        self._lock_fd = _lock_directory(self.path)
        self._catalog_lock = threading.Lock()  # orders catalog mutations (commit, delete, drop)
        self._files: dict[int, Any] = {}  # segment id -> engine handle; under the allocator lock
        self._objects: dict[bytes, _Object] = {}
        self._latest: dict[bytes, int] = {}  # key -> seq of its newest uncommitted put
        self._pins: dict[Extent, int] = {}
        self._deferred: set[Extent] = set()
        self._seq = itertools.count(1)
        self._counters = dict.fromkeys(("bytes_read", "bytes_written", "reads", "writes",
                                        "corrupt_dropped", "recovered_objects",
                                        "recovery_dropped"), 0)
        self._engine: Engine | None = None
        self._catalog: Catalog | None = None
        try:
            self._catalog = Catalog(os.path.join(self.path, CATALOG_DIR))
            self.segment_bytes = self._geometry(segment_bytes)
            self._engine = (engine if isinstance(engine, Engine)
                            else select_engine(engine, io_threads))
            self._alloc = SlabAllocator(budget_bytes=capacity_bytes, arena_bytes=self.segment_bytes,
                                        alignment=ALIGN, on_new_arena=self._create_segment,
                                        on_release_arena=self._remove_segment)
            self._recover()
        except BaseException:
            self._teardown()
            raise
        self._jobs = ThreadPoolExecutor(io_threads, thread_name_prefix="hs-disk")
        self._commits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="hs-disk-commit",
                                           daemon=True)
        self._committer.start()

    # -- capacity -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def engine(self) -> Engine:
        """The I/O engine in use."""
        assert self._engine is not None
        return self._engine

    @property
    def catalog(self) -> Catalog:
        """The durable catalog (for the store's layout blobs)."""
        assert self._catalog is not None
        return self._catalog

    def put_info(self, name: str, value: bytes) -> None:
        """Store a named layout blob in the catalog (see :meth:`Catalog.put_info`)."""
        self._check_open()
        self.catalog.put_info(name, value)

    def get_info(self, name: str) -> bytes | None:
        """A layout blob stored with :meth:`put_info`, or ``None``."""
        self._check_open()
        return self.catalog.get_info(name)

    # -- objects ------------------------------------------------------------------
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Write an object; the future completes (yielding ``nbytes``) once it is durable.

        The bytes are written from ``data`` without a copy: keep ``data``
        unchanged until the future completes.  The future completes on the
        tier's commit thread: its callbacks must not block on locks held by a
        thread that waits for another disk write.

        Raises:
            ObjectTooLargeError: it can never fit.
            CapacityError: the budget is short now; evict and retry.
        """
        self._check_open()
        key = _check_key(key)
        view = byte_view(data, nbytes, what="data")
        extent = self._alloc.alloc(nbytes)
        if extent is None:
            raise CapacityError(f"the disk tier at {self.path} has no room for {nbytes} bytes "
                                f"(a {self.charge(nbytes)}-byte slot; {self.free_bytes} of "
                                f"{self._capacity} bytes free); evict objects and retry")
        with self._lock:
            if self._closed:
                self._alloc.free(extent)
                self._check_open()
            pending = _PendingWrite(key, next(self._seq), extent, view, nbytes, bytes(meta))
            self._latest[key] = pending.seq
        self._jobs.submit(self._write_job, pending)
        return pending.future

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        """:meth:`put` of a run of objects of one size, neighbours in one write.

        The slots are allocated together (adjacent where the allocator's slabs
        allow), and the objects of each run of adjacent slots are gathered into
        one aligned buffer and written with one request of up to
        :data:`COALESCE_BYTES` (write-through of a request's pages costs a few
        large writes instead of one per page).  Each object keeps its own
        checksum, catalog record and future.

        Raises:
            ObjectTooLargeError: an object can never fit.
            CapacityError: the budget is short for all of them (none is written).
        """
        self._check_open()
        keys = [_check_key(key) for key in keys]
        if datas is None or len(set(keys)) != len(keys) or len(datas) != len(keys):
            raise ValueError("put_many needs distinct keys and one data buffer per key")
        metas = [b""] * len(keys) if metas is None else [bytes(m) for m in metas]
        views = [byte_view(data, nbytes, what="data") for data in datas]
        extents = self._alloc.alloc_many(nbytes, len(keys))
        if extents is None:
            raise CapacityError(f"the disk tier at {self.path} has no room for {len(keys)} x "
                                f"{nbytes} bytes ({self.free_bytes} of {self._capacity} bytes "
                                "free); evict objects and retry")
        with self._lock:
            if self._closed:
                for extent in extents:
                    self._alloc.free(extent)
                self._check_open()
            pending = [_PendingWrite(key, next(self._seq), extent, view, nbytes, meta)
                       for key, extent, view, meta in zip(keys, extents, views, metas)]
            for p in pending:
                self._latest[p.key] = p.seq
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

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """Read an object into ``out``; the future yields its ``nbytes``.

        ``out``: a host uint8 numpy array (or writable buffer) of at least
        ``nbytes``, or a torch tensor (CPU or CUDA; CUDA goes SSD -> GPU
        directly where kvikio has GPUDirect Storage).

        Raises:
            KeyError: the object is not visible here.
            CorruptObjectError: (from the future) its checksum failed; it is dropped.
        """
        self._check_open()
        key = _check_key(key)
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                raise KeyError(key)
            target = _ReadTarget.of(out, obj.record.length)
            self._pins[obj.extent] = self._pins.get(obj.extent, 0) + 1
        try:
            return self._jobs.submit(self._read_job, key, obj, target)
        except BaseException:
            self._unpin(obj.extent)
            raise

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes the slot of an ``nbytes`` object spans in its segment file (the spacing at
        which :meth:`read_many_into` reads neighbours in one I/O)."""
        return self._alloc.slot_size(nbytes)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        """Read objects ``keys[i]`` into ``dst[offsets[i]:]``, neighbours in one I/O.

        Objects that lie back to back in one segment file, in the same order and
        spacing as their destinations in ``dst``, are read with one request of
        up to :data:`COALESCE_BYTES` (a load of many small pages written
        together reads at the device's large-I/O rate instead of paying a
        request per page), then each object's checksum is checked on its own.
        The slot padding between two coalesced objects lands in ``dst`` between
        their destinations: space destinations by :meth:`slot_bytes` where they
        should coalesce, and give each at least that much room.

        Args:
            keys: distinct keys of visible objects.
            dst: a writable, C-contiguous host uint8 array.
            offsets: where each object lands in ``dst``.

        Returns:
            One future for all of them, yielding their total ``nbytes`` once every
            read has finished (``dst`` is no longer written to); it fails with the
            first error, e.g. ``CorruptObjectError`` (every corrupt object is
            dropped; the error names the first).

        Raises:
            KeyError: a key is not visible here (nothing is read).
            ValueError: a destination does not fit in ``dst``.
        """
        self._check_open()
        if len(keys) != len(offsets):
            raise ValueError("keys and offsets must have one length")
        with self._lock:
            found = [self._objects.get(_check_key(key)) for key in keys]
            for key, obj in zip(keys, found):
                if obj is None:
                    raise KeyError(key)
            objs = cast("list[_Object]", found)
            for obj, off in zip(objs, offsets):
                if off < 0 or off + obj.record.length > dst.nbytes:
                    raise ValueError(f"offset {off} + {obj.record.length} bytes is past dst "
                                     f"({dst.nbytes} bytes)")
            for obj in objs:
                self._pins[obj.extent] = self._pins.get(obj.extent, 0) + 1
        order = sorted(range(len(keys)), key=lambda i: (objs[i].record.segment, objs[i].record.offset))
        runs: list[list[int]] = []
        for i in order:
            if runs:
                j, head = runs[-1][-1], runs[-1][0]
                a, b = objs[j].record, objs[i].record
                if (a.segment == b.segment and b.offset - a.offset == objs[j].extent.length
                        and offsets[i] - offsets[j] == objs[j].extent.length
                        and b.offset + b.length - objs[head].record.offset <= COALESCE_BYTES):
                    runs[-1].append(i)
                    continue
            runs.append([i])
        group = _ReadGroup(len(runs))
        submitted = 0
        try:
            for run in runs:
                self._jobs.submit(self._read_run, [(bytes(keys[i]), objs[i]) for i in run], dst,
                                  [offsets[i] for i in run], group)
                submitted += 1
        except BaseException as e:
            for run in runs[submitted:]:
                for i in run:
                    self._unpin(objs[i].extent)
                group.done(0, e)
        return group.future

    def _read_run(self, items: list[tuple[bytes, _Object]], dst: np.ndarray, offsets: list[int],
                  group: _ReadGroup) -> None:
        """One I/O for neighbouring objects (see :meth:`read_many_into`), then each checksum."""
        first, last = items[0][1].record, items[-1][1].record
        span = last.offset + last.length - first.offset
        error: BaseException | None = None
        got_bytes = 0
        try:
            self.engine.read(self._files[first.segment], dst[offsets[0]:offsets[0] + span],
                             span, first.offset)
            for (key, obj), off in zip(items, offsets):
                rec = obj.record
                if self._verify:
                    got = xxhash.xxh3_64_intdigest(dst[off:off + rec.length])
                    if got != rec.checksum:
                        try:
                            self._drop_corrupt(key, obj, got)
                        except CorruptObjectError as e:
                            error = error or e
                        continue
                got_bytes += rec.length
            with self._lock:
                self._counters["reads"] += len(items)
                self._counters["bytes_read"] += got_bytes
        except BaseException as e:
            if isinstance(e, BackendIOError):
                _with_key(e, items[0][0])
            error = error or e
        finally:
            for _, obj in items:
                self._unpin(obj.extent)
            group.done(got_bytes, error)

    def get(self, key: ObjectKey) -> np.ndarray:
        n = self.nbytes(key)
        if n is None:
            raise KeyError(key)
        out = aligned_empty(n)  # aligned: O_DIRECT reads land in place, no bounce
        self.get_into(key, out).result()
        return out

    def contains(self, key: ObjectKey) -> bool:
        self._check_open()
        with self._lock:
            return bytes(key) in self._objects

    def nbytes(self, key: ObjectKey) -> int | None:
        self._check_open()
        with self._lock:
            obj = self._objects.get(bytes(key))
        return None if obj is None else obj.record.length

    def meta(self, key: ObjectKey) -> bytes | None:
        self._check_open()
        with self._lock:
            obj = self._objects.get(bytes(key))
        return None if obj is None else obj.record.meta

    def delete(self, key: ObjectKey) -> int:
        """Drop an object (catalog entry first, then its extent); returns the bytes freed.

        An uncommitted ``put`` of the key is cancelled too.
        """
        self._check_open()
        key = ObjectKey(bytes(key))
        with self._catalog_lock:
            with self._lock:
                self._latest.pop(key, None)
                obj = self._objects.get(key)
            if obj is None:
                return 0
            self.catalog.delete(key)
            with self._lock:
                del self._objects[key]
                self._release(obj.extent)
        return obj.extent.length

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        """:meth:`delete` of several keys with one catalog transaction; returns the bytes freed.

        Each catalog transaction is synchronous, so dropping objects in bulk
        (evictions) costs one ``fsync`` instead of one per object.
        """
        self._check_open()
        wanted = list(dict.fromkeys(bytes(k) for k in keys))
        with self._catalog_lock:
            with self._lock:
                found = []
                for key in wanted:
                    self._latest.pop(key, None)
                    obj = self._objects.get(key)
                    if obj is not None:
                        found.append((key, obj))
            if not found:
                return 0
            self.catalog.delete_many(key for key, _ in found)
            with self._lock:
                for key, obj in found:
                    del self._objects[key]
                    self._release(obj.extent)
        return sum(obj.extent.length for _, obj in found)

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        self._check_open()
        with self._lock:
            snapshot = [(ObjectKey(k), o.record.length, o.record.meta)
                        for k, o in self._objects.items()]
        return iter(snapshot)

    def read_seconds(self, nbytes: int) -> float:
        """T_SSD of HiState eq. 2: SSD read, then host-to-device copy."""
        return nbytes / self._ssd_bps + nbytes / self._h2d_bps

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["objects"] = len(self._objects)
            out["pending_writes"] = len(self._latest)
        out.update(engine=self.engine.name, engine_compat=float(self.engine.compat_mode),
                   used_bytes=self.used_bytes, capacity_bytes=self._capacity,
                   committed_bytes=self._alloc.committed_bytes,
                   segments=self._alloc.arena_count)
        return out

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight reads and writes, then close files, catalog and the lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.shutdown(wait=True)
        self._commits.put(_STOP)
        self._committer.join()
        self._teardown()

    def _teardown(self) -> None:
        for handle in list(self._files.values()):
            try:
                assert self._engine is not None
                self._engine.close_file(handle)
            except Exception as e:  # noqa: BLE001 - closing must release the rest
                log.warning("closing a segment of %s failed: %s", self.path, e)
        self._files.clear()
        if self._engine is not None:
            self._engine.close()
        if self._catalog is not None:
            self._catalog.close()
        os.close(self._lock_fd)  # releases the flock

    # -- write path ---------------------------------------------------------------
    def _write_job(self, p: _PendingWrite) -> None:
        engine = self.engine
        try:
            file = self._files[p.extent.arena]
            if p.nbytes <= engine.stream_piece_bytes:
                p.checksum = xxhash.xxh3_64_intdigest(p.view)
                engine.write(file, p.view, p.nbytes, p.extent.offset)
            else:  # checksum while the engine's threads write (both only read p.view)
                written = engine.pwrite(file, p.view, p.nbytes, p.extent.offset)
                try:
                    p.checksum = xxhash.xxh3_64_intdigest(p.view)
                finally:
                    written.exception()  # wait for the write whatever happened here
                written.result()
        except BaseException as e:  # noqa: BLE001 - reported through the future
            self._abandon([p], _with_key(e, p.key))
            return
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
                p.checksum = xxhash.xxh3_64_intdigest(p.view)
            self.engine.write(self._files[first.arena], buf, span, first.offset)
        except BaseException as e:  # noqa: BLE001 - reported through the futures
            self._abandon(run, _with_key(e, run[0].key))
            return
        for p in run:
            self._commits.put(p)

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._commits.get()]
            while len(batch) < _COMMIT_BATCH:
                try:
                    batch.append(self._commits.get_nowait())
                except queue.Empty:
                    break
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
            self._abandon(batch, e)
            return
        with self._catalog_lock:
            with self._lock:
                live = [p for p in batch if self._latest.get(p.key) == p.seq]
                stale = [p for p in batch if self._latest.get(p.key) != p.seq]
            records = {id(p): CatalogRecord(p.extent.arena, p.extent.offset, p.nbytes,
                                            p.extent.length, p.checksum, p.meta) for p in live}
            try:
                self.catalog.put_many((p.key, records[id(p)]) for p in live)
            except BaseException as e:  # noqa: BLE001
                failure: BaseException | None = e
            else:
                failure = None
                self._publish(live, stale, records)
        # Futures complete outside the catalog lock: their callbacks may call delete().
        if failure is not None:
            self._abandon(batch, failure)
            return
        for p in batch:
            p.view = _EMPTY
            p.future.set_result(p.nbytes)

    def _publish(self, live: list[_PendingWrite], stale: list[_PendingWrite],
                 records: dict[int, CatalogRecord]) -> None:
        """Make committed writes visible; free what they replaced and stale writes."""
        with self._lock:
            for p in live:
                old = self._objects.get(p.key)
                self._objects[p.key] = _Object(p.extent, records[id(p)])
                if self._latest.get(p.key) == p.seq:
                    del self._latest[p.key]
                if old is not None:
                    self._release(old.extent)
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
            p.future.set_exception(exc)

    # -- read path ----------------------------------------------------------------
    def _read_job(self, key: bytes, obj: _Object, target: _ReadTarget) -> int:
        rec = obj.record
        try:
            try:
                got = target.read(self.engine, self._files[rec.segment], rec.offset, rec.length,
                                  self._verify)
            except BackendIOError as e:
                _with_key(e, key)
                raise
            if self._verify and got != rec.checksum:
                self._drop_corrupt(key, obj, got)
            with self._lock:
                self._counters["reads"] += 1
                self._counters["bytes_read"] += rec.length
            return rec.length
        finally:
            self._unpin(obj.extent)

    def _drop_corrupt(self, key: bytes, obj: _Object, got: int) -> None:
        rec = obj.record
        with self._catalog_lock:
            with self._lock:
                current = self._objects.get(key) is obj
            if current:
                self.catalog.delete(key)
                with self._lock:
                    del self._objects[key]
                    self._release(obj.extent)
                    self._counters["corrupt_dropped"] += 1
        log.warning("disk tier %s: object %s (%d bytes at %s offset %d) failed its checksum "
                    "(expected %016x, got %016x); dropped it from the catalog",
                    self.path, key.hex(), rec.length, segment_name(rec.segment), rec.offset,
                    rec.checksum, got)
        raise CorruptObjectError(f"object {key.hex()} on the disk tier at {self.path} is corrupt "
                                 f"(checksum {got:016x}, expected {rec.checksum:016x}); it was "
                                 "dropped: recompute it and put it again",
                                 key=key, expected=rec.checksum, got=got)

    # -- extents and pins (call with self._lock held) ------------------------------
    def _release(self, extent: Extent) -> None:
        if self._pins.get(extent):
            self._deferred.add(extent)
        else:
            self._alloc.free(extent)

    def _unpin(self, extent: Extent) -> None:
        with self._lock:
            left = self._pins[extent] - 1
            if left:
                self._pins[extent] = left
                return
            del self._pins[extent]
            if extent in self._deferred:
                self._deferred.discard(extent)
                self._alloc.free(extent)

    # -- segments (allocator callbacks, under the allocator's lock) -----------------
    def _segment_path(self, segment: int) -> str:
        return os.path.join(self.path, segment_name(segment))

    def _create_segment(self, segment: int, nbytes: int) -> None:
        path = self._segment_path(segment)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                if os.fstat(fd).st_size < nbytes:
                    _preallocate(fd, nbytes)
            finally:
                os.close(fd)
            fsync_path(self.path)
        except OSError as e:
            raise BackendIOError(f"cannot create segment {path} of {nbytes} bytes: {e.strerror}; "
                                 "free space on the device or lower disk_bytes") from e
        self._files[segment] = self.engine.open(path)

    def _remove_segment(self, segment: int) -> None:
        handle = self._files.pop(segment, None)
        if handle is not None:
            self.engine.close_file(handle)
        try:
            os.unlink(self._segment_path(segment))
        except OSError as e:
            log.warning("could not remove the unused segment %s: %s",
                        self._segment_path(segment), e.strerror)

    # -- open / recovery ----------------------------------------------------------
    def _geometry(self, segment_bytes: int) -> int:
        raw = self.catalog.get_info("disk.geometry")
        if raw is None:
            self.catalog.put_info("disk.geometry", _GEOMETRY.pack(segment_bytes))
            return segment_bytes
        stored = _GEOMETRY.unpack(raw)[0]
        if stored != segment_bytes:
            log.warning("disk tier %s was created with segment_bytes=%d; keeping it (asked for "
                        "%d)", self.path, stored, segment_bytes)
        return int(stored)

    def _recover(self) -> None:
        """Make every sound catalog entry visible again; drop the rest with a reason."""
        dropped: list[bytes] = []
        for key, rec in self.catalog.items():
            reason = self._check_record(key, rec)
            if reason is None:
                extent = Extent(rec.segment, rec.offset, rec.slot_length)
                try:
                    self._alloc.reserve(extent)
                except (ValueError, CapacityError) as e:
                    reason = f"its extent cannot be reserved ({e})"
                else:
                    self._objects[key] = _Object(extent, rec)
            if reason is not None:
                log.warning("disk tier %s: dropping object %s from the catalog: %s",
                            self.path, key.hex(), reason)
                dropped.append(key)
        self.catalog.delete_many(dropped)
        self._counters["recovered_objects"] = len(self._objects)
        self._counters["recovery_dropped"] = len(dropped)
        self._remove_orphan_segments()

    def _check_record(self, key: bytes, rec: CatalogRecord) -> str | None:
        if len(key) != OBJECT_KEY_BYTES:
            return f"its key has {len(key)} bytes, not {OBJECT_KEY_BYTES}"
        if rec.length > rec.slot_length or rec.offset % ALIGN:
            return f"its record is malformed ({rec.length} bytes in a {rec.slot_length}-byte " \
                   f"slot at offset {rec.offset})"
        path = self._segment_path(rec.segment)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return f"its segment file {path} is missing"
        if size < rec.offset + round_up(rec.length):
            return (f"its segment file {path} is {size} bytes, too short for "
                    f"{rec.length} bytes at offset {rec.offset} (torn or truncated)")
        return None

    def _remove_orphan_segments(self) -> None:
        """Delete segment files that no surviving object uses (torn writes' leftovers)."""
        live = set(self._alloc.arena_sizes())
        for name in os.listdir(self.path):
            if not (name.startswith("seg-") and name.endswith(".dat")):
                continue
            try:
                segment = int(name[4:-4])
            except ValueError:
                continue
            if segment not in live:
                log.info("disk tier %s: removing unused segment %s", self.path, name)
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError as e:
                    log.warning("could not remove %s: %s", name, e.strerror)


# ---------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------
_EMPTY = np.empty(0, dtype=np.uint8)


class _ReadGroup:
    """The runs of one :meth:`DiskTier.read_many_into`: its future completes when the
    last run is done, with the first error any run met."""

    __slots__ = ("future", "_left", "_bytes", "_error", "_lock")

    def __init__(self, runs: int) -> None:
        self.future: Future = Future()
        self._left = runs
        self._bytes = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if not runs:
            self.future.set_result(0)

    def done(self, nbytes: int, error: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            self._bytes += nbytes
            self._error = self._error or error
            last = self._left == 0
        if last:
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(self._bytes)


class _ReadTarget:
    """Where a read lands: a host byte view, or a torch tensor (maybe on a GPU)."""

    __slots__ = ("host", "tensor")

    def __init__(self, host: np.ndarray | None, tensor: Any = None) -> None:
        self.host = host
        self.tensor = tensor

    @classmethod
    def of(cls, out: Any, nbytes: int) -> _ReadTarget:
        if type(out).__module__.startswith("torch"):
            tensor = _torch_bytes(out, nbytes)
            if tensor.device.type == "cpu":
                return cls(tensor.numpy())
            return cls(None, tensor)
        return cls(byte_view(out, nbytes, writable=True, what="out"))

    def read(self, engine: Engine, file: Any, offset: int, nbytes: int, verify: bool) -> int:
        """Read ``nbytes`` at ``offset``; returns the xxh3_64 of what landed (0 unverified)."""
        if self.host is not None:
            if not verify or nbytes <= engine.stream_piece_bytes:
                engine.read(file, self.host, nbytes, offset)
                return xxhash.xxh3_64_intdigest(self.host) if verify else 0
            return _read_hashing(engine, file, self.host, nbytes, offset)
        import torch

        if engine.name.startswith("kvikio"):  # kvikio reads into device memory itself
            engine.read(file, self.tensor, nbytes, offset)
            return xxhash.xxh3_64_intdigest(self.tensor.cpu().numpy()) if verify else 0
        host = aligned_empty(nbytes)
        engine.read(file, host, nbytes, offset)
        self.tensor.copy_(torch.from_numpy(host))
        return xxhash.xxh3_64_intdigest(host) if verify else 0


def _read_hashing(engine: Engine, file: Any, host: np.ndarray, nbytes: int, offset: int) -> int:
    """Read into ``host`` while checksumming the pieces that have landed, in order.

    The checksum of the landed prefix overlaps the reads of the pieces after it,
    so a verified read costs the read plus the hash of its last wave of pieces,
    not of the whole object.  The digest is the same xxh3_64 as a one-shot hash.
    """
    stream = engine.pread_stream(file, host, nbytes, offset)
    hasher = xxhash.xxh3_64()
    hashed = 0  # pieces checksummed so far
    try:
        while hashed < stream.count:
            landed = stream.wait_prefix(hashed + 1)
            hasher.update(host[stream.bounds(hashed)[0]:stream.bounds(landed - 1)[1]])
            hashed = landed
    except BaseException:
        stream.wait_quietly()  # the buffer is the caller's again only once no piece is in flight
        raise
    stream.result()
    return hasher.intdigest()


def _torch_bytes(tensor: Any, nbytes: int) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError("get_into needs a contiguous tensor")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"the tensor holds {flat.numel()} bytes, the object has {nbytes}")
    return flat[:nbytes]


def _spanning_view(views: list[np.ndarray], at: list[int], span: int) -> np.ndarray | None:
    """One uint8 view of ``span`` bytes covering ``views`` when they lie in one buffer with
    ``views[k]`` at byte ``at[k]`` of it (``at[0] == 0``); None otherwise."""
    root = views[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.dtype != np.uint8 or root.ndim != 1 or not root.flags.c_contiguous:
        return None
    base = buffer_address(root)
    start = buffer_address(views[0]) - base
    if start < 0 or start + span > root.nbytes:
        return None
    for view, offset in zip(views, at):
        if buffer_address(view) - base != start + offset:
            return None
    return root[start:start + span]


def _check_key(key: bytes) -> ObjectKey:
    if not isinstance(key, (bytes, bytearray)) or len(key) != OBJECT_KEY_BYTES:
        raise ValueError(f"keys are {OBJECT_KEY_BYTES} bytes (kind + 16-byte hash), got {key!r}")
    return ObjectKey(bytes(key))


def _with_key(exc: BaseException, key: bytes) -> BaseException:
    if isinstance(exc, BackendIOError) and exc.key is None:
        exc.key = key
    return exc


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` for a segment: posix_fallocate, or ftruncate where unsupported."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


def _lock_directory(path: str) -> int:
    """Create ``path`` and hold an exclusive flock on its LOCK file; returns the fd."""
    hint = "set disk_path to a writable directory (ideally on an NVMe SSD)"
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise DiskPathError(f"cannot use {path!r} as the disk tier directory: "
                            f"{e.strerror or e}; {hint}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DiskPathError(f"the disk tier directory {path!r} is in use by another store "
                                f"(process {holder}); close that store, or give each process "
                                "its own disk_path") from e
        raise DiskPathError(f"cannot lock {path!r}: {e.strerror}; {hint}") from e
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise DiskPathError(f"cannot write to {path!r}: {e.strerror}; {hint}") from e
    return fd


def _validate(capacity_bytes: int, segment_bytes: int, io_threads: int, ssd_gbps: float,
              h2d_gbps: float) -> None:
    if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise ConfigError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
    if not isinstance(segment_bytes, int) or segment_bytes < ALIGN or segment_bytes % ALIGN:
        raise ConfigError(f"segment_bytes must be a positive multiple of {ALIGN}, "
                          f"got {segment_bytes!r}")
    if not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
        raise ConfigError(f"io_threads must be an int in [1, 256], got {io_threads!r}")
    if ssd_gbps <= 0 or h2d_gbps <= 0:
        raise ConfigError("ssd_gbps and h2d_gbps must be positive")


__all__ = ["CATALOG_DIR", "LOCK_NAME", "DiskTier", "aligned_empty", "segment_name"]
