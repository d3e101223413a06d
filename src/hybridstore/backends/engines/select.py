"""Which engine a ``disk_engine`` setting gets."""

from __future__ import annotations

import logging
from collections.abc import Collection

from hybridstore.backends.engines.base import DEFAULT_CHUNK_BYTES, Engine
from hybridstore.backends.engines.kvikio import (
    KvikioEngine,
    cuda_driver_usable,
    kvikio_importable,
)
from hybridstore.backends.engines.posix import PosixEngine
from hybridstore.errors import ConfigError

log = logging.getLogger("hybridstore.backends.engines")


def select_engine(kind: str, io_threads: int = 8, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  kvikio_keep: Collection[str] | None = None) -> Engine:
    """The engine for a ``disk_engine`` setting.

    Args:
        kind: ``"posix"``, ``"kvikio"`` or ``"auto"`` (kvikio when a CUDA driver
            with a device is usable and kvikio imports; POSIX otherwise).
        io_threads: the engine's thread pool size.
        chunk_bytes: the POSIX engine's largest request (``StoreConfig.io_chunk_bytes``).
        kvikio_keep: kvikio settings the kvikio engine leaves as they are
            (:class:`KvikioEngine`'s ``keep``).

    Raises:
        ConfigError: unknown ``kind``, or ``"kvikio"`` where kvikio cannot run.
    """
    if kind == "posix":
        return PosixEngine(io_threads, chunk_bytes=chunk_bytes)
    if kind == "kvikio":
        return KvikioEngine(io_threads, keep=kvikio_keep)
    if kind != "auto":
        raise ConfigError(f"disk_engine must be 'auto', 'kvikio' or 'posix', got {kind!r}")
    if cuda_driver_usable() and kvikio_importable():
        try:
            return KvikioEngine(io_threads, keep=kvikio_keep)
        except ConfigError as e:
            log.warning("disk_engine='auto': kvikio is unusable (%s); using the POSIX engine", e)
    else:
        log.info("disk_engine='auto': no usable CUDA driver/device or no kvikio; "
                 "using the POSIX O_DIRECT engine")
    return PosixEngine(io_threads, chunk_bytes=chunk_bytes)
