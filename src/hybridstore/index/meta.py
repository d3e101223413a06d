"""What the durable catalog keeps of each object, so a reopened store can rebuild its index.

Backends treat ``meta`` as opaque bytes; this module is its only codec.

* page: block index, valid tokens, parent page key (the root key for block 0);
* checkpoint: position, base page key, and ``(key, tokens)`` of each cover page.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hybridstore.errors import CatalogError
from hybridstore.objects import ObjectKind

_VERSION = 1
_PAGE = struct.Struct("<BBqI16s")          # version, kind, block, ntok, parent key
_STATE = struct.Struct("<BBqI16s")         # version, kind, position, ncovers, base key
_COVER = struct.Struct("<16sI")
_INT32_MAX = 2**31 - 1
"""The largest block index, token count and position the index keeps (int32 columns)."""


@dataclass(frozen=True, slots=True)
class PageMeta:
    block: int
    ntok: int
    parent_key: bytes


@dataclass(frozen=True, slots=True)
class StateMeta:
    position: int
    base_key: bytes
    covers: tuple[tuple[bytes, int], ...]


def encode_page(block: int, ntok: int, parent_key: bytes) -> bytes:
    return _PAGE.pack(_VERSION, ObjectKind.PAGE, block, ntok, parent_key)


def encode_state(position: int, base_key: bytes, covers: list[tuple[bytes, int]]) -> bytes:
    head = _STATE.pack(_VERSION, ObjectKind.STATE, position, len(covers), base_key)
    return head + b"".join(_COVER.pack(k, n) for k, n in covers)


def decode(meta: bytes) -> PageMeta | StateMeta:
    """Decode catalog meta; CatalogError when it is not ours or of another version."""
    if len(meta) < _PAGE.size or meta[0] != _VERSION:
        raise CatalogError(f"object meta of {len(meta)} bytes is not hybridstore meta v{_VERSION}; "
                           "the disk tier was written by another version: point disk_path elsewhere")
    if meta[1] == ObjectKind.PAGE:
        _, _, block, ntok, parent = _PAGE.unpack_from(meta)
        if not 0 <= block <= _INT32_MAX or not 1 <= ntok <= _INT32_MAX:
            raise CatalogError(f"page meta with block {block} and {ntok} tokens is damaged")
        return PageMeta(block, ntok, parent)
    if meta[1] != ObjectKind.STATE:
        raise CatalogError(f"object meta of unknown kind {meta[1]} is damaged")
    _, _, position, ncovers, base = _STATE.unpack_from(meta)
    if not 1 <= position <= _INT32_MAX or len(meta) != _STATE.size + ncovers * _COVER.size:
        raise CatalogError(f"state meta at position {position} with {ncovers} covers in "
                           f"{len(meta)} bytes is damaged")
    covers = tuple(_COVER.unpack_from(meta, _STATE.size + i * _COVER.size) for i in range(ncovers))
    if any(not 1 <= ntok <= _INT32_MAX for _, ntok in covers):
        raise CatalogError(f"state meta at position {position} has a cover of "
                           f"{max(ntok for _, ntok in covers)} tokens: it is damaged")
    return StateMeta(position, base, covers)
