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
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridstore.errors import BackendIOError, ConfigError

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of file offsets, lengths and buffers for O_DIRECT and GDS."""

DEFAULT_CHUNK_BYTES = 512 << 10
"""Largest piece a large I/O is split into (the request size the device sees).

Measured with ``hybridstore bench ssd`` (docs/bench.md): the virtio SSD of
the development VM reads fastest with 2-4 MiB in flight in 256-512 KiB
requests and slowest with 4-8 MiB requests (what the former 8 MiB split made
of every large object); NVMe drives saturate with 128 KiB-1 MiB requests at
a queue depth of 8 or more.  With the default 8 I/O threads, 512 KiB pieces
keep 4 MiB in flight."""

MIN_PIECE_BYTES = 256 << 10
"""Smallest piece of a split I/O (see :meth:`PosixEngine.piece_bytes`)."""

WHOLE_IO_BYTES = 1 << 20
"""I/Os up to this size on an aligned buffer are issued whole, on the calling thread.

On the 2-core development VM, handing 1 MiB to four threads cost more
(wake-ups, the GIL) than the queue depth gained; larger I/Os are split."""


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


class _FuturePieces(PieceStream):
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
        piece = _piece_size(piece_bytes or self.stream_piece_bytes)
        view = _byte_view(buf, nbytes)
        waits: list[Any] = []
        stream = _FuturePieces(nbytes, piece, waits)
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


# ---------------------------------------------------------------------------------
# POSIX: O_DIRECT + a thread pool
# ---------------------------------------------------------------------------------
@dataclass(slots=True)
class PosixFile:
    """An open file of :class:`PosixEngine`.

    Attributes:
        fd: the descriptor.
        direct: whether it was opened with ``O_DIRECT`` (alignment rules apply).
        path: the file's path, for messages.
    """

    fd: int
    direct: bool
    path: str


class AlignedBufferPool:
    """A free list of page-aligned (mmap-backed) bounce buffers of one size."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes = nbytes
        self._keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)
                return
        buf.close()

    def close(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


class _Striped(PieceStream):
    """One POSIX I/O split into pieces that worker threads pull from a shared cursor.

    Up to ``io_threads`` pool threads (and, for blocking calls, the caller) run
    :meth:`work`: claim the next piece, read or write it, repeat.  A thread
    stays busy for the whole I/O instead of paying a pool hand-off per piece,
    so small pieces (what the device wants) cost little.  The first failure
    stops further claims; :attr:`future` completes once no piece is in flight.
    """

    __slots__ = ("_claimed", "_cond", "_done", "_error", "_file", "_finished", "_offset",
                 "_prefix", "_task", "_view", "_wanted", "future")

    def __init__(self, task: Callable[..., None], file: PosixFile, view: np.ndarray, offset: int,
                 piece_bytes: int) -> None:
        super().__init__(len(view), piece_bytes)
        self._task = task
        self._file = file
        self._view = view
        self._offset = offset
        self._cond = threading.Condition(threading.Lock())
        self._claimed = 0
        self._finished = 0
        self._done = bytearray(self.count)
        self._prefix = 0  # pieces 0.._prefix-1 have all landed
        self._wanted = self.count + 1  # a waiter's prefix target (count + 1: nobody waits)
        self._error: BaseException | None = None
        self.future: Future = Future()
        if self.count == 0:
            self.future.set_result(0)

    def work(self) -> None:
        """Do pieces until none is left or one failed."""
        cond = self._cond
        while True:
            with cond:
                if self._error is not None or self._claimed >= self.count:
                    return
                i = self._claimed
                self._claimed += 1
            start, end = self.bounds(i)
            error: BaseException | None = None
            try:
                self._task(self._file, self._view[start:end], self._offset + start)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                error = e
            with cond:
                self._finished += 1
                if error is None:
                    self._done[i] = 1
                    if i == self._prefix:
                        done, prefix, count = self._done, i + 1, self.count
                        while prefix < count and done[prefix]:
                            prefix += 1
                        self._prefix = prefix
                        if prefix >= self._wanted:
                            cond.notify_all()
                elif self._error is None:
                    self._error = error
                    cond.notify_all()
                last = self._finished == self._claimed and (
                    self._error is not None or self._claimed == self.count)
            if last:
                if self._error is not None:
                    self.future.set_exception(self._error)
                else:
                    self.future.set_result(self.nbytes)
                return

    def wait_piece(self, i: int) -> None:
        self.wait_prefix(i + 1)

    def wait_prefix(self, pieces: int) -> int:
        with self._cond:
            while self._prefix < pieces and self._error is None:
                self._wanted = pieces
                self._cond.wait()
            self._wanted = self.count + 1
            landed = self._prefix
        if landed < pieces:
            self.future.result()  # raises, once every claimed piece has stopped
        return landed

    def result(self) -> int:
        return int(self.future.result())


class PosixEngine(Engine):
    """``O_DIRECT`` reads and writes on a thread pool.

    An I/O is split into pieces of up to ``chunk_bytes`` (:meth:`piece_bytes`)
    that up to ``io_threads`` pool threads pull from a shared cursor (the
    blocking :meth:`read`/:meth:`write` put the calling thread to work too, so
    a one-piece I/O never changes threads).  The queue depth the device sees
    is the number of threads at work, each with one piece in flight.  With
    ``O_DIRECT``,
    a buffer whose address is 4 KiB aligned is read/written in place (only a
    partial last 4 KiB block bounces); an unaligned buffer bounces piece by
    piece through aligned buffers.  File systems that refuse ``O_DIRECT``
    (tmpfs) get buffered I/O, with a logged warning.

    Args:
        io_threads: worker threads (the I/O queue depth).
        chunk_bytes: largest piece of an I/O (a multiple of 4 KiB): the request
            size the device sees for large I/Os.
        direct: try ``O_DIRECT`` (``False`` forces buffered I/O).
    """

    name = "posix-odirect"

    def __init__(self, io_threads: int = 8, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 direct: bool = True) -> None:
        if io_threads < 1:
            raise ConfigError(f"io_threads must be at least 1, got {io_threads}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ConfigError(f"chunk_bytes must be a positive multiple of {ALIGN}, "
                              f"got {chunk_bytes}")
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self.stream_piece_bytes = max(chunk_bytes, WHOLE_IO_BYTES)  # no split up to here
        self._try_direct = direct and hasattr(os, "O_DIRECT")
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hs-posix-io")
        self._chunks = AlignedBufferPool(chunk_bytes, keep=2 * io_threads)
        self._tails = AlignedBufferPool(ALIGN, keep=4 * io_threads)
        self._warned_buffered: set[str] = set()

    # -- files --------------------------------------------------------------------
    def open(self, path: str | os.PathLike[str]) -> PosixFile:
        path = os.fspath(path)
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        if self._try_direct:
            try:
                return PosixFile(os.open(path, flags | os.O_DIRECT), True, path)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # O_DIRECT refused
                    raise
                fs_dir = os.path.dirname(path)
                if fs_dir not in self._warned_buffered:
                    self._warned_buffered.add(fs_dir)
                    log.warning("the file system of %s refuses O_DIRECT (%s); using buffered "
                                "I/O there (put disk_path on an SSD file system such as ext4/xfs "
                                "for direct I/O)", fs_dir, e.strerror)
        return PosixFile(os.open(path, flags), False, path)

    def fileno(self, file: PosixFile) -> int:
        return file.fd

    def close_file(self, file: PosixFile) -> None:
        os.close(file.fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._chunks.close()
        self._tails.close()

    # -- I/O ----------------------------------------------------------------------
    def pread(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> Future:
        return self._start(file, buf, nbytes, offset, write=False, caller_works=False).future

    def pwrite(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> Future:
        return self._start(file, buf, nbytes, offset, write=True, caller_works=False).future

    def read(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> int:
        op = self._start(file, buf, nbytes, offset, write=False, caller_works=True)
        op.work()
        return op.result()

    def write(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> int:
        op = self._start(file, buf, nbytes, offset, write=True, caller_works=True)
        op.work()
        return op.result()

    def piece_bytes(self, nbytes: int, *, in_place: bool = True) -> int:
        """Piece size of an I/O of ``nbytes``: ``chunk_bytes``, smaller for smaller I/Os.

        An in-place I/O of up to :data:`WHOLE_IO_BYTES` is one piece.  Otherwise
        an I/O gets at least two waves of ``io_threads`` pieces when that keeps
        pieces of :data:`MIN_PIECE_BYTES` or more (a power of two): a checksum
        that follows a read (:meth:`pread_stream`) then hashes the first wave
        while the second is in flight, instead of hashing all of it at the end.
        Bounced pieces never exceed ``chunk_bytes`` (the bounce buffers' size).
        """
        if in_place and nbytes <= WHOLE_IO_BYTES:
            return max(round_up(nbytes), ALIGN)
        want = nbytes // (2 * self.io_threads)
        if want >= self.chunk_bytes:
            return self.chunk_bytes
        piece = MIN_PIECE_BYTES
        while piece * 2 <= want:
            piece *= 2
        return min(piece, self.chunk_bytes)

    def pread_stream(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int,
                     piece_bytes: int | None = None) -> PieceStream:
        """A read whose pieces can be awaited in order (see :class:`PieceStream`).

        The pieces are the engine's own I/O requests (:meth:`piece_bytes`);
        ``piece_bytes`` is accepted for the interface and ignored.
        """
        return self._start(file, buf, nbytes, offset, write=False, caller_works=False)

    def _start(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
               write: bool, caller_works: bool) -> _Striped:
        """Plan the pieces of an I/O and put pool threads to work on them."""
        view = _byte_view(buf, nbytes)
        if file.direct and offset % ALIGN:
            raise ValueError(f"O_DIRECT offsets must be multiples of {ALIGN}, got {offset}")
        in_place = not file.direct or buffer_address(view) % ALIGN == 0
        if in_place:
            task: Callable[..., None] = self._write_in_place if write else self._read_in_place
        else:
            task = self._write_bounced if write else self._read_bounced
        op = _Striped(task, file, view, offset, self.piece_bytes(nbytes, in_place=in_place))
        for _ in range(min(op.count - caller_works, self.io_threads)):
            self._pool.submit(op.work)
        return op

    def _read_in_place(self, file: PosixFile, piece: np.ndarray, offset: int) -> None:
        n = len(piece)
        body = n - n % ALIGN if file.direct else n
        if body:
            _pread_full(file, memoryview(piece[:body]), offset)
        if body < n:  # partial last block: O_DIRECT reads whole blocks
            tail = self._tails.take()
            try:
                with memoryview(tail) as mv:
                    _pread_full(file, mv, offset + body)
                    piece[body:] = np.frombuffer(mv, np.uint8, n - body)
            finally:
                self._tails.give(tail)

    def _write_in_place(self, file: PosixFile, piece: np.ndarray, offset: int) -> None:
        n = len(piece)
        body = n - n % ALIGN if file.direct else n
        if body:
            _pwrite_full(file, memoryview(piece[:body]), offset)
        if body < n:
            tail = self._tails.take()
            try:
                with memoryview(tail) as mv:
                    arr = np.frombuffer(mv, np.uint8)
                    arr[:n - body] = piece[body:]
                    arr[n - body:] = 0
                    del arr
                    _pwrite_full(file, mv, offset + body)
            finally:
                self._tails.give(tail)

    def _read_bounced(self, file: PosixFile, piece: np.ndarray, offset: int) -> None:
        n = len(piece)
        bounce = self._chunks.take()
        try:
            with memoryview(bounce) as mv:
                _pread_full(file, mv[:round_up(n)], offset)
                piece[:] = np.frombuffer(mv, np.uint8, n)
        finally:
            self._chunks.give(bounce)

    def _write_bounced(self, file: PosixFile, piece: np.ndarray, offset: int) -> None:
        n = len(piece)
        bounce = self._chunks.take()
        try:
            with memoryview(bounce) as mv:
                arr = np.frombuffer(mv, np.uint8)
                arr[:n] = piece
                arr[n:round_up(n)] = 0
                del arr
                _pwrite_full(file, mv[:round_up(n)], offset)
        finally:
            self._chunks.give(bounce)


def _byte_view(buf: Any, nbytes: int) -> np.ndarray:
    """``buf[:nbytes]`` as a contiguous 1-D uint8 numpy view (no copy)."""
    arr = buf if isinstance(buf, np.ndarray) else np.asarray(memoryview(buf))
    if not arr.flags.c_contiguous:
        raise ValueError("I/O buffers must be C-contiguous")
    arr = arr.reshape(-1).view(np.uint8)
    if arr.nbytes < nbytes:
        raise ValueError(f"buffer holds {arr.nbytes} bytes, the I/O needs {nbytes}")
    return arr[:nbytes]


def _pread_full(file: PosixFile, mv: memoryview, offset: int) -> None:
    """Read all of ``mv`` at ``offset``; short reads continue, EOF raises."""
    done, want = 0, len(mv)
    while done < want:
        try:
            got = os.preadv(file.fd, [mv[done:]], offset + done)
        except OSError as e:
            raise BackendIOError(f"read of {want} bytes at offset {offset} of {file.path} failed: "
                                 f"{e.strerror}", offset=offset, expected=want, got=done) from e
        if got == 0:
            raise BackendIOError(f"read of {want} bytes at offset {offset} of {file.path} hit the "
                                 "end of the file (truncated segment?)",
                                 offset=offset, expected=want, got=done)
        done += got


def _pwrite_full(file: PosixFile, mv: memoryview, offset: int) -> None:
    """Write all of ``mv`` at ``offset``; short writes continue."""
    done, want = 0, len(mv)
    while done < want:
        try:
            got = os.pwritev(file.fd, [mv[done:]], offset + done)
        except OSError as e:
            raise BackendIOError(f"write of {want} bytes at offset {offset} of {file.path} failed: "
                                 f"{e.strerror}; check free space and permissions",
                                 offset=offset, expected=want, got=done) from e
        if got == 0:
            raise BackendIOError(f"write at offset {offset} of {file.path} made no progress",
                                 offset=offset, expected=want, got=done)
        done += got


# ---------------------------------------------------------------------------------
# kvikio: CuFile (GDS or its POSIX compat mode)
# ---------------------------------------------------------------------------------
class KvikioEngine(Engine):
    """kvikio ``CuFile`` reads and writes, on host or device buffers.

    kvikio runs each I/O on its own thread pool (sized here from ``io_threads``
    through ``kvikio.defaults``, which is process-wide) and returns an
    ``IOFuture``; a small waiter pool turns those into standard futures, and
    the blocking :meth:`read`/:meth:`write` wait on them directly.

    Two more process-wide kvikio settings are made unless their environment
    variables are set (:func:`_tune_kvikio`): compat-mode reads use
    ``O_DIRECT`` where the buffer allows (``auto_direct_io_read``; kvikio's
    default reads through the page cache, which ``hybridstore bench ssd``
    measured at 0.4-0.6x the device, and 1.0-1.4x with it), and I/Os are
    split into :data:`DEFAULT_CHUNK_BYTES` tasks (``task_size``, 4 MiB by
    default) for the same reason as the POSIX engine's pieces.

    Args:
        io_threads: size of kvikio's thread pool.

    Raises:
        ConfigError: kvikio cannot be imported, or the CUDA driver library
            (``libcuda.so.1``, which kvikio needs even in compat mode) is missing.
    """

    def __init__(self, io_threads: int = 8) -> None:
        if not _libcuda_loadable():
            raise ConfigError("disk_engine='kvikio' needs the NVIDIA driver library libcuda.so.1, "
                              "even in kvikio's compat mode; install the driver or set "
                              "disk_engine='posix' (or 'auto')")
        try:
            import kvikio
            import kvikio.defaults
        except Exception as e:  # noqa: BLE001 - any import failure means "no kvikio"
            raise ConfigError(f"disk_engine='kvikio' but kvikio cannot be imported ({e}); "
                              "pip install kvikio-cu12, or set disk_engine='posix'") from e
        self._kvikio = kvikio
        try:
            if kvikio.defaults.get("num_threads") != io_threads:
                kvikio.defaults.set("num_threads", io_threads)
        except (AttributeError, KeyError, ValueError):  # older kvikio: num_threads_reset()
            reset = getattr(kvikio.defaults, "num_threads_reset", None)
            if reset is not None:
                reset(io_threads)
        _tune_kvikio(kvikio)
        self._compat = _kvikio_compat_mode(kvikio)
        self.name = "kvikio-compat" if self._compat else "kvikio-gds"
        self._waiters = ThreadPoolExecutor(max(2, io_threads),
                                           thread_name_prefix="hs-kvikio-wait")

    #: Piece size of :meth:`pread_stream` (each piece is a kvikio ``pread`` of
    #: several ``task_size`` tasks).
    stream_piece_bytes = 2 << 20

    @property
    def compat_mode(self) -> bool:
        return self._compat

    def open(self, path: str | os.PathLike[str]) -> Any:
        return self._kvikio.CuFile(os.fspath(path), "r+")

    def fileno(self, file: Any) -> int:
        return int(file.fileno())

    def close_file(self, file: Any) -> None:
        file.close()

    def close(self) -> None:
        self._waiters.shutdown(wait=True)

    def pread(self, file: Any, buf: Any, nbytes: int, offset: int) -> Future:
        io = self._start(file.pread, buf, nbytes, offset, "read")
        return self._waiters.submit(self._finish, io, buf, nbytes, offset, "read")

    def pwrite(self, file: Any, buf: Any, nbytes: int, offset: int) -> Future:
        io = self._start(file.pwrite, buf, nbytes, offset, "write")
        return self._waiters.submit(self._finish, io, buf, nbytes, offset, "write")

    def read(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        io = self._start(file.pread, buf, nbytes, offset, "read")
        return self._finish(io, buf, nbytes, offset, "read")

    def pread_stream(self, file: Any, buf: Any, nbytes: int, offset: int,
                     piece_bytes: int | None = None) -> PieceStream:
        """One kvikio ``pread`` per piece, awaited on the caller's thread (no waiter hop)."""
        piece = _piece_size(piece_bytes or self.stream_piece_bytes)
        waits: list[Any] = []
        stream = _FuturePieces(nbytes, piece, waits)
        try:
            for i in range(stream.count):
                start, end = stream.bounds(i)
                part = buf[start:end]
                io = self._start(file.pread, part, end - start, offset + start, "read")
                waits.append(_KvikioWait(self, io, part, end - start, offset + start))
        except BaseException:
            stream.wait_quietly()
            raise
        return stream

    def write(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        io = self._start(file.pwrite, buf, nbytes, offset, "write")
        return self._finish(io, buf, nbytes, offset, "write")

    @staticmethod
    def _start(call: Callable[..., Any], buf: Any, nbytes: int, offset: int, what: str) -> Any:
        """Issue a kvikio I/O; returns its ``IOFuture`` (``None`` for an empty I/O)."""
        if nbytes == 0:
            return None
        try:
            return call(buf, nbytes, offset)
        except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError for driver errors
            raise BackendIOError(f"kvikio {what} of {nbytes} bytes at offset {offset} failed: {e}",
                                 offset=offset, expected=nbytes, got=0) from e

    @staticmethod
    def _finish(io: Any, buf: Any, nbytes: int, offset: int, what: str) -> int:
        """Wait for an ``IOFuture`` (``buf`` is passed only to keep it alive until then)."""
        if io is None:
            return 0
        try:
            got = int(io.get())
        except Exception as e:  # noqa: BLE001
            raise BackendIOError(f"kvikio {what} of {nbytes} bytes at offset {offset} failed: {e}",
                                 offset=offset, expected=nbytes, got=0) from e
        if got != nbytes:
            raise BackendIOError(f"kvikio {what} at offset {offset} moved {got} of {nbytes} bytes "
                                 "(truncated segment?)", offset=offset, expected=nbytes, got=got)
        return got


class _KvikioWait:
    """``.result()`` of one kvikio ``IOFuture`` (waited once, the outcome kept)."""

    __slots__ = ("_args", "_engine", "_outcome")

    def __init__(self, engine: KvikioEngine, io: Any, buf: Any, nbytes: int, offset: int) -> None:
        self._engine = engine
        self._args = (io, buf, nbytes, offset)
        self._outcome: tuple[bool, Any] | None = None

    def result(self) -> int:
        if self._outcome is None:
            io, buf, nbytes, offset = self._args
            try:
                self._outcome = (True, self._engine._finish(io, buf, nbytes, offset, "read"))
            except BaseException as e:  # noqa: BLE001 - re-raised below, and on every call
                self._outcome = (False, e)
            self._args = (None, None, nbytes, offset)
        ok, value = self._outcome
        if not ok:
            raise value
        return int(value)


def _piece_size(piece_bytes: int) -> int:
    if piece_bytes < ALIGN or piece_bytes % ALIGN:
        raise ValueError(f"piece_bytes must be a positive multiple of {ALIGN}, got {piece_bytes}")
    return piece_bytes


_KVIKIO_TUNING = (("auto_direct_io_read", "KVIKIO_AUTO_DIRECT_IO_READ", True),
                  ("task_size", "KVIKIO_TASK_SIZE", DEFAULT_CHUNK_BYTES))


def _tune_kvikio(kvikio: Any) -> None:
    """O_DIRECT compat reads and smaller tasks, unless the environment says otherwise.

    Older kvikio releases without a setting are left as they are.
    """
    for name, env, value in _KVIKIO_TUNING:
        if env in os.environ:
            continue
        try:
            if kvikio.defaults.get(name) != value:
                kvikio.defaults.set(name, value)
        except (AttributeError, KeyError, ValueError, TypeError, RuntimeError):
            log.debug("kvikio has no setting %r; left as it is", name)


def _kvikio_compat_mode(kvikio: Any) -> bool:
    """Whether kvikio will use its POSIX compat path instead of cuFile/GDS."""
    defaults = kvikio.defaults
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return bool(preferred())
    return bool(defaults.compat_mode())  # kvikio < 24.10


# ---------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------
def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_driver_usable() -> bool:
    """True when ``libcuda.so.1`` loads, ``cuInit(0)`` succeeds and a device exists.

    Never raises: a machine without a driver (or with a broken one) is simply
    "not usable".
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(ctypes.c_uint(0)) != 0:
            return False
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
        return count.value > 0
    except (OSError, AttributeError):
        return False


def kvikio_importable() -> bool:
    """True when ``import kvikio`` works (imports it as a side effect)."""
    try:
        import kvikio  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def select_engine(kind: str, io_threads: int = 8) -> Engine:
    """The engine for a ``disk_engine`` setting.

    Args:
        kind: ``"posix"``, ``"kvikio"`` or ``"auto"`` (kvikio when a CUDA driver
            with a device is usable and kvikio imports; POSIX otherwise).
        io_threads: the engine's thread pool size.

    Raises:
        ConfigError: unknown ``kind``, or ``"kvikio"`` where kvikio cannot run.
    """
    if kind == "posix":
        return PosixEngine(io_threads)
    if kind == "kvikio":
        return KvikioEngine(io_threads)
    if kind != "auto":
        raise ConfigError(f"disk_engine must be 'auto', 'kvikio' or 'posix', got {kind!r}")
    if cuda_driver_usable() and kvikio_importable():
        try:
            return KvikioEngine(io_threads)
        except ConfigError as e:
            log.warning("disk_engine='auto': kvikio is unusable (%s); using the POSIX engine", e)
    else:
        log.info("disk_engine='auto': no usable CUDA driver/device or no kvikio; "
                 "using the POSIX O_DIRECT engine")
    return PosixEngine(io_threads)


__all__ = [
    "ALIGN",
    "AlignedBufferPool",
    "Engine",
    "KvikioEngine",
    "PosixEngine",
    "PieceStream",
    "PosixFile",
    "cuda_driver_usable",
    "gather",
    "kvikio_importable",
    "round_up",
    "select_engine",
]
