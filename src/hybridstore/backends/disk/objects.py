"""What the disk tier's paths share: names, records of objects, key and buffer checks.

:class:`_TierState` declares the state :class:`~hybridstore.backends.disk.tier.DiskTier`
sets up in ``__init__`` and the methods its parts call on each other, so that the
write path (``writer.py``), the read path (``reader.py``) and reopening
(``recovery.py``) can live in modules of their own as parts of the one class.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.backends.base import KEY_BYTES
from hybridstore.backends.catalog import Catalog, CatalogRecord
from hybridstore.errors import BackendIOError

if TYPE_CHECKING:
    from hybridstore.backends.engines import Engine

LOCK_NAME = "LOCK"
CATALOG_DIR = "catalog"
_COMMIT_BATCH = 256
COALESCE_BYTES = 8 << 20
"""Longest I/O :meth:`DiskTier.read_many_into` makes of neighbouring objects."""
_STOP = object()
_EMPTY = np.empty(0, dtype=np.uint8)


def segment_name(segment: int) -> str:
    """File name of a segment: ``seg-000042.dat``."""
    return f"seg-{segment:06d}.dat"


@dataclass(slots=True)
class _Object:
    """A visible (committed) object: where it lives and its catalog record."""

    extent: Extent
    record: CatalogRecord


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


class _TierState:
    """The state and cross-part methods of a :class:`DiskTier` (declarations only)."""

    path: str
    segment_bytes: int
    _capacity: int
    _verify: bool
    _lock: threading.Lock
    _closed: bool
    _catalog_lock: threading.Lock
    _files: dict[int, Any]
    _objects: dict[bytes, _Object]
    _latest: dict[bytes, int]
    _pins: dict[Extent, int]
    _deferred: set[Extent]
    _seq: itertools.count[int]
    _counters: dict[str, int]
    _alloc: SlabAllocator
    _jobs: ThreadPoolExecutor
    _commits: queue.SimpleQueue[Any]

    if TYPE_CHECKING:
        @property
        def engine(self) -> Engine: ...

        @property
        def catalog(self) -> Catalog: ...

        @property
        def free_bytes(self) -> int: ...

        def charge(self, nbytes: int) -> int: ...

        def _check_open(self) -> None: ...

        def _release(self, extent: Extent) -> None: ...

        def _unpin(self, extent: Extent) -> None: ...

        def _segment_path(self, segment: int) -> str: ...

        def _drop_corrupt(self, key: bytes, obj: _Object, got: int) -> None: ...


def _torch_bytes(tensor: Any, nbytes: int) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError("get_into needs a contiguous tensor")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"the tensor holds {flat.numel()} bytes, the object has {nbytes}")
    return flat[:nbytes]


def _host_view(data: Any, nbytes: int, *, writable: bool) -> np.ndarray:
    """``data[:nbytes]`` as a contiguous uint8 numpy view, without copying."""
    if data is None:
        raise TypeError("the disk tier stores bytes: pass a uint8 array, not None")
    if type(data).__module__.startswith("torch"):
        if data.device.type != "cpu":
            raise TypeError("put() takes host memory; copy device tensors to the host pool first")
        data = _torch_bytes(data, nbytes).numpy()
    arr = data if isinstance(data, np.ndarray) else np.asarray(memoryview(data))
    if not arr.flags.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("get_into needs a writable buffer")
    arr = arr.reshape(-1).view(np.uint8)
    if nbytes < 0 or arr.nbytes < nbytes:
        raise ValueError(f"the buffer holds {arr.nbytes} bytes, {nbytes} are needed")
    return arr[:nbytes]


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"keys are {KEY_BYTES} bytes (kind + 16-byte hash), got {key!r}")
    return bytes(key)


def _with_key(exc: BaseException, key: bytes) -> BaseException:
    if isinstance(exc, BackendIOError) and exc.key is None:
        exc.key = key
    return exc
