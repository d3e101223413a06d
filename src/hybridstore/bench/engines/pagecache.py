"""Cold reads of buffered files: drop a directory's pages from the OS page cache, and check.

``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``fdatasync`` on every file under a
directory (:func:`hybridstore.bench.odirect.drop_page_cache`), with the share of
those files' pages still resident measured by ``mincore``
(:func:`hybridstore.bench.odirect.cached_fraction`) before and after, on a sample
of the files.  The drop is advisory: a file system or a hypervisor may keep the
pages, which is why the result says what was left.
"""

from __future__ import annotations

import os
from typing import Any

from hybridstore.bench import odirect

__all__ = ["device_now", "drop_dir", "empty_host_tier", "files_under", "flush_store"]

_SAMPLE = 64


def files_under(root: str) -> list[str]:
    """Every regular file under ``root`` (sorted)."""
    out: list[str] = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names)
    return sorted(p for p in out if os.path.isfile(p))


def _resident(paths: list[str]) -> float | None:
    """Byte-weighted share of ``paths``' pages in the page cache (``None``: mincore failed)."""
    got, total = 0.0, 0
    for p in paths:
        try:
            size = os.path.getsize(p)
        except OSError:
            continue
        frac = odirect.cached_fraction(p)
        if frac is None:
            return None
        got += frac * size
        total += size
    return got / total if total else 0.0


def drop_dir(root: str) -> dict[str, Any]:
    """Evict every file under ``root`` from the page cache; what was resident before and after.

    Returns:
        ``{"files", "bytes", "resident_before", "resident_after", "dropped"}`` where the
        residencies are shares (0..1) of a sample of up to 64 files (largest first), and
        ``dropped`` says whether at most 5% was left.
    """
    paths = files_under(root)
    sizes = {p: os.path.getsize(p) for p in paths}
    sample = sorted(paths, key=lambda p: -sizes[p])[:_SAMPLE]
    before = _resident(sample)
    for p in paths:
        try:
            odirect.drop_page_cache(p)
        except OSError:
            pass
    after = _resident(sample)
    return {"files": len(paths), "bytes": sum(sizes.values()), "resident_before": before,
            "resident_after": after, "dropped": None if after is None else after <= 0.05}


def empty_host_tier(backend: Any) -> dict[str, Any] | None:
    """Evict every object from the DRAM tier of our adapter's store (its ``store`` attribute).

    The counterpart of dropping the page cache for a file backend: afterwards a
    load must come from the SSD.  ``None`` for a backend without a hybridstore store.
    """
    store = getattr(backend, "store", None)
    tiers = getattr(store, "tiers", None)
    if store is None or not tiers or "host" not in tiers:
        return None
    store.flush()                        # every SSD copy written, so DRAM copies may go
    before = int(tiers["host"].used_bytes)
    store.evict(1 << 62, tier="host")
    return {"host_bytes_before": before, "host_bytes_after": int(tiers["host"].used_bytes)}


def flush_store(backend: Any) -> float | None:
    """Seconds until our adapter's store has every SSD write done (``store.flush()``).

    Our stores return once the object is in the DRAM tier and write it to the SSD
    in the background (write-through); a file backend's call returns after its
    ``write``.  The bench times this wait after each store phase, so a durable
    write rate can be given next to the call rate.  ``None`` for other backends.
    """
    import time

    store = getattr(backend, "store", None)
    if store is None or not hasattr(store, "flush"):
        return None
    t0 = time.perf_counter()
    store.flush()
    return time.perf_counter() - t0


def device_now(root: str, job: Any, *, max_bytes: int) -> float | None:
    """GB/s of O_DIRECT reads of the files under ``root`` right now (the in-run device reference).

    Our O_DIRECT thread pool (:func:`hybridstore.bench.odirect.pool_run`) at the
    SSD limit's best read cell (``job``: block size, queue depth), over the
    4 KiB-aligned part of every file of at least 4 KiB, up to ``max_bytes``: what
    the disk delivers for the very data the backends just wrote (a cache below
    the machine included, if there is one).  ``None`` when there is nothing to read.
    """
    extents = []
    for p in files_under(root):
        n = os.path.getsize(p) // 4096 * 4096
        if n:
            extents.append((p, 0, n))
    if not extents:
        return None
    total = min(max_bytes, sum(n for _, _, n in extents))
    return float(odirect.pool_run(None, job, extents=extents, total_bytes=total)["gbps"])
