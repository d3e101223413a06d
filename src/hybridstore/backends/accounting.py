"""A tier that keeps sizes and modeled timings, never bytes (for the trace simulator).

The simulator runs the real index and policies over these tiers, so simulated
results describe the library that ships.  The object table is a
:class:`~hybridstore.backends.keytable.KeyTable` (compiled when built): a run of
pages is recorded or dropped in one call over its key rows
(:class:`~hybridstore.objects.KeyBatch`), with no Python work per key.
Futures are shared, already-completed objects, so millions of operations
allocate nothing per call beyond the table slot of a stored object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridstore.backends.base import ObjectTable, done_future
from hybridstore.backends.keytable import KeyTable
from hybridstore.errors import CapacityError, ConfigError, ObjectTooLargeError
from hybridstore.objects import OBJECT_KEY_BYTES, KeyBatch, ObjectKey


class AccountingTier(ObjectTable):
    """Sizes and modeled timings of a tier, without its bytes.

    Args:
        name: the tier it stands for (``"host"``, ``"disk"``, ``"device"``).
        capacity_bytes: hard budget.
        read_gbps: bandwidth that models restore time (:meth:`read_seconds`).
        write_gbps: bandwidth that models store time (defaults to ``read_gbps``).
        alignment: objects are charged in multiples of it (1: their exact size).

    Raises:
        ConfigError: a size or bandwidth is out of range.
    """

    stores_bytes = False

    def __init__(self, name: str, capacity_bytes: int, *, read_gbps: float,
                 write_gbps: float | None = None, alignment: int = 1) -> None:
        super().__init__()
        write_gbps = read_gbps if write_gbps is None else write_gbps
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        if not (read_gbps > 0 and write_gbps > 0):
            raise ConfigError(f"bandwidths must be positive, got read_gbps={read_gbps!r}, "
                              f"write_gbps={write_gbps!r}")
        if not isinstance(alignment, int) or alignment < 1:
            raise ConfigError(f"alignment must be a positive int, got {alignment!r}")
        self.name = name  # per instance: it stands for any tier
        self._capacity = capacity_bytes
        self._read_bps = read_gbps * 1e9
        self._write_bps = write_gbps * 1e9
        self._align = alignment
        self._used = 0
        self._objects = KeyTable(OBJECT_KEY_BYTES)     # key -> (nbytes, charged, meta)
        self._done: dict[int | None, Future] = {None: done_future()}  # shared results
        self._counts = dict.fromkeys(("puts", "gets", "bytes_in", "bytes_out"), 0)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def charge(self, nbytes: int) -> int:
        charged = -(-nbytes // self._align) * self._align
        if charged > self._capacity:
            raise ObjectTooLargeError(
                f"an object of {nbytes} bytes is larger than the whole {self.name} tier "
                f"({self._capacity} bytes); raise its capacity")
        return charged

    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Record ``key`` as ``nbytes`` long (``data`` is ignored and may be ``None``)."""
        charged = self.charge(nbytes)
        with self._lock:
            self._check_open()
            old = self._objects.get(key)
            used = self._used - (old[1] if old is not None else 0)
            if used + charged > self._capacity:
                raise CapacityError(
                    f"the {self.name} tier has no room for {nbytes} bytes ({self._used} of "
                    f"{self._capacity} bytes in use); evict objects and retry")
            self._objects.set(key, nbytes, charged, bytes(meta))
            self._used = used + charged
            self._counts["puts"] += 1
            self._counts["bytes_in"] += nbytes
        return self._done[None]

    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None = None, *,
                 nbytes: int, metas: Sequence[bytes] | None = None) -> list[Future]:
        """Record many objects of one size at once (a run of pages; see :meth:`put`).

        ``keys`` is best a :class:`KeyBatch` (its rows go to the table whole); the
        bytes of a key repeated in it count once (the ``puts`` counter counts rows).
        ``datas`` is ignored.  Objects with differing ``metas`` are recorded one by
        one, after one room check for all of them.

        Raises:
            CapacityError: they do not all fit (none is recorded).
        """
        if metas is not None and len(metas) != len(keys):
            raise ValueError("put_many needs one meta per key")
        meta = bytes(metas[0]) if metas else b""
        if metas is None or all(m == meta for m in metas):
            self._record(KeyBatch.from_keys(keys), nbytes, meta)
        else:
            self._record_each(list(keys), nbytes, [bytes(m) for m in metas])
        return [self._done[None]] * len(keys)

    def _record_each(self, keys: list[ObjectKey], nbytes: int, metas: list[bytes]) -> None:
        charged = self.charge(nbytes)
        with self._lock:
            self._check_open()
            last = dict(zip(keys, metas))          # a repeated key counts once, its last meta
            replaced = 0
            for key in last:
                old = self._objects.get(key)
                replaced += old[1] if old is not None else 0
            if self._used - replaced + charged * len(last) > self._capacity:
                raise CapacityError(
                    f"the {self.name} tier has no room for {len(keys)} objects of {nbytes} bytes "
                    f"({self._used} of {self._capacity} bytes in use); evict objects and retry")
            for key, meta in last.items():
                self.put(key, None, nbytes=nbytes, meta=meta)
            self._counts["puts"] += len(keys) - len(last)
            self._counts["bytes_in"] += nbytes * (len(keys) - len(last))

    def _record(self, keys: KeyBatch, nbytes: int, meta: bytes) -> None:
        charged = self.charge(nbytes)
        with self._lock:
            self._check_open()
            done = self._objects.put_many(keys.rows, nbytes, charged, meta,
                                          self._capacity - self._used)
            if done is None:
                raise CapacityError(
                    f"the {self.name} tier has no room for {len(keys)} objects of {nbytes} bytes "
                    f"({self._used} of {self._capacity} bytes in use); evict objects and retry")
            self._used += done[1]
            self._counts["puts"] += len(keys)
            self._counts["bytes_in"] += nbytes * len(keys)

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """The future yields ``nbytes``; ``out`` (may be ``None``) is left untouched."""
        with self._lock:
            self._check_open()
            entry = self._objects.get(key)
            if entry is None:
                raise KeyError(key)
            nbytes = entry[0]
            self._counts["gets"] += 1
            self._counts["bytes_out"] += nbytes
            fut = self._done.get(nbytes)
            if fut is None:
                fut = self._done[nbytes] = done_future(nbytes)
        return fut

    def get(self, key: ObjectKey) -> np.ndarray:
        """A zero-filled array of the object's size (there are no bytes to return)."""
        return np.zeros(self.get_into(key, None).result(), dtype=np.uint8)

    def delete(self, key: ObjectKey) -> int:
        with self._lock:
            self._check_open()
            entry = self._objects.pop(key)
            if entry is None:
                return 0
            self._used -= entry[1]
            return entry[1]

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        """Drop many objects at once (absent keys are skipped); returns the bytes freed."""
        rows = KeyBatch.from_keys(keys).rows
        with self._lock:
            self._check_open()
            freed = self._objects.delete_many(rows)[1]
            self._used -= freed
            return freed

    def _entry(self, key: ObjectKey) -> tuple[int, bytes] | None:
        entry = self._objects.get(key) if len(key) == OBJECT_KEY_BYTES else None
        return None if entry is None else (entry[0], entry[2])

    def _listing(self) -> list[tuple[ObjectKey, int, bytes]]:
        return [(ObjectKey(k), n, m) for k, n, _, m in self._objects.items()]

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self._read_bps

    def write_seconds(self, nbytes: int) -> float:
        """Modeled seconds to store ``nbytes`` into this tier."""
        return nbytes / self._write_bps

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"objects": len(self._objects), "used_bytes": self._used,
                    "capacity_bytes": self._capacity, **self._counts,
                    "read_seconds": self.read_seconds(self._counts["bytes_out"]),
                    "write_seconds": self.write_seconds(self._counts["bytes_in"])}

    def close(self) -> None:
        with self._lock:
            super().close()
            self._objects.clear()
            self._used = 0
