"""A compact hash map from uint64 keys to int32 values.

The prefix index maps the low 64 bits of every node's 128-bit block key to
the node id.  A ``dict[int, int]`` costs about 100 bytes per entry (two
Python ints plus the table slot); :class:`U64Map` stores the same mapping in
12-byte slots of one open-addressing table (17-34 bytes per entry) and
answers whole arrays of keys in one call.

Semantics
---------
* Keys are ints in ``[0, 2**64)`` (0 and ``2**64 - 1`` included).  Any other
  int raises ``OverflowError``; a non-int (``float``, ``str``, ...) raises
  ``TypeError``.  This holds for every operation, lookups included.
* Values are ints in ``[0, 2**31)``: ``ValueError`` for a negative value
  (``-1`` is the "missing" marker of the batch methods), ``OverflowError`` for
  one ``>= 2**31``.
* ``m[k]``, ``m[k] = v``, ``del m[k]``, ``k in m``, ``len(m)``, iteration over
  the keys (in unspecified order), :meth:`~PyU64Map.get`,
  :meth:`~PyU64Map.pop`, :meth:`~PyU64Map.clear` and
  :meth:`~PyU64Map.items` behave as for a dict; adding or removing keys while
  iterating raises ``RuntimeError``.
* The batch methods take 1-D C-contiguous buffers (numpy arrays): keys of
  8-byte integers (``np.uint64``; ``np.int64`` is read bit for bit), outputs
  of ``np.int64``, values of 4- or 8-byte integers.  A wrong item type raises
  ``TypeError``; a wrong shape or length, a non-contiguous or read-only
  output raises ``ValueError``.

Backends
--------
:func:`U64Map` makes the C extension type ``hybridstore._cext.u64map.U64Map``
when it is in use (``hybridstore._native.u64map``; built and not switched to
the twins) and otherwise a :class:`PyU64Map`, a dict-backed twin with the same
API and errors.  The C type is an open-addressing table with linear probing, a
splitmix64-mixed home slot, a load factor of at most 0.7 and backward-shift
deletion (see the header of ``native/src/u64map.c``).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridstore import _native

__all__ = ["PyU64Map", "U64Map"]

_KEY_LIMIT = 1 << 64
_VALUE_LIMIT = 1 << 31
_MISSING = -1

_SIGNED_FORMATS = "bhilqn"
_UNSIGNED_FORMATS = "BHILQN"
_FOREIGN_ORDER = ">!" if sys.byteorder == "little" else "<"


def _key(key: Any) -> int:
    """Validate one key: an int in ``[0, 2**64)``."""
    k = operator.index(key)
    if not 0 <= k < _KEY_LIMIT:
        raise OverflowError(f"U64Map keys must be ints in [0, 2**64), got {k!r}")
    return k


def _value_range_error(value: int) -> Exception:
    message = (f"U64Map values must be ints in [0, 2**31) (-1 marks an empty slot), "
               f"got {value!r}")
    return ValueError(message) if value < 0 else OverflowError(message)


def _value(value: Any) -> int:
    """Validate one value: an int in ``[0, 2**31)``."""
    v = operator.index(value)
    if not 0 <= v < _VALUE_LIMIT:
        raise _value_range_error(v)
    return v


def _int_kind(fmt: str) -> str:
    """``"i"``/``"u"`` for a native-order signed/unsigned integer buffer format, else ``""``."""
    if fmt[:1] in ("@", "=") or (fmt[:1] in ("<", ">", "!") and fmt[0] not in _FOREIGN_ORDER):
        fmt = fmt[1:]
    if len(fmt) != 1:
        return ""
    if fmt in _SIGNED_FORMATS:
        return "i"
    return "u" if fmt in _UNSIGNED_FORMATS else ""


def _buffer(obj: Any, what: str, itemsizes: tuple[int, ...], kinds: str, desc: str,
            dtype: str, writable: bool = False) -> np.ndarray:
    """View a buffer-protocol object as a 1-D numpy array, checked as the C type checks it.

    Args:
        obj: the argument.
        what: its name, for messages.
        itemsizes: accepted item sizes in bytes.
        kinds: accepted integer kinds, ``"i"`` (signed) and/or ``"u"`` (unsigned).
        desc: the accepted item types in words, for the ``TypeError``.
        dtype: the numpy dtype to suggest in the ``TypeError``.
        writable: whether the buffer must be writable.

    Returns:
        A 1-D array sharing ``obj``'s memory, of the buffer's own integer type.

    Raises:
        TypeError: ``obj`` is not a buffer, or its items are not such integers.
        ValueError: it is not 1-D or not C-contiguous, or read-only when
            ``writable``.
    """
    view = memoryview(obj)
    kind = _int_kind(view.format)
    if not kind or kind not in kinds or view.itemsize not in itemsizes:
        raise TypeError(
            f"{what} must hold native-order {desc} (got buffer format '{view.format}', "
            f"itemsize {view.itemsize}); convert it with np.ascontiguousarray(x, dtype={dtype})")
    if view.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got {view.ndim} dimensions")
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; copy it with np.ascontiguousarray(x)")
    if writable and view.readonly:
        raise ValueError(f"{what} must be writable, got a read-only buffer")
    return np.frombuffer(view, dtype=f"{kind}{view.itemsize}")


def _keys(obj: Any) -> np.ndarray:
    """Keys as a uint64 array (int64 keys reinterpreted bit for bit)."""
    return _buffer(obj, "keys", (8,), "iu", "8-byte integers (uint64)", "np.uint64").view(
        np.uint64)


def _out(obj: Any, keys: np.ndarray) -> np.ndarray:
    out = _buffer(obj, "out", (8,), "i", "int64", "np.int64", writable=True)
    if out.shape[0] != keys.shape[0]:
        raise ValueError(f"out has {out.shape[0]} items but keys has {keys.shape[0]}")
    return out


class PyU64Map:
    """Dict-backed twin of the C ``U64Map``: same API, same errors.

    Used when the native extension is not built or the twins are selected
    (:mod:`hybridstore._native`), and by the tests to check
    the C type against it.

    Args:
        capacity_hint: entries expected (``>= 0``); the C type sizes its
            table for them, this twin only validates it.

    Raises:
        ValueError: ``capacity_hint < 0``.
        TypeError: ``capacity_hint`` is not an int.
    """

    __slots__ = ("_d",)

    def __init__(self, capacity_hint: int = 0) -> None:
        hint = operator.index(capacity_hint)
        if hint < 0:
            raise ValueError(f"capacity_hint must be >= 0, got {hint}")
        self._d: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    def __getitem__(self, key: int) -> int:
        return self._d[_key(key)]

    def __setitem__(self, key: int, value: int) -> None:
        self._d[_key(key)] = _value(value)

    def __delitem__(self, key: int) -> None:
        del self._d[_key(key)]

    def __contains__(self, key: int) -> bool:
        return _key(key) in self._d

    def __iter__(self) -> Iterator[int]:
        return iter(self._d)

    def get(self, key: int, default: Any = None, /) -> Any:
        """``m[key]`` when ``key`` is present, else ``default``."""
        return self._d.get(_key(key), default)

    def pop(self, key: int, *default: Any) -> Any:
        """Remove ``key`` and return its value.

        Args:
            key: the key.
            default: (optional, positional) returned when ``key`` is missing.

        Raises:
            KeyError: ``key`` is missing and no default was given.
        """
        if len(default) > 1:
            raise TypeError(f"pop expected 1 or 2 arguments, got {1 + len(default)}")
        return self._d.pop(_key(key), *default)

    def clear(self) -> None:
        """Remove every entry."""
        self._d.clear()

    def items(self) -> list[tuple[int, int]]:
        """A new list of ``(key, value)`` tuples, in unspecified order."""
        return list(self._d.items())

    def get_many(self, keys: Any, out: Any, /) -> None:
        """For each ``i``, ``out[i] = m[keys[i]]``, or ``-1`` when ``keys[i]`` is missing.

        Args:
            keys: 1-D C-contiguous buffer of 8-byte integers (``np.uint64``).
            out: writable 1-D C-contiguous ``np.int64`` buffer, as long as ``keys``.
        """
        k = _keys(keys)
        o = _out(out, k)
        get = self._d.get
        o[:] = [get(key, _MISSING) for key in k.tolist()]

    def prefix_many(self, keys: Any, out: Any, /) -> int:
        """Look keys up in order until the first missing one.

        Args:
            keys: 1-D C-contiguous buffer of 8-byte integers (``np.uint64``).
            out: writable 1-D C-contiguous ``np.int64`` buffer, as long as ``keys``.

        Returns:
            The count ``k`` of leading keys found; ``out[:k]`` receives their
            values and ``out[k:]`` is left untouched.
        """
        k = _keys(keys)
        o = _out(out, k)
        d = self._d
        found = []
        for key in k.tolist():
            value = d.get(key, _MISSING)
            if value == _MISSING:
                break
            found.append(value)
        o[:len(found)] = found
        return len(found)

    def set_many(self, keys: Any, values: Any, /) -> None:
        """``m[keys[i]] = values[i]`` for each ``i`` in order (a repeated key keeps its last value).

        Every value is checked before anything is stored.

        Args:
            keys: 1-D C-contiguous buffer of 8-byte integers (``np.uint64``).
            values: 1-D C-contiguous buffer of 4- or 8-byte integers, as long
                as ``keys``, each in ``[0, 2**31)``.

        Raises:
            ValueError: a negative value, or a length mismatch.
            OverflowError: a value ``>= 2**31``.
        """
        k = _keys(keys)
        v = _buffer(values, "values", (4, 8), "iu", "4- or 8-byte integers", "np.int32")
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"values has {v.shape[0]} items but keys has {k.shape[0]}")
        bad = np.flatnonzero((v < 0) | (v >= _VALUE_LIMIT))
        if bad.size:
            raise _value_range_error(int(v[bad[0]]))
        self._d.update(zip(k.tolist(), v.tolist()))

    def delete_many(self, keys: Any, /) -> int:
        """Remove every key of ``keys`` that is present.

        Args:
            keys: 1-D C-contiguous buffer of 8-byte integers (``np.uint64``).

        Returns:
            How many entries were removed.
        """
        pop = self._d.pop
        return sum(pop(key, _MISSING) != _MISSING for key in _keys(keys).tolist())

    def memory_bytes(self) -> int:
        """Bytes this map holds: the dict, its int objects and this wrapper."""
        getsizeof = sys.getsizeof
        return (object.__sizeof__(self) + getsizeof(self._d)
                + sum(getsizeof(k) + getsizeof(v) for k, v in self._d.items()))

    def __sizeof__(self) -> int:
        return self.memory_bytes()


if TYPE_CHECKING:
    U64Map = PyU64Map
else:
    def U64Map(*args: Any, **kwargs: Any) -> PyU64Map:
        """A new map (arguments as :class:`PyU64Map`): the C type when
        ``_native.u64map`` is in use, else the twin."""
        ext = _native.u64map
        return (PyU64Map if ext is None else ext.U64Map)(*args, **kwargs)
