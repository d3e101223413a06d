"""``python -m benchmarks ssd``: :func:`run_ssd_bench`, the whole benchmark in order."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.ssd.availability import (
    block_device,
    cuda_available,
    dali_state,
    importable,
    kvikio_direct_reads,
    kvikio_state,
    versions,
)
from benchmarks.ssd.host import bench_host
from benchmarks.ssd.paths import (
    DaliPath,
    FilePath,
    NumpyPath,
    SafetensorsPath,
    TierPath,
    TorchPath,
)
from benchmarks.ssd.report import plot_results, print_report, ratios, target_summary
from benchmarks.ssd.runs import Bench, SizeRun, cpu_times, objects_per_size, steal_share
from benchmarks.ssd.sizes import CKPT_BYTES, FULL_SIZES, KIB, MIB, OURS, QUICK_SIZES
from hybridstore.bench import odirect
from hybridstore.bench.common import (
    emit,
    fs_type,
    json_safe,
    machine_info,
    o_direct_works,
    progress,
)
from hybridstore.bench.device import device_matrix, measure_device
from hybridstore.bench.odirect import IoJob


def run_ssd_bench(json_path: str | None = None, disk_dir: str | None = None, *,
                  plot_path: str | None = None, quick: bool = False,
                  sizes: Sequence[int] | None = None, reps: int | None = None,
                  objects: int | None = None, use_fio: bool = True, host_pool: bool = True,
                  print_json: bool = True, cell_seconds: float | None = None,
                  device_file_bytes: int | None = None) -> dict[str, Any]:
    """Run the SSD benchmark, print a table (and the JSON document), return the document.

    Args:
        json_path: also write the JSON document here.
        disk_dir: directory on the file system to measure (a fresh subdirectory
            is made in it and removed afterwards); a temp dir when ``None``.
        plot_path: write the PNG of GB/s against object size here.
        quick: fewer sizes, repetitions, objects and device cells (< 1 minute).
        sizes: object sizes in bytes (default: :data:`QUICK_SIZES` or
            :data:`FULL_SIZES`).
        reps: read repetitions (default 3 quick, 5 full).
        objects: objects per size (default: enough for ~96 MiB quick, ~512 MiB full).
        use_fio: measure the device with fio when it is installed.
        host_pool: include the host-pool copy section.
        print_json: also print the JSON document to stdout.
        cell_seconds: seconds per device-matrix cell (default 0.3 quick, 1 full).
        device_file_bytes: size of the device test file (default 256 MiB quick,
            2 GiB full).

    Returns:
        ``{"machine", "versions", "config", "disk", "device_limit", "results",
        "unavailable", "host", "host_pool", "target", "issues"}``.
    """
    from rich.console import Console

    from hybridstore.backends.disk import DiskTier
    from hybridstore.config import StoreConfig

    sizes = list(sizes or (QUICK_SIZES if quick else FULL_SIZES))
    reps = reps or (3 if quick else 5)
    write_reps = 1 if quick else 2
    counts = {s: objects or objects_per_size(s, quick) for s in sizes}
    issues: list[str] = []
    unavailable: list[dict[str, Any]] = []
    out_console = Console()
    if not out_console.is_terminal:
        out_console = Console(width=170)
    if disk_dir is not None:
        os.makedirs(disk_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="hybridstore-ssd-", dir=disk_dir)
    started = time.perf_counter()
    cfg = StoreConfig()
    dali_ok, dali_why = dali_state()
    safetensors_ok = importable("safetensors.torch")
    kvikio_ok, kvikio_why = kvikio_state()
    cuda = cuda_available()
    threads = max(1, min(4, os.cpu_count() or 1))
    host_sizes = ([64 * KIB, 4 * MIB, CKPT_BYTES] if quick else
                  [64 * KIB, 1 * MIB, 4 * MIB, CKPT_BYTES, 256 * MIB])
    if sizes and max(sizes) < 4 * MIB:  # a tiny test run: keep the host section tiny too
        host_sizes = sorted(set(sizes))[:2]
    n_tiers = 1 + int(kvikio_ok)
    n_reads = n_tiers + ((2 + int(cuda)) if dali_ok else 0) + (6 if safetensors_ok else 4)
    with_fio = use_fio and odirect.fio_path() is not None
    steps = (1 + (3 if with_fio else len(device_matrix(quick)) + 11)
             + len(sizes) * (write_reps * (n_tiers + 2 + int(safetensors_ok))
                             + reps * (1 + n_reads))
             + (len(host_sizes) * (reps + 1) if host_pool else 0))
    o_direct = o_direct_works(root)
    tiers: list[Any] = []
    steal: dict[str, float | None] = {}
    doc: dict[str, Any]
    try:
        with progress("bench ssd", steps) as step:
            # 1. the device
            file_bytes = device_file_bytes or ((256 << 20) if quick else (2 << 30))
            test_file = os.path.join(root, "device-test.dat")
            step(f"device test file: writing {file_bytes >> 20} MiB")
            odirect.make_test_file(test_file, file_bytes)
            device = measure_device(test_file, file_bytes, quick, use_fio, step, issues,
                                     cell_seconds)
            ref = device["reference_job"]
            ref_job = IoJob("read", ref["block_bytes"], ref["iodepth"])
            bench = Bench(root, reps, write_reps, test_file, file_bytes, ref_job, step,
                           np.random.default_rng(20240607).bytes(8 << 20), issues)
            # 2. paths
            biggest = max(counts[s] * s for s in sizes)
            capacity = 2 * biggest + (1 << 30)
            posix = DiskTier(os.path.join(root, "tier-posix"), capacity, engine="posix",
                             segment_bytes=cfg.disk_segment_bytes, io_threads=cfg.io_threads)
            tiers.append(posix)
            bench.tier_paths.append(TierPath(
                posix, OURS, "cold-odirect",
                f"DiskTier(engine={posix.engine.name}, io_threads={cfg.io_threads}, "
                f"chunk={getattr(posix.engine, 'chunk_bytes', 0) >> 10} KiB): "
                "get_into(key, aligned buffer).result(), xxh3 checksum verified"))
            if kvikio_ok:
                try:
                    kv = DiskTier(os.path.join(root, "tier-kvikio"), capacity, engine="kvikio",
                                  segment_bytes=cfg.disk_segment_bytes, io_threads=cfg.io_threads)
                except Exception as e:  # noqa: BLE001
                    unavailable.append({"path": "hybridstore-kvikio", "op": "read/write",
                                        "reason": f"DiskTier(engine='kvikio') failed: {e}"})
                else:
                    tiers.append(kv)
                    name = f"hybridstore-{kv.engine.name}"
                    direct = kvikio_direct_reads()
                    bench.tier_paths.append(TierPath(
                        kv, name, "cold-odirect" if direct else "cold-dropped",
                        f"DiskTier(engine={kv.engine.name}); {kvikio_why}; kvikio "
                        f"auto_direct_io_read={direct}; segment pages dropped before each op",
                        drop_segments=True))
                    other = ("hybridstore-kvikio-gds" if kv.engine.compat_mode
                             else "hybridstore-kvikio-compat")
                    unavailable.append({"path": other, "op": "read/write",
                                        "reason": f"kvikio runs in {kv.engine.name} mode here "
                                                  f"({kvikio_why})"})
            else:
                for name in ("hybridstore-kvikio-compat", "hybridstore-kvikio-gds"):
                    unavailable.append({"path": name, "op": "read/write", "reason": kvikio_why})
            bench.read_paths.extend(bench.tier_paths)
            if dali_ok:
                bench.read_paths += [DaliPath("odirect", threads), DaliPath("warm", threads)]
                if cuda:
                    bench.read_paths.append(DaliPath("gpu", threads))
                else:
                    unavailable.append({"path": "dali-numpy-gpu", "op": "read",
                                        "reason": "no CUDA device: DALI's GPU/GDS numpy reader "
                                                  "needs one"})
            else:
                for name in ("dali-numpy-cpu", "dali-numpy-gpu"):
                    unavailable.append({"path": name, "op": "read", "reason": dali_why})
            readers: list[type[FilePath]] = [TorchPath, NumpyPath]
            if safetensors_ok:
                readers.insert(1, SafetensorsPath)
            else:
                bench.safetensors = False
                unavailable.append({"path": "safetensors", "op": "read/write",
                                    "reason": "safetensors cannot be imported (pip install "
                                              "safetensors)"})
            for cls in readers:
                bench.read_paths += [cls(cold=True), cls(cold=False)]
            unavailable.append({"path": OURS, "op": "read-to-gpu",
                                "reason": "get_into a CUDA tensor (host bounce + H2D, or kvikio "
                                          "GDS) is not measured by this version of the bench"})
            for size in sizes:
                run = SizeRun(bench, size, counts[size])
                cpu0 = cpu_times()
                try:
                    for wrep in range(write_reps):
                        run.writes(wrep)
                        bench.last_write_rep = wrep
                    for rep in range(reps):
                        run.reads(rep)
                finally:
                    run.close()
                    steal[str(size)] = steal_share(cpu0, cpu_times())
                del run
                gc.collect()
            # 3. the host pool
            host_rows: list[dict[str, Any]] = []
            pinned = False
            if host_pool:
                host_rows, pinned = bench_host(host_sizes, reps, step, unavailable)
    finally:
        for t in tiers:
            with contextlib.suppress(Exception):
                t.close()
        shutil.rmtree(root, ignore_errors=True)

    rows = list(bench.rows.values())
    results = ratios(rows, device, bench.device_now)
    doc = {
        "machine": machine_info(),
        "versions": versions(),
        "config": {"quick": quick, "reps": reps, "write_reps": write_reps,
                   "sizes": sizes, "objects_per_size": {str(s): counts[s] for s in sizes},
                   "io_threads": cfg.io_threads, "segment_bytes": cfg.disk_segment_bytes,
                   "gbps_unit": "1e9 bytes/s",
                   "gbps": "bytes of the objects / summed seconds of their ops, median of reps",
                   "vs_device_now": "median over reps of (path GB/s / device-ref GB/s of the "
                                    "same rep and size)",
                   "vs_hybridstore": f"median over reps of (path GB/s / {OURS} GB/s, same "
                                     "rep, op and size)",
                   "cache": {"cold-odirect": "O_DIRECT reads: no page cache",
                             "cold-dropped": "buffered reads after posix_fadvise(DONTNEED) of "
                                             "the file (page_cache_after_drop: mincore share "
                                             "left, sampled on the first object)",
                             "warm": "buffered reads of files already in the page cache",
                             "durable (O_DIRECT + fdatasync + catalog commit)":
                                 "put().result() of the disk tier",
                             "buffered + fsync": "file written, then fsync'ed (timed)"},
                   "dali": ("batch_size=1, one pipeline per repetition (built untimed), "
                            f"num_threads={threads}, exec_pipelined=False; its loader reads one "
                            "sample ahead, so per-op times after the first overlap the next read"),
                   "cpu_steal_share": steal,
                   "cpu_steal_note": "share of CPU time the hypervisor stole (/proc/stat) while "
                                     "each object size ran: a busy host slows every path, the "
                                     "ones that compute (checksums, Python) the most",
                   "elapsed_s": None},
        "disk": {"dir": root, "fs_type": fs_type(os.path.dirname(root) or "."),
                 "o_direct": bool(o_direct), "block_device": block_device(os.path.dirname(root))},
        "device_limit": device,
        "results": results,
        "unavailable": unavailable,
        "host": {"pinned": bool(pinned),
                 "note": ("HostPool arenas page-locked with cudaHostRegister" if pinned else
                          "pageable mmap arenas (pinning needs a CUDA device)")},
        "host_pool": host_rows,
        "target": target_summary(results),
        "issues": issues,
    }
    doc["config"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    doc = json_safe(doc)
    print_report(doc, out_console)
    try:
        emit(doc, json_path=json_path, echo_json=print_json, plot_path=plot_path, plot=plot_results)
    except ImportError as e:
        out_console.print(f"[red]no plot:[/red] {e}; pip install matplotlib (the bench extra)")
        raise
    return doc
