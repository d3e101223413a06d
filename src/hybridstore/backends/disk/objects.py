"""What the disk tier's paths share: names, records of objects, key and buffer checks.

:class:`_TierState` declares the state :class:`~hybridstore.backends.disk.tier.DiskTier`
sets up in ``__init__`` and the methods its parts call on each other, so that the
write path (``writer.py``), the read path (``reader.py``) and reopening
(``recovery.py``) can live in modules of their own as parts of the one class.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.backends.catalog import Catalog, CatalogRecord
from hybridstore.errors import BackendIOError, DiskFullError
from hybridstore.objects import OBJECT_KEY_BYTES, ObjectKey

if TYPE_CHECKING:
    from hybridstore.backends.disk.shared import SharedDirectory
    from hybridstore.backends.engines import Engine


def checksum(buf: Any) -> int:
    """The xxh3_64 of a buffer's bytes (a catalog record's ``checksum``), hashed with the
    GIL released.

    python-xxhash's one-shot ``xxh3_64_intdigest`` holds the GIL while it hashes; the
    hasher's constructor (``xxh3_64(buf)``) releases it around the same
    ``XXH3_64bits_update``, at the same speed and with the same digest, so while one thread
    checks a 1.5 MiB chunk (~50 us) the others (the next read's submission, vLLM's
    polling) run on the other cores instead of waiting for the GIL.
    """
    return int(xxhash.xxh3_64(buf).intdigest())


LOCK_NAME = "LOCK"
CATALOG_DIR = "catalog"
_COMMIT_BATCH = 256
COMMIT_GATHER_S = 0.5
"""How long the committer waits for writes still in flight to join a commit.

Each commit is an ``fdatasync`` of the segments plus an lmdb transaction, each a
device cache flush: O_DIRECT writes in flight stall behind it.  Measured on the
2-core VM (virtio disk): 16 threads writing 1.5 MiB pieces ran at 1.0-1.8 GB/s
alone and 0.4-0.6 GB/s while another thread ``fdatasync``-ed a 4 KiB file every
30 ms; a burst of 16-chunk store jobs wrote at 1.3-1.5 GB/s one job at a time
(each committed before the next) and 0.4-0.5 GB/s with a commit per landed run.
So while other writes are in flight, a commit waits for them, up to this long: a
lone write is committed at once, a steady stream about twice a second."""
COALESCE_BYTES = 8 << 20
"""Longest I/O :meth:`DiskTier.read_many_into` makes of neighbouring objects."""
_STOP = object()
_EMPTY = np.empty(0, dtype=np.uint8)

SEGMENT_MIN_BYTES = 4 << 20
SEGMENT_MAX_BYTES = 256 << 20
SEGMENTS_PER_BUDGET = 16
"""A tier's segments are the power of two nearest below 1/16 of its budget, within
[:data:`SEGMENT_MIN_BYTES`, :data:`SEGMENT_MAX_BYTES`] (:func:`segment_bytes_for`): a
small budget is not one segment that the first process of a shared directory takes
whole, a large one is not thousands of files."""


def segment_bytes_for(capacity_bytes: int) -> int:
    """The segment size of a new tier of ``capacity_bytes`` (see :data:`SEGMENTS_PER_BUDGET`)."""
    size = SEGMENT_MIN_BYTES
    while size * 2 <= min(capacity_bytes // SEGMENTS_PER_BUDGET, SEGMENT_MAX_BYTES):
        size *= 2
    return size


def segment_name(segment: int) -> str:
    """File name of a segment: ``seg-000042.dat``."""
    return f"seg-{segment:06d}.dat"


@dataclass(slots=True)
class _Object:
    """A visible (committed) object: where it lives and its catalog record.

    ``extent.arena`` is the segment id (a shared directory's global id); ``seq`` is
    the change-log sequence number that made it visible (0: from the snapshot at open,
    or a tier that does not share its directory).
    """

    extent: Extent
    record: CatalogRecord
    seq: int = 0


@dataclass(slots=True, eq=False)
class _PendingWrite:
    """A ``put`` between its call and its catalog commit."""

    key: bytes
    seq: int
    extent: Extent
    view: np.ndarray
    nbytes: int
    meta: bytes
    future: Future = field(default_factory=Future)
    checksum: int = 0
    written: Future | None = None
    """Set once ``view`` is no longer read (the write returned, or the put failed)."""
    replaces: CatalogRecord | None = None
    """A move in a shared directory: the record it replaces.  It commits only while the
    catalog still holds that record (another process's put or delete of the key wins)."""


class _TierState:
    """The state and cross-part methods of a :class:`DiskTier` (declarations only)."""

    path: str
    segment_bytes: int
    _capacity: int
    _verify: bool
    _lock: threading.RLock
    _closed: bool
    _catalog_lock: threading.Lock
    _files: dict[int, Any]
    _objects: dict[bytes, _Object]
    _latest: dict[bytes, int]
    _writing: int
    _urgent: int
    _pins: dict[Extent, int]
    _deferred: set[Extent]
    _seq: itertools.count[int]
    _counters: dict[str, int]
    _alloc: SlabAllocator
    _jobs: ThreadPoolExecutor
    _shared: SharedDirectory | None
    _base: int
    _view: int
    _foreign_used: int
    _commits: queue.SimpleQueue[Any]

    if TYPE_CHECKING:
        @property
        def engine(self) -> Engine: ...

        @property
        def catalog(self) -> Catalog: ...

        @property
        def free_bytes(self) -> int: ...

        def charge(self, nbytes: int) -> int: ...

        def nbytes(self, key: ObjectKey) -> int | None: ...

        def _check_open(self) -> None: ...

        def _release(self, extent: Extent, seq: int | None = None) -> None: ...

        def _forget(self, key: bytes, obj: _Object, seq: int) -> None: ...

        def _mine(self, segment: int) -> bool: ...

        def _own(self, extent: Extent) -> Extent: ...

        def _local(self, extent: Extent) -> Extent: ...

        def _file(self, segment: int) -> Any: ...

        def _log(self) -> int | None: ...

        def _maybe_grow_ahead(self) -> None: ...

        def sync(self) -> None: ...

        def _reclaim(self) -> None: ...

        def _enter_read(self) -> int: ...

        def _leave_read(self, view: int) -> None: ...

        def _unpin(self, extent: Extent) -> None: ...

        def _unpin_many(self, extents: Iterable[Extent]) -> None: ...

        def _segment_path(self, segment: int) -> str: ...


def _torch_bytes(tensor: Any, nbytes: int) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError("get_into needs a contiguous tensor")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"the tensor holds {flat.numel()} bytes, the object has {nbytes}")
    return flat[:nbytes]


def _check_key(key: bytes) -> ObjectKey:
    if not isinstance(key, (bytes, bytearray)) or len(key) != OBJECT_KEY_BYTES:
        raise ValueError(f"keys are {OBJECT_KEY_BYTES} bytes (kind + 16-byte hash), got {key!r}")
    return ObjectKey(bytes(key))


def _with_key(exc: BaseException, key: bytes) -> BaseException:
    if isinstance(exc, BackendIOError) and exc.key is None:
        exc.key = key
    return exc


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = tuple(os.strerror(code) for code in _FULL_ERRNOS)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the file system is full:
    ``ENOSPC``/``EDQUOT`` as an errno, or in the message of an engine or lmdb error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(text in str(e) for text in _FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _full_error(exc: BaseException, path: str, what: str) -> BaseException:
    """``exc`` as a :class:`DiskFullError` when the file system is full, else unchanged."""
    if isinstance(exc, DiskFullError) or not disk_full(exc):
        return exc
    full = DiskFullError(f"the file system under the disk tier at {path} is full: {what} "
                         f"failed ({exc}); the object is not stored there (lower disk_bytes "
                         "to what the device can hold)")
    full.__cause__ = exc
    return full
