"""How one object is laid out as a Mooncake value, and its name there.

A value is a 32-byte header, the object's opaque ``meta``, then its payload::

    magic "HSR1" | version u16 | meta_len u16 | nbytes u64 | checksum u64 | key tag u64

``checksum`` is xxh3_64 of the payload seeded by xxh3_64 of (key, meta, nbytes), and
``key tag`` the xxh3_64 of the 17-byte key: a value written under another name, by
another version, cut short or damaged in any byte of its header, meta or payload
fails :func:`check` and is a miss, never returned.  Names are
``PREFIX/KEYHEX`` (the 17-byte :data:`~hybridstore.objects.ObjectKey` in hex) and
``PREFIX/info/NAME`` for :meth:`~hybridstore.backends.base.Tier.put_info` blobs.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from hybridstore.errors import CorruptObjectError

MAGIC = b"HSR1"
VERSION = 1
HEADER = struct.Struct("<4sHHQQQ")
HEADER_BYTES = HEADER.size            # 32
MAX_META = 0xFFFF


def object_name(prefix: str, key: bytes) -> str:
    """The Mooncake name of an object."""
    return f"{prefix}/{key.hex()}"


def info_name(prefix: str, name: str) -> str:
    """The Mooncake name of an info blob."""
    return f"{prefix}/info/{name}"


def _seed(key: bytes, meta: bytes, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(key + meta + nbytes.to_bytes(8, "little"))


def header(key: bytes, meta: bytes, payload: np.ndarray) -> bytes:
    """The header and meta that precede ``payload`` (a uint8 array) in its value."""
    if len(meta) > MAX_META:
        raise ValueError(f"meta of {len(meta)} bytes is longer than {MAX_META}")
    n = int(payload.nbytes)
    checksum = xxhash.xxh3_64_intdigest(payload, seed=_seed(key, meta, n))
    return HEADER.pack(MAGIC, VERSION, len(meta), n, checksum,
                       xxhash.xxh3_64_intdigest(key)) + meta


def parse_header(key: bytes, head: np.ndarray | bytes) -> tuple[int, int, int]:
    """``(meta_len, nbytes, checksum)`` of a value's first :data:`HEADER_BYTES`.

    Raises:
        CorruptObjectError: not a value of this version written under ``key``.
    """
    raw = bytes(head[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise CorruptObjectError(f"remote object {key.hex()}: {len(raw)} bytes, shorter than "
                                 "a header", key=key)
    magic, version, meta_len, nbytes, checksum, tag = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or tag != xxhash.xxh3_64_intdigest(key):
        raise CorruptObjectError(f"remote object {key.hex()} is not a hybridstore v{VERSION} "
                                 "object written under this key", key=key)
    return meta_len, nbytes, checksum


def check(key: bytes, value: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Verify a whole value; returns ``(meta, payload)`` (the payload a view of ``value``).

    Raises:
        CorruptObjectError: wrong header, size or checksum.
    """
    meta_len, nbytes, checksum = parse_header(key, value)
    start = HEADER_BYTES + meta_len
    if value.nbytes != start + nbytes:
        raise CorruptObjectError(f"remote object {key.hex()} is {value.nbytes} bytes, its header "
                                 f"says {start + nbytes}", key=key)
    meta = bytes(value[HEADER_BYTES:start])
    payload = value[start:]
    got = xxhash.xxh3_64_intdigest(payload, seed=_seed(key, meta, nbytes))
    if got != checksum:
        raise CorruptObjectError(f"remote object {key.hex()} failed its checksum", key=key,
                                 expected=checksum, got=got)
    return meta, payload
