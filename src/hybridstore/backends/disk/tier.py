"""The disk tier: :class:`DiskTier`, its objects' bookkeeping, pins and segment files.

The class is assembled from its parts: the write path (``writer.py``), the
read path (``reader.py``), compaction (``compact.py``) and reopening
(``recovery.py``); what they share is
in ``objects.py``.  The package docstring (``backends/disk/__init__.py``)
states the directory layout and the durability order.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridstore.backends.alloc import Extent, SlabAllocator, SlabBudget
from hybridstore.backends.base import Tier
from hybridstore.backends.catalog import PUT, Catalog, Change
from hybridstore.backends.disk.compact import _Compaction
from hybridstore.backends.disk.objects import (
    _STOP,
    CATALOG_DIR,
    _Object,
    segment_bytes_for,
    segment_name,
)
from hybridstore.backends.disk.reader import _ReadPath
from hybridstore.backends.disk.recovery import _lock_directory, _Recovery
from hybridstore.backends.disk.shared import SLOT_BITS, SharedDirectory, slot_of
from hybridstore.backends.disk.writer import _WritePath
from hybridstore.backends.engines import (
    ALIGN,
    Engine,
    allocate_file,
    fsync_path,
    round_up,
    select_engine,
)
from hybridstore.errors import (
    BackendIOError,
    CapacityError,
    CatalogError,
    ConfigError,
    DiskFullError,
)
from hybridstore.objects import ObjectKey

log = logging.getLogger("hybridstore.backends.disk")

GROW_MIN_BYTES = 1 << 20
"""A segment file grows as its objects need room, to twice its size at a time (at least
by this much): a new directory takes a few MiB, not a whole segment."""

FULL_RECHECK_S = 5.0
"""After the file system refused to grow a segment, the tier holds only what its grown
bytes hold for this long before it tries to grow again."""


class DiskTier(_WritePath, _ReadPath, _Compaction, _Recovery, SlabBudget, Tier):
    """Durable SSD tier over segment files; see the module docstring.

    Args:
        path: directory of the tier (created if missing).
        capacity_bytes: hard budget of the segment files.
        engine: ``"auto"``, ``"kvikio"``, ``"posix"``, or an :class:`Engine`
            (the tier then owns it and closes it).
        segment_bytes: size of one segment file; ``None``: from the budget
            (:func:`~hybridstore.backends.disk.objects.segment_bytes_for`).  An
            existing tier keeps the size it was created with.  Segment files grow
            as their objects need room.
        io_threads: threads of the I/O pool (and of the engine).
        ssd_gbps, h2d_gbps: bandwidths of the restore-time model.
        verify_checksums: check every object read back.
        shared: share the directory with other processes (each opens it with
            ``shared=True``; see ``backends/disk/shared.py``): each sees what the
            others made durable, and ``capacity_bytes`` bounds them together.
        sync_interval_s: in a shared directory, how often a background thread
            applies the others' changes (and so takes back the room their deletions
            of this process's objects freed) when no call does.

    Raises:
        ConfigError: a size or bandwidth is out of range.
        DiskPathError: ``path`` cannot be created or written, or another
            process has it open in the other mode (shared or not).
        CatalogError: the catalog is unreadable or of another format.
    """

    name = "disk"
    durable = True
    coalesces_writes = True
    reports_written = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 engine: str | Engine = "auto", segment_bytes: int | None = None,
                 io_threads: int = 8, ssd_gbps: float = 5.0, h2d_gbps: float = 64.0,
                 verify_checksums: bool = True, shared: bool = False,
                 sync_interval_s: float = 0.1) -> None:
        super().__init__()
        _validate(capacity_bytes, segment_bytes, io_threads, ssd_gbps, h2d_gbps)
        self.path = os.fspath(path)
        self._capacity = capacity_bytes
        self._ssd_bps = ssd_gbps * 1e9
        self._h2d_bps = h2d_gbps * 1e9
        self._verify = verify_checksums
        self._lock_fds = _lock_directory(self.path, shared)
        self._shared: SharedDirectory | None = None
        self._base = 0                      # segment ids of this process: _base | n
        self._view = 0                      # change-log entries applied (shared)
        self._quarantine: list[tuple[int, Extent]] = []  # (freed by change, own extent)
        self._changes: list[tuple[int, bytes, int, bytes]] = []  # for take_changes()
        self._tombstones: dict[bytes, int] = {}  # key -> change of this process's delete of it
        self._truncated = 0
        self._open_lock = threading.Lock()
        self._inodes: dict[int, int] = {}     # another process's segment -> inode opened
        self._foreign_used = 0              # slot bytes of visible objects in others' segments
        self._full_at: float | None = None  # when the file system last refused a segment room
        self._full_logged = False
        self._starved = False               # said that the others hold the whole budget
        self._catalog_lock = threading.Lock()  # orders catalog mutations (commit, delete, drop)
        self._files: dict[int, Any] = {}  # segment id -> engine handle; under the allocator lock
        self._objects: dict[bytes, _Object] = {}
        self._latest: dict[bytes, int] = {}  # key -> seq of its newest uncommitted put
        self._writing = 0                    # writes submitted and not landed nor failed
        self._urgent = 0                     # callers waiting for a write to be durable
        self._pins: dict[Extent, int] = {}
        self._deferred: set[Extent] = set()
        self._seq = itertools.count(1)
        self._counters = dict.fromkeys(("bytes_read", "bytes_written", "reads", "writes",
                                        "corrupt_dropped", "recovered_objects",
                                        "recovery_dropped", "relocated",
                                        "relocated_bytes"), 0)
        self._engine: Engine | None = None
        self._catalog: Catalog | None = None
        try:
            if shared:
                self._shared = SharedDirectory(self.path)
                self._base = self._shared.slot << SLOT_BITS
            self._catalog = Catalog(os.path.join(self.path, CATALOG_DIR))
            self.segment_bytes = self._geometry(segment_bytes, capacity_bytes)
            self._engine = (engine if isinstance(engine, Engine)
                            else select_engine(engine, io_threads))
            self._alloc = SlabAllocator(
                budget_bytes=capacity_bytes, arena_bytes=self.segment_bytes, alignment=ALIGN,
                on_new_arena=lambda arena, n: self._create_segment(self._base | arena, n),
                on_release_arena=lambda arena: self._remove_segment(self._base | arena),
                on_grow_arena=self._grow_segment)
            self._recover()
        except BaseException:
            self._teardown()
            raise
        self._jobs = ThreadPoolExecutor(io_threads, thread_name_prefix="hs-disk")
        self._grower = ThreadPoolExecutor(1, thread_name_prefix="hs-disk-grow")
        self._growing = False
        self._commits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="hs-disk-commit",
                                           daemon=True)
        self._committer.start()
        self._stop_sync = threading.Event()
        if self._shared is not None:
            self._syncer = threading.Thread(target=self._sync_loop, args=(sync_interval_s,),
                                            name="hs-disk-sync", daemon=True)
            self._syncer.start()

    # -- capacity -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The budget; while the file system is full (it refused a segment room less than
        :data:`FULL_RECHECK_S` ago), only the bytes the segments have grown to (and the
        others' objects in a shared directory): the store then evicts what a put needs
        from what is there, not a share of a budget the device cannot hold."""
        full = self._full_at
        if full is None:
            return self._capacity
        if time.monotonic() - full > FULL_RECHECK_S:
            self._full_at = None
            return self._capacity
        return min(self._capacity, self._alloc.grown_bytes + self._foreign_used)

    @property
    def used_bytes(self) -> int:
        """Slot bytes in use: this process's, and in a shared directory the slots of the
        objects it sees in the others' segments (what the directory's budget holds)."""
        return self._alloc.used_bytes + self._foreign_used

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
    @property
    def shared(self) -> SharedDirectory | None:
        """This process's slot when the directory is shared, else ``None``."""
        return self._shared

    def contains(self, key: ObjectKey) -> bool:
        # no sync here: the loader asks per page, and every read applies the log first
        # (an object another process deleted since is then not found: a typed miss)
        self._check_open()
        with self._lock:
            return bytes(key) in self._objects

    def nbytes(self, key: ObjectKey) -> int | None:
        self._check_open()
        self.sync()
        with self._lock:
            obj = self._objects.get(bytes(key))
        return None if obj is None else obj.record.length

    def meta(self, key: ObjectKey) -> bytes | None:
        self._check_open()
        self.sync()
        with self._lock:
            obj = self._objects.get(bytes(key))
        return None if obj is None else obj.record.meta

    def delete(self, key: ObjectKey) -> int:
        """Drop an object (catalog entry first, then its extent); returns the bytes freed.

        An uncommitted ``put`` of the key is cancelled too.
        """
        self._check_open()
        self.sync()
        key = ObjectKey(bytes(key))
        with self._catalog_lock:
            with self._lock:
                self._latest.pop(key, None)
                obj = self._objects.get(key)
            if obj is None:
                return 0
            _, seq = self.catalog.remove([key], log=self._log())
            with self._lock:
                self._forget(key, obj, seq)
        self._reclaim()
        return obj.extent.length

    @property
    def finds_windows(self) -> bool:
        """True unless the directory is shared: there eviction goes through the lease, one
        policy step at a time, never by window (a shared tier compacts its own segments
        with :meth:`relocate_window` instead)."""
        return self._shared is None

    def window_victims(self, nbytes: int, may_free: Callable[[ObjectKey], bool]
                       ) -> list[ObjectKey] | None:
        """The objects to delete so that one object of ``nbytes`` finds a slot, when the
        free bytes are enough but split (:meth:`SlabAllocator.window`, fewest bytes
        first): objects being written or read, and those ``may_free`` refuses, stay.
        ``None``: no such set."""
        window, owner = self._window(nbytes, may_free, idle=False)
        return None if window is None else [ObjectKey(owner[e][0]) for e in window.extents]

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        """:meth:`delete` of several keys with one catalog transaction; returns the bytes freed.

        Each catalog transaction is synchronous, so dropping objects in bulk
        (evictions) costs one ``fsync`` instead of one per object.
        """
        self._check_open()
        self.sync()
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
            _, seq = self.catalog.remove((key for key, _ in found), log=self._log())
            with self._lock:
                for key, obj in found:
                    self._forget(key, obj, seq)
        self._reclaim()
        return sum(obj.extent.length for _, obj in found)

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """While held, the committer commits what landed at once instead of gathering
        the writes still in flight (:data:`~hybridstore.backends.disk.objects.COMMIT_GATHER_S`):
        a caller is waiting for durability."""
        with self._lock:
            self._urgent += 1
        try:
            yield
        finally:
            with self._lock:
                self._urgent -= 1

    # -- a shared directory --------------------------------------------------------
    def sync(self) -> None:
        """Apply the other processes' puts and deletes to this view, then reuse the extents
        of this process's segments that nobody can be reading any more.  Nothing to do
        when the directory is not shared.  Thread-safe; cheap when nothing changed (one
        read of the log head)."""
        if self._shared is None or self._closed:
            return
        with self._catalog_lock:
            if self.catalog.log_head() != self._view:
                try:
                    changes = self.catalog.changes(self._view)
                except CatalogError as e:      # truncated past this view: cannot happen to a
                    log.error("disk tier %s: %s", self.path, e)   # live slot; start again
                    changes = []
                with self._lock:
                    for change in changes:
                        self._apply(change)
                    if changes:
                        self._view = changes[-1].seq
                        if self._tombstones:   # no change below the view is left to apply
                            self._tombstones = {k: d for k, d in self._tombstones.items()
                                                if d > self._view}
                self._shared.applied(self._view)
                if self._view - self._truncated >= 4096:
                    self._truncated = self._shared.truncatable(self._view)
                    self.catalog.truncate_log(self._truncated)
            self._reclaim()

    def _apply(self, change: Change) -> None:
        """One change of another process (under both locks)."""
        me = self._base >> SLOT_BITS
        if change.slot == me:
            return                          # applied when it was made
        key = change.key
        if self._tombstones.get(key, 0) > change.seq:
            return                          # this process deleted the key after it
        old = self._objects.get(key)
        if old is not None and old.seq > change.seq:
            return                          # this view holds a newer version already
        rec = change.record
        if change.op == PUT and rec is not None and slot_of(rec.segment) == change.slot:
            self._objects[key] = _Object(Extent(rec.segment, rec.offset, rec.slot_length), rec,
                                         change.seq)
            self._foreign_used += rec.slot_length
            self._changes.append((PUT, key, rec.length, rec.meta))
        elif old is not None:
            del self._objects[key]
            self._changes.append((change.op, key, old.record.length, b""))
        if old is not None:
            self._release(old.extent, change.seq)

    def _reclaim(self) -> None:
        """Free the quarantined extents whose deletion no live reader can predate: a read
        in flight planned at view ``v`` may still read what changes after ``v`` freed."""
        if self._shared is None:
            return
        with self._lock:
            if not self._quarantine:
                return
            oldest = self._shared.oldest_reading()
            keep = []
            for seq, extent in self._quarantine:
                if oldest is not None and oldest < seq:
                    keep.append((seq, extent))
                else:
                    self._release(extent)
            freed = len(keep) < len(self._quarantine)
            self._quarantine = keep
        if freed:
            self._alloc.trim()      # emptied segments go back to the directory's budget

    def visible(self, keys: Iterable[bytes]) -> dict[bytes, tuple[int, bytes]]:
        """``(nbytes, meta)`` of those of ``keys`` visible in this view now (no sync: what
        :meth:`take_changes` reported is checked against the same view)."""
        with self._lock:
            found = ((bytes(k), self._objects.get(bytes(k))) for k in keys)
            return {k: (obj.record.length, obj.record.meta) for k, obj in found
                    if obj is not None}

    def take_changes(self) -> list[tuple[int, bytes, int, bytes]]:
        """The other processes' changes applied since the last call, oldest first:
        ``(op, key, nbytes, meta)`` with ``op`` :data:`~hybridstore.backends.catalog.PUT`
        (visible now) or ``DELETE`` (gone); a store applies them to its index."""
        self.sync()
        with self._lock:
            out, self._changes = self._changes, []
        return out

    def _sync_loop(self, interval_s: float) -> None:
        while not self._stop_sync.wait(interval_s):
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.warning("disk tier %s: applying the other processes' changes failed: %s",
                            self.path, e)

    def _enter_read(self) -> int:
        """A read starts: publish the view it is planned at, then apply the log (so an
        object deleted before now is no longer found); returns the token for
        :meth:`_leave_read`."""
        if self._shared is None:
            return 0
        view = self._view
        self._shared.begin_read(view)
        try:
            self.sync()
        except BaseException:
            self._shared.end_read(view)
            raise
        return view

    def _leave_read(self, view: int) -> None:
        if self._shared is not None:
            self._shared.end_read(view)

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        self._check_open()
        self.sync()
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
            if self._shared is not None:
                out.update(slot=self._shared.slot, log_applied=self._view,
                           quarantined=len(self._quarantine))
        out.update(engine=self.engine.name, engine_compat=float(self.engine.compat_mode),
                   used_bytes=self.used_bytes, capacity_bytes=self._capacity,
                   committed_bytes=self._alloc.committed_bytes,
                   grown_bytes=self._alloc.grown_bytes, device_full=self._full_at is not None,
                   segments=self._alloc.arena_count)
        return out

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight reads and writes, then close files, catalog and the lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_sync.set()
        self._jobs.shutdown(wait=True)
        self._grower.shutdown(wait=True)
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
        if self._shared is not None:
            self._shared.close()
        for fd in self._lock_fds:
            os.close(fd)  # releases the flocks

    # -- extents and pins (call with self._lock held) ------------------------------
    def _release(self, extent: Extent, seq: int | None = None) -> None:
        """An object left this extent (``seq``: the change-log number of its deletion or
        replacement, in a shared directory): reuse it once nobody can be reading it."""
        if not self._mine(extent.arena):
            self._foreign_used -= extent.length
            return                      # another process's segment: its owner reuses it
        if self._shared is not None and seq:
            self._quarantine.append((seq, extent))
        elif self._pins.get(extent):
            self._deferred.add(extent)
        else:
            self._alloc.free(self._local(extent))

    def _forget(self, key: bytes, obj: _Object, seq: int) -> None:
        """This process deleted ``key`` (its version ``obj``) from the catalog at change
        ``seq`` (lock held): drop it from the view and release its extent after ``seq``.

        In a shared directory ``seq`` is never 0 there: when the key had already left the
        catalog (another process deleted or replaced it after this view) it is the log's
        head, and readers planned before that may still read the extent, so it is not
        reused at once (the kill campaign found reads failing their checksum, and a segment
        file removed under a reader, from that).  And another process's change of the key
        logged before ``seq`` and not yet applied here must stay unapplied: it would bring
        back an object the catalog no longer holds, whose extent its owner reuses (the
        campaign read such phantoms again and again).  A tombstone keeps it out until the
        view passes ``seq``."""
        del self._objects[key]
        self._release(obj.extent, seq)
        if self._shared is not None and seq:
            self._tombstones[key] = max(seq, self._tombstones.get(key, 0))

    def _mine(self, segment: int) -> bool:
        """Whether a segment is this process's (every one is, unless the directory is shared)."""
        return slot_of(segment) == self._base >> SLOT_BITS

    def _own(self, extent: Extent) -> Extent:
        """An extent of this process's allocator with its segment's global id."""
        return Extent(self._base | extent.arena, extent.offset, extent.length)

    def _local(self, extent: Extent) -> Extent:
        """:meth:`_own` undone."""
        return Extent(extent.arena & ((1 << SLOT_BITS) - 1), extent.offset, extent.length)

    def _log(self) -> int | None:
        """The slot to log changes under (a shared directory), else ``None``."""
        return None if self._shared is None else self._shared.slot

    def _file(self, segment: int) -> Any:
        """The engine handle of a segment.  Another process's segment is opened on first
        use, and again when its owner removed the file and made a new one of that id (a
        handle of the old file would read what it held); the object being read keeps the
        file it is in from being removed meanwhile (its extent is not reused)."""
        if self._mine(segment):
            return self._files[segment]
        path = self._segment_path(segment)
        try:
            inode = os.stat(path).st_ino
        except OSError as e:
            raise BackendIOError(f"segment {path} of another process is gone ({e.strerror}); "
                                 "the object was deleted meanwhile") from e
        with self._open_lock:
            handle = self._files.get(segment)
            if handle is None or self._inodes.get(segment) != inode:
                if handle is not None:
                    self.engine.close_file(handle)
                handle = self._files[segment] = self.engine.open(path)
                self._inodes[segment] = inode
        return handle

    def _unpin(self, extent: Extent) -> None:
        self._unpin_many((extent,))

    def _unpin_many(self, extents: Iterable[Extent]) -> None:
        """Drop one read pin of each extent (one lock hold); an extent freed while it was
        read is given back to the allocator when its last pin goes."""
        with self._lock:
            for extent in extents:
                left = self._pins[extent] - 1
                if left:
                    self._pins[extent] = left
                    continue
                del self._pins[extent]
                if extent in self._deferred:
                    self._deferred.discard(extent)
                    self._alloc.free(self._local(extent))

    # -- segments (allocator callbacks, under the allocator's lock) -----------------
    def _maybe_grow_ahead(self) -> None:
        """After an allocation: when less than half a segment is left free in the segments
        that exist and the budget allows another, create it now on a background thread
        (:meth:`SlabAllocator.grow_ahead`), so that no put waits inside the allocator for
        a new segment's file and catalog transaction (~0.2 s on the development VM during
        a burst of writes).  Not in a shared directory, whose budget other processes
        draw on too."""
        if self._shared is not None or self._growing or self._closed or self._full_at:
            return                  # (a full device: no empty segment files meanwhile)
        alloc = self._alloc
        if alloc.committed_bytes >= self._capacity or \
                alloc.committed_bytes - alloc.used_bytes >= self.segment_bytes // 2:
            return
        self._growing = True
        try:
            self._grower.submit(self._grow_ahead)
        except RuntimeError:        # closing
            self._growing = False

    def _grow_ahead(self) -> None:
        try:
            self._alloc.grow_ahead(self.segment_bytes // 2)
        except Exception as e:  # noqa: BLE001 - the next put that needs it tries again
            log.warning("disk tier %s: creating the next segment ahead failed: %s", self.path, e)
        finally:
            self._growing = False

    def _segment_path(self, segment: int) -> str:
        return os.path.join(self.path, segment_name(segment))

    def _create_segment(self, segment: int, nbytes: int) -> None:
        """Create (or, reopening, open) a segment file of up to ``nbytes``, admitted against
        the budget in the catalog.  A new file is empty: :meth:`_grow_segment` reserves its
        blocks as objects need them.  In a shared directory the catalog charges a segment
        its grown bytes, so a process's segment that its objects fill only in part leaves
        the rest of the budget to the others (a process joining a directory whose budget is
        below processes x segment size finds room without evicting every other process's
        objects); an exclusive tier charges it whole."""
        path = self._segment_path(segment)
        new = not os.path.exists(path)
        charged = 0 if self._shared is not None else nbytes
        if not self.catalog.add_segment(segment, charged, self._capacity if new else None):
            raise self._over_budget(nbytes)
        try:
            self._open_segment(segment, path)
        except BaseException:
            if new:
                self.catalog.remove_segments([segment])
            raise

    def _over_budget(self, nbytes: int) -> CapacityError:
        """The budget is committed (in a shared directory, perhaps by the others): say so,
        once per process that holds no room of its own, since making room then evicts the
        others' objects."""
        msg = (f"the disk tier at {self.path} has no room for {nbytes} more bytes of "
               f"segments: the processes that share it have committed its "
               f"{self._capacity}-byte budget; evict objects and retry")
        if self._shared is not None and not self._alloc.grown_bytes and not self._starved:
            self._starved = True
            log.warning("%s (this process holds none of it: its puts evict the other "
                        "processes' objects in the policy's order; raise disk_bytes)", msg)
        return CapacityError(msg)

    def _open_segment(self, segment: int, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.close(fd)
            fsync_path(self.path)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full(f"no room for a new segment file ({e.strerror})") from e
            raise BackendIOError(f"cannot create segment {path}: {e.strerror}; free space on "
                                 "the device or lower disk_bytes") from e
        self._files[segment] = self.engine.open(path)

    def _grow_segment(self, arena: int, limit: int, need: int, size: int) -> int:
        """The allocator's ``on_grow_arena`` (its lock held): reserve the blocks of this
        process's segment ``arena`` up to at least ``need`` (it holds ``limit`` now, of
        ``size``), twice its size at a time; returns its new size.  A full file system (or
        shared budget) gets only what is needed, else :class:`DiskFullError`
        (:class:`CapacityError`): nothing changes, and on a full file system the tier holds
        what its grown segments hold for :data:`FULL_RECHECK_S`."""
        segment = self._base | arena
        least = round_up(need, ALIGN)
        try:
            held = os.stat(self._segment_path(segment)).st_size // ALIGN * ALIGN
        except OSError:
            held = 0
        if held >= least:       # its blocks are there (reopening): charged, nothing to reserve
            if self._shared is not None:
                self.catalog.add_segment(segment, min(size, held), None)
            return min(size, held)
        new = min(size, max(least, limit + max(limit, GROW_MIN_BYTES)))
        for size_ in dict.fromkeys((new, least)):    # the device (or a shared budget) may
            try:                                     # have less: then the least
                self._extend_segment(segment, limit, size_)
            except _NoRoom as e:
                if size_ == least:
                    raise self._full(str(e)) from e.__cause__
                continue
            except CapacityError:
                if size_ == least:
                    raise
                continue
            self._full_at, self._full_logged = None, False
            return size_
        raise AssertionError("unreachable")

    def _extend_segment(self, segment: int, old: int, new: int) -> None:
        """Reserve blocks ``[old, new)`` of a segment file, the catalog's slack for the
        records of their objects first (a segment never takes the room the catalog needs
        to commit and delete records on a full device), and in a shared directory their
        share of the budget."""
        if not self.catalog.keep_slack((new - old) // 32):
            raise _NoRoom(f"no room for the catalog of {new - old} more bytes of segments")
        if self._shared is not None and not self.catalog.add_segment(segment, new, self._capacity):
            raise self._over_budget(new - old)
        path = self._segment_path(segment)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            try:
                _preallocate(fd, new)
            finally:
                os.close(fd)
        except OSError as e:
            if self._shared is not None:
                self.catalog.add_segment(segment, old, None)     # the budget goes back
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _NoRoom(f"no room to grow segment {path} to {new} bytes "
                              f"({e.strerror})") from e
            raise BackendIOError(f"cannot grow segment {path} to {new} bytes: {e.strerror}; "
                                 "free space on the device or lower disk_bytes") from e

    def _full(self, what: str) -> DiskFullError:
        """The file system is full: hold what is there (:attr:`capacity_bytes`), say so once."""
        self._full_at = time.monotonic()
        msg = (f"the file system under {self.path} is full: {what}; the disk tier holds "
               f"{self._alloc.grown_bytes} bytes of its {self._capacity}-byte budget and makes "
               "room among them until the device has room again; lower disk_bytes to what "
               "the device can hold")
        if not self._full_logged:
            self._full_logged = True
            log.warning("%s", msg)
        return DiskFullError(msg)

    def _remove_segment(self, segment: int) -> None:
        handle = self._files.pop(segment, None)
        if handle is not None:
            self.engine.close_file(handle)
        path = self._segment_path(segment)
        try:
            freed = os.stat(path).st_blocks
            os.unlink(path)
        except OSError as e:
            log.warning("could not remove the unused segment %s: %s", path, e.strerror)
            return
        if freed:
            self._full_at = None            # its blocks are free: growing may succeed again
        self.catalog.remove_segments([segment])


class _NoRoom(Exception):
    """The file system has no room for a segment's growth (:meth:`DiskTier._full` says so)."""


_preallocate = allocate_file
"""Reserve the blocks of a segment as it grows (a module name: tests make the device fill up
here)."""


def _validate(capacity_bytes: int, segment_bytes: int | None, io_threads: int,
              ssd_gbps: float, h2d_gbps: float) -> None:
    if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise ConfigError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
    if segment_bytes is not None and (not isinstance(segment_bytes, int)
                                      or segment_bytes < ALIGN or segment_bytes % ALIGN):
        raise ConfigError(f"segment_bytes must be a positive multiple of {ALIGN}, "
                          f"got {segment_bytes!r}")
    if not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
        raise ConfigError(f"io_threads must be an int in [1, 256], got {io_threads!r}")
    if ssd_gbps <= 0 or h2d_gbps <= 0:
        raise ConfigError("ssd_gbps and h2d_gbps must be positive")
