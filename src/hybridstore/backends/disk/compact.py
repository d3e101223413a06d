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
it until it is done (the usual pins).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from hybridstore.backends.alloc import Extent, Window
from hybridstore.backends.disk.objects import _Object, _PendingWrite, _TierState
from hybridstore.errors import CorruptObjectError
from hybridstore.objects import ObjectKey

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("hybridstore.backends.disk")


class _Compaction(_TierState):
    """Part of :class:`~hybridstore.backends.disk.DiskTier`: :meth:`relocate_window`."""

    if TYPE_CHECKING:
        def get(self, key: ObjectKey) -> np.ndarray: ...

        def _write_job(self, p: _PendingWrite) -> None: ...

        def urgent(self) -> contextlib.AbstractContextManager[None]: ...

    def relocate_window(self, nbytes: int, may_move: Callable[[ObjectKey], bool]) -> int | None:
        """Make room for one object of ``nbytes`` by moving the objects of the cheapest
        window (:meth:`~hybridstore.backends.alloc.SlabAllocator.window_at`, fewest live
        bytes) into free slots outside it; returns once the moves are durable.

        Objects being written or read stay where they are, as do those ``may_move``
        refuses (windows holding one are skipped).  An object deleted or replaced
        meanwhile is not moved; one that fails its read is dropped as any corrupt
        object is.

        Returns:
            Bytes moved (0: the window was free already); ``None`` when no window can
            be emptied this way (too little room outside it, or a shared directory,
            whose segments other processes fill too).
        """
        self._check_open()
        if self._shared is not None:
            return None
        window, owner = self._window(nbytes, may_move, idle=True)
        if window is None:
            return None
        if not window.extents:
            return 0
        targets = self._alloc.alloc_outside(window)
        if targets is None:
            return None
        moves: list[Future] = []
        moved = 0
        for old, new in zip(window.extents, targets):
            key, obj = owner[old]
            pending = self._move(key, obj, self._own(new))
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
        with self._lock:
            owner = {self._local(obj.extent): (key, obj) for key, obj in self._objects.items()}
            busy = {self._local(extent) for extent in self._pins}
            writing = set(self._latest) if idle else set()

        def movable(extent: Extent) -> bool:
            found = owner.get(extent)
            return (found is not None and extent not in busy and found[0] not in writing
                    and allowed(ObjectKey(found[0])))

        return self._alloc.window_at(nbytes, movable), owner

    def _move(self, key: bytes, obj: _Object, extent: Extent) -> _PendingWrite | None:
        """Read ``key`` and write it at ``extent`` as its next version; ``None`` (nothing
        submitted) when it is no longer the version ``obj`` or a write of it is in flight."""
        try:
            data = self.get(ObjectKey(key))
        except (KeyError, CorruptObjectError):
            return None
        with self._lock:
            current = self._objects.get(key)
            if current is not obj or key in self._latest or self._closed:
                return None
            rec = current.record
            pending = _PendingWrite(key, next(self._seq), extent, data, rec.length, rec.meta)
            self._latest[key] = pending.seq
            self._writing += 1
        self._jobs.submit(self._write_job, pending)
        return pending
