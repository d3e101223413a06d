"""Opening a disk tier: the directory lock, the segment geometry, recovery from the catalog.

The catalog is the truth.  Every entry whose segment file exists and is long
enough is visible again, and reserved in a fresh allocator when its segment is
this process's (in a shared directory, the segments of its slot; the others'
objects are visible, their space is their owners'); others are dropped with a
logged reason.  This process's segment files that no surviving entry uses are
removed, and the catalog's record of segments is brought in line with the files.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import stat
import struct

from hybridstore.backends.alloc import Extent
from hybridstore.backends.catalog import CatalogRecord
from hybridstore.backends.disk.objects import (
    LOCK_NAME,
    _Object,
    _TierState,
    checksum,
    segment_bytes_for,
)
from hybridstore.backends.engines import ALIGN
from hybridstore.errors import CapacityError, DiskPathError
from hybridstore.objects import OBJECT_KEY_BYTES

log = logging.getLogger("hybridstore.backends.disk")

_GEOMETRY = struct.Struct("<Q")  # segment_bytes, stored as catalog info "disk.geometry"


class _Recovery(_TierState):
    """Part of :class:`~hybridstore.backends.disk.DiskTier`: what reopening a tier does."""

    # -- open / recovery ----------------------------------------------------------
    def _geometry(self, segment_bytes: int | None, capacity_bytes: int) -> int:
        """The segment size: the one the tier was created with, else ``segment_bytes``,
        else :func:`~hybridstore.backends.disk.objects.segment_bytes_for` the budget."""
        wanted = segment_bytes_for(capacity_bytes) if segment_bytes is None else segment_bytes
        raw = self.catalog.get_info("disk.geometry")
        stored = _GEOMETRY.unpack(raw)[0] if raw is not None and len(raw) == _GEOMETRY.size \
            else 0
        if raw is not None and (stored < ALIGN or stored % ALIGN or stored > 1 << 50):
            # damaged: the configured size (objects of segments made otherwise are dropped,
            # each with a reason, when their extents do not fit it)
            log.warning("disk tier %s: the geometry record is damaged (%r); using "
                        "segment_bytes=%d", self.path, raw[:16], wanted)
            raw = None
        if raw is None:
            self.catalog.put_info("disk.geometry", _GEOMETRY.pack(wanted))
            return wanted
        if segment_bytes is not None and stored != segment_bytes:
            log.warning("disk tier %s was created with segment_bytes=%d; keeping it (asked for "
                        "%d)", self.path, stored, segment_bytes)
        return int(stored)

    def _recover(self) -> None:
        """Make every sound catalog entry visible again; drop the rest with a reason."""
        dropped: list[bytes] = []
        damaged: list[tuple[bytes, str]] = []
        self._view, items = self.catalog.snapshot(damaged)
        if self._shared is not None:
            self._shared.applied(self._view)
            # this slot's free space may hold objects that others still read (deleted
            # after the slot's last owner died, read at views from before): wait for them
            if not self._shared.await_readers(self._view):
                log.warning("disk tier %s: another process has held a read for 10 s; "
                            "taking slot %d over anyway (its checksums guard it)", self.path,
                            self._shared.slot)
        checked = [(key, rec, self._check_record(key, rec)) for key, rec in items]
        claims = self._overlapping([(key, rec) for key, rec, reason in checked if reason is None])
        for key, rec, reason in checked:
            reason = reason or claims.get(key)
            if reason is None:
                extent = Extent(rec.segment, rec.offset, rec.slot_length)
                try:
                    if self._mine(rec.segment):
                        self._alloc.reserve(self._local(extent))
                except (ValueError, CapacityError) as e:
                    reason = f"its extent cannot be reserved ({e})"
                else:
                    self._objects[key] = _Object(extent, rec)
                    if not self._mine(rec.segment):
                        self._foreign_used += rec.slot_length
            if reason is not None:
                log.warning("disk tier %s: dropping object %s from the catalog: %s",
                            self.path, key.hex(), reason)
                dropped.append(key)
        for key, reason in damaged:
            log.warning("disk tier %s: dropping object %s from the catalog: its record is "
                        "damaged (%s)", self.path, key.hex(), reason)
            dropped.append(key)
        self.catalog.remove(dropped, log=self._log())
        self._counters["recovered_objects"] = len(self._objects)
        self._counters["recovery_dropped"] = len(dropped)
        self._remove_orphan_segments()
        self._reconcile_segments()

    def _overlapping(self, records: list[tuple[bytes, CatalogRecord]]) -> dict[bytes, str]:
        """Records whose slots overlap (a damaged record claims another object's slot): of
        each overlapping group, the records whose bytes pass their checksum are kept (in
        offset order, while they do not overlap one kept), the others lose.  Returns the
        losers' reasons by key.  Reads only the records of an overlap."""
        by_segment: dict[int, list[tuple[int, int, bytes, CatalogRecord]]] = {}
        for key, rec in records:
            by_segment.setdefault(rec.segment, []).append(
                (rec.offset, rec.offset + max(rec.slot_length, rec.length), key, rec))
        losers: dict[bytes, str] = {}
        for items in by_segment.values():
            items.sort(key=lambda item: (item[0], item[1], item[2]))
            group: list[tuple[int, int, bytes, CatalogRecord]] = []
            end = -1
            for item in items + [(1 << 64, 1 << 64, b"", items[0][3])]:
                if item[0] >= end:
                    if len(group) > 1:
                        losers.update(self._resolve(group))
                    group, end = [item], item[1]
                else:
                    group.append(item)
                    end = max(end, item[1])
        return losers

    def _resolve(self, group: list[tuple[int, int, bytes, CatalogRecord]]) -> dict[bytes, str]:
        """The losers of one group of overlapping records (in offset order).

        Records whose bytes fail their checksum lose.  Of those that pass, one whose slot
        (not its bytes) reaches into the bytes of a later one has a damaged slot length:
        it loses alone (were it kept, every object its slot covers would lose).  The
        rest are kept in offset order while they overlap none kept."""
        losers = {}
        real = []
        for item in group:
            if self._genuine(item[3]):
                real.append(item)
            else:
                losers[item[2]] = ("its slot overlaps another object's and its bytes fail "
                                   "its checksum")
        starts = [start for start, _, _, _ in real]
        kept: list[tuple[int, int]] = []
        for start, end, key, rec in real:
            after = bisect.bisect_left(starts, start + rec.length)   # the next bytes past its own
            if after < len(real) and starts[after] < end:
                losers[key] = (f"its slot of {rec.slot_length} bytes reaches into another "
                               "object's bytes that pass their checksum (a damaged record)")
            elif any(s < end and start < e for s, e in kept):
                losers[key] = "its slot overlaps another object's that passes its checksum"
            else:
                kept.append((start, end))
        return losers

    def _genuine(self, rec: CatalogRecord) -> bool:
        """Whether the bytes a record points at pass its checksum."""
        try:
            with open(self._segment_path(rec.segment), "rb") as fh:
                fh.seek(rec.offset)
                data = fh.read(rec.length)
        except OSError:
            return False
        return len(data) == rec.length and checksum(data) == rec.checksum

    def _check_record(self, key: bytes, rec: CatalogRecord) -> str | None:
        if len(key) != OBJECT_KEY_BYTES:
            return f"its key has {len(key)} bytes, not {OBJECT_KEY_BYTES}"
        if not 0 < rec.length <= rec.slot_length or rec.offset % ALIGN:
            return f"its record is malformed ({rec.length} bytes in a {rec.slot_length}-byte " \
                   f"slot at offset {rec.offset})"
        path = self._segment_path(rec.segment)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return f"its segment file {path} is missing"
        if size < rec.offset + rec.length:
            return (f"its segment file {path} is {size} bytes, too short for "
                    f"{rec.length} bytes at offset {rec.offset} (torn or truncated)")
        return None

    def _remove_orphan_segments(self) -> None:
        """Delete segment files that no surviving object uses (torn writes' leftovers): this
        process's, and in an exclusive directory the dead slots' too."""
        live = {self._base | arena for arena in self._alloc.arena_sizes()}
        live |= {obj.record.segment for obj in self._objects.values()}
        for name in os.listdir(self.path):
            if not (name.startswith("seg-") and name.endswith(".dat")):
                continue
            try:
                segment = int(name[4:-4])
            except ValueError:
                continue
            if segment not in live and (self._mine(segment) or self._shared is None):
                log.info("disk tier %s: removing unused segment %s", self.path, name)
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError as e:
                    log.warning("could not remove %s: %s", name, e.strerror)


    def _reconcile_segments(self) -> None:
        """Make the catalog's record of segments (the directory's committed bytes) match
        this process's segment files, and forget the files that are gone."""
        recorded = self.catalog.segments()
        sizes = self._alloc.arena_sizes(grown=self._shared is not None)  # what is charged
        own = {self._base | arena: size for arena, size in sizes.items()}
        stale = [seg for seg in recorded
                 if seg not in own and (self._mine(seg)
                                        or not os.path.exists(self._segment_path(seg)))]
        self.catalog.remove_segments(stale)
        for seg, size in own.items():
            if recorded.get(seg) != size:
                self.catalog.add_segment(seg, size, None)


def _lock_directory(path: str, shared: bool = False) -> tuple[int, int]:
    """Create ``path`` (owner-only, see :func:`_owner_only`) and hold a flock on it
    (shared: by every process of a shared directory; else exclusive); returns the fds
    held, closed to unlock.

    The lock is taken on the directory itself, which a stray ``rm LOCK`` cannot take
    away (a lock on the file alone would then be on an orphan inode, and a second
    process would create a new LOCK and get in), and on its LOCK file too, as earlier
    versions take it, so that they and this one still exclude each other; the LOCK
    file names the holder's process id."""
    hint = "set disk_path to a writable directory (ideally on an NVMe SSD)"
    fds: list[int] = []
    try:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)     # owner-only: tenants' prefixes
            fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)))
            _owner_only(path, fds[0])
            fds.append(os.open(os.path.join(path, LOCK_NAME),
                               os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600))
        except DiskPathError:
            raise
        except OSError as e:
            raise DiskPathError(f"cannot use {path!r} as the disk tier directory: "
                                f"{e.strerror or e}; {hint}") from e
        for fd in fds:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as e:
                busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
                if fd == fds[0] and not busy:   # e.g. NFS, whose flock wants a writable fd
                    log.warning("cannot lock the directory %s itself (%s); relying on its "
                                "LOCK file alone", path, e.strerror)
                    continue
                holder = os.pread(fds[1], 32, 0).decode(errors="replace").strip() or "unknown"
                if busy:
                    how = ("by a store that does not share it" if shared else "by another store")
                    raise DiskPathError(f"the disk tier directory {path!r} is in use {how} "
                                        f"(process {holder}); close that store, open every "
                                        "process with disk_shared=True, or give each process "
                                        "its own disk_path") from e
                raise DiskPathError(f"cannot lock {path!r}: {e.strerror}; {hint}") from e
        if not shared:
            try:
                os.ftruncate(fds[1], 0)
                os.pwrite(fds[1], f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                raise DiskPathError(f"cannot write to {path!r}: {e.strerror}; {hint}") from e
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], fds[1]


def _owner_only(path: str, fd: int) -> None:
    """Make the directory open as ``fd`` owner-only (0700), as the store creates it.

    A directory the store did not create may grant group or others access: with
    write access they could replace the catalog or a segment file (files are 0600,
    but a directory's writers may rename and unlink them) and have forged bytes
    loaded.  One this process owns is tightened to 0700, with a warning; a shared
    scratch directory (sticky bit, like ``/tmp``) or one of another user that others
    may write is refused (:class:`~hybridstore.errors.DiskPathError`): the store
    changes no permissions but its own directory's.
    """
    st = os.fstat(fd)
    if not st.st_mode & 0o077:
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        os.fchmod(fd, mode & ~0o077)
        log.warning("disk_path %r was mode %04o; made it owner-only (0700): the store's "
                    "directory holds every tenant's prefixes", path, mode)
        return
    if st.st_mode & 0o022 or st.st_mode & stat.S_ISVTX:
        raise DiskPathError(f"disk_path {path!r} is mode {mode:04o}, owned by uid "
                            f"{st.st_uid}: other users may replace the store's files in it; "
                            "give the store a directory of its own (it creates one 0700), "
                            f"or chmod 700 {path!r} as its owner")
