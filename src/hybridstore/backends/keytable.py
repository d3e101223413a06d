"""An exact-key object table: fixed-width byte keys to ``(nbytes, charged, meta)``.

The accounting tier records every stored object as ``nbytes`` (its size),
``charged`` (what it costs against the tier's budget) and ``meta`` (opaque
bytes).  In a ``dict[bytes, tuple]`` the per-key Python work of a batch (a
bytes object and a tuple per key, one probe each) dominates puts and deletes
of a few thousand pages; :class:`KeyTable` takes a whole batch as one buffer
of packed keys (a uint8 array of shape ``(n, width)``) and handles it in one
call.

Semantics
---------
* ``KeyTable(width, capacity_hint=0)``: keys are exactly ``width`` bytes
  (``8 <= width <= 65536``; the store's object keys are 17: a kind byte and a
  16-byte hash).  ``ValueError`` for a width outside that range or a negative
  hint.  ``t.width`` gives it back.
* An entry is ``(nbytes, charged, meta)``: two ints in ``[0, 2**63)``
  (``ValueError`` when negative, ``OverflowError`` when too large,
  ``TypeError`` for a non-int) and ``bytes`` (``b""`` for none; a ``bytes``
  subclass is stored as plain ``bytes``; anything else is a ``TypeError``).
* Single keys (:meth:`~PyKeyTable.get`, :meth:`~PyKeyTable.set`,
  :meth:`~PyKeyTable.pop`, ``in``) are ``bytes`` or any other C-contiguous
  bytes-like object: ``TypeError`` for a non-buffer, ``ValueError`` for a
  non-contiguous one or (except for ``in``, which answers ``False``) one of
  another length.
* Batches (:meth:`~PyKeyTable.put_many`, :meth:`~PyKeyTable.delete_many`)
  take ``rows``: any C-contiguous buffer (a uint8 array of shape
  ``(n, width)``, a ``V{width}`` array, ``bytes``) whose length is a multiple
  of ``width``; each ``width``-byte row is one key.  ``TypeError`` for a
  non-buffer, ``ValueError`` for a non-contiguous buffer or a ragged length.
* :meth:`~PyKeyTable.put_many` applies its rows in order exactly as a dict
  would and returns ``(added, delta)``: the distinct keys that were absent
  before the call and the sum over rows of ``charged`` minus the charge the
  key had just before that row (0 for a new key), so a key repeated within
  the batch counts once.  When ``delta > budget`` it undoes everything and
  returns ``None``; when a partial sum leaves int64 it undoes everything and
  raises ``OverflowError``.  An invalid argument changes nothing.
* Every method either succeeds or leaves the contents unchanged.  Order of
  :meth:`~PyKeyTable.items` is unspecified.

Backends
--------
:func:`KeyTable` makes the C extension type
``hybridstore._cext.keytable.KeyTable`` when it is in use
(``hybridstore._native.keytable``; built and not switched to the twins) and
otherwise a :class:`PyKeyTable`, a dict-backed twin with the same API and
errors.  The C type is an open-addressing table with linear probing, a
splitmix64-mixed home slot, a load factor of at most 0.7, backward-shift
deletion and a journal that undoes a rejected batch (see the header of
``native/src/keytable.c``).
Only its capacity can differ after a rejected :meth:`~PyKeyTable.put_many`
(it may have grown for the batch), which :meth:`~PyKeyTable.memory_bytes`
shows.
"""

from __future__ import annotations

import operator
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridstore import _native

__all__ = ["KeyTable", "PyKeyTable"]

_MIN_WIDTH = 8
_MAX_WIDTH = 65536
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

Entry = tuple[int, int, bytes]
"""``(nbytes, charged, meta)``."""


def _count(value: Any, what: str) -> int:
    """Validate ``nbytes`` / ``charged``: an int in ``[0, 2**63)``."""
    v = operator.index(value)
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v!r}")
    if v > _INT64_MAX:
        raise OverflowError(f"{what} must be < 2**63 (int64), got {v!r}")
    return v


def _meta(meta: Any) -> bytes:
    """Validate ``meta``: ``bytes`` (a subclass becomes plain ``bytes``)."""
    if type(meta) is bytes:
        return meta
    if not isinstance(meta, bytes):
        raise TypeError(f"meta must be bytes, got {type(meta).__name__}")
    return bytes(meta)


class PyKeyTable:
    """Dict-backed twin of the C ``KeyTable``: same API, same errors.

    Used when the native extension is not built or the twins are selected
    (:mod:`hybridstore._native`), and by the tests to check
    the C type against it.

    Args:
        width: bytes in every key, in ``[8, 65536]``.
        capacity_hint: entries expected (``>= 0``); the C type sizes its
            table for them, this twin only validates it.

    Raises:
        ValueError: ``width`` out of range or ``capacity_hint < 0``.
        TypeError: an argument is not an int.
    """

    __slots__ = ("_d", "_width")

    def __init__(self, width: int, capacity_hint: int = 0) -> None:
        hint = operator.index(capacity_hint)
        w = operator.index(width)
        if not _MIN_WIDTH <= w <= _MAX_WIDTH:
            raise ValueError(f"width must be in [{_MIN_WIDTH}, {_MAX_WIDTH}], got {w!r}")
        if hint < 0:
            raise ValueError(f"capacity_hint must be >= 0, got {hint}")
        self._width = w
        self._d: dict[bytes, Entry] = {}

    @property
    def width(self) -> int:
        """Bytes in every key."""
        return self._width

    # -- argument checks ----------------------------------------------------

    def _key_bytes(self, key: Any) -> bytes:
        """A bytes-like key as ``bytes``, of any length."""
        if type(key) is bytes:
            return key
        try:
            view = memoryview(key)
        except TypeError:
            raise TypeError(
                f"KeyTable keys must be bytes-like, got {type(key).__name__}") from None
        with view:
            if not view.c_contiguous:
                raise ValueError("KeyTable keys must be C-contiguous buffers")
            return view.tobytes()

    def _key(self, key: Any) -> bytes:
        """A bytes-like key of exactly ``width`` bytes, as ``bytes``."""
        k = self._key_bytes(key)
        if len(k) != self._width:
            raise ValueError(f"KeyTable keys must be {self._width} bytes, got {len(k)}")
        return k

    def _rows(self, rows: Any) -> list[bytes]:
        """The keys packed in ``rows``, as a list of ``bytes``."""
        w = self._width
        try:
            view = memoryview(rows)
        except TypeError:
            raise TypeError(
                f"rows must be a bytes-like buffer of {w}-byte keys (e.g. a uint8 array of "
                f"shape (n, {w})), got {type(rows).__name__}") from None
        with view:
            if not view.c_contiguous:
                raise ValueError(
                    "rows must be C-contiguous; copy it with np.ascontiguousarray(x)")
            if view.nbytes % w:
                raise ValueError(
                    f"rows holds {view.nbytes} bytes, not a multiple of the key width {w}")
            if not view.nbytes:
                return []
            return np.frombuffer(view.cast("B"), dtype=f"V{w}").tolist()

    # -- queries ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Any) -> bool:
        """Whether ``key`` is present (``False`` for a key of another width)."""
        return self._key_bytes(key) in self._d

    def get(self, key: Any, /) -> Entry | None:
        """``(nbytes, charged, meta)`` of ``key``, or ``None`` when it is absent."""
        return self._d.get(self._key(key))

    def items(self) -> list[tuple[bytes, int, int, bytes]]:
        """A new list of ``(key, nbytes, charged, meta)`` tuples, in unspecified order."""
        return [(k, *e) for k, e in self._d.items()]

    # -- single changes -----------------------------------------------------

    def set(self, key: Any, nbytes: int, charged: int, meta: bytes = b"") -> Entry | None:
        """Insert or replace the entry of ``key``.

        Returns:
            The previous ``(nbytes, charged, meta)``, or ``None``.
        """
        k = self._key(key)
        entry = (_count(nbytes, "nbytes"), _count(charged, "charged"), _meta(meta))
        old = self._d.get(k)
        self._d[k] = entry
        return old

    def pop(self, key: Any, /) -> Entry | None:
        """Remove ``key``; return its ``(nbytes, charged, meta)``, or ``None`` when absent."""
        return self._d.pop(self._key(key), None)

    def clear(self) -> None:
        """Remove every entry."""
        self._d.clear()

    # -- batches ------------------------------------------------------------

    def put_many(self, rows: Any, nbytes: int, charged: int, meta: bytes,
                 budget: int) -> tuple[int, int] | None:
        """Record every key of ``rows`` with ``(nbytes, charged, meta)``, within a budget.

        Rows apply in order, as ``t.set(key, nbytes, charged, meta)`` each.

        Args:
            rows: packed ``width``-byte keys (see the module docstring).
            nbytes: size of every object, in ``[0, 2**63)``.
            charged: charge of every object, in ``[0, 2**63)``.
            meta: bytes stored with every object (``b""`` for none).
            budget: the most ``delta`` may be (any int).

        Returns:
            ``(added, delta)``: the distinct keys absent before the call, and
            the sum over rows of ``charged`` minus the charge the key had just
            before that row (0 for a new key).  ``None`` when ``delta >
            budget``: the table is then exactly as before the call.

        Raises:
            OverflowError: a partial sum of ``delta`` leaves int64 (nothing
                is changed).
        """
        keys = self._rows(rows)
        nb = _count(nbytes, "nbytes")
        ch = _count(charged, "charged")
        entry = (nb, ch, _meta(meta))
        limit = operator.index(budget)
        d = self._d
        fresh = dict.fromkeys(keys)
        if d.keys().isdisjoint(fresh):
            # Only new keys: the partial sums only grow, so the last one
            # decides both the overflow and the budget.
            delta = ch * len(fresh)
            if delta > _INT64_MAX:
                raise OverflowError("put_many: the change in charged bytes overflows int64")
            if delta > limit:
                return None
            d.update(dict.fromkeys(fresh, entry))
            return len(fresh), delta
        journal: list[Entry | None] = []
        get = d.get
        delta = added = 0
        overflowed = False
        for k in keys:
            before = get(k)
            journal.append(before)
            d[k] = entry
            if before is None:
                added += 1
                delta += ch
            else:
                delta += ch - before[1]
            if not _INT64_MIN <= delta <= _INT64_MAX:
                overflowed = True
                break
        if overflowed or delta > limit:
            for k, before in zip(reversed(keys[:len(journal)]), reversed(journal)):
                if before is None:
                    del d[k]
                else:
                    d[k] = before
            if overflowed:
                raise OverflowError("put_many: the change in charged bytes overflows int64")
            return None
        return added, delta

    def delete_many(self, rows: Any, /) -> tuple[int, int]:
        """Remove every key of ``rows`` that is present (absent and repeated keys are ignored).

        Returns:
            ``(removed, freed)``: the entries removed and the sum of their ``charged``.
        """
        pop = self._d.pop
        removed = freed = 0
        for k in self._rows(rows):
            e = pop(k, None)
            if e is not None:
                removed += 1
                freed += e[1]
        return removed, freed

    # -- size ---------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes this table holds: the dict, its keys, entry tuples and ints, and this wrapper.

        Meta bytes objects, usually shared between entries, are not counted.
        """
        getsizeof = sys.getsizeof
        return (object.__sizeof__(self) + getsizeof(self._d)
                + sum(getsizeof(k) + getsizeof(e) + getsizeof(e[0]) + getsizeof(e[1])
                      for k, e in self._d.items()))

    def __sizeof__(self) -> int:
        return self.memory_bytes()


if TYPE_CHECKING:
    KeyTable = PyKeyTable
else:
    def KeyTable(*args: Any, **kwargs: Any) -> PyKeyTable:
        """A new table (arguments as :class:`PyKeyTable`): the C type when
        ``_native.keytable`` is in use, else the twin."""
        ext = _native.keytable
        return (PyKeyTable if ext is None else ext.KeyTable)(*args, **kwargs)
