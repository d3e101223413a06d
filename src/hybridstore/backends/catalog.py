"""The disk tier's durable catalog: one lmdb environment next to the segment files.

Two named databases:

===========  ==================================================================
database     contents
===========  ==================================================================
``objects``  key (17-byte :data:`~hybridstore.objects.ObjectKey`) ->
             packed :class:`CatalogRecord` (segment, offset, length, slot
             length, xxh3_64 checksum of the payload, opaque meta bytes)
``meta``     ``format`` -> the catalog format version; ``info:<name>`` ->
             layout blobs of the store (:meth:`Catalog.put_info`)
===========  ==================================================================

Records are packed with :mod:`struct` and start with their own version byte.
An entry exists only for an object whose bytes were made durable before the
entry was committed (the disk tier's ordering), so the catalog is the truth on
reopen.  Every write transaction is synchronous (lmdb ``sync=True``).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from hybridstore.backends.engines.base import allocate_file
from hybridstore.errors import CatalogError

log = logging.getLogger("hybridstore.backends.catalog")

FORMAT_VERSION = 1
"""Version of the catalog layout; stored in the ``meta`` database."""

RECORD_VERSION = 1
"""Version byte at the start of every packed record."""

SLACK_BYTES = 1 << 20
"""Bytes of the lmdb data file kept allocated past its last used page (plus an eighth of
what it uses): a transaction, above all one that deletes records to make room, never needs
new blocks from a full file system (see :meth:`Catalog.keep_slack`)."""

T = TypeVar("T")

_RECORD = struct.Struct("<BxxxIQQQQ")  # version, segment, offset, length, slot, checksum
_FORMAT = struct.Struct("<I")
_FORMAT_KEY = b"format"
_INFO_PREFIX = b"info:"
_FIX_HINT = ("move the directory away (or delete it) to start an empty disk tier, or open it "
             "with the hybridstore version that wrote it")


@dataclass(frozen=True, slots=True)
class CatalogRecord:
    """Where one durable object lives and how to check it.

    Attributes:
        segment: id of the segment file (``seg-<id>.dat``).
        offset: byte offset in the segment (4 KiB aligned).
        length: payload bytes.
        slot_length: bytes reserved for it (the allocator's slot size).
        checksum: xxh3_64 of the payload.
        meta: opaque bytes given at ``put`` (the index's kind/position/deps).
    """

    segment: int
    offset: int
    length: int
    slot_length: int
    checksum: int
    meta: bytes = b""

    def pack(self) -> bytes:
        """The record as stored in lmdb."""
        return _RECORD.pack(RECORD_VERSION, self.segment, self.offset, self.length,
                            self.slot_length, self.checksum) + self.meta

    @classmethod
    def unpack(cls, raw: bytes) -> CatalogRecord:
        """Decode a stored record.

        Raises:
            CatalogError: the record is truncated or of an unknown version.
        """
        if len(raw) < _RECORD.size or raw[0] != RECORD_VERSION:
            version = raw[0] if raw else None
            raise CatalogError(f"catalog record of version {version} and {len(raw)} bytes; this "
                               f"hybridstore reads version {RECORD_VERSION}; {_FIX_HINT}")
        _, segment, offset, length, slot, checksum = _RECORD.unpack_from(raw)
        return cls(segment, offset, length, slot, checksum, bytes(raw[_RECORD.size:]))


class Catalog:
    """The lmdb catalog of a disk tier directory.

    Thread-safe; the lmdb map grows on demand.

    Args:
        path: directory of the lmdb environment (created if missing).
        map_size: initial lmdb map size in bytes (doubled whenever it fills).

    Raises:
        CatalogError: lmdb cannot open the environment, or it holds another
            catalog format.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = 64 << 20) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)   # owner-only, as the data
            self._env = lmdb.open(self.path, map_size=map_size, subdir=True, max_dbs=2,
                                  sync=True, metasync=True, readahead=False, mode=0o600)
            self._objects = self._env.open_db(b"objects")
            self._meta = self._env.open_db(b"meta")
        except (lmdb.Error, OSError) as e:
            raise CatalogError(f"cannot open the disk tier catalog at {self.path}: {e}; "
                               f"check permissions and free space, or {_FIX_HINT}") from e
        self._check_format()
        self.short = False
        """Set when the slack could not be kept (the file system is full)."""
        self.keep_slack()

    def _check_format(self) -> None:
        with self._env.begin(db=self._meta, write=True) as txn:
            raw = txn.get(_FORMAT_KEY)
            if raw is None:
                txn.put(_FORMAT_KEY, _FORMAT.pack(FORMAT_VERSION))
                return
        version = _FORMAT.unpack(raw)[0] if len(raw) == _FORMAT.size else None
        if version != FORMAT_VERSION:
            self._env.close()
            raise CatalogError(f"the catalog at {self.path} has format version {version}; this "
                               f"hybridstore reads version {FORMAT_VERSION}; {_FIX_HINT}")

    # -- objects ------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[bytes, CatalogRecord]]) -> None:
        """Commit several records in one durable transaction (replacing same keys)."""
        packed = [(bytes(key), rec.pack()) for key, rec in items]

        def body(txn: lmdb.Transaction) -> None:
            for key, raw in packed:
                txn.put(key, raw, db=self._objects)

        if packed:
            self._write(body)

    def put(self, key: bytes, record: CatalogRecord) -> None:
        """Commit one record."""
        self.put_many([(key, record)])

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove records in one durable transaction; returns how many existed."""
        wanted = [bytes(k) for k in keys]

        def body(txn: lmdb.Transaction) -> int:
            return sum(bool(txn.delete(key, db=self._objects)) for key in wanted)

        return self._write(body) if wanted else 0

    def delete(self, key: bytes) -> bool:
        """Remove one record; ``True`` if it existed."""
        return self.delete_many([key]) == 1

    def get(self, key: bytes) -> CatalogRecord | None:
        """The record of ``key``, or ``None``."""
        with self._lock, self._env.begin(db=self._objects) as txn:
            raw = txn.get(bytes(key))
        return None if raw is None else CatalogRecord.unpack(raw)

    def items(self, damaged: list[tuple[bytes, str]] | None = None
              ) -> Iterator[tuple[bytes, CatalogRecord]]:
        """Every ``(key, record)`` (a snapshot taken in one read transaction).

        Args:
            damaged: where records that do not decode go, as ``(key, reason)``,
                instead of raising (recovery drops exactly those).

        Raises:
            CatalogError: a record does not decode and ``damaged`` is ``None``.
        """
        with self._lock, self._env.begin(db=self._objects) as txn:
            raw_items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
        for key, raw in raw_items:
            try:
                rec = CatalogRecord.unpack(raw)
            except CatalogError as e:
                if damaged is None:
                    raise
                damaged.append((key, str(e)))
                continue
            yield key, rec

    def __len__(self) -> int:
        with self._lock, self._env.begin(db=self._objects) as txn:
            return int(txn.stat(self._objects)["entries"])

    # -- layout blobs -------------------------------------------------------------
    def put_info(self, name: str, value: bytes) -> None:
        """Store a named blob (the store's page/state layout, the tier's geometry)."""
        key, raw = _INFO_PREFIX + name.encode(), bytes(value)

        def body(txn: lmdb.Transaction) -> None:
            txn.put(key, raw, db=self._meta)

        self._write(body)

    def get_info(self, name: str) -> bytes | None:
        """A blob stored with :meth:`put_info`, or ``None``."""
        with self._lock, self._env.begin(db=self._meta) as txn:
            raw = txn.get(_INFO_PREFIX + name.encode())
        return None if raw is None else bytes(raw)

    # -- room on the device ---------------------------------------------------------------
    def keep_slack(self, extra: int = 0) -> bool:
        """Keep :data:`SLACK_BYTES` (plus an eighth of the used size, plus ``extra``) of the
        data file allocated past its last used page, so that the catalog can commit while
        the file system is full.  The disk tier calls it before it creates a segment, so
        that its segments never take the catalog's room.

        Returns:
            False when the file system has no room for it (``ENOSPC``/``EDQUOT``; also
            recorded in :attr:`short`).
        """
        with self._lock:
            return self._keep_slack(extra)

    def _keep_slack(self, extra: int = 0) -> bool:
        info = self._env.info()
        used = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        want = used + SLACK_BYTES + used // 8 + extra
        path = os.path.join(self.path, "data.mdb")
        try:
            if os.path.getsize(path) >= want - (SLACK_BYTES // 2 if not extra else 0):
                self.short = False
                return True
            if info["map_size"] < want:
                self._env.set_mapsize(max(want, 2 * info["map_size"]))
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            try:
                allocate_file(fd, want)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("could not extend the catalog at %s: %s", self.path, e)
                return True
            self.short = True
            return False
        self.short = False
        return True

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Close the lmdb environment (idempotent)."""
        with self._lock:
            self._env.close()

    def _write(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``body(txn)`` in a durable write transaction, growing the map when full."""
        with self._lock:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        out = body(txn)
                    self._keep_slack()
                    return out
                except lmdb.MapFullError:
                    size = self._env.info()["map_size"] * 2
                    self._env.set_mapsize(size)
                except lmdb.Error as e:
                    raise CatalogError(f"writing the disk tier catalog at {self.path} failed: "
                                       f"{e}; check free space and permissions") from e


__all__ = ["FORMAT_VERSION", "RECORD_VERSION", "SLACK_BYTES", "Catalog", "CatalogRecord"]
