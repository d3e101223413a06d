"""Raw device measurements (``python -m benchmarks ssd``, ``hybridstore bench engines``): fio and an O_DIRECT pool.

* :func:`fio_matrix` runs one fio invocation (``libaio``, ``direct=1``) with one
  stonewalled job per ``(rw, block size, queue depth)`` and returns a row per job.
* :func:`pool_run` is the fallback when fio is absent (and the quick in-run
  reference of the benchmark): ``queue_depth`` Python threads, each issuing
  ``os.preadv``/``os.pwritev`` of ``block_bytes`` on an ``O_DIRECT`` descriptor
  into its own page-aligned buffer (the syscalls release the GIL, so the
  threads keep ``queue_depth`` I/Os in flight).
* :func:`drop_page_cache` / :func:`cached_fraction`: ``posix_fadvise(DONTNEED)``
  a file's clean pages and measure what is left with ``mincore`` (cold reads of
  the buffered paths: torch.load, safetensors, numpy, DALI's mmap reader).

Throughput is in GB/s (1e9 bytes/s); latencies are per I/O, in milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridstore.objects import ALIGN

__all__ = ["IoJob", "cached_fraction", "drop_page_cache", "fio_matrix", "fio_path",
           "fio_version", "make_test_file", "pool_run"]

_READS = ("read", "randread")


@dataclass(frozen=True, slots=True)
class IoJob:
    """One cell of the device matrix: ``rw`` in read/randread/write/randwrite."""

    rw: str
    block_bytes: int
    queue_depth: int

    @property
    def is_read(self) -> bool:
        return self.rw in _READS

    @property
    def name(self) -> str:
        return f"{self.rw}-{_bs_text(self.block_bytes)}-qd{self.queue_depth}"


def _bs_text(n: int) -> str:
    for unit, size in (("m", 1 << 20), ("k", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------
# page cache
# ---------------------------------------------------------------------------------
def drop_page_cache(path: str) -> None:
    """Evict ``path``'s pages from the OS page cache (flushing dirty ones first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc: Any = None


def cached_fraction(path: str) -> float | None:
    """Share of ``path``'s pages in the page cache (``mincore``), ``None`` if unknown."""
    global _libc
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        page = mmap.PAGESIZE
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
            addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
            pages = -(-size // page)
            vec = (ctypes.c_ubyte * pages)()
            rc = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
            if rc != 0:
                return None
            resident = np.frombuffer(vec, dtype=np.uint8) & 1
            return float(resident.sum()) / pages
    except (OSError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------
# our own O_DIRECT pool
# ---------------------------------------------------------------------------------
def make_test_file(path: str, nbytes: int, *, direct: bool = True) -> None:
    """Write ``nbytes`` of incompressible bytes to ``path`` (O_DIRECT when possible), durably."""
    nbytes = -(-nbytes // ALIGN) * ALIGN
    block = 8 << 20
    buf = mmap.mmap(-1, block)
    buf[:] = np.random.default_rng(12345).integers(0, 256, block, dtype=np.uint8).tobytes()
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:
            fd = -1
    if fd < 0:
        fd = os.open(path, flags, 0o644)
    try:
        with memoryview(buf) as mv:
            off = 0
            while off < nbytes:
                n = min(block, nbytes - off)
                mv[:8] = off.to_bytes(8, "little")  # no two blocks alike
                done = 0
                while done < n:
                    done += os.pwritev(fd, [mv[done:n]], off + done)
                off += n
        os.fdatasync(fd)
    finally:
        os.close(fd)
        buf.close()


def pool_run(path: str | None, job: IoJob, *, file_bytes: int = 0,
             seconds: float | None = None, total_bytes: int | None = None, seed: int = 0,
             extents: list[tuple[str, int, int]] | None = None) -> dict[str, Any]:
    """Run ``job`` with ``queue_depth`` threads of O_DIRECT syscalls.

    On ``path`` (``file_bytes`` long): sequential jobs hand out consecutive
    blocks from a shared cursor (wrapping at the end of the file), random jobs
    pick uniform block-aligned offsets.  On ``extents`` instead (``(path,
    offset, length)`` with 4 KiB aligned offsets, read only): each extent is
    cut into blocks of up to ``block_bytes`` (the last rounded up to 4 KiB),
    handed out in order, wrapping around.  Stops after ``seconds`` or after
    ``total_bytes`` (whichever is given; both: the first reached).

    Returns:
        ``{"gbps", "p50_ms", "p99_ms", "iops", "bytes", "seconds", "direct"}``.
    """
    if seconds is None and total_bytes is None:
        raise ValueError("give seconds or total_bytes")
    bs, qd = job.block_bytes, job.queue_depth
    write = not job.is_read
    seq = not job.rw.startswith("rand")
    if extents is not None and write:
        raise ValueError("extents are read only")
    flags = (os.O_RDWR if write else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
    direct = hasattr(os, "O_DIRECT")
    fds: dict[str, int] = {}

    def open_fd(p: str) -> int:
        nonlocal direct
        if p not in fds:
            try:
                fds[p] = os.open(p, flags | (os.O_DIRECT if direct else 0))
            except OSError:
                fds[p], direct = os.open(p, flags), False
        return fds[p]

    blocks: list[tuple[int, int, int]] = []  # (fd, offset, length) for extents
    try:
        if extents is not None:
            for p, off, length in extents:
                fd = open_fd(p)
                for start in range(0, length, bs):
                    n = min(bs, length - start)
                    blocks.append((fd, off + start, -(-n // ALIGN) * ALIGN))
            if not blocks:
                raise ValueError("no extents to read")
        else:
            assert path is not None
            open_fd(path)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    file_fd = None if path is None or extents is not None else fds[path]
    nblocks = max(1, file_bytes // bs)
    cursor = [0]
    done_bytes = [0]
    lock = threading.Lock()
    lat: list[list[float]] = [[] for _ in range(qd)]
    moved = [0] * qd
    errors: list[BaseException] = []
    deadline = [float("inf")]

    def next_io(rng: random.Random) -> tuple[int, int, int] | None:
        with lock:
            if total_bytes is not None and done_bytes[0] >= total_bytes:
                return None
            i = cursor[0]
            cursor[0] += 1
            if blocks:
                io = blocks[i % len(blocks)]
            else:
                assert file_fd is not None
                io = (file_fd, (i % nblocks if seq else rng.randrange(nblocks)) * bs, bs)
            done_bytes[0] += io[2]
            return io

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        buf = mmap.mmap(-1, bs)
        mine = lat[k]
        try:
            with memoryview(buf) as mv:
                while time.perf_counter() < deadline[0]:
                    io = next_io(rng)
                    if io is None:
                        return
                    fd, off, n = io
                    t0 = time.perf_counter()
                    done = 0
                    while done < n:
                        got = (os.pwritev(fd, [mv[done:n]], off + done) if write
                               else os.preadv(fd, [mv[done:n]], off + done))
                        if got <= 0:
                            raise OSError(f"short {'write' if write else 'read'} at {off}")
                        done += got
                    mine.append(time.perf_counter() - t0)
                    moved[k] += n
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)
        finally:
            buf.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(qd)]
    try:
        t0 = time.perf_counter()
        if seconds is not None:
            deadline[0] = t0 + seconds
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if write:
            for fd in fds.values():
                os.fdatasync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    all_lat = np.concatenate([np.asarray(x, dtype=np.float64) for x in lat if x] or
                             [np.zeros(1)])
    ops = sum(len(x) for x in lat)
    nbytes = sum(moved)
    return {"gbps": nbytes / elapsed / 1e9, "p50_ms": float(np.percentile(all_lat, 50)) * 1e3,
            "p99_ms": float(np.percentile(all_lat, 99)) * 1e3, "iops": ops / elapsed,
            "bytes": nbytes, "seconds": elapsed, "direct": direct}


# ---------------------------------------------------------------------------------
# fio
# ---------------------------------------------------------------------------------
def fio_path() -> str | None:
    """Path of the ``fio`` executable, or ``None``."""
    return shutil.which("fio")


def fio_version(fio: str) -> str:
    try:
        out = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
        return out.stdout.strip() or "fio"
    except (OSError, subprocess.SubprocessError):
        return "fio"


def fio_matrix(fio: str, path: str, jobs: list[IoJob], *, file_bytes: int,
               runtime_s: float, ioengine: str = "libaio") -> list[dict[str, Any]]:
    """Run every job in one fio invocation (stonewalled, O_DIRECT); a row per job, in order.

    Raises:
        RuntimeError: fio failed or printed no JSON.
    """
    lines = ["[global]", f"filename={path}", f"size={file_bytes}", "direct=1",
             f"ioengine={ioengine}", "time_based=1", f"runtime={max(1, int(runtime_s * 1000))}ms",
             "norandommap=1", "randrepeat=0", "invalidate=1", "thread=1", ""]
    for k, job in enumerate(jobs):  # a job may repeat: sections are numbered
        lines += [f"[j{k}-{job.name}]", f"rw={job.rw}", f"bs={job.block_bytes}",
                  f"iodepth={job.queue_depth}", "stonewall", ""]
    with tempfile.NamedTemporaryFile("w", suffix=".fio", delete=False) as fh:
        fh.write("\n".join(lines))
        jobfile = fh.name
    try:
        proc = subprocess.run([fio, "--output-format=json", jobfile], capture_output=True,
                              text=True, timeout=60 + len(jobs) * (runtime_s + 10), check=False)
    finally:
        os.unlink(jobfile)
    text = proc.stdout
    start = text.find("{")  # fio may print notes before the JSON
    if proc.returncode != 0 or start < 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    doc = json.loads(text[start:])
    by_name = {j["jobname"]: j for j in doc.get("jobs", [])}
    rows = []
    for k, job in enumerate(jobs):
        j = by_name.get(f"j{k}-{job.name}")
        if j is None:
            raise RuntimeError(f"fio printed no result for job {job.name}")
        side = j["read" if job.is_read else "write"]
        pct = side.get("clat_ns", {}).get("percentile", {})
        rows.append({"rw": job.rw, "block_bytes": job.block_bytes, "iodepth": job.queue_depth,
                     "gbps": side["bw_bytes"] / 1e9, "iops": side.get("iops"),
                     "p50_ms": pct.get("50.000000", 0) / 1e6,
                     "p99_ms": pct.get("99.000000", 0) / 1e6})
    return rows
