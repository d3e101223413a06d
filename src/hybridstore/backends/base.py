"""The tier contract: what every backend (host, disk, device, accounting) does.

Backends move bytes; they never decide what to keep (that is ``policy/``).
Every tier implements the same small set of primitives, so one conformance
suite (:mod:`hybridstore.testing.tiers`) checks them all:

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

Batch and paired verbs.  Each has a working default built on the primitives
above, so a new tier needs only those; a tier overrides a verb where it can do
better (the disk tier coalesces neighbours into one I/O, the pinned pool hands
out its slots, the accounting tier records a run of keys in one call):

==================================  ==========================================
verb                                meaning (default)
==================================  ==========================================
``put_many(keys, datas, nbytes=,    ``put`` of a run of objects of one size;
metas=)``                           a list of futures (``put`` of each)
``delete_many(keys)``               ``delete`` of several; bytes freed
``read_many_into(keys, dst,         read ``keys[i]`` into ``dst[offsets[i]:]``;
offsets)``                          one future for all (``get_into`` of each)
``slot_bytes(nbytes)``              the spacing at which neighbours' reads
                                    coalesce (``charge(nbytes)``)
``stage_many(keys, nbytes)``        writable slots for a run of new objects,
``commit_many(keys)`` /             invisible until committed (vLLM's
``abort_many(keys)``                ``prepare_store``/``complete_store``;
                                    ``stage``/``commit``/``abort`` of one key);
                                    returned as ``(buffers, which, offsets)``,
                                    object ``i`` at
                                    ``buffers[which[i]][offsets[i]:]`` (host
                                    buffers, ``put_many`` on commit)
``pin_many(keys)`` /                hold objects so that their bytes stay where
``unpin_many(keys)``                they are (no-ops)
``view(key)``                       the object's bytes, read-only (a copy)
``locate(keys)``                    where pinned objects lie, as
                                    ``stage_many`` returns it (a copy of each)
``put_info(name, value)`` /         small named blobs kept with the objects
``get_info(name)``                  (in memory; a ``durable`` tier keeps them
                                    across a restart)
==================================  ==========================================

Capabilities (attributes a caller branches on, instead of the tier's type):
``stores_bytes`` (False: the accounting tier keeps sizes only), ``durable``
(objects and info blobs survive a restart), ``zero_copy`` (``view`` and
``locate`` give the tier's own memory, valid while pinned: no copy),
``coalesces_writes`` (``put_many`` of a run is cheaper than a ``put`` of each).

Keys are :data:`ObjectKey` values: 17 bytes, one :class:`ObjectKind` byte
followed by the 16-byte prefix hash.  ``meta`` is opaque to backends; the index
encodes an object's kind, position and dependencies in it so that a reopened
disk tier can rebuild the index.

All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridstore.errors import StoreClosedError
from hybridstore.objects import ObjectKey, aligned_empty

Slots = tuple[list[np.ndarray], np.ndarray, np.ndarray]
"""``(buffers, which, offsets)``: object ``i`` lies at ``buffers[which[i]][offsets[i]:]``
(what :meth:`Tier.stage_many` and :meth:`Tier.locate` return)."""


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

    name: str = "tier"
    #: False for the accounting tier, which keeps sizes but no bytes.
    stores_bytes: bool = True
    #: True when objects survive a restart and ``entries()`` lists them after
    #: a reopen; such a tier also keeps its named blobs (``put_info`` /
    #: ``get_info``) across a restart, where the store records its tensor layouts.
    durable: bool = False
    #: True when :meth:`view` and :meth:`locate` give the tier's own memory (valid
    #: while the keys are pinned), so objects are gathered in place, never copied.
    zero_copy: bool = False
    #: True when :meth:`put_many` of a run costs less than a :meth:`put` of each (the
    #: disk tier writes neighbours in one I/O), so copies to it go a run at a time.
    coalesces_writes: bool = False
    #: True when :meth:`put_many` takes ``written=`` futures, each completed as soon as
    #: the tier no longer reads its data buffer (the write returned), before the object
    #: is durable and visible (the disk tier); otherwise a buffer is in use until its
    #: put's future completes.
    reports_written: bool = False

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
        """A copy of an object's bytes.

        Raises:
            KeyError: the object is not here.
        """
        while True:
            n = self.nbytes(key)
            if n is None:
                raise KeyError(key)
            out = np.empty(n, dtype=np.uint8)
            try:
                got = self.get_into(key, out).result()
            except ValueError:
                if self.nbytes(key) not in (n, None):
                    continue       # replaced by a larger version since nbytes(): again
                raise
            if got == n:
                return out
            # replaced by a smaller version since nbytes(): ``out`` holds it and a tail of
            # garbage, so read again at the size it has now (a thread's put of the key)

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

    def urgent(self) -> contextlib.AbstractContextManager[None]:
        """While held, the tier makes pending writes durable as soon as they land (a
        caller waits for one); tiers that batch their commits (the disk tier) otherwise
        let them gather.  A no-op by default."""
        return contextlib.nullcontext()

    # -- batch and paired verbs (working defaults; see the module docstring) -------
    def put_many(self, keys: Sequence[ObjectKey], datas: Sequence[Any] | None, *, nbytes: int,
                 metas: Sequence[bytes] | None = None) -> list[Future]:
        """:meth:`put` of a run of objects of one size (``datas`` ``None`` only on a tier
        that keeps no bytes).

        The default puts them one by one: a failure leaves the objects put before it.

        Returns:
            One future per key, each as :meth:`put` returns it.
        """
        if datas is not None and len(datas) != len(keys):
            raise ValueError("put_many needs one data buffer per key")
        if metas is not None and len(metas) != len(keys):
            raise ValueError("put_many needs one meta per key")
        return [self.put(key, None if datas is None else datas[i], nbytes=nbytes,
                         meta=b"" if metas is None else metas[i])
                for i, key in enumerate(keys)]

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        """Read objects ``keys[i]`` into ``dst[offsets[i]:]`` (a host uint8 array).

        The default is :meth:`get_into` of each.

        Returns:
            One future for all of them, yielding their total ``nbytes`` once every
            read has finished; it fails with the first error.

        Raises:
            KeyError: a key is not visible here.
            ValueError: a destination does not fit in ``dst``.
        """
        if len(keys) != len(offsets):
            raise ValueError("keys and offsets must have one length")
        futs = []
        for key, off in zip(keys, offsets):
            n = self.nbytes(key)
            if n is None:
                raise KeyError(key)
            if off < 0 or off + n > dst.nbytes:
                raise ValueError(f"offset {off} + {n} bytes is past dst ({dst.nbytes} bytes)")
            futs.append(self.get_into(key, dst[off:off + n]))
        return _all_of(futs)

    def window_victims(self, nbytes: int, may_free: Callable[[ObjectKey], bool]
                       ) -> list[ObjectKey] | None:
        """Objects whose deletion lets one object of ``nbytes`` find a slot when the free
        bytes suffice but are split (fragmentation), fewest bytes first, among those
        ``may_free`` allows; ``None`` when no such set exists.  Only called on tiers
        whose :attr:`finds_windows` is true (the default tier has no slots)."""
        return None

    @property
    def finds_windows(self) -> bool:
        """Whether :meth:`window_victims` answers (a tier that carves slots out of arenas)."""
        return False

    def relocate_window(self, nbytes: int, may_move: Callable[[ObjectKey], bool]) -> int | None:
        """Make one slot for ``nbytes`` in a fragmented tier by moving the objects of the
        cheapest window elsewhere in the tier instead of deleting them (compaction);
        ``may_move`` says which may move.  Returns the bytes moved, or ``None`` when the
        tier cannot (the default: callers evict :meth:`window_victims` instead)."""
        return None

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes an ``nbytes`` object spans where this tier keeps it (the spacing at which
        :meth:`read_many_into` may read neighbours together); default :meth:`charge`."""
        return self.charge(nbytes)

    def stage_many(self, keys: Sequence[ObjectKey], nbytes: int) -> Slots:
        """Writable slots for a run of new objects of one size: all of them or none.

        The objects stay invisible until :meth:`commit_many`; :meth:`abort_many`
        gives the slots back.  The default stages in new host buffers and puts
        them on commit.

        Returns:
            ``(buffers, which, offsets)``: object ``i`` is written at
            ``buffers[which[i]][offsets[i]:][:nbytes]``.

        Raises:
            CapacityError: no room for all of them (none is staged).
            ObjectTooLargeError: ``nbytes`` can never fit.
            ValueError: a key is repeated or already staged.
        """
        self._check_open()
        self.charge(nbytes)
        staged = self._staged_buffers()
        with self._lock:
            if len(set(keys)) != len(keys) or any(key in staged for key in keys):
                raise ValueError("stage_many needs distinct keys that are not staged; "
                                 "commit_many() or abort_many() the earlier ones first")
            stride = -(-nbytes // 64) * 64
            buf = aligned_empty(stride * len(keys))
            for i, key in enumerate(keys):
                staged[key] = (buf[i * stride:i * stride + nbytes], nbytes)
        return ([buf], np.zeros(len(keys), np.int64),
                np.arange(len(keys), dtype=np.int64) * stride)

    def commit_many(self, keys: Sequence[ObjectKey]) -> None:
        """Make the objects staged for ``keys`` visible (replacing older ones).

        Raises:
            KeyError: a key is not staged (none is committed).
            CapacityError: (default) the put of the staged bytes found no room; the
                keys stay staged: evict and commit again, or abort.
        """
        self._check_open()
        staged = self._staged_buffers()
        with self._lock:
            for key in keys:
                if key not in staged:
                    raise KeyError(key)
            items = [staged[key] for key in keys]
        if items:
            futs = self.put_many(keys, [buf for buf, _ in items], nbytes=items[0][1])
            for fut in futs:
                fut.result()
        with self._lock:
            for key in keys:
                staged.pop(key, None)

    def abort_many(self, keys: Sequence[ObjectKey]) -> None:
        """Give back the slots staged for ``keys``; keys not staged are skipped."""
        staged = self._staged_buffers()
        with self._lock:
            for key in keys:
                staged.pop(key, None)

    def stage(self, key: ObjectKey, nbytes: int) -> np.ndarray:
        """:meth:`stage_many` of one key: the writable slot of a new object (then
        :meth:`commit` or :meth:`abort` it)."""
        buffers, which, offsets = self.stage_many([key], nbytes)
        at = int(offsets[0])
        return buffers[int(which[0])][at:at + nbytes]

    def commit(self, key: ObjectKey) -> None:
        """:meth:`commit_many` of one key."""
        self.commit_many([key])

    def abort(self, key: ObjectKey) -> None:
        """:meth:`abort_many` of one key."""
        self.abort_many([key])

    def _staged_buffers(self) -> dict[ObjectKey, tuple[np.ndarray, int]]:
        """The default :meth:`stage_many`'s buffers by key (made on first use)."""
        staged: dict[ObjectKey, tuple[np.ndarray, int]] = self.__dict__.setdefault(
            "_default_staged", {})
        return staged

    def pin_many(self, keys: Sequence[ObjectKey]) -> None:
        """Hold ``keys`` so that their bytes stay where :meth:`locate` / :meth:`view` say,
        until :meth:`unpin_many`; all of them or none (the default holds nothing).

        Raises:
            KeyError: (tiers that pin) a key is not visible.
        """

    def unpin_many(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one hold of each key taken by :meth:`pin_many`."""

    def view(self, key: ObjectKey) -> np.ndarray:
        """The object's bytes, read-only: the tier's own memory on a ``zero_copy`` tier
        (valid while the key is pinned), else a copy (the default)."""
        out = self.get(key)
        out.flags.writeable = False
        return out

    def locate(self, keys: Sequence[ObjectKey]) -> Slots:
        """Where objects lie, as ``(buffers, which, offsets)`` (object ``i`` at
        ``buffers[which[i]][offsets[i]:]``), for one gather over all of them.

        On a ``zero_copy`` tier this is the tier's own memory (pin the keys while
        using it); the default reads a copy of each into one new buffer.

        Raises:
            KeyError: a key is not visible.
        """
        sizes = []
        for key in keys:
            n = self.nbytes(key)
            if n is None:
                raise KeyError(key)
            sizes.append(-(-n // 64) * 64)
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        buf = aligned_empty(int(offsets[-1]))
        if keys:
            self.read_many_into(keys, buf, offsets[:-1].tolist()).result()
        return [buf], np.zeros(len(keys), np.int64), offsets[:-1]

    def put_info(self, name: str, value: bytes) -> None:
        """Keep a small named blob (the store's tensor layouts); a ``durable`` tier keeps it
        across a restart, the default only in memory."""
        self._check_open()
        with self._lock:
            self.__dict__.setdefault("_default_info", {})[name] = bytes(value)

    def get_info(self, name: str) -> bytes | None:
        """A blob kept with :meth:`put_info`, or ``None``."""
        self._check_open()
        with self._lock:
            return self.__dict__.get("_default_info", {}).get(name)

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


def _all_of(futs: list[Future]) -> Future:
    """One future for ``futs``: their results summed once all are done, or the first error."""
    if len(futs) == 1:
        return futs[0]
    total = FutureSum(len(futs))
    for f in futs:
        f.add_done_callback(total.done_future)
    return total.future


class FutureSum:
    """One future for ``parts`` pieces of work: it completes when the last part is
    done, with the parts' byte counts summed, or with the first error any part met."""

    __slots__ = ("future", "_left", "_bytes", "_error", "_lock")

    def __init__(self, parts: int) -> None:
        self.future: Future = Future()
        self._left = parts
        self._bytes = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if not parts:
            self.future.set_result(0)

    def done(self, nbytes: int, error: BaseException | None = None) -> None:
        """One part is done: ``nbytes`` moved, or ``error``."""
        with self._lock:
            self._left -= 1
            self._bytes += nbytes
            self._error = self._error or error
            last = self._left == 0
        if last:
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(self._bytes)

    def done_future(self, f: Future) -> None:
        """:meth:`done` with a finished part's future (a done callback)."""
        exc = f.exception()
        self.done(0 if exc is not None else (f.result() or 0), exc)


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
