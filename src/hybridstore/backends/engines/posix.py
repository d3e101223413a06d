"""The POSIX engine: ``O_DIRECT`` files, a thread pool, large I/Os split into pieces."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from hybridstore.backends.engines.base import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    Engine,
    PieceStream,
    buffer_address,
    round_up,
)
from hybridstore.errors import BackendIOError, ConfigError
from hybridstore.objects import byte_view

log = logging.getLogger("hybridstore.backends.engines")

MIN_PIECE_BYTES = 256 << 10
"""Smallest piece of a streamed or bounced I/O (see :meth:`PosixEngine.piece_bytes`)."""

WHOLE_IO_BYTES = 1 << 20
"""Streamed I/Os up to this size on an aligned buffer are issued whole, on the calling
thread (a stream's pieces exist for its checksum to overlap them; below this there is
nothing worth overlapping)."""

BOUNCE_BYTES = 1 << 20
"""Largest piece of a bounced I/O (an unaligned buffer under ``O_DIRECT``): the bounce
buffers' size is ``min(chunk_bytes, BOUNCE_BYTES)``, so a large ``chunk_bytes`` does not
keep large idle buffers."""


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

    An in-place I/O (an aligned buffer, or buffered I/O) is issued as requests
    that follow it: one request for the whole I/O up to ``chunk_bytes``, else
    the fewest equal requests of at most ``chunk_bytes``
    (:meth:`request_bytes`).  A one-request I/O runs on the calling thread of
    :meth:`read`/:meth:`write` (no hand-off); the requests of a larger one are
    pulled from a shared cursor by up to ``io_threads`` threads, the caller
    included, each with one request in flight (the queue depth).  A read
    streamed for its checksum (:meth:`pread_stream`) and an unaligned buffer
    under ``O_DIRECT`` (bounced through aligned buffers) are cut smaller
    (:meth:`piece_bytes`).  File systems that refuse ``O_DIRECT`` (tmpfs) get
    buffered I/O, with a logged warning.

    Each request costs a system call, a wake-up when it changes threads, and
    page pinning in the kernel; the kernel splits a large ``O_DIRECT`` request
    into the device's own maximum and submits the parts at once, so a large
    request still keeps the device busy.  On the 2-core VM of docs/bench/engines.md
    one thread's ``O_DIRECT`` reads cost 0.17 ms of CPU per MiB in 512 KiB
    requests, 0.11 in 1.5 MiB and 0.06 in 4-8 MiB ones, at the same or better
    GB/s.

    Args:
        io_threads: threads that run the requests of one I/O (its queue depth).
        chunk_bytes: largest request (a multiple of 4 KiB).
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
        self._bounce = min(chunk_bytes, BOUNCE_BYTES)
        self._chunks = AlignedBufferPool(self._bounce, keep=2 * io_threads)
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
        return self._blocking(file, buf, nbytes, offset, write=False)

    def write(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> int:
        return self._blocking(file, buf, nbytes, offset, write=True)

    def _blocking(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
                  write: bool) -> int:
        """A blocking I/O: one request runs on the calling thread with nothing to hand off
        or wake (no piece cursor, no future); more are striped over the pool with the
        caller at work too."""
        view = byte_view(buf, nbytes)
        if (nbytes <= self.chunk_bytes and (not file.direct or buffer_address(view) % ALIGN == 0)
                and not (file.direct and offset % ALIGN)):
            (self._write_in_place if write else self._read_in_place)(file, view, offset)
            return nbytes
        op = self._start(file, view, nbytes, offset, write=write, caller_works=True)
        op.work()
        return op.result()

    def request_bytes(self, nbytes: int) -> int:
        """Request size of an in-place I/O of ``nbytes``: the whole I/O up to
        ``chunk_bytes``, else the fewest equal requests of at most ``chunk_bytes``
        (4 KiB multiples; the last may be shorter)."""
        whole = max(round_up(nbytes), ALIGN)
        if whole <= self.chunk_bytes:
            return whole
        count = -(-nbytes // self.chunk_bytes)
        return round_up(-(-nbytes // count))

    def piece_bytes(self, nbytes: int, *, in_place: bool = True, stream: bool = False) -> int:
        """Piece size of an I/O of ``nbytes``: each piece is one request.

        An in-place I/O that is not streamed: :meth:`request_bytes`.  A stream
        (:meth:`pread_stream`: a checksum follows the landed prefix) or a bounced
        I/O: whole up to :data:`WHOLE_IO_BYTES` when in place, else at least two
        waves of ``io_threads`` pieces when that keeps pieces of
        :data:`MIN_PIECE_BYTES` or more (a power of two), so the checksum hashes
        the first wave while the second is in flight; never above ``chunk_bytes``
        (nor, bounced, the bounce buffers' :data:`BOUNCE_BYTES`).
        """
        if in_place and not stream:
            return self.request_bytes(nbytes)
        if in_place and nbytes <= WHOLE_IO_BYTES:
            return max(round_up(nbytes), ALIGN)
        top = self.chunk_bytes if in_place else self._bounce
        want = nbytes // (2 * self.io_threads)
        if want >= top:
            return top
        piece = MIN_PIECE_BYTES
        while piece * 2 <= want:
            piece *= 2
        return min(piece, top)

    def pread_stream(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int,
                     piece_bytes: int | None = None) -> PieceStream:
        """A read whose pieces can be awaited in order (see :class:`PieceStream`).

        The pieces are the engine's own I/O requests (:meth:`piece_bytes` of a
        stream); ``piece_bytes`` is accepted for the interface and ignored.
        """
        return self._start(file, buf, nbytes, offset, write=False, caller_works=False,
                           stream=True)

    def _start(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
               write: bool, caller_works: bool, stream: bool = False) -> _Striped:
        """Plan the requests of an I/O and put pool threads to work on them: up to
        ``io_threads`` threads in all, the caller included when it works."""
        view = byte_view(buf, nbytes)
        if file.direct and offset % ALIGN:
            raise ValueError(f"O_DIRECT offsets must be multiples of {ALIGN}, got {offset}")
        in_place = not file.direct or buffer_address(view) % ALIGN == 0
        if in_place:
            task: Callable[..., None] = self._write_in_place if write else self._read_in_place
        else:
            task = self._write_bounced if write else self._read_bounced
        op = _Striped(task, file, view, offset,
                      self.piece_bytes(nbytes, in_place=in_place, stream=stream))
        for _ in range(min(op.count, self.io_threads) - caller_works):
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
                    _pread_full(file, mv, offset + body, need=n - body)
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
                _pread_full(file, mv[:round_up(n)], offset, need=n)
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


def _pread_full(file: PosixFile, mv: memoryview, offset: int, need: int | None = None) -> None:
    """Read all of ``mv`` at ``offset``; short reads continue, EOF raises unless the first
    ``need`` bytes have landed (an O_DIRECT read of a whole last block whose file ends
    after the payload but inside the block)."""
    done, want = 0, len(mv)
    need = want if need is None else need
    while done < want:
        try:
            got = os.preadv(file.fd, [mv[done:]], offset + done)
        except OSError as e:
            raise BackendIOError(f"read of {want} bytes at offset {offset} of {file.path} failed: "
                                 f"{e.strerror}", offset=offset, expected=want, got=done) from e
        if got == 0:
            if done >= need:
                return
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
