"""The device limit: O_DIRECT reads and writes over a matrix of block sizes and queue depths.

With fio when it is installed (and allowed), else with the O_DIRECT thread pool of
:mod:`hybridstore.bench.odirect`; ``tool`` in the result says which measured it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridstore.bench import odirect
from hybridstore.bench.common import KIB, MIB, median
from hybridstore.bench.odirect import IoJob

TOOL_FIO = "fio"
TOOL_POOL = "odirect-pool"
"""``tool`` of the device limit: fio, or the O_DIRECT thread pool of :mod:`hybridstore.bench.odirect`."""


def device_matrix(quick: bool) -> list[IoJob]:
    k, m = KIB, MIB
    if quick:
        cells = [("read", 256 * k, 2), ("read", 256 * k, 8), ("read", 1 * m, 2), ("read", 1 * m, 8),
                 ("read", 4 * m, 1), ("randread", 4 * k, 1), ("randread", 4 * k, 32),
                 ("randread", 1 * m, 8), ("write", 1 * m, 4), ("write", 4 * k, 1),
                 ("randwrite", 4 * k, 32), ("randwrite", 1 * m, 8)]
    else:
        cells = [(rw, bs, qd) for rw in ("read", "randread")
                 for bs in (4 * k, 64 * k, 256 * k, 1 * m, 4 * m) for qd in (1, 4, 8, 16, 32)]
        cells += [(rw, bs, qd) for rw in ("write", "randwrite")
                  for bs in (4 * k, 256 * k, 1 * m, 4 * m) for qd in (1, 8, 32)]
    return [IoJob(rw, bs, qd) for rw, bs, qd in cells]


def _run_cells(jobs: list[IoJob], path: str, file_bytes: int, runtime: float,
               fio: str | None, step: Callable[[str], None], what: str) -> list[dict[str, Any]]:
    """One row per job: fio when given, else the O_DIRECT thread pool."""
    if fio is not None:
        step(f"device limit: fio, {what}: {len(jobs)} cells x {runtime:g} s")
        return odirect.fio_matrix(fio, path, jobs, file_bytes=file_bytes, runtime_s=runtime)
    rows = []
    for job in jobs:
        step(f"device limit: {what}: {job.name} (python O_DIRECT pool)")
        r = odirect.pool_run(path, job, file_bytes=file_bytes, seconds=runtime)
        rows.append({"rw": job.rw, "block_bytes": job.block_bytes, "iodepth": job.queue_depth,
                     "gbps": r["gbps"], "iops": r["iops"], "p50_ms": r["p50_ms"],
                     "p99_ms": r["p99_ms"]})
    return rows


def measure_device(path: str, file_bytes: int, quick: bool, use_fio: bool,
                    step: Callable[[str], None], issues: list[str],
                    cell_seconds: float | None = None) -> dict[str, Any]:
    """The matrix, then its best cells twice more: the limit is the best median of 3 runs.

    One run of a cell catches the device's good and bad moments alike (this
    VM's disk swings between ~1.3 and ~3 GB/s over minutes); the best cell's
    median over three runs is a limit a path can be held to.
    """
    jobs = device_matrix(quick)
    runtime = cell_seconds or (0.3 if quick else 1.0)
    fio = odirect.fio_path() if use_fio else None
    method = None
    fallback = None  # why the pool measured instead of fio
    rows: list[dict[str, Any]] = []
    if fio is not None:
        try:
            rows = _run_cells(jobs, path, file_bytes, runtime, fio, step, "matrix")
            method = f"{odirect.fio_version(fio)}, ioengine=libaio, direct=1 (O_DIRECT)"
        except (RuntimeError, OSError, ValueError) as e:
            issues.append(f"fio failed ({e}); measured the device with the O_DIRECT thread pool")
            fio, rows = None, []
    if not rows:
        why = ("fio disabled (--no-fio)" if not use_fio else
               "fio not found" if odirect.fio_path() is None else "fio failed")
        fallback = why
        method = ("python O_DIRECT thread pool: os.preadv/os.pwritev on O_DIRECT fds, one thread "
                  f"per queue slot ({why})")
        rows = _run_cells(jobs, path, file_bytes, runtime, None, step, "matrix")
    for r in rows:
        r["samples_gbps"] = [r["gbps"]]
    top = (sorted((r for r in rows if r["rw"] in ("read", "randread")),
                  key=lambda r: -r["gbps"])[:3]
           + sorted((r for r in rows if r["rw"] in ("write", "randwrite")),
                    key=lambda r: -r["gbps"])[:2])
    again = [IoJob(r["rw"], r["block_bytes"], r["iodepth"]) for r in top] * 2
    try:
        more = _run_cells(again, path, file_bytes, runtime, fio, step, "best cells again")
    except (RuntimeError, OSError, ValueError) as e:
        issues.append(f"re-running the best device cells failed ({e}); the limit is one run's")
        more = []
    for r, m in zip(top * 2, more):
        r["samples_gbps"].append(m["gbps"])
    for r in rows:
        r["gbps_median"] = median(r["samples_gbps"])
    confirmed = [r for r in rows if len(r["samples_gbps"]) > 1] or rows
    reads = [r for r in confirmed if r["rw"] in ("read", "randread")]
    writes = [r for r in confirmed if r["rw"] in ("write", "randwrite")]
    best_read = max(reads, key=lambda r: r["gbps_median"])
    best_write = max(writes, key=lambda r: r["gbps_median"]) if writes else None
    # our pool at the best read cell: the reference of every repetition (device-ref rows)
    ref_job = IoJob("read", best_read["block_bytes"], best_read["iodepth"])
    step(f"device limit: python pool at {ref_job.name}")
    pool = odirect.pool_run(path, ref_job, file_bytes=file_bytes, seconds=runtime)

    def cell(r: dict[str, Any]) -> dict[str, Any]:
        return {k: r[k] for k in ("rw", "block_bytes", "iodepth", "samples_gbps")}

    return {
        "read_gbps": best_read["gbps_median"],
        "write_gbps": best_write["gbps_median"] if best_write else None,
        "method": method,
        "tool": TOOL_FIO if fallback is None else TOOL_POOL,
        "fallback": fallback,
        "estimator": "the whole matrix once, then its top 3 read and top 2 write cells twice "
                     "more; the limit is the best of those cells' medians over their 3 runs",
        "best_read": cell(best_read),
        "best_write": cell(best_write) if best_write else None,
        "reference_job": {"rw": ref_job.rw, "block_bytes": ref_job.block_bytes,
                          "iodepth": ref_job.queue_depth, "gbps": pool["gbps"],
                          "method": "python O_DIRECT thread pool (device-ref rows)"},
        "file_bytes": file_bytes,
        "seconds_per_cell": runtime,
        "matrix": rows,
    }
