"""The least a verified load costs on this machine: O_DIRECT reads and checksums, nothing else.

Issue 26 asks the vLLM tier's loads for at most 0.15 ms of CPU per MiB with every byte
checked.  :func:`load_floor` measures what the same bytes cost one thread with no store,
no tier and no engine: ``os.preadv`` requests of ``run_bytes`` (the disk tier's coalesced
reads, :data:`~hybridstore.backends.disk.objects.COALESCE_BYTES`) from a file of fresh
incompressible bytes opened with ``O_DIRECT``, and the same reads followed by the
xxh3_64 of every ``chunk_bytes`` (:func:`~hybridstore.backends.disk.objects.checksum`,
the tier's check of one object).  The CPU is this thread's (``RUSAGE_THREAD``): the
bench's polling loop and every other thread are outside it, so a tier's process CPU
per MiB, which includes them, can be set against it.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

from hybridstore.backends.disk.objects import checksum
from hybridstore.bench import odirect
from hybridstore.errors import ConfigError
from hybridstore.objects import ALIGN, aligned_empty

__all__ = ["load_floor"]


def _thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def load_floor(path: str, nbytes: int, *, run_bytes: int, chunk_bytes: int,
               passes: int = 3) -> dict[str, Any]:
    """CPU per MiB of ``passes`` reads of an ``nbytes`` file at ``path`` (written here),
    alternating plain reads and reads whose every chunk is checksummed; medians.

    Returns:
        ``read_cpu_ms_per_mib`` and ``checked_cpu_ms_per_mib`` (this thread's user +
        system time per MiB), their difference ``check_cpu_ms_per_mib``, ``read_gbps``
        (1e9 bytes/s of the plain reads), ``chunks_checked`` per pass, ``direct``
        (whether the file system took ``O_DIRECT``).  The file is removed.

    Raises:
        ConfigError: ``run_bytes`` is not a multiple of ``chunk_bytes`` and of 4 KiB, or
            ``nbytes`` holds no whole run.
    """
    if (run_bytes <= 0 or chunk_bytes <= 0 or run_bytes % chunk_bytes or run_bytes % ALIGN
            or nbytes < run_bytes):
        raise ConfigError(f"run_bytes {run_bytes} must be a multiple of chunk_bytes "
                          f"{chunk_bytes} and of {ALIGN}, and fit in {nbytes} bytes")
    nbytes -= nbytes % run_bytes
    odirect.make_test_file(path, nbytes)
    try:
        direct = hasattr(os, "O_DIRECT")
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError:           # a file system without O_DIRECT (tmpfs)
            direct = False
            fd = os.open(path, os.O_RDONLY)
        buf = aligned_empty(run_bytes)
        plain: list[tuple[float, float]] = []
        checked: list[float] = []
        try:
            for _ in range(passes):
                for check in (False, True):
                    cpu0, wall0 = _thread_cpu(), time.perf_counter()
                    for off in range(0, nbytes, run_bytes):
                        _read_full(fd, buf, off)
                        if check:
                            for c in range(0, run_bytes, chunk_bytes):
                                checksum(buf[c:c + chunk_bytes])
                    cpu, wall = _thread_cpu() - cpu0, time.perf_counter() - wall0
                    per_mib = cpu / (nbytes / 2**20) * 1e3
                    if check:
                        checked.append(per_mib)
                    else:
                        plain.append((per_mib, nbytes / wall / 1e9 if wall > 0 else 0.0))
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    read = statistics.median(p[0] for p in plain)
    full = statistics.median(checked)
    return {"read_cpu_ms_per_mib": read, "checked_cpu_ms_per_mib": full,
            "check_cpu_ms_per_mib": full - read,
            "read_gbps": statistics.median(p[1] for p in plain),
            "chunks_checked": nbytes // chunk_bytes, "run_bytes": run_bytes,
            "chunk_bytes": chunk_bytes, "bytes": nbytes, "passes": passes, "direct": direct}


def _read_full(fd: int, buf: Any, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of ``fd`` (short reads continue; EOF is an error)."""
    with memoryview(buf) as mv:
        done = 0
        while done < len(mv):
            got = os.preadv(fd, [mv[done:]], offset + done)
            if got == 0:
                raise EOFError(f"the file ends at {offset + done}")
            done += got
