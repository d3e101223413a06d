"""The pinned-DRAM pool: objects in slots of a few large page-aligned arenas.

Arenas are anonymous ``mmap`` regions (page-aligned, so ``O_DIRECT`` and GDS
can use them), page-locked through ``cudaHostRegister`` when a GPU is present
and pinning is asked for; a :class:`~hybridstore.backends.alloc.SlabAllocator`
carves them, so there is no per-object allocation.

The pool is the ``zero_copy`` tier of the contract: the facade packs tensors
straight into a slot and the disk tier writes straight from it.  Its
overrides of the contract's paired verbs, and their single-key forms:

=================================  ===========================================
``stage_many(keys, n)`` /          writable views of new ``n``-byte slots; the
``stage(key, n)`` /                objects are invisible until committed
``reserve_slot(key, n, meta)``
``commit_many(keys)`` /            publish the reserved slots (replacing any
``commit(key)``                    older object of the key)
``abort_many(keys)`` /             give them back
``abort(key)``
``pin_many(keys)`` /               hold the keys: while held, no slot a key has
``acquire(key)``                   used since is freed (``delete`` and
                                   replacement free old slots on the last
                                   release)
``unpin_many(keys)`` /             drop one hold of each
``release_ref(key)``
``view(key)``                      a read-only view of the live object; valid
                                   only while the caller holds the key
``locate(keys)``                   the arenas and offsets of held objects (one
                                   gather restores an entry of all of them)
=================================  ===========================================
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridstore.backends.alloc import Extent, SlabAllocator, SlabBudget, Window
from hybridstore.backends.base import ObjectKey, ObjectTable, Slots, done_future
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.objects import ALIGN, byte_view

log = logging.getLogger(__name__)

_DONE = done_future()  # completed futures are immutable: one serves every put
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class _Arena:
    """One mmap region, as a uint8 array; ``pinned`` once cudaHostRegister'ed."""

    __slots__ = ("data", "pinned")

    def __init__(self, nbytes: int, pin: bool) -> None:
        # Populated up front (a pool is meant to be used), so copies into it do
        # not pay a page fault per 4 KiB; huge pages where the kernel allows.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(-1, nbytes, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        self.data = np.frombuffer(region, dtype=np.uint8)
        self.pinned = pin and _host_register(self.data)

    def release(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.data.ctypes.data)
        # The mmap unmaps itself once the last view a caller may hold is gone.


def _host_register(data: np.ndarray) -> bool:
    """Page-lock ``data`` for fast async H2D copies; False (logged) if that fails."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(data.ctypes.data, data.nbytes,
                                               _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        log.warning("cudaHostRegister of %d bytes failed (%s); the host pool stays pageable, "
                    "so H2D copies will be slower (raise `ulimit -l`?)", data.nbytes, err)
        return False
    return True


class _Object:
    __slots__ = ("extent", "nbytes", "meta")

    def __init__(self, extent: Extent, nbytes: int, meta: bytes) -> None:
        self.extent = extent
        self.nbytes = nbytes
        self.meta = meta


class HostPool(SlabBudget, ObjectTable):
    """Pinned host memory carved into size-class slots.

    Args:
        capacity_bytes: hard budget of the pool (arena bytes mapped at once).
        arena_bytes: size of one arena (one mmap); objects larger than it get
            an arena of their own.
        pin: page-lock arenas when ``torch.cuda.is_available()``.
        h2d_gbps: host-to-device bandwidth used to model restore time.

    Raises:
        ConfigError: a size or bandwidth is out of range.
    """

    name = "host"
    zero_copy = True

    def __init__(self, capacity_bytes: int, *, arena_bytes: int = 256 << 20, pin: bool = True,
                 h2d_gbps: float = 64.0) -> None:
        super().__init__()
        if not h2d_gbps > 0:
            raise ConfigError(f"h2d_gbps must be positive, got {h2d_gbps!r}")
        if not isinstance(arena_bytes, int) or arena_bytes < ALIGN:
            raise ConfigError(f"arena_bytes must be an int of at least {ALIGN}, got {arena_bytes!r}")
        self._pin = pin and _cuda_available()
        self._h2d_gbps = h2d_gbps
        self._arenas: dict[int, _Arena] = {}
        self._alloc = SlabAllocator(budget_bytes=capacity_bytes, arena_bytes=arena_bytes,
                                    alignment=ALIGN, on_new_arena=self._map_arena,
                                    on_release_arena=self._unmap_arena)
        self._objects: dict[ObjectKey, _Object] = {}
        self._pending: dict[ObjectKey, _Object] = {}
        self._refs: dict[ObjectKey, int] = {}
        self._retired: dict[ObjectKey, list[Extent]] = {}  # freed on the key's last release
        self._counts = dict.fromkeys(("puts", "gets", "bytes_in", "bytes_out", "relocated",
                                      "relocated_bytes"), 0)
        self._done: dict[int, Future] = {}  # completed get_into futures, by object size

    # -- capacity -----------------------------------------------------------------
    @property
    def is_pinned(self) -> bool:
        """True when the arenas are page-locked (pinning asked for and a GPU present)."""
        with self._lock:
            return self._pin and all(arena.pinned for arena in self._arenas.values())

    # -- two-phase store ----------------------------------------------------------
    def reserve_slot(self, key: ObjectKey, nbytes: int, meta: bytes = b"") -> np.ndarray:
        """A writable uint8 view of a new ``nbytes`` slot for ``key``.

        The object stays invisible until :meth:`commit`; :meth:`abort` gives the
        slot back.

        Raises:
            CapacityError: no room; evict and retry.
            ObjectTooLargeError: ``nbytes`` exceeds the whole pool.
            ValueError: ``key`` already has a reserved slot.
        """
        with self._lock:
            self._check_open()
            if key in self._pending:
                raise ValueError(f"key {key.hex()} already has a reserved slot; commit() or "
                                 "abort() it first")
            obj = self._new_object(nbytes, meta)
            self._pending[key] = obj
            return self._slot(obj.extent, nbytes)

    def stage(self, key: ObjectKey, nbytes: int) -> np.ndarray:
        """:meth:`reserve_slot` without metadata (the contract's single-key ``stage``)."""
        return self.reserve_slot(key, nbytes)

    def stage_many(self, keys: Sequence[ObjectKey], nbytes: int) -> Slots:
        """:meth:`reserve_slot` for a run of objects of one size: all of them or none.

        Returns where the slots lie, as :meth:`locate` does (object ``i`` at
        ``arenas[which[i]][offsets[i]:]``), for
        :func:`~hybridstore.backends.gather.scatter_rows`.  Then
        :meth:`commit_many` or :meth:`abort_many` the same keys.

        Raises:
            CapacityError: no room for all of them (none is reserved).
            ObjectTooLargeError: ``nbytes`` exceeds the whole pool.
            ValueError: a key is repeated or already has a reserved slot.
        """
        with self._lock:
            self._check_open()
            if len(set(keys)) != len(keys) or any(key in self._pending for key in keys):
                raise ValueError("stage_many needs distinct keys without a reserved slot; "
                                 "commit() or abort() the earlier reservation first")
            objs = self._new_objects(nbytes, len(keys), b"")
            self._pending.update(zip(keys, objs))
            return self._where([obj.extent for obj in objs])

    @property
    def finds_windows(self) -> bool:
        return True

    def window_victims(self, nbytes: int, may_free: Callable[[ObjectKey], bool]
                       ) -> list[ObjectKey] | None:
        """:meth:`Tier.window_victims` from the allocator's windows; held slots stay."""
        with self._lock:
            window, owner = self._window(nbytes, may_free)
        return None if window is None else [owner[e] for e in window.extents]

    def _window(self, nbytes: int, allowed: Callable[[ObjectKey], bool]
                ) -> tuple[Window | None, dict[Extent, ObjectKey]]:
        """The cheapest window for ``nbytes`` whose objects nobody holds and ``allowed``
        accepts (lock held), and the keys of the objects by slot."""
        owner = {obj.extent: key for key, obj in self._objects.items() if not self._refs.get(key)}

        def movable(extent: Extent) -> bool:
            key = owner.get(extent)
            return key is not None and allowed(key)

        return self._alloc.window_at(nbytes, movable), owner

    def relocate_window(self, nbytes: int, may_move: Callable[[ObjectKey], bool]) -> int | None:
        """:meth:`Tier.relocate_window`: the objects of the cheapest window are copied into
        free slots outside it (a memcpy each, under the pool's lock) and their old slots
        freed; held objects (views or locations handed out) stay where they are."""
        with self._lock:
            self._check_open()
            window, owner = self._window(nbytes, may_move)
            if window is None:
                return None
            targets = self._alloc.alloc_outside(window)
            if targets is None:
                return None
            for old, new in zip(window.extents, targets):
                key = owner[old]
                obj = self._objects[key]
                self._slot(new, obj.nbytes)[:] = self._slot(old, obj.nbytes)
                self._objects[key] = _Object(new, obj.nbytes, obj.meta)
                self._alloc.free(old)
            moved = sum(e.length for e in window.extents)
            self._counts["relocated"] += len(targets)
            self._counts["relocated_bytes"] += moved
            return moved

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        """:meth:`commit` of several keys (a run reserved by :meth:`stage_many`).

        Raises:
            KeyError: a key has no reserved slot (none is committed).
        """
        with self._lock:
            self._check_open()
            pending = self._pending
            for key in keys:
                if key not in pending:
                    raise KeyError(key)
            for key in keys:
                self._publish(key, pending.pop(key))

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        """:meth:`abort` of several keys; keys without a reserved slot are skipped."""
        with self._lock:
            self._check_open()
            for key in keys:
                obj = self._pending.pop(key, None)
                if obj is not None:
                    self._alloc.free(obj.extent)

    def commit(self, key: ObjectKey) -> None:
        """Make the slot reserved for ``key`` visible, replacing any older object.

        Raises:
            KeyError: no slot is reserved for ``key``.
        """
        with self._lock:
            self._check_open()
            self._publish(key, self._pending.pop(key))

    def abort(self, key: ObjectKey) -> None:
        """Give back the slot reserved for ``key``.

        Raises:
            KeyError: no slot is reserved for ``key``.
        """
        with self._lock:
            self._check_open()
            self._alloc.free(self._pending.pop(key).extent)

    # -- references and views -----------------------------------------------------
    def acquire(self, key: ObjectKey) -> None:
        """Hold ``key``: slots it used are kept until the matching :meth:`release_ref`.

        Raises:
            KeyError: ``key`` is not visible.
        """
        with self._lock:
            self._check_open()
            if key not in self._objects:
                raise KeyError(key)
            self._refs[key] = self._refs.get(key, 0) + 1

    def pin_many(self, keys: Sequence[ObjectKey]) -> None:
        """:meth:`acquire` of several keys at once; holds none of them if one is missing.

        Raises:
            KeyError: a key is not visible.
        """
        with self._lock:
            self._check_open()
            objects, refs = self._objects, self._refs
            for key in keys:
                if key not in objects:
                    raise KeyError(key)
            for key in keys:
                refs[key] = refs.get(key, 0) + 1

    def unpin_many(self, keys: Sequence[ObjectKey]) -> None:
        """:meth:`release_ref` of several keys at once."""
        with self._lock:
            for key in keys:
                self.release_ref(key)

    def release_ref(self, key: ObjectKey) -> None:
        """Drop one hold on ``key``; the last one frees its deleted or replaced slots.

        A no-op after :meth:`close`, so in-flight I/O may finish late.

        Raises:
            ValueError: ``key`` is not held.
        """
        with self._lock:
            if self._closed:
                return
            refs = self._refs.get(key, 0)
            if refs == 0:
                raise ValueError(f"release_ref({key.hex()}) without a matching acquire()")
            if refs > 1:
                self._refs[key] = refs - 1
                return
            del self._refs[key]
            for extent in self._retired.pop(key, ()):
                self._alloc.free(extent)

    def view(self, key: ObjectKey) -> np.ndarray:
        """A read-only uint8 view of the object's bytes (no copy).

        Hold the key with :meth:`acquire` while using the view: without a hold a
        concurrent ``delete`` or ``put`` may hand the slot to another object.

        Raises:
            KeyError: ``key`` is not visible.
        """
        with self._lock:
            self._check_open()
            obj = self._objects[key]
            out = self._slot(obj.extent, obj.nbytes)
        out.flags.writeable = False
        return out

    def locate(self, keys: Sequence[ObjectKey]) -> Slots:
        """Where held objects lie: ``(arenas, which, offsets)`` with object ``i`` at
        ``arenas[which[i]][offsets[i]:]`` (for :func:`~hybridstore.backends.gather.gather_rows`).

        Hold every key (:meth:`acquire`) while using the result.

        Raises:
            KeyError: a key is not visible.
        """
        with self._lock:
            self._check_open()
            return self._where([self._objects[key].extent for key in keys])

    def _where(self, extents: list[Extent]) -> Slots:
        """``(arenas, which, offsets)`` of slots ``extents`` (see :meth:`locate`)."""
        order: dict[int, int] = {}
        which = np.fromiter((order.setdefault(e.arena, len(order)) for e in extents),
                            np.int64, len(extents))
        offsets = np.fromiter((e.offset for e in extents), np.int64, len(extents))
        return [self._arenas[a].data for a in order], which, offsets

    # -- tier contract ------------------------------------------------------------
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        if data is None:
            raise TypeError("the host pool stores bytes; pass data (only the accounting tier "
                            "takes None)")
        src = byte_view(data, what="data")
        if src.size < nbytes:
            raise ValueError(f"data has {src.size} bytes, fewer than nbytes={nbytes}")
        with self._lock:
            self._check_open()
            obj = self._new_object(nbytes, meta)
        try:  # copy outside the lock: the slot is ours alone until it is published
            self._slot(obj.extent, nbytes)[:] = src[:nbytes]
        except BaseException:
            with self._lock:
                self._alloc.free(obj.extent)
            raise
        with self._lock:
            self._check_open()
            self._publish(key, obj)
        return _DONE

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        dst = byte_view(out, what="out")
        with self._lock:
            self._check_open()
            obj = self._objects[key]
            if dst.size < obj.nbytes:
                raise ValueError(f"out has {dst.size} bytes; the object needs {obj.nbytes}")
            self._refs[key] = self._refs.get(key, 0) + 1
        try:
            dst[: obj.nbytes] = self._slot(obj.extent, obj.nbytes)
        finally:
            self.release_ref(key)
        with self._lock:
            self._counts["gets"] += 1
            self._counts["bytes_out"] += obj.nbytes
            fut = self._done.get(obj.nbytes)
            if fut is None:
                fut = self._done[obj.nbytes] = done_future(obj.nbytes)
        return fut

    def delete(self, key: ObjectKey) -> int:
        """Drop ``key``; returns its slot size (freed on the last release if held)."""
        with self._lock:
            self._check_open()
            obj = self._objects.pop(key, None)
            if obj is None:
                return 0
            self._drop_slot(key, obj.extent)
            return obj.extent.length

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / (self._h2d_gbps * 1e9)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"objects": len(self._objects), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes,
                    "committed_bytes": self._alloc.committed_bytes, **self._counts}

    def close(self) -> None:
        """Unpin and drop every arena; views callers still hold stay readable."""
        with self._lock:
            if self._closed:
                return
            super().close()
            for arena in self._arenas.values():
                arena.release()
            self._arenas.clear()
            self._objects.clear()
            self._pending.clear()
            self._refs.clear()
            self._retired.clear()

    # -- internals ----------------------------------------------------------------
    def _new_object(self, nbytes: int, meta: bytes) -> _Object:
        return self._new_objects(nbytes, 1, meta)[0]

    def _new_objects(self, nbytes: int, n: int, meta: bytes) -> list[_Object]:
        """Slots for ``n`` objects of ``nbytes``: all of them, or CapacityError."""
        extents = self._alloc.alloc_many(nbytes, n)
        if extents is None:
            raise CapacityError(
                f"the host pool has no room for {n} x {nbytes} bytes ({self.used_bytes} of "
                f"{self.capacity_bytes} bytes in use, {len(self._objects)} objects); evict "
                "objects and retry, or raise host_bytes")
        meta = bytes(meta)
        return [_Object(extent, nbytes, meta) for extent in extents]

    def _publish(self, key: ObjectKey, obj: _Object) -> None:
        old = self._objects.get(key)
        if old is not None:
            self._drop_slot(key, old.extent)
        self._objects[key] = obj
        self._counts["puts"] += 1
        self._counts["bytes_in"] += obj.nbytes

    def _drop_slot(self, key: ObjectKey, extent: Extent) -> None:
        if key in self._refs:
            self._retired.setdefault(key, []).append(extent)
        else:
            self._alloc.free(extent)

    def _slot(self, extent: Extent, nbytes: int) -> np.ndarray:
        return self._arenas[extent.arena].data[extent.offset: extent.offset + nbytes]

    def _map_arena(self, arena_id: int, nbytes: int) -> None:
        self._arenas[arena_id] = _Arena(nbytes, self._pin)

    def _unmap_arena(self, arena_id: int) -> None:
        self._arenas.pop(arena_id).release()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
