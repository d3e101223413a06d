"""The kvikio engine: ``CuFile`` (GPUDirect Storage, or kvikio's POSIX compat mode).

kvikio is imported lazily and only here (and only when this engine is built).
Its settings are process-wide (``kvikio.defaults``): this engine applies its
own while any kvikio engine is open and restores the values it found when the
last one closes (:class:`KvikioSettings`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hybridstore.backends.engines.base import (
    Engine,
    FuturePieces,
    PieceStream,
    piece_size,
)
from hybridstore.errors import BackendIOError, ConfigError

log = logging.getLogger("hybridstore.backends.engines")


class KvikioEngine(Engine):
    """kvikio ``CuFile`` reads and writes, on host or device buffers.

    kvikio runs each I/O on its own thread pool (sized here from ``io_threads``
    through ``kvikio.defaults``, which is process-wide) and returns an
    ``IOFuture``; a small waiter pool turns those into standard futures, and
    the blocking :meth:`read`/:meth:`write` wait on them directly.

    Two more process-wide kvikio settings are made (:data:`KVIKIO_TUNING`),
    unless the user gave kvikio their values (``keep``: ``StoreConfig.kvikio_keep``,
    which ``StoreConfig.from_env`` fills from the ``KVIKIO_*`` variables set):
    compat-mode reads use ``O_DIRECT`` where the buffer allows
    (``auto_direct_io_read``; kvikio's default reads through the page cache,
    which ``python -m benchmarks ssd`` measured at 0.4-0.6x the device, and
    1.0-1.4x with it), and I/Os are split into :data:`KVIKIO_TASK_BYTES`
    tasks (``task_size``, 4 MiB by default) for the same reason as the POSIX
    engine's pieces.  All of them hold while any kvikio engine is open;
    :meth:`close` of the last one restores the values kvikio had before
    (:class:`KvikioSettings`).

    Args:
        io_threads: size of kvikio's thread pool.
        keep: names of :data:`KVIKIO_TUNING` settings to leave as kvikio has
            them (none by default).

    Raises:
        ConfigError: kvikio cannot be imported, or the CUDA driver library
            (``libcuda.so.1``, which kvikio needs even in compat mode) is missing.
    """

    def __init__(self, io_threads: int = 8, *, keep: Collection[str] | None = None) -> None:
        if not libcuda_loadable():
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
        keep = frozenset(keep or ())
        tuning = {name: value for name, value in KVIKIO_TUNING.items() if name not in keep}
        SETTINGS.acquire(kvikio, {"num_threads": io_threads, **tuning})
        self._holds_settings = True
        try:
            self._compat = _kvikio_compat_mode(kvikio)
            self.name = "kvikio-compat" if self._compat else "kvikio-gds"
            self._waiters = ThreadPoolExecutor(max(2, io_threads),
                                               thread_name_prefix="hs-kvikio-wait")
        except BaseException:
            self._release_settings()
            raise

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
        """Wait for the I/Os in flight; the last kvikio engine to close restores kvikio's settings."""
        self._waiters.shutdown(wait=True)
        self._release_settings()

    def _release_settings(self) -> None:
        if self._holds_settings:
            self._holds_settings = False
            SETTINGS.release(self._kvikio)

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
        piece = piece_size(piece_bytes or self.stream_piece_bytes)
        waits: list[Any] = []
        stream = FuturePieces(nbytes, piece, waits)
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
        _, value = self._outcome  # (ok, result) or (False, the exception)
        if isinstance(value, BaseException):
            raise value
        return int(value)


KVIKIO_TASK_BYTES = 512 << 10
"""kvikio's ``task_size`` here (the size the SSD benchmark of docs/bench/ssd.md chose for
compat reads; the POSIX engine's requests follow ``StoreConfig.io_chunk_bytes`` instead)."""

KVIKIO_TUNING: Mapping[str, Any] = {"auto_direct_io_read": True, "task_size": KVIKIO_TASK_BYTES}
"""kvikio settings of :class:`KvikioEngine` besides ``num_threads``: O_DIRECT compat reads,
smaller tasks."""


_SETTING_ERRORS = (AttributeError, KeyError, ValueError, TypeError, RuntimeError)


class KvikioSettings:
    """kvikio's process-wide settings (``kvikio.defaults``), held while kvikio engines are open.

    :meth:`acquire` reads each setting's current value with kvikio's getter
    (the first time this holder changes it) and sets the engine's value (the
    engine opened last wins, as with plain ``kvikio.defaults.set``);
    :meth:`release` of the last holder sets every recorded value back.  So
    closing every kvikio engine leaves ``kvikio.defaults`` as they were, and an
    engine closing before another does not undo the other's settings.
    Settings this kvikio release lacks are skipped (logged at debug level).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: dict[str, Any] = {}

    def acquire(self, kvikio: Any, values: Mapping[str, Any]) -> None:
        """Apply ``values`` (setting name -> value) for one more holder."""
        with self._lock:
            try:
                for name, value in values.items():
                    self._apply(kvikio, name, value)
            except BaseException:
                if not self._holders:
                    self._restore(kvikio)
                raise
            self._holders += 1

    def release(self, kvikio: Any) -> None:
        """One holder fewer; the last one restores the recorded values."""
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._restore(kvikio)

    def _apply(self, kvikio: Any, name: str, value: Any) -> None:
        defaults = kvikio.defaults
        try:
            old = defaults.get(name)
            self._saved.setdefault(name, old)
            if old != value:
                defaults.set(name, value)
        except _SETTING_ERRORS:
            reset = getattr(defaults, "num_threads_reset", None)  # older kvikio
            if name == "num_threads" and reset is not None:
                reset(value)
            else:
                log.debug("kvikio has no setting %r; left as it is", name)

    def _restore(self, kvikio: Any) -> None:
        saved, self._saved = self._saved, {}
        for name, value in saved.items():
            try:
                if kvikio.defaults.get(name) != value:
                    kvikio.defaults.set(name, value)
            except _SETTING_ERRORS as e:
                log.warning("could not restore kvikio's setting %r to %r: %s", name, value, e)


SETTINGS = KvikioSettings()
"""The one holder of kvikio's settings in this process (kvikio's are process-wide too)."""


def _kvikio_compat_mode(kvikio: Any) -> bool:
    """Whether kvikio will use its POSIX compat path instead of cuFile/GDS."""
    defaults = kvikio.defaults
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return bool(preferred())
    return bool(defaults.compat_mode())  # kvikio < 24.10


def libcuda_loadable() -> bool:
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
