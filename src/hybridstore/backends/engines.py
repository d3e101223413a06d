"""I/O engines of the disk tier: positional reads and writes that return futures.

One small interface, two implementations:

=========================  ====================================================
engine (``name``)          how it moves bytes
=========================  ====================================================
``"posix-odirect"``        :class:`PosixEngine`: ``O_DIRECT`` files, a thread
                           pool, large I/Os split into chunks issued in
                           parallel (queue depth is what an NVMe SSD needs);
                           unaligned buffers bounce through aligned ones
``"kvikio-gds"``           :class:`KvikioEngine`: kvikio ``CuFile`` with
                           GPUDirect Storage (device buffers go SSD -> GPU)
``"kvikio-compat"``        :class:`KvikioEngine` in kvikio's POSIX compat mode
=========================  ====================================================

Every engine offers ``open(path) -> file``, ``pread(file, buf, nbytes, offset)``
and ``pwrite(...)`` (both return a :class:`~concurrent.futures.Future` that
yields ``nbytes``; a short or failed I/O raises
:class:`~hybridstore.errors.BackendIOError`), their blocking twins ``read`` and
``write`` (which may run part of the I/O on the calling thread: one thread hop
less for small objects), ``fsync(file)``, ``close_file(file)`` and ``close()``.
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

DEFAULT_CHUNK_BYTES = 8 << 20
"""Size of the pieces a large I/O is split into (one per pool task)."""


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


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


class Engine(ABC):
    """Positional file I/O returning futures; see the module docstring."""

    name: str = "engine"

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


class PosixEngine(Engine):
    """``O_DIRECT`` reads and writes on a thread pool.

    A large I/O is split into ``chunk_bytes`` pieces issued in parallel.  With
    ``O_DIRECT``, a buffer whose address is 4 KiB aligned is read/written in
    place (only a partial last 4 KiB block bounces); an unaligned buffer
    bounces chunk by chunk through aligned buffers.  File systems that refuse
    ``O_DIRECT`` (tmpfs) get buffered I/O, with a logged warning.

    Args:
        io_threads: worker threads (the I/O queue depth).
        chunk_bytes: split size of large I/Os (a multiple of 4 KiB).
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
        return self._submit(file, buf, nbytes, offset, write=False)

    def pwrite(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> Future:
        return self._submit(file, buf, nbytes, offset, write=True)

    def read(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> int:
        return self._run(file, buf, nbytes, offset, write=False)

    def write(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int) -> int:
        return self._run(file, buf, nbytes, offset, write=True)

    def _submit(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
                write: bool) -> Future:
        pieces = self._plan(file, buf, nbytes, offset, write=write)
        return gather([self._pool.submit(*p) for p in pieces], nbytes)

    def _run(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
             write: bool) -> int:
        """Blocking I/O: the first chunk runs in the calling thread, the rest on the pool."""
        pieces = self._plan(file, buf, nbytes, offset, write=write)
        rest = gather([self._pool.submit(*p) for p in pieces[1:]], nbytes)
        if pieces:
            task, *args = pieces[0]
            try:
                task(*args)
            finally:
                rest.exception()  # wait for the others even if ours failed
        return int(rest.result())

    def _plan(self, file: PosixFile, buf: np.ndarray, nbytes: int, offset: int, *,
              write: bool) -> list[tuple[Any, ...]]:
        """``(task, file, piece, offset)`` per chunk of the I/O."""
        view = _byte_view(buf, nbytes)
        if file.direct and offset % ALIGN:
            raise ValueError(f"O_DIRECT offsets must be multiples of {ALIGN}, got {offset}")
        if not file.direct or buffer_address(view) % ALIGN == 0:
            task: Callable[..., None] = self._write_in_place if write else self._read_in_place
        else:
            task = self._write_bounced if write else self._read_bounced
        return [(task, file, view[start:start + self.chunk_bytes], offset + start)
                for start in range(0, nbytes, self.chunk_bytes)]

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
        self._compat = _kvikio_compat_mode(kvikio)
        self.name = "kvikio-compat" if self._compat else "kvikio-gds"
        self._waiters = ThreadPoolExecutor(max(2, io_threads),
                                           thread_name_prefix="hs-kvikio-wait")

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
    "PosixFile",
    "cuda_driver_usable",
    "gather",
    "kvikio_importable",
    "round_up",
    "select_engine",
]
