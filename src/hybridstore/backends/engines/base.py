"""The engine interface and what every engine shares: alignment, futures, piece streams.

:class:`Engine` is the interface (see the package docstring); :class:`PieceStream`
a read whose pieces can be awaited in order; the helpers below are the small
shared pieces of both engines (``posix.py``, ``kvikio.py``) and of the disk tier.
"""

from __future__ import annotations

import errno
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridstore.errors import BackendIOError
from hybridstore.objects import ALIGN, byte_view

DEFAULT_CHUNK_BYTES = 8 << 20
"""Largest request of the POSIX engine (``StoreConfig.io_chunk_bytes``): an in-place I/O
up to this size, e.g. a run of neighbouring objects the disk tier reads at once (up to
:data:`~hybridstore.backends.disk.COALESCE_BYTES`, 8 MiB), is one system call.

Each request costs CPU (a system call, a wake-up when it changes threads, page pinning)
whatever its size, so the CPU per byte falls as requests grow: on the 2-core VM of
docs/bench/engines.md one thread's ``O_DIRECT`` reads cost 0.17 ms of CPU per MiB in
512 KiB requests and 0.06 in 4-8 MiB ones, at the same GB/s.  The kernel cuts a large
``O_DIRECT`` request into the device's largest (``max_sectors_kb``) and submits the parts
together, so the device still sees a queue.  (Until issue 26 this was 512 KiB, chosen
by GB/s alone on an earlier VM, docs/bench/ssd.md, and every run was cut into 256-512 KiB
pieces on a thread pool.)"""


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path (a new directory entry, a closed file) to make it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ZEROS = bytes(1 << 20)


def allocate_file(fd: int, nbytes: int) -> None:
    """Give a file at least ``nbytes`` of allocated blocks: ``posix_fallocate``, or where the
    file system does not support it, zeros written past its end.

    Either way a full file system shows up here (``ENOSPC``/``EDQUOT``), never in a later
    write into the file: a sparse file would let writes fail one by one with the device
    full.  Bytes already in the file are kept.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    done = os.fstat(fd).st_size // ALIGN * ALIGN    # what a former try wrote stays written
    while done < nbytes:
        n = os.pwrite(fd, memoryview(_ZEROS)[:min(len(_ZEROS), nbytes - done)], done)
        if n <= 0:
            raise OSError(errno.EIO, f"a write of zeros at offset {done} made no progress")
        done += n
    os.fsync(fd)


def buffer_address(buf: np.ndarray) -> int:
    """Address of the first byte of a numpy array."""
    return int(buf.__array_interface__["data"][0])


def gather(futures: Sequence[Future], total: int) -> Future:
    """A future that yields ``total`` once every future in ``futures`` succeeded.

    The first exception among them becomes the exception of the result.
    """
    out: Future = Future()
    if not futures:
        out.set_result(total)
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def on_done(fut: Future) -> None:
        exc = fut.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
            if out.done():
                return
            if exc is not None:
                out.set_exception(exc)
            elif last:
                out.set_result(total)

    for fut in futures:
        fut.add_done_callback(on_done)
    return out


class PieceStream:
    """A read in flight, split into ``count`` pieces of ``piece_bytes`` (the last may be shorter).

    :meth:`wait_piece` returns once piece ``i`` (bytes ``bounds(i)`` of the
    buffer) has landed, while later pieces may still be in flight;
    :meth:`result` waits for every piece and returns ``nbytes``.  Either raises
    :class:`~hybridstore.errors.BackendIOError` when the I/O failed, and only
    once no piece is in flight any more.  Call :meth:`result` (or
    :meth:`wait_quietly`) before the buffer is reused, even after an error.
    """

    def __init__(self, nbytes: int, piece_bytes: int) -> None:
        self.nbytes = nbytes
        self.piece_bytes = piece_bytes
        self.count = -(-nbytes // piece_bytes) if nbytes else 0

    def bounds(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of piece ``i`` in the buffer."""
        start = i * self.piece_bytes
        return start, min(start + self.piece_bytes, self.nbytes)

    def wait_piece(self, i: int) -> None:
        """Block until piece ``i`` has landed."""
        raise NotImplementedError

    def wait_prefix(self, pieces: int) -> int:
        """Block until at least the first ``pieces`` pieces have landed; returns how many have.

        The count returned may exceed ``pieces`` (every piece of a contiguous
        landed prefix is reported at once), so a consumer wakes up less often.
        """
        self.wait_piece(pieces - 1)
        return pieces

    def result(self) -> int:
        """Block until every piece has landed; returns ``nbytes``."""
        raise NotImplementedError

    def wait_quietly(self) -> None:
        """Block until no piece is in flight, ignoring errors (cleanup after a failure)."""
        try:
            self.result()
        except BaseException:  # noqa: BLE001 - the caller is already handling an error
            pass


class FuturePieces(PieceStream):
    """A :class:`PieceStream` over one waitable (``.result()``) per piece."""

    def __init__(self, nbytes: int, piece_bytes: int, waits: list[Any]) -> None:
        super().__init__(nbytes, piece_bytes)
        self._waits = waits

    def wait_piece(self, i: int) -> None:
        try:
            self._waits[i].result()
        except BaseException:
            self.wait_quietly()
            raise

    def result(self) -> int:
        first: BaseException | None = None
        for w in self._waits:
            try:
                w.result()
            except BaseException as e:  # noqa: BLE001 - re-raised once all are done
                first = first or e
        if first is not None:
            raise first
        return self.nbytes


class Engine(ABC):
    """Positional file I/O returning futures; see the module docstring."""

    name: str = "engine"
    #: Piece size of :meth:`pread_stream` unless one is given; callers (the disk
    #: tier) read and write objects up to this size whole, with a one-shot
    #: checksum, and stream larger ones.
    stream_piece_bytes: int = 4 << 20

    @property
    def compat_mode(self) -> bool:
        """True when device buffers go through host memory (no GPUDirect Storage)."""
        return True

    @abstractmethod
    def open(self, path: str | os.PathLike[str]) -> Any:
        """Open an existing file for reading and writing; returns the engine's handle."""

    @abstractmethod
    def pread(self, file: Any, buf: Any, nbytes: int, offset: int) -> Future:
        """Read ``nbytes`` at ``offset`` into ``buf``; the future yields ``nbytes``."""

    @abstractmethod
    def pwrite(self, file: Any, buf: Any, nbytes: int, offset: int) -> Future:
        """Write ``buf[:nbytes]`` at ``offset``; the future yields ``nbytes``."""

    def read(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        """Blocking :meth:`pread` (may use the calling thread for part of the I/O)."""
        return int(self.pread(file, buf, nbytes, offset).result())

    def write(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        """Blocking :meth:`pwrite` (may use the calling thread for part of the I/O)."""
        return int(self.pwrite(file, buf, nbytes, offset).result())

    def pread_stream(self, file: Any, buf: Any, nbytes: int, offset: int,
                     piece_bytes: int | None = None) -> PieceStream:
        """Start a read of ``nbytes`` at ``offset`` whose pieces can be awaited in order.

        ``piece_bytes`` (a multiple of 4 KiB; default :attr:`stream_piece_bytes`)
        is the granularity of :meth:`PieceStream.wait_piece`.
        """
        piece = piece_size(piece_bytes or self.stream_piece_bytes)
        view = byte_view(buf, nbytes)
        waits: list[Any] = []
        stream = FuturePieces(nbytes, piece, waits)
        try:
            for i in range(stream.count):
                start, end = stream.bounds(i)
                waits.append(self.pread(file, view[start:end], end - start, offset + start))
        except BaseException:
            stream.wait_quietly()
            raise
        return stream

    @abstractmethod
    def fileno(self, file: Any) -> int:
        """The OS file descriptor behind a handle."""

    def fsync(self, file: Any) -> None:
        """Make the file's written data durable (``fdatasync``)."""
        try:
            os.fdatasync(self.fileno(file))
        except OSError as e:
            raise BackendIOError(f"fdatasync failed: {e}; check the disk and its free space") from e

    @abstractmethod
    def close_file(self, file: Any) -> None:
        """Close a handle returned by :meth:`open`."""

    def close(self) -> None:
        """Release the engine's threads and buffers."""


def piece_size(piece_bytes: int) -> int:
    if piece_bytes < ALIGN or piece_bytes % ALIGN:
        raise ValueError(f"piece_bytes must be a positive multiple of {ALIGN}, got {piece_bytes}")
    return piece_bytes
