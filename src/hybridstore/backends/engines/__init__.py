"""I/O engines of the disk tier: positional reads and writes that return futures.

One small interface, two implementations:

=========================  ====================================================
engine (``name``)          how it moves bytes
=========================  ====================================================
``"posix-odirect"``        :class:`PosixEngine`: ``O_DIRECT`` files, a thread
                           pool, large I/Os split into pieces that the pool's
                           threads pull from a shared cursor (queue depth is
                           what an SSD needs); unaligned buffers bounce
                           through aligned ones
``"kvikio-gds"``           :class:`KvikioEngine`: kvikio ``CuFile`` with
                           GPUDirect Storage (device buffers go SSD -> GPU)
``"kvikio-compat"``        :class:`KvikioEngine` in kvikio's POSIX compat mode
=========================  ====================================================

Every engine offers ``open(path) -> file``, ``pread(file, buf, nbytes, offset)``
and ``pwrite(...)`` (both return a :class:`~concurrent.futures.Future` that
yields ``nbytes``; a short or failed I/O raises
:class:`~hybridstore.errors.BackendIOError`), their blocking twins ``read`` and
``write`` (which may run part of the I/O on the calling thread: one thread hop
less for small objects), ``pread_stream`` (a read whose pieces can be waited
for one by one, in order, while later ones are still in flight: the disk tier
checksums what has landed while the rest is read), ``fsync(file)``,
``close_file(file)`` and ``close()``.
Offsets are 4 KiB aligned (the disk tier's records are); a write of ``nbytes``
may occupy ``nbytes`` rounded up to 4 KiB on disk, zero padded, and a read
never writes past ``buf[nbytes - 1]``.  The caller keeps ``buf`` alive and
unchanged until the future completes.

:func:`select_engine` maps the ``disk_engine`` setting (``"auto"``, ``"kvikio"``,
``"posix"``) to an engine.  kvikio is imported lazily and only here; ``"auto"``
never touches kvikio unless a usable CUDA driver with a device is present.

Modules:

=================  ===============================================================
``base.py``        :class:`Engine`, :class:`PieceStream`, alignment and future helpers
``posix.py``       :class:`PosixEngine` (``O_DIRECT``, thread pool, pieces)
``kvikio.py``      :class:`KvikioEngine`, its scoped kvikio settings, driver probes
``select.py``      :func:`select_engine`
=================  ===============================================================
"""

from __future__ import annotations

from hybridstore.backends.engines.base import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    Engine,
    FuturePieces,
    PieceStream,
    allocate_file,
    buffer_address,
    fsync_path,
    gather,
    piece_size,
    round_up,
)
from hybridstore.backends.engines.kvikio import (
    KVIKIO_TUNING,
    KvikioEngine,
    KvikioSettings,
    cuda_driver_usable,
    kvikio_importable,
    libcuda_loadable,
)
from hybridstore.backends.engines.posix import (
    MIN_PIECE_BYTES,
    WHOLE_IO_BYTES,
    AlignedBufferPool,
    PosixEngine,
    PosixFile,
)
from hybridstore.backends.engines.select import select_engine

__all__ = [
    "ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "KVIKIO_TUNING",
    "MIN_PIECE_BYTES",
    "WHOLE_IO_BYTES",
    "AlignedBufferPool",
    "Engine",
    "FuturePieces",
    "KvikioEngine",
    "KvikioSettings",
    "PieceStream",
    "PosixEngine",
    "PosixFile",
    "allocate_file",
    "buffer_address",
    "cuda_driver_usable",
    "fsync_path",
    "gather",
    "kvikio_importable",
    "libcuda_loadable",
    "piece_size",
    "round_up",
    "select_engine",
]
