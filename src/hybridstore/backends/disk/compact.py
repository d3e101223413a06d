"""The disk tier's compaction: empty a window of a segment by moving its objects elsewhere.

A tier whose free bytes suffice for a put but are split (small slots left between
the objects that eviction spared, in the policy's order) has two ways to make one
slot contiguous: evict the live objects of the cheapest window whatever the
policy thinks of them (:meth:`~hybridstore.backends.disk.DiskTier.window_victims`),
or move them into free slots outside the window and keep them.  Moving costs one
read and one write of at most the window's live bytes (under one slot's size) and
loses nothing, which is what a file-per-object store such as SGLang's
``HiCacheFile`` gets from its file system for free.

A move is a new version of the object's key written at the new extent: the same
write path, ``fdatasync`` and catalog commit as a put, so a crash leaves either the
old or the new version visible, never neither.  A delete or a newer put of the key
while the move is in flight wins (the move's write is then stale and its extent is
freed at commit, as for any superseded put), and a reader of the old extent keeps
it until it is done (the usual pins).  In a directory shared by several processes a
process moves only the objects of its own segments, each move commits only while the
catalog still holds the record it read (another process's put or delete of the key
meanwhile wins), and the other processes' reads keep the old extent through the reuse
rule of ``shared.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from hybridstore.backends.alloc import Extent, Window
from hybridstore.backends.disk.objects import _Object, _PendingWrite, _TierState
from hybridstore.errors import CorruptObjectError
from hybridstore.objects import ObjectKey, aligned_empty

log = logging.getLogger("hybridstore.backends.disk")


class _Compaction(_TierState):
    """Part of :class:`~hybridstore.backends.disk.DiskTier`: :meth:`relocate_window`."""

    if TYPE_CHECKING:
        def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                           offsets: Sequence[int]) -> Future: ...

        def _begin_write(self, key: bytes, extent: Extent, view: np.ndarray, nbytes: int,
                         meta: bytes) -> _PendingWrite: ...

        def _write_job(self, p: _PendingWrite) -> None: ...

        def urgent(self) -> contextlib.AbstractContextManager[None]: ...

    def relocate_window(self, nbytes: int, may_move: Callable[[ObjectKey], bool]) -> int | None:
        """Make room for one object of ``nbytes`` by moving the objects of the cheapest
        window (:meth:`~hybridstore.backends.alloc.SlabAllocator.window_at`, fewest live
        bytes) into free slots outside it; returns once the moves are durable.

        Objects being written or read stay where they are, as do those ``may_move``
        refuses (windows holding one are skipped).  The window is read with one
        coalesced read.  An object replaced meanwhile is not moved; when one was deleted
        or fails its read (it is dropped as any corrupt object is) nothing moves.

        In a shared directory the window lies in this process's segments (only it writes
        them); a move commits only while the catalog still holds the record it read
        (another process's put or delete of the key meanwhile wins), and readers in other
        processes keep the old extent until they are done (the reuse rule).

        Returns:
            Bytes moved (0: the window was free already); ``None`` when no window can
            be emptied this way (too little room outside it).
        """
        self._check_open()
        window, owner = self._window(nbytes, may_move, idle=True)
        if window is None:
            return None
        if not window.extents:
            return 0
        targets = self._alloc.alloc_outside(window)
        if targets is None:
            return None
        # one read of the window: its objects lie spaced like their slots (read_many_into
        # coalesces neighbours and checks each checksum)
        base = min(e.offset for e in window.extents)
        buf = aligned_empty(max(e.offset + e.length for e in window.extents) - base)
        keys = [ObjectKey(owner[e][0]) for e in window.extents]
        try:
            self.read_many_into(keys, buf, [e.offset - base for e in window.extents]).result()
        except (KeyError, CorruptObjectError):   # deleted meanwhile, or dropped as corrupt
            for new in targets:
                self._alloc.free(new)
            return None
        moves: list[Future] = []
        moved = 0
        for old, new in zip(window.extents, targets):
            key, obj = owner[old]
            at = old.offset - base
            pending = self._move(key, obj, self._own(new), buf[at:at + obj.record.length])
            if pending is None:
                self._alloc.free(new)
                continue
            moves.append(pending.future)
            moved += old.length
        with self.urgent():
            for fut in moves:
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - the object stays where it was
                    log.warning("disk tier %s: moving an object failed (%s); it stays",
                                self.path, e)
        with self._lock:
            self._counters["relocated"] += len(moves)
            self._counters["relocated_bytes"] += moved
        return moved

    def _window(self, nbytes: int, allowed: Callable[[ObjectKey], bool], *, idle: bool
                ) -> tuple[Window | None, dict[Extent, tuple[bytes, _Object]]]:
        """The cheapest window for ``nbytes`` (:meth:`SlabAllocator.window_at`) whose objects
        nobody reads (nor writes, when ``idle``) and ``allowed`` accepts, and the objects of
        this process's segments by (local) extent."""
        with self._lock:            # in a shared directory, this process's segments only
            owner = {self._local(obj.extent): (key, obj) for key, obj in self._objects.items()
                     if self._mine(obj.extent.arena)}
            busy = {self._local(extent) for extent in self._pins if self._mine(extent.arena)}
            writing = set(self._latest) if idle else set()

        def movable(extent: Extent) -> bool:
            found = owner.get(extent)
            return (found is not None and extent not in busy and found[0] not in writing
                    and allowed(ObjectKey(found[0])))

        return self._alloc.window_at(nbytes, movable), owner

    def _move(self, key: bytes, obj: _Object, extent: Extent, data: np.ndarray
              ) -> _PendingWrite | None:
        """Write ``data`` (``key``'s bytes as read) at ``extent`` as its next version; ``None``
        (nothing submitted) when it is no longer the version ``obj`` or a write of it is in
        flight."""
        with self._lock:
            if self._objects.get(key) is not obj or key in self._latest or self._closed:
                return None
            pending = self._begin_write(key, extent, data, obj.record.length, obj.record.meta)
            if self._shared is not None:
                pending.replaces = obj.record
        self._jobs.submit(self._write_job, pending)
        return pending
