"""The bottom vocabulary: what an object is, how it is named, where it may live.

Index, policies, backends and the store all speak of the same few things; they
are defined once here, below all of them (this module imports only numpy,
the standard library and :mod:`hybridstore.errors`):

=========================  =====================================================
name                       meaning
=========================  =====================================================
:class:`ObjectKind`        page (KV of one block) or state (a checkpoint)
:data:`ObjectKey`          17 bytes: kind byte + 16-byte prefix hash
:func:`object_key`,        build a key / read its kind
:func:`key_kind`
:class:`KeyBatch`          the keys of a run of objects as ``(n, 17)`` uint8 rows
:data:`HASH_BYTES`         16: a chained prefix hash (``index/keys.py``)
:data:`OBJECT_KEY_BYTES`   17: an object key
:data:`TIER_ORDER`         tier names, fastest first
:data:`TIER_BITS`          the bit of each tier in per-object tier masks
:data:`ALIGN`              4096: slot / ``O_DIRECT`` / GDS alignment
:func:`aligned_empty`      an uninitialised ``ALIGN``-aligned uint8 array
:func:`byte_view`          any host buffer as a flat uint8 numpy view (no copy)
=========================  =====================================================
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NewType, overload

import numpy as np

HASH_BYTES = 16
"""Bytes of a chained prefix hash (the index's node key)."""

OBJECT_KEY_BYTES = HASH_BYTES + 1
"""Bytes of an :data:`ObjectKey`: a kind byte, then the prefix hash."""

ALIGN = 4096
"""Alignment of host-pool and device slots, disk slots and read buffers (``O_DIRECT``, GDS)."""

TIER_ORDER: tuple[str, ...] = ("device", "host", "disk", "remote")
"""Fastest first: a load reads each object from the first tier that holds it."""

TIER_BITS: dict[str, int] = {"device": 1, "host": 2, "disk": 4, "remote": 8}
"""Bit of each tier in the per-object tier masks."""

ObjectKey = NewType("ObjectKey", bytes)
"""17 bytes: an :class:`ObjectKind` byte, then the 16-byte prefix hash."""


class ObjectKind(enum.IntEnum):
    """What an object is; the first byte of its :data:`ObjectKey`."""

    PAGE = 1
    STATE = 2


def object_key(kind: ObjectKind, prefix_hash: bytes) -> ObjectKey:
    """Build the :data:`ObjectKey` of a page or checkpoint from its 16-byte hash."""
    if len(prefix_hash) != HASH_BYTES:
        raise ValueError(f"prefix hash must be {HASH_BYTES} bytes, got {len(prefix_hash)}")
    return ObjectKey(bytes((int(kind),)) + bytes(prefix_hash))


def key_kind(key: ObjectKey) -> ObjectKind:
    """The :class:`ObjectKind` of a key."""
    return ObjectKind(key[0])


class KeyBatch(Sequence[ObjectKey]):
    """Object keys of a run of objects, as the rows of one ``(n, 17)`` uint8 array.

    The store builds the keys of a run of pages at once from the index's
    16-byte keys.  A tier that keeps its object table natively (the
    accounting tier's :class:`~hybridstore.backends.keytable.KeyTable`) takes
    :attr:`rows` whole; every other tier sees an ordinary sequence of
    :data:`ObjectKey` bytes, built on first use.  Slicing gives a batch that
    shares the rows.
    """

    __slots__ = ("rows", "_keys")

    def __init__(self, rows: np.ndarray) -> None:
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != OBJECT_KEY_BYTES:
            raise ValueError(f"key rows must be a (n, {OBJECT_KEY_BYTES}) uint8 array, got "
                             f"{rows.dtype} {rows.shape}")
        self.rows = np.ascontiguousarray(rows)     # a stepped slice is copied
        self._keys: list[ObjectKey] | None = None

    @classmethod
    def of(cls, kind: ObjectKind, hashes: bytes) -> KeyBatch:
        """Keys of ``kind`` from 16-byte prefix hashes, concatenated (``object_key`` in bulk)."""
        if len(hashes) % HASH_BYTES:
            raise ValueError(f"prefix hashes must be {HASH_BYTES} bytes each, got {len(hashes)} bytes")
        rows = np.empty((len(hashes) // HASH_BYTES, OBJECT_KEY_BYTES), np.uint8)
        rows[:, 0] = int(kind)
        rows[:, 1:] = np.frombuffer(hashes, np.uint8).reshape(-1, HASH_BYTES)
        return cls(rows)

    @classmethod
    def from_keys(cls, keys: Iterable[ObjectKey]) -> KeyBatch:
        """A batch of any keys (a :class:`KeyBatch` is returned as it is)."""
        if isinstance(keys, KeyBatch):
            return keys
        keys = list(keys)
        if any(len(k) != OBJECT_KEY_BYTES for k in keys):
            raise ValueError(f"object keys are {OBJECT_KEY_BYTES} bytes")
        return cls(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, OBJECT_KEY_BYTES))

    def keys(self) -> list[ObjectKey]:
        """The keys as ``bytes``: the rows read back through a 17-byte *void* dtype, whose
        ``tolist()`` gives whole ``bytes`` (an ``S17`` view would strip trailing NULs)."""
        if self._keys is None:
            self._keys = self.rows.view(f"V{OBJECT_KEY_BYTES}").ravel().tolist()
        return self._keys

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @overload
    def __getitem__(self, i: int) -> ObjectKey: ...

    @overload
    def __getitem__(self, i: slice) -> KeyBatch: ...

    def __getitem__(self, i: int | slice) -> ObjectKey | KeyBatch:
        if isinstance(i, slice):
            return KeyBatch(self.rows[i])
        return self.keys()[i]

    def __iter__(self) -> Iterator[ObjectKey]:
        return iter(self.keys())


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array whose first byte is ``align``-aligned (O_DIRECT / GDS in place)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % align
    return raw[start:start + nbytes]


def byte_view(buf: Any, nbytes: int | None = None, *, writable: bool = False,
              what: str = "the buffer") -> np.ndarray:
    """``buf`` (its first ``nbytes``) as a flat uint8 numpy view, without copying.

    Takes a numpy array, a CPU torch tensor (torch is imported only when one is
    passed) or any bytes-like object, of any dtype.

    Args:
        buf: the host buffer.
        nbytes: bytes wanted (the view is cut to them); ``None``: all of ``buf``.
        writable: the caller writes into the view (a read-only buffer is refused).
        what: the name of ``buf`` in error messages.

    Raises:
        TypeError: ``buf`` is ``None`` or a tensor on a device.
        ValueError: ``buf`` is not contiguous, read-only while ``writable``, or
            shorter than ``nbytes``.
    """
    if type(buf).__module__.startswith("torch"):
        if not buf.is_cpu:
            raise TypeError(f"{what} is a {buf.device.type} tensor; this takes host memory "
                            "(use the device tier, or .cpu() it first)")
        if not buf.is_contiguous():
            raise ValueError(f"{what} must be contiguous; pass .contiguous() of it")
        # torch is loaded (buf is a tensor); a contiguous tensor's flat uint8 numpy view is
        # contiguous and writable, so the array checks below are not needed.
        return _cut(buf.detach().view(-1).view(sys.modules["torch"].uint8).numpy(), nbytes, what)
    if isinstance(buf, np.ndarray):
        arr = buf
    elif buf is None:
        raise TypeError(f"{what} is None; pass a uint8 array (only the accounting tier "
                        "takes None)")
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous; pass np.ascontiguousarray(...) of it")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only; pass a writable buffer")
    return _cut(arr.reshape(-1).view(np.uint8), nbytes, what)


def _cut(arr: np.ndarray, nbytes: int | None, what: str) -> np.ndarray:
    """The first ``nbytes`` of a flat uint8 view (all of it for None)."""
    if nbytes is None:
        return arr
    if nbytes < 0 or arr.nbytes < nbytes:
        raise ValueError(f"{what} holds {arr.nbytes} bytes, {nbytes} are needed")
    return arr[:nbytes]


__all__ = [
    "ALIGN", "HASH_BYTES", "OBJECT_KEY_BYTES", "TIER_BITS", "TIER_ORDER",
    "KeyBatch", "ObjectKey", "ObjectKind",
    "aligned_empty", "byte_view", "key_kind", "object_key",
]
