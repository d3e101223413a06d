"""``hybridstore bench ssd``: the disk tier against the device limit and other loaders.

What is measured, in order, all on the file system of ``--dir``:

1. **Device limit.**  O_DIRECT sequential and random reads and writes at
   several block sizes and queue depths on a test file: with fio (``libaio``,
   ``direct=1``, one stonewalled job per cell) when ``fio`` is on ``PATH``, else
   with an O_DIRECT thread pool of our own (:mod:`hybridstore.bench.odirect`).
   ``read_gbps``/``write_gbps`` are the best cells.
2. **Object paths.**  For each object size (4 KiB to 256 MiB, including a
   Qwen3.5-9B recurrent-state checkpoint of 50 MB and one of its 576-token KV
   blocks), ``n`` objects are written, then read back one at a time through:

   ============================  ==============================================
   path                          how
   ============================  ==============================================
   ``hybridstore-posix``         :class:`~hybridstore.backends.disk.DiskTier`
                                 with the POSIX engine: ``put(...).result()``
                                 (durable) and ``get_into(key, out).result()``
                                 (O_DIRECT, checksum verified)
   ``hybridstore-kvikio-*``      the same tier on kvikio (compat or GDS), where
                                 a CUDA driver exists
   ``dali-numpy-cpu``            ``nvidia.dali.fn.readers.numpy`` on the CPU
                                 (``use_o_direct`` cold; mmap warm), one
                                 ``.npy`` per object, batch size 1
   ``dali-numpy-gpu``            the same reader on a GPU (GDS), where present
   ``torch.load``                ``torch.save``/``torch.load`` of a uint8 tensor
   ``safetensors``               ``safetensors.torch`` ``save_file``/``load_file``
   ``numpy.fromfile``            ``np.save`` / ``np.fromfile`` of the ``.npy``
   ============================  ==============================================

   Cache states: ``cold-odirect`` (O_DIRECT: the page cache is bypassed),
   ``cold-dropped`` (buffered reader; the file's pages were evicted with
   ``posix_fadvise(DONTNEED)`` before each op, checked with ``mincore``),
   ``warm`` (buffered reader, file in the page cache).  Writes are durable
   (fsync'ed) for every path.
3. **Host pool.**  Copies into and out of the pinned DRAM pool
   (:class:`~hybridstore.backends.host.HostPool` ``put``/``get_into``) against
   ``numpy.copyto``; on a GPU also H2D/D2H between the pool and the device
   against torch pinned tensors.

Every repetition runs every path once, in a rotated order, and first
``device-ref``: our O_DIRECT pool at the best read cell (block size, queue
depth) reading the very extents of these objects in the disk tier's segment
files, so each path's throughput is compared with the device *in the same
repetition, on the same blocks* (``vs_device_now``) as well as with the
device limit (``vs_device_limit``) and with hybridstore (``vs_hybridstore``).
The virtual disk this was developed on swings between ~1.3 and ~3 GB/s
within minutes, so the in-run ratios are the ones to compare.  GB/s is bytes of the objects over the
summed wall time of their ops (1e9 bytes/s), median over repetitions;
``p50_ms``/``p99_ms`` are per op, over all repetitions.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridstore.backends.engines import fsync_path
from hybridstore.bench import odirect
from hybridstore.bench.common import emit
from hybridstore.bench.common import json_safe as _finite
from hybridstore.bench.common import machine_info as _machine
from hybridstore.bench.common import median as _median
from hybridstore.bench.common import no_gc as _no_gc
from hybridstore.bench.common import percentile as _pct
from hybridstore.bench.core import _aligned, _fs_type, _o_direct_works
from hybridstore.bench.odirect import IoJob

__all__ = ["CKPT_BYTES", "KV_BLOCK_BYTES", "QUICK_SIZES", "FULL_SIZES", "parse_sizes",
           "run_ssd_bench"]

KIB = 1 << 10
MIB = 1 << 20


def _qwen_sizes() -> tuple[int, int]:
    from hybridstore.replay.models import model_preset

    m = model_preset("qwen3.5-9b")
    return m.page_bytes(576), m.checkpoint_bytes


KV_BLOCK_BYTES, CKPT_BYTES = _qwen_sizes()
"""One 576-token KV block and one recurrent-state checkpoint of Qwen3.5-9B (≈ 19.3 MB, 50 MB)."""

FULL_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, KV_BLOCK_BYTES, CKPT_BYTES, 64 * MIB, 256 * MIB)
QUICK_SIZES = (4 * KIB, 4 * MIB, KV_BLOCK_BYTES, CKPT_BYTES)
TARGET_MIN_BYTES = 4 * MIB
TARGET_RATIO = 0.9
OURS = "hybridstore-posix"

_SIZE_NAMES = {KV_BLOCK_BYTES: "kv-block-576", CKPT_BYTES: "checkpoint"}


def size_label(n: int) -> str:
    """``4 KiB``, ``50000000 B (checkpoint)``..."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            text = f"{n // size} {unit}"
            break
    else:
        text = f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} B"
    name = _SIZE_NAMES.get(n)
    return f"{text} ({name})" if name else text


def parse_sizes(text: str) -> list[int]:
    """``"4K,4M,kv,ckpt,1G,12345"`` -> byte counts (``kv``: KV block, ``ckpt``: checkpoint)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        if p in ("kv", "kv-block"):
            out.append(KV_BLOCK_BYTES)
        elif p in ("ckpt", "checkpoint"):
            out.append(CKPT_BYTES)
        else:
            mult = {"k": KIB, "m": MIB, "g": 1 << 30}.get(p[-1], 1)
            num = p[:-1] if p[-1] in "kmg" else p
            if p.endswith(("kib", "mib", "gib")):
                mult, num = {"kib": KIB, "mib": MIB, "gib": 1 << 30}[p[-3:]], p[:-3]
            out.append(int(float(num) * mult))
        if out[-1] < 1:
            raise ValueError(f"object sizes must be positive: {part!r}")
    return out


# ---------------------------------------------------------------------------------
# the device matrix
# ---------------------------------------------------------------------------------
def _matrix(quick: bool) -> list[IoJob]:
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


def _measure_device(path: str, file_bytes: int, quick: bool, use_fio: bool,
                    step: Callable[[str], None], issues: list[str],
                    cell_seconds: float | None = None) -> dict[str, Any]:
    """The matrix, then its best cells twice more: the limit is the best median of 3 runs.

    One run of a cell catches the device's good and bad moments alike (this
    VM's disk swings between ~1.3 and ~3 GB/s over minutes); the best cell's
    median over three runs is a limit a path can be held to.
    """
    jobs = _matrix(quick)
    runtime = cell_seconds or (0.3 if quick else 1.0)
    fio = odirect.fio_path() if use_fio else None
    method = None
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
        r["gbps_median"] = _median(r["samples_gbps"])
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


# ---------------------------------------------------------------------------------
# timing rows
# ---------------------------------------------------------------------------------
@dataclass
class _Row:
    path: str
    op: str
    cache: str
    object_bytes: int
    note: str = ""
    rep_gbps: dict[int, float] = field(default_factory=dict)
    op_seconds: list[float] = field(default_factory=list)
    objects_per_rep: int = 0
    cached_after_drop: float | None = None

    def add_rep(self, rep: int, seconds: list[float], nbytes: int) -> None:
        self.rep_gbps[rep] = nbytes / sum(seconds) / 1e9
        self.op_seconds.extend(seconds)
        self.objects_per_rep = len(seconds)

    def doc(self) -> dict[str, Any]:
        g = list(self.rep_gbps.values())
        out: dict[str, Any] = {
            "path": self.path, "op": self.op, "cache": self.cache,
            "object_bytes": self.object_bytes, "gbps": _median(g),
            "gbps_p10": _pct(g, 10.0), "p50_ms": _pct(self.op_seconds, 50.0) * 1e3,
            "p99_ms": _pct(self.op_seconds, 99.0) * 1e3, "reps": len(g),
            "objects_per_rep": self.objects_per_rep,
        }
        if self.cached_after_drop is not None:
            out["page_cache_after_drop"] = self.cached_after_drop
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class _Objects:
    """``n`` objects of ``size`` bytes: names, keys, the source buffer, a target buffer."""

    size: int
    n: int
    dir: str
    src: np.ndarray
    out: np.ndarray

    def stamp(self, i: int, rep: int) -> np.ndarray:
        """The source buffer, made unique to object ``i`` of write repetition ``rep``."""
        head = min(16, self.size)
        self.src[:head] = np.frombuffer((i + (rep << 32)).to_bytes(8, "little") * 2,
                                        np.uint8)[:head]
        return self.src

    def file(self, i: int, ext: str) -> str:
        return os.path.join(self.dir, f"obj-{i:04d}.{ext}")

    def key(self, i: int, salt: int) -> bytes:
        from hybridstore.backends.base import ObjectKind, object_key

        return object_key(ObjectKind.STATE, (self.size * 1_000_003 + i * 131 + salt)
                          .to_bytes(16, "little"))


def _npy_offset(path: str) -> int:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            np.lib.format.read_array_header_1_0(fh)
        else:
            np.lib.format.read_array_header_2_0(fh)
        return fh.tell()


# ---------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------
class _Path:
    """One way of writing/reading the objects; ``read_one`` is what gets timed."""

    name = "path"
    cache = "warm"
    op = "read"
    note = ""

    def start_rep(self, objs: _Objects, rep: int) -> None:
        """Untimed set-up before a repetition's reads."""

    def before_one(self, objs: _Objects, i: int) -> None:
        """Untimed set-up before one read (dropping the page cache)."""

    def read_one(self, objs: _Objects, i: int) -> None:
        raise NotImplementedError

    def end_rep(self, objs: _Objects) -> None:
        """Untimed clean-up after a repetition (and a byte check)."""


class _TierPath(_Path):
    """A DiskTier: put() per object (durable), get_into() into an aligned buffer."""

    def __init__(self, tier: Any, name: str, cache: str, note: str,
                 drop_segments: bool = False) -> None:
        self.tier = tier
        self.name = name
        self.cache = cache
        self.note = note
        self.keys: dict[int, bytes] = {}
        self._drop = drop_segments

    def write_one(self, objs: _Objects, i: int, rep: int) -> float:
        key = objs.key(i, rep)
        src = objs.stamp(i, rep)
        t0 = time.perf_counter()
        self.tier.put(key, src, nbytes=objs.size).result()
        dt = time.perf_counter() - t0
        old = self.keys.get(i)
        if old is not None and old != key:
            self.tier.delete(old)
        self.keys[i] = key
        return dt

    def before_one(self, objs: _Objects, i: int) -> None:
        if self._drop:  # kvikio compat reads through the page cache
            for name in os.listdir(self.tier.path):
                if name.startswith("seg-"):
                    odirect.drop_page_cache(os.path.join(self.tier.path, name))

    def read_one(self, objs: _Objects, i: int) -> None:
        self.tier.get_into(self.keys[i], objs.out).result()

    def clear(self) -> None:
        for key in self.keys.values():
            self.tier.delete(key)
        self.keys.clear()


def _durable_write(path: str | os.PathLike[str], dump: Callable[[Any], None]) -> float:
    """Seconds to serialise into ``path`` with ``dump(file)`` and fsync it (a durable write)."""
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        dump(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


class _FilePath(_Path):
    """A file-per-object reader: cold (pages dropped before each op) or warm."""

    ext = "npy"

    def __init__(self, cold: bool) -> None:
        self.cache = "cold-dropped" if cold else "warm"
        self.cold = cold
        self.cached_after_drop: float | None = None

    def start_rep(self, objs: _Objects, rep: int) -> None:
        if not self.cold:  # warm: every file in the page cache
            for i in range(objs.n):
                with open(objs.file(i, self.ext), "rb") as fh:
                    while fh.read(16 << 20):
                        pass

    def before_one(self, objs: _Objects, i: int) -> None:
        if self.cold:
            path = objs.file(i, self.ext)
            odirect.drop_page_cache(path)
            if i == 0:
                frac = odirect.cached_fraction(path)
                if frac is not None:
                    self.cached_after_drop = max(self.cached_after_drop or 0.0, frac)


class _NumpyPath(_FilePath):
    name = "numpy.fromfile"
    ext = "npy"
    note = "np.fromfile(.npy, uint8, offset=header); write: np.save + fsync"

    def __init__(self, cold: bool) -> None:
        super().__init__(cold)
        self._offset = 128

    def start_rep(self, objs: _Objects, rep: int) -> None:
        self._offset = _npy_offset(objs.file(0, "npy"))
        super().start_rep(objs, rep)

    def read_one(self, objs: _Objects, i: int) -> None:
        a = np.fromfile(objs.file(i, "npy"), dtype=np.uint8, offset=self._offset)
        if a.size != objs.size:
            raise RuntimeError(f"numpy.fromfile read {a.size} of {objs.size} bytes")

    @staticmethod
    def write_one(objs: _Objects, i: int, rep: int) -> float:
        src = objs.stamp(i, rep)
        return _durable_write(objs.file(i, "npy"), lambda fh: np.save(fh, src))


class _TorchPath(_FilePath):
    name = "torch.load"
    ext = "pt"
    note = "torch.load(weights_only=True) of a uint8 tensor; write: torch.save + fsync"

    def read_one(self, objs: _Objects, i: int) -> None:
        import torch

        t = torch.load(objs.file(i, "pt"), weights_only=True)
        if t.numel() != objs.size:
            raise RuntimeError("torch.load returned the wrong size")

    @staticmethod
    def write_one(objs: _Objects, i: int, rep: int) -> float:
        import torch

        t = torch.from_numpy(objs.stamp(i, rep))
        return _durable_write(objs.file(i, "pt"), lambda fh: torch.save(t, fh))


class _SafetensorsPath(_FilePath):
    name = "safetensors"
    ext = "safetensors"
    note = ("safetensors.torch.load_file (lazy mmap: one byte of every 4 KiB page is read, so "
            "the bytes are in memory); write: save_file + fsync")

    def read_one(self, objs: _Objects, i: int) -> None:
        from safetensors.torch import load_file

        x = load_file(objs.file(i, "safetensors"))["x"]
        if x.numel() != objs.size:
            raise RuntimeError("safetensors returned the wrong size")
        int(x[::4096].sum())  # load_file maps the file lazily: fault every page in

    @staticmethod
    def write_one(objs: _Objects, i: int, rep: int) -> float:
        import torch
        from safetensors.torch import save_file

        t = torch.from_numpy(objs.stamp(i, rep))
        path = objs.file(i, "safetensors")
        t0 = time.perf_counter()
        save_file({"x": t}, path)
        fsync_path(path)
        return time.perf_counter() - t0


class _DaliPath(_FilePath):
    """``fn.readers.numpy`` over the ``.npy`` files, batch size 1, one pipeline per repetition.

    A fresh pipeline per repetition (built untimed): DALI's loader reads one
    sample ahead, so a pipeline kept across repetitions would read the next
    repetition's first object while other paths are being timed.
    """

    ext = "npy"

    def __init__(self, mode: str, threads: int) -> None:
        super().__init__(cold=mode != "warm")
        self.mode = mode  # "odirect" | "warm" | "gpu"
        self.name = "dali-numpy-gpu" if mode == "gpu" else "dali-numpy-cpu"
        self.cache = "cold-odirect" if mode == "odirect" else (
            "cold-gds" if mode == "gpu" else "warm")
        self.threads = threads
        self.note = {"odirect": "CPU reader, dont_use_mmap=True, use_o_direct=True",
                     "warm": "CPU reader, mmap (default), files in the page cache",
                     "gpu": "GPU reader (cuFile / GDS)"}[mode]
        self._pipe: Any = None

    def start_rep(self, objs: _Objects, rep: int) -> None:
        if self.mode == "warm":
            super().start_rep(objs, rep)
        from nvidia.dali import fn, pipeline_def

        files = [os.path.basename(objs.file(i, "npy")) for i in range(objs.n)]
        mode = self.mode

        @pipeline_def(batch_size=1, num_threads=self.threads,
                      device_id=0 if mode == "gpu" else None, prefetch_queue_depth=1,
                      exec_pipelined=False, exec_async=False)
        def pipe() -> Any:
            if mode == "gpu":
                return fn.readers.numpy(device="gpu", file_root=objs.dir, files=files)
            if mode == "odirect":
                return fn.readers.numpy(file_root=objs.dir, files=files, dont_use_mmap=True,
                                        use_o_direct=True)
            return fn.readers.numpy(file_root=objs.dir, files=files)

        self._pipe = pipe()
        self._pipe.build()

    def before_one(self, objs: _Objects, i: int) -> None:
        if self.mode == "gpu":  # GDS may still go through the page cache in compat mode
            super().before_one(objs, i)

    def read_one(self, objs: _Objects, i: int) -> None:
        (out,) = self._pipe.run()
        if self.mode == "gpu":
            import torch

            torch.cuda.synchronize()
        del out

    def end_rep(self, objs: _Objects) -> None:
        self._pipe = None
        gc.collect()


# ---------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------
def _libcuda_path() -> str | None:
    """Where ``libcuda.so.1`` was loaded from (after a successful load), if known."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                if "libcuda.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def _kvikio_state() -> tuple[bool, str]:
    """(usable, reason or the libcuda it runs on)."""
    from hybridstore.backends import engines

    if not engines._libcuda_loadable():  # noqa: SLF001 - same test the engine applies
        return False, ("no NVIDIA driver: libcuda.so.1 is not loadable, and kvikio needs it "
                       "even in its POSIX compat mode")
    if not engines.kvikio_importable():
        return False, "kvikio cannot be imported (pip install kvikio-cu12)"
    where = _libcuda_path() or "libcuda.so.1"
    devices = "a CUDA device" if engines.cuda_driver_usable() else "no usable CUDA device"
    return True, f"libcuda: {where} ({devices})"


def _kvikio_direct_reads() -> bool:
    """Whether kvikio's compat reads use O_DIRECT (``auto_direct_io_read``)."""
    try:
        import kvikio.defaults

        return bool(kvikio.defaults.get("auto_direct_io_read"))
    except Exception:  # noqa: BLE001 - older kvikio: buffered
        return False


def _dali_state() -> tuple[bool, str]:
    try:
        import nvidia.dali as dali  # noqa: F401
        from nvidia.dali import fn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means no DALI
        return False, f"DALI cannot be imported ({e}); pip install nvidia-dali-cuda120"
    return True, f"nvidia-dali {getattr(dali, '__version__', '?')}"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False
    return True


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mod, attr in (("nvidia.dali", "__version__"), ("kvikio", "__version__"),
                      ("safetensors", "__version__")):
        try:
            m = __import__(mod, fromlist=["_"])
            out[mod] = getattr(m, attr, "?")
        except Exception:  # noqa: BLE001
            out[mod] = None
    fio = odirect.fio_path()
    out["fio"] = odirect.fio_version(fio) if fio else None
    return out


def _block_device(path: str) -> dict[str, Any]:
    """The block device under ``path`` (sysfs), as far as Linux tells."""
    out: dict[str, Any] = {}
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sys_dir = os.path.realpath(f"/sys/dev/block/{dev}")
        out["dev"] = dev
        out["name"] = os.path.basename(sys_dir)
        queue = os.path.join(sys_dir, "queue")
        if not os.path.isdir(queue):
            queue = os.path.join(os.path.dirname(sys_dir), "queue")  # a partition
        for key in ("rotational", "scheduler", "max_sectors_kb", "nr_requests",
                    "logical_block_size"):
            with contextlib.suppress(OSError):
                with open(os.path.join(queue, key)) as fh:
                    out[key] = fh.read().strip()
        for key in ("device/model", "device/vendor"):
            for base in (sys_dir, os.path.dirname(sys_dir)):
                with contextlib.suppress(OSError):
                    with open(os.path.join(base, key)) as fh:
                        out[key.split("/")[-1]] = fh.read().strip()
                        break
    except OSError:
        pass
    return out


# ---------------------------------------------------------------------------------
# the host pool
# ---------------------------------------------------------------------------------
def _bench_host(sizes: Sequence[int], reps: int, step: Callable[[str], None],
                unavailable: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    from hybridstore.backends.base import ObjectKind, object_key
    from hybridstore.backends.host import HostPool

    rows: list[dict[str, Any]] = []
    cuda = _cuda()
    counts = {s: max(2, min(64, (256 << 20) // s)) for s in sizes}
    need = max((counts[s] + 2) * s for s in sizes)  # a put replaces a key: one slot extra
    pool = HostPool(need + need // 2 + (64 << 20), arena_bytes=256 << 20, pin=True)
    pinned = pool.is_pinned
    try:
        for size in sizes:
            n = counts[size]
            src = _aligned(size, 7)
            dst = _aligned(size)
            keys = [object_key(ObjectKind.PAGE, (size * 7919 + i).to_bytes(16, "little"))
                    for i in range(n)]
            for k in keys:
                pool.put(k, src, nbytes=size)
            series: dict[str, list[float]] = {}
            lat: dict[str, list[float]] = {}
            ratios: dict[str, list[float]] = {}

            def timed(name: str, fn: Callable[[int], None]) -> float:
                secs = []
                with _no_gc():
                    for i in range(n):
                        t0 = time.perf_counter()
                        fn(i)
                        secs.append(time.perf_counter() - t0)
                g = n * size / sum(secs) / 1e9
                series.setdefault(name, []).append(g)
                lat.setdefault(name, []).extend(secs)
                return g

            for rep in range(reps + 1):
                step(f"host pool {size_label(size)} rep {rep}/{reps}")
                mc = timed("numpy.copyto|copy", lambda i: np.copyto(dst, src))
                put = timed("hybridstore-hostpool|put",
                            lambda i: pool.put(keys[i], src, nbytes=size))
                get = timed("hybridstore-hostpool|get_into",
                            lambda i: pool.get_into(keys[i], dst).result())
                if rep == 0:  # warm-up
                    for d in (series, lat):
                        d.clear()
                    continue
                ratios.setdefault("hybridstore-hostpool|put", []).append(put / mc)
                ratios.setdefault("hybridstore-hostpool|get_into", []).append(get / mc)
            if cuda:
                try:
                    _bench_host_gpu(pool, keys, size, reps, series, lat, ratios)
                except Exception as e:  # noqa: BLE001 - report, keep the CPU rows
                    unavailable.append({"path": "hybridstore-hostpool", "op": "h2d/d2h",
                                        "object_bytes": size, "reason": f"failed: {e!r}"})
            for name, gs in series.items():
                path, op = name.split("|")
                row: dict[str, Any] = {
                    "path": path, "op": op, "object_bytes": size, "gbps": _median(gs),
                    "gbps_p10": _pct(gs, 10.0), "p50_ms": _pct(lat[name], 50.0) * 1e3,
                    "p99_ms": _pct(lat[name], 99.0) * 1e3, "reps": len(gs),
                    "objects_per_rep": n}
                if name in ratios:
                    ref = "vs_torch_pinned" if op in ("h2d", "d2h") else "vs_memcpy"
                    row[ref] = _median(ratios[name])
                rows.append(row)
            for k in keys:
                pool.delete(k)
    finally:
        pool.close()
    if not cuda:
        unavailable.append({"path": "hybridstore-hostpool", "op": "h2d/d2h",
                            "reason": "no CUDA device (torch.cuda.is_available() is False): "
                                      "H2D/D2H from the pool vs torch pinned copies need a GPU"})
    return rows, pinned


def _bench_host_gpu(pool: Any, keys: list[bytes], size: int, reps: int,
                    series: dict[str, list[float]], lat: dict[str, list[float]],
                    ratios: dict[str, list[float]]) -> None:
    """H2D/D2H between the pool's slots and the GPU, against torch pinned tensors."""
    import torch

    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    n = len(keys)

    def run(name: str, fn: Callable[[int], None]) -> float:
        secs = []
        for i in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        series.setdefault(name, []).append(n * size / sum(secs) / 1e9)
        lat.setdefault(name, []).extend(secs)
        return series[name][-1]

    def pool_h2d(i: int) -> None:
        pool.acquire(keys[i])
        try:
            dev.copy_(torch.from_numpy(pool.view(keys[i])), non_blocking=True)
            torch.cuda.synchronize()
        finally:
            pool.release_ref(keys[i])

    def pool_d2h(i: int) -> None:
        tmp = bytes(17)
        slot = pool.reserve_slot(tmp, size)
        torch.from_numpy(slot).copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        pool.commit(tmp)

    for rep in range(reps + 1):
        tp_h2d = run("torch-pinned|h2d", lambda i: dev.copy_(pinned, non_blocking=True))
        hp_h2d = run("hybridstore-hostpool|h2d", pool_h2d)
        tp_d2h = run("torch-pinned|d2h", lambda i: pinned.copy_(dev, non_blocking=True))
        hp_d2h = run("hybridstore-hostpool|d2h", pool_d2h)
        if rep == 0:
            for name in ("torch-pinned|h2d", "hybridstore-hostpool|h2d", "torch-pinned|d2h",
                         "hybridstore-hostpool|d2h"):
                series[name].clear()
                lat[name].clear()
            continue
        ratios.setdefault("hybridstore-hostpool|h2d", []).append(hp_h2d / tp_h2d)
        ratios.setdefault("hybridstore-hostpool|d2h", []).append(hp_d2h / tp_d2h)
    pool.delete(bytes(17))


# ---------------------------------------------------------------------------------
# the object sizes
# ---------------------------------------------------------------------------------
class _SizeRun:
    """Writes and reads of one object size through every path."""

    def __init__(self, bench: _Bench, size: int, n: int) -> None:
        self.b = bench
        self.size = size
        self.n = n
        d = os.path.join(bench.root, f"objects-{size}")
        os.makedirs(d, exist_ok=True)
        self.objs = _Objects(size, n, d, _aligned(size), _aligned(size))
        self.objs.src[:] = np.frombuffer(bench.noise[:size], np.uint8) if size <= len(
            bench.noise) else np.resize(np.frombuffer(bench.noise, np.uint8), size)

    def row(self, path: str, op: str, cache: str, note: str = "") -> _Row:
        key = (path, op, cache, self.size)
        r = self.b.rows.get(key)
        if r is None:
            r = self.b.rows[key] = _Row(path, op, cache, self.size, note)
        return r

    def writes(self, rep: int) -> None:
        b, objs = self.b, self.objs
        writers: list[tuple[str, str, Callable[[_Objects, int, int], float], str]] = []
        for tp in b.tier_paths:
            writers.append((tp.name, "durable (O_DIRECT + fdatasync + catalog commit)",
                            tp.write_one, tp.note))
        writers += [("numpy.save", "buffered + fsync", _NumpyPath.write_one,
                     "np.save to .npy + fsync (the files of numpy.fromfile and DALI)"),
                    ("torch.save", "buffered + fsync", _TorchPath.write_one, "torch.save + fsync")]
        if b.safetensors:
            writers.append(("safetensors", "buffered + fsync", _SafetensorsPath.write_one,
                            "safetensors.torch.save_file + fsync"))
        order = writers[rep % len(writers):] + writers[:rep % len(writers)]
        for name, cache, fn, note in order:
            b.step(f"{size_label(self.size)}: write {name} (rep {rep})")
            secs = []
            with _no_gc():
                for i in range(self.n):
                    secs.append(fn(objs, i, rep))
            self.row(name, "write", cache, note).add_rep(rep, secs, self.n * self.size)

    def reads(self, rep: int) -> None:
        b, objs = self.b, self.objs
        total = self.n * self.size
        b.step(f"{size_label(self.size)}: device-ref (rep {rep})")
        ref_bytes = min(max(total, 64 << 20), 512 << 20)
        r = odirect.pool_run(None, b.ref_job, total_bytes=ref_bytes, seed=rep,
                             extents=self.extents())
        b.device_now[(self.size, rep)] = r["gbps"]
        ref = self.row("device-ref", "read", "cold-odirect",
                       f"python O_DIRECT pool, {b.ref_job.queue_depth} threads, requests of up to "
                       f"{b.ref_job.block_bytes >> 10} KiB (the best read cell), reading the "
                       f"extents of these objects in the {OURS} tier's segment files")
        ref.rep_gbps[rep] = r["gbps"]
        ref.op_seconds.extend([r["p50_ms"] / 1e3, r["p99_ms"] / 1e3])
        ref.objects_per_rep = 0
        paths = b.read_paths
        k = rep % len(paths)
        for p in paths[k:] + paths[:k]:
            b.step(f"{size_label(self.size)}: read {p.name} [{p.cache}] (rep {rep})")
            try:
                p.start_rep(objs, rep)
                secs = []
                with _no_gc():  # one collection before the loop, none while timing
                    for i in range(self.n):
                        p.before_one(objs, i)
                        t0 = time.perf_counter()
                        p.read_one(objs, i)
                        secs.append(time.perf_counter() - t0)
                p.end_rep(objs)
            except Exception as e:  # noqa: BLE001 - one broken path must not sink the run
                b.issues.append(f"{p.name} [{p.cache}] at {size_label(self.size)} failed: {e!r}")
                b.broken.add((p.name, p.cache))
                continue
            row = self.row(p.name, p.op, p.cache, p.note)
            row.add_rep(rep, secs, total)
            if isinstance(p, _FilePath) and p.cached_after_drop is not None:
                row.cached_after_drop = max(row.cached_after_drop or 0.0, p.cached_after_drop)
            if isinstance(p, _TierPath) and rep == b.reps - 1:
                head = min(16, self.size)
                want = np.frombuffer((self.n - 1 + (b.last_write_rep << 32)).to_bytes(8, "little")
                                     * 2, np.uint8)[:head]
                if not np.array_equal(objs.out[:head], want):
                    b.issues.append(f"{p.name} at {size_label(self.size)} read other bytes "
                                    "than were written")

    def extents(self) -> list[tuple[str, int, int]]:
        """``(segment file, offset, length)`` of the objects in the POSIX tier."""
        from hybridstore.backends.disk import segment_name

        tp = self.b.tier_paths[0]
        out = []
        for i in range(self.n):
            rec = tp.tier.catalog.get(tp.keys[i])
            if rec is not None:
                out.append((os.path.join(tp.tier.path, segment_name(rec.segment)), rec.offset,
                            rec.length))
        return out

    def close(self) -> None:
        for tp in self.b.tier_paths:
            tp.clear()
        shutil.rmtree(self.objs.dir, ignore_errors=True)


@dataclass
class _Bench:
    root: str
    reps: int
    write_reps: int
    test_file: str
    test_file_bytes: int
    ref_job: IoJob
    step: Callable[[str], None]
    noise: bytes
    issues: list[str]
    tier_paths: list[_TierPath] = field(default_factory=list)
    read_paths: list[_Path] = field(default_factory=list)
    rows: dict[tuple[str, str, str, int], _Row] = field(default_factory=dict)
    device_now: dict[tuple[int, int], float] = field(default_factory=dict)
    broken: set[tuple[str, str]] = field(default_factory=set)
    last_write_rep: int = 0
    safetensors: bool = True


def _cpu_times() -> list[int] | None:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal)."""
    try:
        with open("/proc/stat") as fh:
            return [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def _steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time stolen by the hypervisor between two :func:`_cpu_times`."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta)
    return delta[7] / total if total > 0 else None


def _objects_per_size(size: int, quick: bool) -> int:
    target, lo, hi = ((96 << 20), 2, 32) if quick else ((512 << 20), 3, 128)
    return max(lo, min(hi, target // size))


# ---------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------
def _ratios(rows: list[_Row], device_limit: dict[str, Any],
            device_now: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    ours = {(r.op, r.object_bytes): r for r in rows if r.path == OURS}
    out = []
    for r in rows:
        d = r.doc()
        limit = device_limit["read_gbps"] if r.op.startswith("read") else device_limit["write_gbps"]
        if limit:
            d["vs_device_limit"] = d["gbps"] / limit
        if r.op.startswith("read") and r.path != "device-ref":
            now = [g / device_now[(r.object_bytes, rep)] for rep, g in r.rep_gbps.items()
                   if (r.object_bytes, rep) in device_now]
            if now:
                d["vs_device_now"] = _median(now)
        mine = ours.get((r.op, r.object_bytes))
        if mine is not None and r.path not in (OURS, "device-ref"):
            both = [g / mine.rep_gbps[rep] for rep, g in r.rep_gbps.items()
                    if rep in mine.rep_gbps]
            if both:
                d["vs_hybridstore"] = _median(both)
        out.append(d)
    return out


def _target(results: list[dict[str, Any]]) -> dict[str, Any]:
    """hybridstore vs the device limit and vs DALI / torch.load, objects >= 4 MiB."""
    rows = []
    for r in results:
        if r["path"] != OURS or r["op"] != "read" or r["object_bytes"] < TARGET_MIN_BYTES:
            continue
        size = r["object_bytes"]
        others = {f"{o['path']} [{o['cache']}]": o["gbps"] for o in results
                  if o["object_bytes"] == size and o["op"].startswith("read")
                  and ("dali" in o["path"] or o["path"] == "torch.load")}
        cold_others = {k: v for k, v in others.items() if "warm" not in k}
        rows.append({
            "object_bytes": size, "hybridstore_gbps": r["gbps"],
            "vs_device_limit": r.get("vs_device_limit"), "vs_device_now": r.get("vs_device_now"),
            "device_limit_met": (r.get("vs_device_limit") or 0) >= TARGET_RATIO,
            "device_now_met": (r.get("vs_device_now") or 0) >= TARGET_RATIO,
            "others_gbps": others,
            "ahead_of_cold_others": all(r["gbps"] > g for g in cold_others.values()),
            "ahead_of_all_others": all(r["gbps"] > g for g in others.values()),
        })
    return {"goal": f"{OURS} reads >= {TARGET_RATIO:.0%} of the device read limit for objects "
                    f">= {TARGET_MIN_BYTES >> 20} MiB, ahead of DALI and torch.load",
            "rows": rows}


def _print_report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    dl = doc["device_limit"]
    best = dl["best_read"]
    console.print(f"device limit on {doc['disk']['dir']} ({doc['disk']['fs_type']}): read "
                  f"{dl['read_gbps']:.2f} GB/s ({best['rw']} bs={best['block_bytes']} "
                  f"qd={best['iodepth']}), write {dl['write_gbps'] or 0:.2f} GB/s; {dl['method']}")
    t = Table(title="hybridstore bench ssd (GB/s: median of reps; ms per op)")
    for col in ("object", "op", "path", "cache", "GB/s", "p50 ms", "p99 ms", "vs limit",
                "vs dev now", "vs hybridstore"):
        t.add_column(col, justify="left" if col in ("object", "op", "path", "cache") else "right")

    def f(x: Any, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in sorted(doc["results"], key=lambda r: (r["object_bytes"], r["op"], -r["gbps"])):
        t.add_row(size_label(r["object_bytes"]), r["op"], r["path"], r["cache"],
                  f(r["gbps"], ".2f"), f(r["p50_ms"], ".3f"), f(r["p99_ms"], ".3f"),
                  f(r.get("vs_device_limit"), ".2f"), f(r.get("vs_device_now"), ".2f"),
                  f(r.get("vs_hybridstore"), ".2f"))
    console.print(t)
    if doc["host_pool"]:
        h = Table(title=f"host pool (pinned: {doc['host']['pinned']})")
        for col in ("object", "path", "op", "GB/s", "p50 ms", "p99 ms", "vs memcpy / pinned"):
            h.add_column(col, justify="left" if col in ("object", "path", "op") else "right")
        for r in doc["host_pool"]:
            h.add_row(size_label(r["object_bytes"]), r["path"], r["op"], f(r["gbps"], ".2f"),
                      f(r["p50_ms"], ".3f"), f(r["p99_ms"], ".3f"),
                      f(r.get("vs_memcpy", r.get("vs_torch_pinned")), ".2f"))
        console.print(h)
    for row in doc["target"]["rows"]:
        ok = "[green]met[/green]" if row["device_limit_met"] else "[red]short[/red]"
        console.print(f"target {size_label(row['object_bytes'])}: {OURS} "
                      f"{row['hybridstore_gbps']:.2f} GB/s = {row['vs_device_limit'] or 0:.2f}x "
                      f"the device limit ({ok}), {row['vs_device_now'] or 0:.2f}x the device in "
                      f"the same reps; ahead of DALI/torch.load (cold): "
                      f"{row['ahead_of_cold_others']}")
    for u in doc["unavailable"]:
        console.print(f"[yellow]unavailable:[/yellow] {u['path']} {u['op']}: {u['reason']}")
    for issue in doc["issues"]:
        console.print(f"[yellow]issue:[/yellow] {issue}")


def plot_results(doc: dict[str, Any], path: str) -> None:
    """PNG of GB/s against object size per path: cold reads, warm reads, writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(20, 6.5))
    dl = doc["device_limit"]
    panels = ((axes[0], "read", lambda c: not c.startswith("warm"), dl["read_gbps"],
               "reads from the device (cold: O_DIRECT, or page cache dropped)", "linear"),
              (axes[1], "read", lambda c: c.startswith("warm"), dl["read_gbps"],
               "reads from the page cache (warm)", "log"),
              (axes[2], "write", lambda c: True, dl["write_gbps"], "durable writes", "linear"))
    for ax, op, keep, limit, title, yscale in panels:
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in doc["results"]:
            if r["op"] == op and keep(r["cache"]):
                lines.setdefault(f"{r['path']} [{r['cache']}]", []).append(
                    (r["object_bytes"], r["gbps"]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            style: dict[str, Any] = {}
            if label.startswith(OURS):
                style = {"lw": 2.8, "color": "black", "zorder": 5}
            elif label.startswith("device-ref"):
                style = {"ls": "--", "color": "red", "lw": 1.2}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=label,
                    **style)
        if limit:
            ax.axhline(limit, color="red", ls=":", lw=1.5, label=f"device limit {limit:.2f} GB/s")
            if op == "read" and yscale == "linear":
                ax.axhline(TARGET_RATIO * limit, color="red", ls=":", lw=0.8, alpha=0.5,
                           label=f"{TARGET_RATIO:.0%} of the limit")
        for size, name in _SIZE_NAMES.items():
            ax.axvline(size, color="grey", lw=0.6, alpha=0.4)
            ax.text(size, 0.98, name, rotation=90, va="top", ha="right", fontsize=7,
                    color="grey", transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel("object size (bytes)")
        ax.set_ylabel("GB/s (1e9 B/s), median of reps")
        ax.set_title(f"{title}, one object per op", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    bd = doc["disk"].get("block_device", {})
    fig.suptitle(f"hybridstore bench ssd: {doc['disk']['fs_type']} on {bd.get('name', '?')}; "
                 f"device limit by {dl['method'].split(',')[0]}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench ssd", total=total)

        def step(what: str) -> None:
            progress.update(task, advance=1, description=what)

        yield step


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
    counts = {s: objects or _objects_per_size(s, quick) for s in sizes}
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
    dali_ok, dali_why = _dali_state()
    safetensors_ok = _importable("safetensors.torch")
    kvikio_ok, kvikio_why = _kvikio_state()
    cuda = _cuda()
    threads = max(1, min(4, os.cpu_count() or 1))
    host_sizes = ([64 * KIB, 4 * MIB, CKPT_BYTES] if quick else
                  [64 * KIB, 1 * MIB, 4 * MIB, CKPT_BYTES, 256 * MIB])
    if sizes and max(sizes) < 4 * MIB:  # a tiny test run: keep the host section tiny too
        host_sizes = sorted(set(sizes))[:2]
    n_tiers = 1 + int(kvikio_ok)
    n_reads = n_tiers + ((2 + int(cuda)) if dali_ok else 0) + (6 if safetensors_ok else 4)
    with_fio = use_fio and odirect.fio_path() is not None
    steps = (1 + (3 if with_fio else len(_matrix(quick)) + 11)
             + len(sizes) * (write_reps * (n_tiers + 2 + int(safetensors_ok))
                             + reps * (1 + n_reads))
             + (len(host_sizes) * (reps + 1) if host_pool else 0))
    o_direct = _o_direct_works(root)
    tiers: list[Any] = []
    steal: dict[str, float | None] = {}
    doc: dict[str, Any]
    try:
        with _progress(steps) as step:
            # 1. the device
            file_bytes = device_file_bytes or ((256 << 20) if quick else (2 << 30))
            test_file = os.path.join(root, "device-test.dat")
            step(f"device test file: writing {file_bytes >> 20} MiB")
            odirect.make_test_file(test_file, file_bytes)
            device = _measure_device(test_file, file_bytes, quick, use_fio, step, issues,
                                     cell_seconds)
            ref = device["reference_job"]
            ref_job = IoJob("read", ref["block_bytes"], ref["iodepth"])
            bench = _Bench(root, reps, write_reps, test_file, file_bytes, ref_job, step,
                           np.random.default_rng(20240607).bytes(8 << 20), issues)
            # 2. paths
            biggest = max(counts[s] * s for s in sizes)
            capacity = 2 * biggest + (1 << 30)
            posix = DiskTier(os.path.join(root, "tier-posix"), capacity, engine="posix",
                             segment_bytes=cfg.disk_segment_bytes, io_threads=cfg.io_threads)
            tiers.append(posix)
            bench.tier_paths.append(_TierPath(
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
                    direct = _kvikio_direct_reads()
                    bench.tier_paths.append(_TierPath(
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
                bench.read_paths += [_DaliPath("odirect", threads), _DaliPath("warm", threads)]
                if cuda:
                    bench.read_paths.append(_DaliPath("gpu", threads))
                else:
                    unavailable.append({"path": "dali-numpy-gpu", "op": "read",
                                        "reason": "no CUDA device: DALI's GPU/GDS numpy reader "
                                                  "needs one"})
            else:
                for name in ("dali-numpy-cpu", "dali-numpy-gpu"):
                    unavailable.append({"path": name, "op": "read", "reason": dali_why})
            readers: list[type[_FilePath]] = [_TorchPath, _NumpyPath]
            if safetensors_ok:
                readers.insert(1, _SafetensorsPath)
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
                run = _SizeRun(bench, size, counts[size])
                cpu0 = _cpu_times()
                try:
                    for wrep in range(write_reps):
                        run.writes(wrep)
                        bench.last_write_rep = wrep
                    for rep in range(reps):
                        run.reads(rep)
                finally:
                    run.close()
                    steal[str(size)] = _steal_share(cpu0, _cpu_times())
                del run
                gc.collect()
            # 3. the host pool
            host_rows: list[dict[str, Any]] = []
            pinned = False
            if host_pool:
                host_rows, pinned = _bench_host(host_sizes, reps, step, unavailable)
    finally:
        for t in tiers:
            with contextlib.suppress(Exception):
                t.close()
        shutil.rmtree(root, ignore_errors=True)

    rows = list(bench.rows.values())
    results = _ratios(rows, device, bench.device_now)
    doc = {
        "machine": _machine(),
        "versions": _versions(),
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
        "disk": {"dir": root, "fs_type": _fs_type(os.path.dirname(root) or "."),
                 "o_direct": bool(o_direct), "block_device": _block_device(os.path.dirname(root))},
        "device_limit": device,
        "results": results,
        "unavailable": unavailable,
        "host": {"pinned": bool(pinned),
                 "note": ("HostPool arenas page-locked with cudaHostRegister" if pinned else
                          "pageable mmap arenas (pinning needs a CUDA device)")},
        "host_pool": host_rows,
        "target": _target(results),
        "issues": issues,
    }
    doc["config"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    doc = _finite(doc)
    _print_report(doc, out_console)
    try:
        emit(doc, json_path=json_path, echo_json=print_json, plot_path=plot_path, plot=plot_results)
    except ImportError as e:
        out_console.print(f"[red]no plot:[/red] {e}; pip install matplotlib (the bench extra)")
        raise
    return doc
