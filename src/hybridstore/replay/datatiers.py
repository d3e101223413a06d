"""Real tiers for the data-mode replay, charged exactly like the accounting tiers.

Data mode moves real bytes through the pinned pool (:class:`HostPool`) and the
disk tier (:class:`DiskTier`), yet must make every decision the accounting
replay makes (same index, same policies, same hit rates).  Two things of the
real tiers would otherwise change decisions, and are neutralised here:

* **Charges.**  The real tiers charge an object its allocator slot (4 KiB
  units, size classes) and can refuse a slot when free space is fragmented.
  These subclasses charge an object its exact bytes against the replay's
  budget, as :class:`~hybridstore.backends.accounting.AccountingTier` does;
  the allocator underneath gets ``headroom`` times the budget so that slot
  rounding and fragmentation fit.  Should the allocator refuse anyway, the
  refusal goes to the store as a :class:`CapacityError` (it evicts more; the
  run may then differ from accounting mode) and is counted in
  ``physical_refusals``.
* **Asynchronous disk writes.**  The store applies a disk write to the index
  when its future completes, and never evicts an object whose write is in
  flight; accounting copies complete at once.  :class:`WriteBehindDisk`
  copies the bytes into a staging buffer and reports the put done at once;
  the write proceeds in the background and a read of the object waits for it.
  (Durability is not what the replay measures; restore time is.)  Deletes
  are batched likewise (:meth:`DiskTier.delete_many`: one synchronous catalog
  transaction per batch, not per eviction).

Read times are modeled from the bandwidth given (the same formula as the
accounting tier, so modeled restores agree to the last bit).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from hybridstore.backends.base import done_future
from hybridstore.backends.disk import DiskTier
from hybridstore.backends.host import HostPool
from hybridstore.errors import CapacityError, ConfigError, ObjectTooLargeError
from hybridstore.objects import ObjectKey, aligned_empty, byte_view

T = TypeVar("T")

HEADROOM = 1.5
"""Allocator bytes per budget byte: slot rounding (< 1/8, or up to one 4 KiB unit on small
objects) plus fragmentation between page and checkpoint slots."""

MAX_STAGED_WRITES = 256
"""Disk writes in flight before a put waits for the oldest (bounds staging memory)."""

DELETE_BATCH = 256
"""Disk deletes gathered before they are applied in one catalog transaction."""

_MIB = 1 << 20


def physical_bytes(budget: int, headroom: float = HEADROOM) -> int:
    """Allocator budget that backs a logical ``budget`` (at least 4 MiB more than it)."""
    return int(budget * headroom) + 4 * _MIB


class _Budget:
    """Exact-byte charges against a logical budget (the accounting tier's rule)."""

    def _init_budget(self, name: str, budget: int, read_gbps: float) -> None:
        if not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"budget must be a non-negative int of bytes, got {budget!r}")
        if not read_gbps > 0:
            raise ConfigError(f"read_gbps must be positive, got {read_gbps!r}")
        self._tier_name = name
        self._budget = budget
        self._read_bps = read_gbps * 1e9
        self._held: dict[bytes, tuple[int, bytes]] = {}   # key -> (nbytes, meta)
        self._charged = 0
        self.physical_refusals = 0

    def _room_for(self, key: bytes, nbytes: int) -> None:
        self._room_for_many([key], nbytes)

    def _room_for_many(self, keys: Sequence[bytes], nbytes: int) -> None:
        """Raise CapacityError unless ``keys`` (distinct), ``nbytes`` each, fit the budget."""
        held = self._held
        replaced = sum(held[k][0] for k in keys if k in held) if held else 0
        if self._charged - replaced + nbytes * len(keys) > self._budget:
            raise CapacityError(
                f"the {self._tier_name} tier has no room for {len(keys)} x {nbytes} bytes "
                f"({self._charged} of {self._budget} bytes in use); evict objects and retry")

    def _hold(self, key: bytes, nbytes: int, meta: bytes) -> None:
        old = self._held.get(key)
        self._charged += nbytes - (old[0] if old else 0)
        self._held[key] = (nbytes, bytes(meta))

    def _unhold(self, key: bytes) -> int:
        old = self._held.pop(key, None)
        if old is None:
            return 0
        self._charged -= old[0]
        return old[0]

    def _physical(self, attempt: Callable[[], T], recover: Callable[[], None] | None = None) -> T:
        """Run an allocation of the real tier; count (and pass on) its refusals."""
        try:
            return attempt()
        except ObjectTooLargeError:
            raise
        except CapacityError:
            if recover is None:
                self.physical_refusals += 1
                raise
        recover()
        try:
            return attempt()
        except ObjectTooLargeError:
            raise
        except CapacityError:
            self.physical_refusals += 1
            raise

    # -- the Tier capacity contract, logical --------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        return self._charged

    def charge(self, nbytes: int) -> int:
        if nbytes > self._budget:
            raise ObjectTooLargeError(
                f"an object of {nbytes} bytes is larger than the whole {self._tier_name} tier "
                f"({self._budget} bytes); raise its budget or the replay's --scale")
        return nbytes

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self._read_bps


class BudgetedPool(_Budget, HostPool):
    """A :class:`HostPool` charged like an accounting tier (see the module docstring).

    Args:
        name: the tier it is in the store (``"host"``; ``"device"`` where it
            stands in for GPU memory).
        budget: the logical budget in bytes.
        read_gbps: bandwidth of the restore-time model.
        headroom: allocator bytes per budget byte.
    """

    def __init__(self, name: str, budget: int, *, read_gbps: float,
                 headroom: float = HEADROOM) -> None:
        self._init_budget(name, budget, read_gbps)
        self._reserved: dict[bytes, tuple[int, bytes]] = {}
        physical = physical_bytes(budget, headroom)
        HostPool.__init__(self, physical, arena_bytes=min(256 * _MIB, physical))
        self.name = name  # type: ignore[misc]  # per instance: it may stand for the GPU tier

    def reserve_slot(self, key: ObjectKey, nbytes: int, meta: bytes = b"") -> np.ndarray:
        with self._lock:
            self._room_for(bytes(key), nbytes)
            slot = self._physical(lambda: HostPool.reserve_slot(self, key, nbytes, meta))
            self._reserved[bytes(key)] = (nbytes, bytes(meta))
            return slot

    def stage_many(self, keys: Sequence[ObjectKey],
                     nbytes: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        with self._lock:
            self._room_for_many(keys, nbytes)
            slots = self._physical(lambda: HostPool.stage_many(self, keys, nbytes))
            self._reserved.update((bytes(key), (nbytes, b"")) for key in keys)
            return slots

    def commit(self, key: ObjectKey) -> None:
        self.commit_many([key])

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            HostPool.commit_many(self, keys)
            for key in keys:
                self._hold(bytes(key), *self._reserved.pop(bytes(key)))

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            HostPool.abort_many(self, keys)
            for key in keys:
                self._reserved.pop(bytes(key), None)

    def abort(self, key: ObjectKey) -> None:
        with self._lock:
            HostPool.abort(self, key)
            self._reserved.pop(bytes(key), None)

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        with self._lock:
            self._room_for(bytes(key), nbytes)
            fut = self._physical(lambda: HostPool.put(self, key, data, nbytes=nbytes, meta=meta))
            self._hold(bytes(key), nbytes, meta)
            return fut

    def delete(self, key: ObjectKey) -> int:
        with self._lock:
            HostPool.delete(self, key)
            return self._unhold(bytes(key))

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = HostPool.stats(self)
            out.update(physical_used_bytes=self._alloc.used_bytes,
                       physical_capacity_bytes=self._alloc.budget_bytes,
                       physical_refusals=self.physical_refusals)
            return out

    def close(self) -> None:
        with self._lock:
            HostPool.close(self)
            self._held.clear()
            self._reserved.clear()
            self._charged = 0


class WriteBehindDisk(_Budget, DiskTier):
    """A :class:`DiskTier` charged like an accounting tier, whose puts complete at once.

    A put copies the bytes into a staging buffer, starts the real write and
    returns a completed future; a read of the object waits for its write
    (see the module docstring).

    Args:
        path: directory of the tier (created if missing; use a fresh one).
        budget: the logical budget in bytes.
        read_gbps: bandwidth of the restore-time model (HiState eq. 2's SSD path).
        headroom: segment-file bytes per budget byte.
        io_threads: threads of the disk tier's I/O pool.
    """

    def __init__(self, path: str | os.PathLike[str], budget: int, *, read_gbps: float,
                 headroom: float = HEADROOM, io_threads: int = 8) -> None:
        self._init_budget("disk", budget, read_gbps)
        self._writes: dict[bytes, tuple[Future, np.ndarray]] = {}  # key -> write, staging; oldest first
        self._spare: dict[int, list[np.ndarray]] = {}  # staging buffers of finished writes, by size
        self._wb_lock = threading.Lock()         # never held while waiting on a write
        self._doomed: dict[bytes, None] = {}     # deleted here, not yet on disk
        physical = physical_bytes(budget, headroom)
        segment = min(256 * _MIB, max(_MIB, physical // 8 // _MIB * _MIB))
        DiskTier.__init__(self, path, physical, segment_bytes=segment, io_threads=io_threads)

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        k = bytes(key)
        with self._wb_lock:
            self._room_for(k, nbytes)
            self._doomed.pop(k, None)   # the new write replaces the old object on disk
        with self._wb_lock:
            spare = self._spare.get(nbytes)
            staged = spare.pop() if spare else aligned_empty(nbytes)   # reused: no page faults
        staged[:] = byte_view(data, what="data")[:nbytes]
        fut = self._physical(lambda: DiskTier.put(self, key, staged, nbytes=nbytes, meta=meta),
                             recover=self._reclaim)
        with self._wb_lock:
            self._writes.pop(k, None)
            self._writes[k] = (fut, staged)
            self._hold(k, nbytes, meta)
            backlog = len(self._writes) > MAX_STAGED_WRITES
        if backlog:
            self._settle(MAX_STAGED_WRITES // 2)
        return done_future(nbytes)

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any], *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        """:meth:`put` of each (every put is staged and charged on its own here)."""
        metas = [b""] * len(keys) if metas is None else metas
        return [self.put(key, data, nbytes=nbytes, meta=meta)
                for key, data, meta in zip(keys, datas, metas)]

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        self._written([key])
        return DiskTier.get_into(self, key, out)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        self._written(keys)
        return DiskTier.read_many_into(self, keys, dst, offsets)

    def _written(self, keys: Iterable[ObjectKey]) -> None:
        """The write-behind: a read waits for the writes of its objects still in flight."""
        with self._wb_lock:
            writes = [self._writes.get(bytes(key)) for key in keys]
        for write in writes:
            if write is not None:
                write[0].result()

    def contains(self, key: ObjectKey) -> bool:
        self._check_open()
        with self._wb_lock:
            return bytes(key) in self._held

    def nbytes(self, key: ObjectKey) -> int | None:
        self._check_open()
        with self._wb_lock:
            held = self._held.get(bytes(key))
        return None if held is None else held[0]

    def meta(self, key: ObjectKey) -> bytes | None:
        self._check_open()
        with self._wb_lock:
            held = self._held.get(bytes(key))
        return None if held is None else held[1]

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        self._check_open()
        with self._wb_lock:
            items = [(ObjectKey(k), n, m) for k, (n, m) in self._held.items()]
        return iter(items)

    def delete(self, key: ObjectKey) -> int:
        k = bytes(key)
        with self._wb_lock:
            freed = self._unhold(k)
            if not freed:
                return 0
            self._writes.pop(k, None)
            self._doomed[k] = None
            batch = len(self._doomed) >= DELETE_BATCH
        if batch:
            self.apply_deletes()
        return freed

    def apply_deletes(self) -> None:
        """Drop the objects deleted so far from disk (cancelling writes still in flight)."""
        with self._wb_lock:
            doomed, self._doomed = list(self._doomed), {}
        if doomed:
            DiskTier.delete_many(self, doomed)

    def wait_writes(self) -> None:
        """Wait until every write started so far is on disk (or failed)."""
        self._settle(0)

    def _reclaim(self) -> None:
        """Free what deferred deletes and replaced writes still hold (before a retry)."""
        self.apply_deletes()
        self.wait_writes()

    def _settle(self, keep: int) -> None:
        """Wait for the oldest writes until at most ``keep`` are in flight."""
        while True:
            with self._wb_lock:
                for k in [k for k, (f, _) in self._writes.items() if f.done()]:
                    _, staged = self._writes.pop(k)
                    spare = self._spare.setdefault(staged.size, [])
                    if len(spare) < MAX_STAGED_WRITES:
                        spare.append(staged)
                if len(self._writes) <= keep:
                    return
                oldest = next(iter(self._writes.values()))[0]
            try:
                oldest.result()
            except Exception:  # noqa: BLE001 - a failed write surfaces when the object is read
                with self._wb_lock:
                    for k in [k for k, (f, _) in self._writes.items() if f is oldest]:
                        del self._writes[k]

    def stats(self) -> dict[str, Any]:
        out = DiskTier.stats(self)
        out.update(physical_used_bytes=self._alloc.used_bytes,
                   physical_capacity_bytes=self._alloc.budget_bytes,
                   physical_refusals=self.physical_refusals)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.apply_deletes()
        self.wait_writes()
        DiskTier.close(self)
        with self._wb_lock:
            self._held.clear()
            self._writes.clear()
            self._spare.clear()
            self._charged = 0
