"""Several processes on one disk tier directory: slots, the readers' table, the eviction lease.

A process that opens a directory in shared mode (``DiskTier(shared=True)``)
holds a shared ``flock`` on ``LOCK`` (a process in exclusive mode holds it
exclusively, so the two modes never meet) and takes a **slot**: the first
``slots/slot-NNNN.lock`` it can ``flock`` exclusively.  The kernel drops the
lock when the process dies, however it dies, so a slot whose lock can be taken
is free and whatever it published is void.

* **Space.**  A slot writes only into its own segment files: segment ids
  ``slot << 20 | n`` (slot 0's are the ids an exclusive tier uses).  Every segment
  file is recorded in the catalog's ``segments`` database in the transaction that
  admits it against the directory's budget, so two processes never overlap an
  extent and never commit more than the budget between them.  Only the owner of
  a segment reuses its extents; a dead slot's segments are taken back by the next
  process that takes the slot (its recovery is the exclusive tier's).
* **Visibility.**  Every put and delete is also appended to the catalog's change
  log in the same transaction; each process applies the others' changes to its
  view (:meth:`DiskTier.sync`) before it reads, writes or lists, and a store
  applies them to its index before it matches.  A process's own delete may land
  before an older change of the same key that it has not applied yet; it keeps a
  tombstone of the key until its view passes the delete, so that change is not
  applied (it would bring back an object the catalog no longer holds).
* **Reuse.**  The owner of an extent whose object another process may still be
  reading waits: the readers' table (``slots/table``, one row of 64-bit words per
  slot, ``mmap``-ed by all) holds each live slot's *oldest view in use*, the log
  sequence number its reads in flight were planned at (stored plus one: 0 means no
  read in flight).  A read publishes its view, then applies the log (so an object
  deleted before that point is no longer found), and clears it when done.  An
  extent freed by the change numbered ``d`` is reused once no live slot publishes a
  view below ``d``.  A process that takes over a dead slot waits the same way for
  the views below its snapshot of the catalog before it reuses the slot's free space.
  Each row also holds the slot's *applied* sequence number: the log is truncated
  below the smallest one of the live slots.
* **Eviction.**  Deciding what leaves a shared tier is done by one process at a
  time: the ``EVICT.lock`` lease (:meth:`SharedDirectory.evict_lease`).  Whoever
  holds it first applies the others' changes, so it sees the room their evictions
  made before it evicts more.

The table's words are written with aligned 8-byte stores; a lock operation
between publishing a view and reading the log orders them on x86-64 (the
property the reuse rule needs).  Reads are also checked against their xxh3_64
checksum, so even without that order a reused extent could never be returned as
the object's bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator

import numpy as np

from hybridstore.errors import DiskPathError

log = logging.getLogger("hybridstore.backends.disk")

SLOT_BITS = 20
"""Segment ids of slot ``k`` are ``k << SLOT_BITS | n``."""

MAX_SLOTS = 1024
"""Processes that may share one directory at once."""

SLOTS_DIR = "slots"
EVICT_LOCK = "EVICT.lock"

_APPLIED, _READING, _PID = 0, 1, 2
_ROW_WORDS = 4
_HINT = "set disk_path to a writable directory (ideally on an NVMe SSD)"


def slot_of(segment: int) -> int:
    """The slot that owns a segment id."""
    return segment >> SLOT_BITS


class SharedDirectory:
    """This process's slot in a shared disk tier directory (see the module docstring).

    Args:
        path: the tier's directory (it exists and ``LOCK`` is held shared).

    Raises:
        DiskPathError: the slots cannot be created, or all :data:`MAX_SLOTS` are taken.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        root = os.path.join(path, SLOTS_DIR)
        self._mutex = threading.Lock()
        self._reads: dict[int, int] = {}          # view -> reads in flight planned at it
        self._lease_mutex = threading.RLock()
        self._lease_depth = 0
        self._lease_fd: int | None = None
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            self.slot, self._slot_fd = self._take_slot(root)
            self._table_fd = os.open(os.path.join(root, "table"),
                                     os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise DiskPathError(f"cannot share the disk tier directory {path!r}: "
                                f"{e.strerror or e}; {_HINT}") from e
        try:
            size = MAX_SLOTS * _ROW_WORDS * 8
            if os.fstat(self._table_fd).st_size < size:
                os.ftruncate(self._table_fd, size)
            self._map = mmap.mmap(self._table_fd, size)
        except OSError as e:
            os.close(self._table_fd)
            os.close(self._slot_fd)
            raise DiskPathError(f"cannot map the readers' table of {path!r}: {e.strerror}; "
                                f"{_HINT}") from e
        self._table = np.frombuffer(self._map, dtype=np.uint64).reshape(MAX_SLOTS, _ROW_WORDS)
        self._table[self.slot] = 0
        self._table[self.slot, _PID] = os.getpid()
        self._root = root
        self._closed = False

    @staticmethod
    def _take_slot(root: str) -> tuple[int, int]:
        for slot in range(MAX_SLOTS):
            fd = os.open(os.path.join(root, f"slot-{slot:04d}.lock"),
                         os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    continue
                raise
            return slot, fd
        raise DiskPathError(f"all {MAX_SLOTS} slots of the shared disk tier directory "
                            f"{os.path.dirname(root)!r} are taken; close some stores")

    # -- liveness ---------------------------------------------------------------------
    def live(self, slot: int) -> bool:
        """Whether a process holds ``slot`` now (its lock cannot be taken)."""
        if slot == self.slot:
            return True
        try:
            fd = os.open(os.path.join(self._root, f"slot-{slot:04d}.lock"),
                         os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)                     # closing drops the probe's lock
        return False

    def _live_rows(self) -> Iterator[int]:
        """Slots other than this one whose row says something, and that are live.  A dead
        slot's row is skipped, never cleared: a process may take the slot over between
        the probe and the write, and its row is its own (it resets it when it takes it)."""
        for slot in np.flatnonzero(self._table[:, _PID]).tolist():
            if slot != self.slot and self.live(slot):
                yield slot

    def peers(self) -> int:
        """How many other live processes share the directory now."""
        return sum(1 for _ in self._live_rows())

    # -- views --------------------------------------------------------------------------
    def applied(self, seq: int) -> None:
        """Publish that this process has applied the log up to ``seq``."""
        self._table[self.slot, _APPLIED] = seq

    def truncatable(self, mine: int) -> int:
        """The log sequence number every live slot has applied (``mine`` for this one)."""
        low = mine
        for slot in self._live_rows():
            low = min(low, int(self._table[slot, _APPLIED]))
        return low

    def begin_read(self, view: int) -> None:
        """A read planned at ``view`` starts: publish it (the oldest in flight wins)."""
        with self._mutex:
            self._reads[view] = self._reads.get(view, 0) + 1
            self._table[self.slot, _READING] = min(self._reads) + 1
        # a lock round trip: a full barrier on x86-64, so the view is visible to every
        # process before this one reads the log (see the module docstring)
        with self._mutex:
            pass

    def end_read(self, view: int) -> None:
        """The read planned at ``view`` is done."""
        with self._mutex:
            left = self._reads[view] - 1
            if left:
                self._reads[view] = left
            else:
                del self._reads[view]
            self._table[self.slot, _READING] = min(self._reads) + 1 if self._reads else 0

    def oldest_reading(self) -> int | None:
        """The oldest view a live slot other than this one has reads in flight at
        (``None``: none has): an extent freed by a change numbered above it may still be
        read.  Slots with no read in flight cost nothing to check."""
        oldest = None
        for slot in np.flatnonzero(self._table[:, _READING]).tolist():
            if slot == self.slot:
                continue
            reading = int(self._table[slot, _READING]) - 1     # 0 in the table: none
            if reading < 0 or not self.live(slot):
                continue
            oldest = reading if oldest is None else min(oldest, reading)
        return oldest

    def await_readers(self, seq: int, timeout_s: float = 10.0) -> bool:
        """Wait until no live slot has a read in flight planned before change ``seq``
        (what a process taking over a slot waits for before it reuses the slot's free
        space, which changes up to ``seq`` freed).  ``False`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            oldest = self.oldest_reading()
            if oldest is None or oldest >= seq:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    # -- the eviction lease -------------------------------------------------------------
    @contextlib.contextmanager
    def evict_lease(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Hold the directory's eviction lease (re-entrant within this process).  A process
        that waited ``timeout_s`` for it goes on without it, with a warning: a stuck
        holder must not stop every other process's puts."""
        with self._lease_mutex:
            self._lease_depth += 1
            try:
                if self._lease_depth == 1:
                    self._lease_fd = self._take_lease(timeout_s)
                yield
            finally:
                self._lease_depth -= 1
                if self._lease_depth == 0 and self._lease_fd is not None:
                    os.close(self._lease_fd)         # closing drops the flock
                    self._lease_fd = None

    def _take_lease(self, timeout_s: float) -> int | None:
        fd = os.open(os.path.join(self.path, EVICT_LOCK),
                     os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    log.warning("disk tier %s: the eviction lease was held for %.0f s by "
                                "another process; evicting without it", self.path, timeout_s)
                    return None
                time.sleep(0.002)

    def close(self) -> None:
        """Clear this slot's row and give the slot back."""
        if self._closed:
            return
        self._closed = True
        self._table[self.slot] = 0
        del self._table
        self._map.close()
        os.close(self._table_fd)
        os.close(self._slot_fd)


__all__ = ["EVICT_LOCK", "MAX_SLOTS", "SLOTS_DIR", "SLOT_BITS", "SharedDirectory", "slot_of"]
