"""The tier contract: what every backend (host, disk, device, accounting) does.

Backends move bytes; they never decide what to keep (that is ``policy/``).
Every tier implements the same small set of primitives, so one conformance
suite (``tests/backends/conformance.py``) checks them all:

============================  ================================================
primitive                     meaning
============================  ================================================
``charge(nbytes)``            bytes the object would occupy here (after slot
                              rounding / 4 KiB alignment); ``ObjectTooLargeError``
                              if it can never fit
``free_bytes``                budget left (``capacity_bytes - used_bytes``)
``put(key, data, nbytes=,     store an object; returns a future that completes
meta=)``                      when the object is visible (for the disk tier:
                              after its bytes are durable and its catalog entry
                              committed). ``CapacityError`` when the budget is
                              short: the caller evicts and retries. Putting an
                              existing key replaces it.
``get_into(key, out)``        copy the object's bytes into ``out`` (a uint8
                              buffer of at least ``nbytes``); returns a future.
                              ``KeyError`` if absent; ``CorruptObjectError`` if
                              its checksum fails (the object is dropped).
``get(key)``                  convenience: a new uint8 array with the bytes
``contains(key)``             visible here?
``nbytes(key)``               its size, or ``None``
``meta(key)``                 the opaque metadata given at ``put``, or ``None``
``delete(key)``               drop it; returns the bytes freed (0 if absent)
``entries()``                 ``(key, nbytes, meta)`` of every visible object
                              (the disk tier lists what survived a restart)
``read_seconds(nbytes)``      modeled time to restore ``nbytes`` from this tier
``stats()``                   counters (a dict of numbers)
``close()``                   release resources; later calls raise
                              ``StoreClosedError``
============================  ================================================

Keys are :data:`ObjectKey` values: 17 bytes, one :class:`ObjectKind` byte
followed by the 16-byte prefix hash.  ``meta`` is opaque to backends; the index
encodes an object's kind, position and dependencies in it so that a reopened
disk tier can rebuild the index.

All methods are thread-safe.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any, ClassVar

import numpy as np

from hybridstore.errors import StoreClosedError
from hybridstore.objects import (  # noqa: F401 - the vocabulary, importable from here too
    KeyBatch,
    ObjectKey,
    ObjectKind,
    aligned_empty,
    key_kind,
    object_key,
)


def done_future(result: Any = None) -> Future:
    """A future that is already complete (for synchronous tiers)."""
    fut: Future = Future()
    fut.set_result(result)
    return fut


class Tier(ABC):
    """Abstract tier; see the module docstring for the contract.

    Subclasses set ``name`` and implement the abstract methods; they call
    :meth:`_check_open` first in every public method.
    """

    name: ClassVar[str] = "tier"
    #: False for the accounting tier, which keeps sizes but no bytes.
    stores_bytes: ClassVar[bool] = True
    #: True when objects survive a restart and ``entries()`` lists them after
    #: a reopen; such a tier also keeps small named blobs (``put_info`` /
    #: ``get_info``), where the store records its tensor layouts.
    durable: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._closed = False

    # -- capacity -----------------------------------------------------------------
    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """The tier's hard byte budget."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes charged against the budget (slot sizes, not payload sizes)."""

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @abstractmethod
    def charge(self, nbytes: int) -> int:
        """Bytes an object of ``nbytes`` would occupy; raises ``ObjectTooLargeError``."""

    # -- objects ------------------------------------------------------------------
    @abstractmethod
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Store ``data`` (uint8, ``nbytes`` long; ``None`` only on the accounting tier)."""

    @abstractmethod
    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """Copy the object's bytes into ``out``; the future yields ``nbytes``."""

    def get(self, key: ObjectKey) -> np.ndarray:
        n = self.nbytes(key)
        if n is None:
            raise KeyError(key)
        out = np.empty(n, dtype=np.uint8)
        self.get_into(key, out).result()
        return out

    @abstractmethod
    def contains(self, key: ObjectKey) -> bool: ...

    @abstractmethod
    def nbytes(self, key: ObjectKey) -> int | None: ...

    @abstractmethod
    def meta(self, key: ObjectKey) -> bytes | None: ...

    @abstractmethod
    def delete(self, key: ObjectKey) -> int: ...

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        """:meth:`delete` of several keys (a batch of evictions); returns the bytes freed."""
        return sum(self.delete(key) for key in keys)

    @abstractmethod
    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]: ...

    @abstractmethod
    def read_seconds(self, nbytes: int) -> float:
        """Modeled seconds to restore ``nbytes`` from this tier into engine memory."""

    def stats(self) -> dict[str, float]:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes}

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(
                f"the {self.name} tier was used after close(); open a new HybridStore")

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectTable(Tier):
    """A tier that keeps its object table in memory.

    ``self._objects`` maps each visible key to an entry with ``nbytes`` and
    ``meta`` attributes (a tier with another table overrides :meth:`_entry`
    and :meth:`_listing`); the probes below are shared by every such tier.
    """

    _objects: Any

    def _entry(self, key: ObjectKey) -> tuple[int, bytes] | None:
        """``(nbytes, meta)`` of a visible object, or None (the lock is held)."""
        entry = self._objects.get(key)
        return None if entry is None else (entry.nbytes, entry.meta)

    def _listing(self) -> list[tuple[ObjectKey, int, bytes]]:
        """``(key, nbytes, meta)`` of every visible object (the lock is held)."""
        return [(key, e.nbytes, e.meta) for key, e in self._objects.items()]

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            self._check_open()
            return key in self._objects

    def nbytes(self, key: ObjectKey) -> int | None:
        with self._lock:
            self._check_open()
            entry = self._entry(key)
            return None if entry is None else entry[0]

    def meta(self, key: ObjectKey) -> bytes | None:
        with self._lock:
            self._check_open()
            entry = self._entry(key)
            return None if entry is None else entry[1]

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        with self._lock:
            self._check_open()
            items = self._listing()
        return iter(items)
