"""Real tiers for the data-mode replay, charged exactly like the accounting tiers.

Data mode moves real bytes through the pinned pool (:class:`HostPool`) and the
disk tier (:class:`DiskTier`), yet must make every decision the accounting
replay makes (same index, same policies, same hit rates).  Two things of the
real tiers would otherwise change decisions, and are neutralised here by
*wrapping* the real tiers (zarr's ``WrapperStore``: each wrapper forwards the
tier contract to the tier inside and changes only what it is about):

* **Charges.**  The real tiers charge an object its allocator slot (4 KiB
  units, size classes) and can refuse a slot when free space is fragmented.
  :class:`Budgeted` charges an object its exact bytes against the replay's
  budget, as :class:`~hybridstore.backends.accounting.AccountingTier` does;
  the allocator underneath gets ``headroom`` times the budget so that slot
  rounding and fragmentation fit.  Should the allocator refuse anyway, the
  refusal goes to the store as a :class:`CapacityError` (it evicts more; the
  run may then differ from accounting mode) and is counted in
  ``physical_refusals``.
* **Asynchronous disk writes.**  The store applies a disk write to the index
  when its future completes, and never evicts an object whose write is in
  flight; accounting copies complete at once.  :class:`WriteBehind`
  copies the bytes into a staging buffer and reports the put done at once;
  the write proceeds in the background and a read of the object waits for it.
  (Durability is not what the replay measures; restore time is.)  Deletes
  are batched likewise (:meth:`DiskTier.delete_many`: one synchronous catalog
  transaction per batch, not per eviction).

:class:`BudgetedPool` and :class:`WriteBehindDisk` build the wrapped tiers the
replay uses.  Read times are modeled from the bandwidth given (the same formula
as the accounting tier, so modeled restores agree to the last bit).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from hybridstore.backends.base import Slots, Tier, done_future
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


class TierWrapper(Tier):
    """A tier that forwards every verb of the contract to the tier it wraps.

    Subclasses override what they change (zarr's ``WrapperStore``); the
    capabilities (``stores_bytes``, ``durable``, ``zero_copy``,
    ``coalesces_writes``) and the name are the wrapped tier's.
    """

    def __init__(self, tier: Tier) -> None:
        super().__init__()
        self.tier = tier
        self.name = tier.name
        self.stores_bytes = tier.stores_bytes
        self.durable = tier.durable
        self.zero_copy = tier.zero_copy
        self.coalesces_writes = tier.coalesces_writes

    @property
    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.tier.used_bytes

    def charge(self, nbytes: int) -> int:
        return self.tier.charge(nbytes)

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        return self.tier.put(key, data, nbytes=nbytes, meta=meta)

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        return self.tier.put_many(keys, datas, nbytes=nbytes, metas=metas)

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        return self.tier.get_into(key, out)

    def get(self, key: ObjectKey) -> np.ndarray:
        return self.tier.get(key)

    def contains(self, key: ObjectKey) -> bool:
        return self.tier.contains(key)

    def nbytes(self, key: ObjectKey) -> int | None:
        return self.tier.nbytes(key)

    def meta(self, key: ObjectKey) -> bytes | None:
        return self.tier.meta(key)

    def delete(self, key: ObjectKey) -> int:
        return self.tier.delete(key)

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        return self.tier.delete_many(keys)

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        return self.tier.entries()

    def read_seconds(self, nbytes: int) -> float:
        return self.tier.read_seconds(nbytes)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        return self.tier.read_many_into(keys, dst, offsets)

    def slot_bytes(self, nbytes: int) -> int:
        return self.tier.slot_bytes(nbytes)

    def stage_many(self, keys: Sequence[ObjectKey], nbytes: int) -> Slots:
        return self.tier.stage_many(keys, nbytes)

    def stage(self, key: ObjectKey, nbytes: int) -> np.ndarray:
        return self.tier.stage(key, nbytes)

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        self.tier.commit_many(keys)

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        self.tier.abort_many(keys)

    def pin_many(self, keys: Sequence[ObjectKey]) -> None:
        self.tier.pin_many(keys)

    def unpin_many(self, keys: Sequence[ObjectKey]) -> None:
        self.tier.unpin_many(keys)

    def view(self, key: ObjectKey) -> np.ndarray:
        return self.tier.view(key)

    def locate(self, keys: Sequence[ObjectKey]) -> Slots:
        return self.tier.locate(keys)

    def put_info(self, name: str, value: bytes) -> None:
        self.tier.put_info(name, value)

    def get_info(self, name: str) -> bytes | None:
        return self.tier.get_info(name)

    def stats(self) -> dict[str, float]:
        return self.tier.stats()

    @property
    def closed(self) -> bool:
        return self.tier.closed

    def close(self) -> None:
        self.tier.close()
        super().close()


class Budgeted(TierWrapper):
    """A real tier charged like an accounting tier: exact bytes against a logical budget.

    Args:
        tier: the real tier (its allocator should have room beyond ``budget``:
            :func:`physical_bytes`).
        name: the tier it is in the store (``"host"``; ``"device"`` where a pool
            stands in for GPU memory; ``"disk"``).
        budget: the logical budget in bytes.
        read_gbps: bandwidth of the restore-time model.

    Raises:
        ConfigError: the budget or bandwidth is out of range.
    """

    def __init__(self, tier: Tier, *, name: str, budget: int, read_gbps: float) -> None:
        _check_budget(budget, read_gbps)
        super().__init__(tier)
        self.name = name
        self._budget = budget
        self._read_bps = read_gbps * 1e9
        self._held: dict[bytes, tuple[int, bytes]] = {}   # key -> (nbytes, meta)
        self._reserved: dict[bytes, tuple[int, bytes]] = {}
        self._charged = 0
        self.physical_refusals = 0

    # -- the budget -------------------------------------------------------------------
    def _room_for(self, key: bytes, nbytes: int) -> None:
        self._room_for_many([key], nbytes)

    def _room_for_many(self, keys: Sequence[bytes], nbytes: int) -> None:
        """Raise CapacityError unless ``keys`` (distinct), ``nbytes`` each, fit the budget."""
        held = self._held
        replaced = sum(held[k][0] for k in keys if k in held) if held else 0
        if self._charged - replaced + nbytes * len(keys) > self._budget:
            raise CapacityError(
                f"the {self.name} tier has no room for {len(keys)} x {nbytes} bytes "
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
                f"an object of {nbytes} bytes is larger than the whole {self.name} tier "
                f"({self._budget} bytes); raise its budget or the replay's --scale")
        return nbytes

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self._read_bps

    # -- objects, charged -------------------------------------------------------------
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        with self._lock:
            self._room_for(bytes(key), nbytes)
            fut = self._physical(lambda: self.tier.put(key, data, nbytes=nbytes, meta=meta))
            self._hold(bytes(key), nbytes, meta)
            return fut

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        """:meth:`put` of each (every object is charged on its own)."""
        metas = [b""] * len(keys) if metas is None else metas
        return [self.put(key, None if datas is None else datas[i], nbytes=nbytes, meta=metas[i])
                for i, key in enumerate(keys)]

    def stage(self, key: ObjectKey, nbytes: int) -> np.ndarray:
        with self._lock:
            self._room_for(bytes(key), nbytes)
            slot = self._physical(lambda: self.tier.stage(key, nbytes))
            self._reserved[bytes(key)] = (nbytes, b"")
            return slot

    def stage_many(self, keys: Sequence[ObjectKey], nbytes: int) -> Slots:
        with self._lock:
            self._room_for_many(keys, nbytes)
            slots = self._physical(lambda: self.tier.stage_many(keys, nbytes))
            self._reserved.update((bytes(key), (nbytes, b"")) for key in keys)
            return slots

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.tier.commit_many(keys)
            for key in keys:
                self._hold(bytes(key), *self._reserved.pop(bytes(key)))

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.tier.abort_many(keys)
            for key in keys:
                self._reserved.pop(bytes(key), None)

    def delete(self, key: ObjectKey) -> int:
        with self._lock:
            self.tier.delete(key)
            return self._unhold(bytes(key))

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        return sum(self.delete(key) for key in keys)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.tier.stats())
            out.update(used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes,
                       physical_used_bytes=self.tier.used_bytes,
                       physical_capacity_bytes=self.tier.capacity_bytes,
                       physical_refusals=self.physical_refusals)
            return out

    def close(self) -> None:
        with self._lock:
            super().close()
            self._held.clear()
            self._reserved.clear()
            self._charged = 0


def _check_budget(budget: int, read_gbps: float) -> None:
    if not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"budget must be a non-negative int of bytes, got {budget!r}")
    if not read_gbps > 0:
        raise ConfigError(f"read_gbps must be positive, got {read_gbps!r}")


class BudgetedPool(Budgeted):
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
        _check_budget(budget, read_gbps)
        physical = physical_bytes(budget, headroom)
        self.pool = HostPool(physical, arena_bytes=min(256 * _MIB, physical))
        super().__init__(self.pool, name=name, budget=budget, read_gbps=read_gbps)

    def reserve_slot(self, key: ObjectKey, nbytes: int, meta: bytes = b"") -> np.ndarray:
        """:meth:`HostPool.reserve_slot`, charged on :meth:`commit`."""
        with self._lock:
            self._room_for(bytes(key), nbytes)
            slot = self._physical(lambda: self.pool.reserve_slot(key, nbytes, meta))
            self._reserved[bytes(key)] = (nbytes, bytes(meta))
            return slot


class WriteBehind(Budgeted):
    """A budgeted disk tier whose puts complete at once (see the module docstring).

    A put copies the bytes into a staging buffer, starts the real write and
    returns a completed future; a read of the object waits for its write.
    Deletes are deferred and applied in batches (:meth:`apply_deletes`).

    Args:
        tier: the real disk tier.
        budget: the logical budget in bytes.
        read_gbps: bandwidth of the restore-time model (HiState eq. 2's SSD path).
    """

    def __init__(self, tier: Tier, *, budget: int, read_gbps: float) -> None:
        super().__init__(tier, name="disk", budget=budget, read_gbps=read_gbps)
        self._writes: dict[bytes, tuple[Future, np.ndarray]] = {}  # key -> write, staging; oldest first
        self._spare: dict[int, list[np.ndarray]] = {}  # staging buffers of finished writes, by size
        self._wb_lock = threading.Lock()         # never held while waiting on a write
        self._doomed: dict[bytes, None] = {}     # deleted here, not yet on disk

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        k = bytes(key)
        with self._wb_lock:
            self._room_for(k, nbytes)
            self._doomed.pop(k, None)   # the new write replaces the old object on disk
            spare = self._spare.get(nbytes)
            staged = spare.pop() if spare else aligned_empty(nbytes)   # reused: no page faults
        staged[:] = byte_view(data, what="data")[:nbytes]
        fut = self._physical(lambda: self.tier.put(key, staged, nbytes=nbytes, meta=meta),
                             recover=self._reclaim)
        with self._wb_lock:
            self._writes.pop(k, None)
            self._writes[k] = (fut, staged)
            self._hold(k, nbytes, meta)
            backlog = len(self._writes) > MAX_STAGED_WRITES
        if backlog:
            self._settle(MAX_STAGED_WRITES // 2)
        return done_future(nbytes)

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        """:meth:`put` of each (every put is staged and charged on its own here)."""
        if datas is None:
            raise TypeError("the disk tier stores bytes: pass one data buffer per key")
        metas = [b""] * len(keys) if metas is None else metas
        return [self.put(key, data, nbytes=nbytes, meta=meta)
                for key, data, meta in zip(keys, datas, metas)]

    def stage_many(self, keys: Sequence[ObjectKey], nbytes: int) -> Slots:
        # The contract's default: host buffers, put (staged, charged) on commit.
        return Tier.stage_many(self, keys, nbytes)

    def stage(self, key: ObjectKey, nbytes: int) -> np.ndarray:
        return Tier.stage(self, key, nbytes)

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        Tier.commit_many(self, keys)

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        Tier.abort_many(self, keys)

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        self._written([key])
        return self.tier.get_into(key, out)

    def get(self, key: ObjectKey) -> np.ndarray:
        self._written([key])
        return self.tier.get(key)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        self._written(keys)
        return self.tier.read_many_into(keys, dst, offsets)

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
            self.tier.delete_many([ObjectKey(k) for k in doomed])

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

    def close(self) -> None:
        if self.closed:
            return
        self.apply_deletes()
        self.wait_writes()
        super().close()
        with self._wb_lock:
            self._writes.clear()
            self._spare.clear()


class WriteBehindDisk(WriteBehind):
    """A :class:`DiskTier` in a fresh directory, wrapped by :class:`WriteBehind`.

    Args:
        path: directory of the tier (created if missing; use a fresh one).
        budget: the logical budget in bytes.
        read_gbps: bandwidth of the restore-time model (HiState eq. 2's SSD path).
        headroom: segment-file bytes per budget byte.
        io_threads: threads of the disk tier's I/O pool.
    """

    def __init__(self, path: str | os.PathLike[str], budget: int, *, read_gbps: float,
                 headroom: float = HEADROOM, io_threads: int = 8) -> None:
        _check_budget(budget, read_gbps)
        physical = physical_bytes(budget, headroom)
        segment = min(256 * _MIB, max(_MIB, physical // 8 // _MIB * _MIB))
        disk = DiskTier(path, physical, segment_bytes=segment, io_threads=io_threads)
        super().__init__(disk, budget=budget, read_gbps=read_gbps)
