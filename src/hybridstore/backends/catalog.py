"""The disk tier's durable catalog: one lmdb environment next to the segment files.

Four named databases:

============  =================================================================
database      contents
============  =================================================================
``objects``   key (17-byte :data:`~hybridstore.objects.ObjectKey`) ->
              packed :class:`CatalogRecord` (segment, offset, length, slot
              length, xxh3_64 checksum of the payload, opaque meta bytes)
``meta``      ``format`` -> the catalog format version; ``info:<name>`` ->
              layout blobs of the store (:meth:`Catalog.put_info`); ``log-head``
              -> the sequence number of the newest change-log entry
``segments``  segment id -> its size in bytes: every segment file that exists
              (the directory's committed bytes, shared by all its processes)
``log``       sequence number (8 bytes, big-endian) -> :class:`Change`: every
              put and delete made by a process that shares the directory
              (``log=`` of :meth:`Catalog.put_many`), so that the others follow
============  =================================================================

A process that shares the directory with others (the disk tier's ``shared``
mode) writes each change to ``objects`` and to ``log`` in one transaction; lmdb
serialises write transactions across processes, so the log's order is the
order in which the changes took effect.

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
from typing import Any, TypeVar

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
_SEQ = struct.Struct(">Q")            # log keys and the log head
_CHANGE = struct.Struct("<BxH")       # op, slot of the writer
_HEAD_KEY = b"log-head"
PUT, DELETE = 1, 2
"""Operations of a :class:`Change`."""
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


@dataclass(frozen=True, slots=True)
class Change:
    """One entry of the change log.

    Attributes:
        seq: its sequence number (1, 2, ... in commit order).
        slot: the writer's slot in the shared directory.
        op: :data:`PUT` or :data:`DELETE`.
        key: the object's key.
        record: the new record of a put (``None`` for a delete, or when it
            does not decode: the follower then treats the object as gone).
    """

    seq: int
    slot: int
    op: int
    key: bytes
    record: CatalogRecord | None


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
        self._open = False
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)   # owner-only, as the data
            self._env, self._lock = _open_env(self.path, map_size)
            self._open = True
            with self._lock:        # open_db runs a transaction: see _adopting
                dbs = self._adopting(lambda: [self._env.open_db(name) for name in _DBS])
            self._objects, self._meta, self._segments, self._log = dbs
        except (lmdb.Error, OSError) as e:
            self.close()
            raise CatalogError(f"cannot open the disk tier catalog at {self.path}: {e}; "
                               f"check permissions and free space, or {_FIX_HINT}") from e
        self._check_format()
        self.short = False
        """Set when the slack could not be kept (the file system is full)."""
        self.keep_slack()

    def _check_format(self) -> None:
        with self._lock, self._begin(db=self._meta, write=True) as txn:
            raw = txn.get(_FORMAT_KEY)
            if raw is None:
                txn.put(_FORMAT_KEY, _FORMAT.pack(FORMAT_VERSION))
                return
        version = _FORMAT.unpack(raw)[0] if len(raw) == _FORMAT.size else None
        if version != FORMAT_VERSION:
            self.close()
            raise CatalogError(f"the catalog at {self.path} has format version {version}; this "
                               f"hybridstore reads version {FORMAT_VERSION}; {_FIX_HINT}")

    # -- objects ------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[bytes, CatalogRecord]], *,
                 log: int | None = None) -> int:
        """Commit several records in one durable transaction (replacing same keys).

        Args:
            items: ``(key, record)`` pairs.
            log: the writer's slot: also append one :class:`Change` per record to
                the change log (a shared directory); ``None``: no log entry.

        Returns:
            The log's sequence number of the last record (0 without ``log``).
        """
        packed = [(bytes(key), rec.pack()) for key, rec in items]

        def body(txn: lmdb.Transaction) -> int:
            for key, raw in packed:
                txn.put(key, raw, db=self._objects)
            return self._append(txn, log, PUT, packed)

        return self._write(body) if packed else 0

    def replace_many(self, items: Iterable[tuple[bytes, CatalogRecord, CatalogRecord]], *,
                     log: int | None = None) -> tuple[list[bytes], int]:
        """Replace records that are still what the caller read, in one durable transaction
        (a compare-and-swap per key: a move of an object in a directory that other
        processes change too must not undo their newer put or delete of the key).

        Args:
            items: ``(key, new record, the record it must replace)``.
            log: as for :meth:`put_many` (one entry per record replaced).

        Returns:
            The keys replaced, in order, and the log's sequence number of the last (0
            without ``log`` or when none was).
        """
        packed = [(bytes(key), new.pack(), old.pack()) for key, new, old in items]

        def body(txn: lmdb.Transaction) -> tuple[list[bytes], int]:
            done = [(key, raw) for key, raw, was in packed
                    if txn.get(key, db=self._objects) == was]
            for key, raw in done:
                txn.put(key, raw, db=self._objects)
            return [key for key, _ in done], self._append(txn, log, PUT, done)

        return self._write(body) if packed else ([], 0)

    def put(self, key: bytes, record: CatalogRecord) -> None:
        """Commit one record."""
        self.put_many([(key, record)])

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove records in one durable transaction; returns how many existed."""
        return self.remove(keys)[0]

    def delete(self, key: bytes) -> bool:
        """Remove one record; ``True`` if it existed."""
        return self.remove([key])[0] == 1

    def remove(self, keys: Iterable[bytes], *, log: int | None = None) -> tuple[int, int]:
        """:meth:`delete_many` that may also log.

        Args:
            keys: the keys to remove (absent ones are skipped).
            log: as for :meth:`put_many` (one entry per record that existed).

        Returns:
            ``(how many existed, the log's sequence number of the last)``; with ``log``
            and none of the keys here, the log's head (another process removed or
            replaced them, at changes no later than it); 0 without ``log``.
        """
        wanted = [bytes(k) for k in keys]

        def body(txn: lmdb.Transaction) -> tuple[int, int]:
            gone = [(key, b"") for key in wanted if txn.delete(key, db=self._objects)]
            if gone or log is None:
                return len(gone), self._append(txn, log, DELETE, gone)
            return 0, self._head(txn)

        return self._write(body) if wanted else (0, 0)

    def delete_record(self, key: bytes, record: CatalogRecord, *, log: int | None = None) -> int:
        """Remove ``key`` only while its record is still ``record`` (a reader that found an
        object damaged must not drop a newer version another process put meanwhile).

        Returns:
            The log sequence number (0 without ``log``), or -1 when the record was another.
        """
        want = bytes(key)
        packed = record.pack()

        def body(txn: lmdb.Transaction) -> int:
            if txn.get(want, db=self._objects) != packed:
                return -1
            txn.delete(want, db=self._objects)
            return self._append(txn, log, DELETE, [(want, b"")])

        return self._write(body)

    # -- the change log (a directory shared by several processes) ---------------------
    def _append(self, txn: lmdb.Transaction, slot: int | None, op: int,
                entries: list[tuple[bytes, bytes]]) -> int:
        if slot is None or not entries:
            return 0
        seq = self._head(txn)
        head = _CHANGE.pack(op, slot)
        for key, record in entries:
            seq += 1
            txn.put(_SEQ.pack(seq), head + key + record, db=self._log)
        txn.put(_HEAD_KEY, _SEQ.pack(seq), db=self._meta)
        return seq

    def log_head(self) -> int:
        """The sequence number of the newest change (0: none yet)."""
        with self._lock, self._begin() as txn:
            return self._head(txn)

    def _head(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_HEAD_KEY, db=self._meta)
        return _SEQ.unpack(raw)[0] if raw is not None and len(raw) == _SEQ.size else 0

    def changes(self, after: int, limit: int = 1 << 16) -> list[Change]:
        """The changes with sequence numbers above ``after``, oldest first (at most
        ``limit``).

        Raises:
            CatalogError: the log was truncated past ``after`` (the caller must
                rescan the objects; see :meth:`truncate_log`).
        """
        out: list[Change] = []
        with self._lock, self._begin(db=self._log) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_SEQ.pack(after)):
                return out
            for k, v in cursor:
                seq = _SEQ.unpack(k)[0]
                if seq <= after:
                    continue
                if not out and seq != after + 1:
                    raise CatalogError(f"the change log of {self.path} resumes at {seq}, not "
                                       f"{after + 1}: it was truncated past this reader")
                op, slot = _CHANGE.unpack_from(v)
                key = bytes(v[_CHANGE.size:_CHANGE.size + 17])
                rec: CatalogRecord | None = None
                if op == PUT:
                    try:
                        rec = CatalogRecord.unpack(bytes(v[_CHANGE.size + 17:]))
                    except CatalogError:
                        rec = None
                out.append(Change(seq, slot, op, key, rec))
                if len(out) >= limit:
                    break
        return out

    def snapshot(self, damaged: list[tuple[bytes, str]] | None = None
                 ) -> tuple[int, list[tuple[bytes, CatalogRecord]]]:
        """Every ``(key, record)`` and the log head they reflect, in one read transaction
        (a process joining a shared directory starts following the log from there)."""
        with self._lock, self._begin() as txn:
            head = self._head(txn)
            raw_items = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._objects)]
        return head, list(_decoded(raw_items, damaged))

    def truncate_log(self, upto: int) -> int:
        """Drop the log entries with sequence numbers up to ``upto`` (every live follower
        has applied them); returns how many went."""
        def body(txn: lmdb.Transaction) -> int:
            cursor = txn.cursor(db=self._log)
            stale = []
            for k in cursor.iternext(keys=True, values=False):
                if _SEQ.unpack(k)[0] > upto:
                    break
                stale.append(bytes(k))
            for k in stale:
                txn.delete(k, db=self._log)
            return len(stale)

        return self._write(body)

    # -- segments (the directory's committed bytes) ----------------------------------
    def add_segment(self, segment: int, nbytes: int, budget: int | None) -> bool:
        """Record a new segment file of ``nbytes``; with a ``budget``, only if all
        recorded segments and it stay within it (``False``: refused, nothing recorded).
        One transaction: two processes never both take the last room."""
        def body(txn: lmdb.Transaction) -> bool:
            if budget is not None:
                used = sum(_SEQ.unpack(v)[0] for k, v in txn.cursor(db=self._segments)
                           if _SEQ.unpack(k)[0] != segment)
                if used + nbytes > budget:
                    return False
            txn.put(_SEQ.pack(segment), _SEQ.pack(nbytes), db=self._segments)
            return True

        return self._write(body)

    def remove_segments(self, segments: Iterable[int]) -> None:
        """Forget segment files (removed, or never created)."""
        keys = [_SEQ.pack(s) for s in segments]

        def body(txn: lmdb.Transaction) -> None:
            for key in keys:
                txn.delete(key, db=self._segments)

        if keys:
            self._write(body)

    def segments(self) -> dict[int, int]:
        """Every recorded segment and its size."""
        with self._lock, self._begin(db=self._segments) as txn:
            return {_SEQ.unpack(k)[0]: _SEQ.unpack(v)[0] for k, v in txn.cursor()}

    def get(self, key: bytes) -> CatalogRecord | None:
        """The record of ``key``, or ``None``."""
        with self._lock, self._begin(db=self._objects) as txn:
            raw = txn.get(bytes(key))
        return None if raw is None else CatalogRecord.unpack(bytes(raw))

    def items(self, damaged: list[tuple[bytes, str]] | None = None
              ) -> Iterator[tuple[bytes, CatalogRecord]]:
        """Every ``(key, record)`` (a snapshot taken in one read transaction).

        Args:
            damaged: where records that do not decode go, as ``(key, reason)``,
                instead of raising (recovery drops exactly those).

        Raises:
            CatalogError: a record does not decode and ``damaged`` is ``None``.
        """
        with self._lock, self._begin(db=self._objects) as txn:
            raw_items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
        yield from _decoded(raw_items, damaged)

    def __len__(self) -> int:
        with self._lock, self._begin(db=self._objects) as txn:
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
        with self._lock, self._begin(db=self._meta) as txn:
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
        """Close the lmdb environment (idempotent; the last catalog of a directory open in
        this process closes it)."""
        if self._open:
            self._open = False
            _close_env(self.path)

    def _begin(self, **kw: Any) -> lmdb.Transaction:
        """``self._env.begin(**kw)`` (lock held), through :meth:`_adopting`."""
        return self._adopting(lambda: self._env.begin(**kw))

    def _adopting(self, start: Callable[[], T]) -> T:
        """``start()``, which begins a transaction (lock held).  Another process that shares
        the catalog (a shared disk tier directory) may have grown the map (:meth:`_write`):
        lmdb then refuses every new transaction here with ``MDB_MAP_RESIZED`` until this
        process adopts the new size (``set_mapsize(0)``, safe with no transaction of its own
        open, which the lock guarantees)."""
        try:
            return start()
        except lmdb.MapResizedError:
            self._env.set_mapsize(0)
            return start()

    def _write(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``body(txn)`` in a durable write transaction, growing the map when full."""
        with self._lock:
            while True:
                try:
                    with self._begin(write=True) as txn:
                        out = body(txn)
                    self._keep_slack()
                    return out
                except lmdb.MapFullError:
                    size = self._env.info()["map_size"] * 2
                    self._env.set_mapsize(size)
                except lmdb.Error as e:
                    raise CatalogError(f"writing the disk tier catalog at {self.path} failed: "
                                       f"{e}; check free space and permissions") from e


_DBS = (b"objects", b"meta", b"segments", b"log")
_ENVS: dict[str, tuple[lmdb.Environment, threading.Lock, list[int]]] = {}
_ENVS_LOCK = threading.Lock()


def _open_env(path: str, map_size: int) -> tuple[lmdb.Environment, threading.Lock]:
    """The process's one lmdb environment of ``path`` (lmdb allows one per process: stores
    of one process that share a directory share it, and its lock)."""
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
        if entry is None:
            env = lmdb.open(path, map_size=map_size, subdir=True, max_dbs=4, sync=True,
                            metasync=True, readahead=False, mode=0o600)
            entry = _ENVS[real] = (env, threading.Lock(), [0])
        entry[2][0] += 1
        return entry[0], entry[1]


def _close_env(path: str) -> None:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
        if entry is None:
            return
        entry[2][0] -= 1
        if entry[2][0] == 0:
            del _ENVS[real]
            with entry[1]:
                entry[0].close()


def _decoded(raw_items: list[tuple[bytes, bytes]], damaged: list[tuple[bytes, str]] | None
             ) -> Iterator[tuple[bytes, CatalogRecord]]:
    for key, raw in raw_items:
        try:
            rec = CatalogRecord.unpack(raw)
        except CatalogError as e:
            if damaged is None:
                raise
            damaged.append((key, str(e)))
            continue
        yield key, rec


__all__ = ["DELETE", "FORMAT_VERSION", "PUT", "RECORD_VERSION", "SLACK_BYTES", "Catalog",
           "CatalogRecord", "Change"]
