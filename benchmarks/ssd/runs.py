"""One object size through every path: writes, then reads in a rotated order per repetition."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.ssd.paths import (
    FilePath,
    NumpyPath,
    ObjectPath,
    SafetensorsPath,
    TierPath,
    TorchPath,
)
from benchmarks.ssd.rows import ObjectSet, Row
from benchmarks.ssd.sizes import OURS, size_label
from hybridstore.bench import odirect
from hybridstore.bench.common import aligned, no_gc
from hybridstore.bench.odirect import IoJob


class SizeRun:
    """Writes and reads of one object size through every path."""

    def __init__(self, bench: Bench, size: int, n: int) -> None:
        self.b = bench
        self.size = size
        self.n = n
        d = os.path.join(bench.root, f"objects-{size}")
        os.makedirs(d, exist_ok=True)
        self.objs = ObjectSet(size, n, d, aligned(size), aligned(size))
        self.objs.src[:] = np.frombuffer(bench.noise[:size], np.uint8) if size <= len(
            bench.noise) else np.resize(np.frombuffer(bench.noise, np.uint8), size)

    def row(self, path: str, op: str, cache: str, note: str = "") -> Row:
        key = (path, op, cache, self.size)
        r = self.b.rows.get(key)
        if r is None:
            r = self.b.rows[key] = Row(path, op, cache, self.size, note)
        return r

    def writes(self, rep: int) -> None:
        b, objs = self.b, self.objs
        writers: list[tuple[str, str, Callable[[ObjectSet, int, int], float], str]] = []
        for tp in b.tier_paths:
            writers.append((tp.name, "durable (O_DIRECT + fdatasync + catalog commit)",
                            tp.write_one, tp.note))
        writers += [("numpy.save", "buffered + fsync", NumpyPath.write_one,
                     "np.save to .npy + fsync (the files of numpy.fromfile and DALI)"),
                    ("torch.save", "buffered + fsync", TorchPath.write_one, "torch.save + fsync")]
        if b.safetensors:
            writers.append(("safetensors", "buffered + fsync", SafetensorsPath.write_one,
                            "safetensors.torch.save_file + fsync"))
        order = writers[rep % len(writers):] + writers[:rep % len(writers)]
        for name, cache, fn, note in order:
            b.step(f"{size_label(self.size)}: write {name} (rep {rep})")
            secs = []
            with no_gc():
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
                with no_gc():  # one collection before the loop, none while timing
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
            if isinstance(p, FilePath) and p.cached_after_drop is not None:
                row.cached_after_drop = max(row.cached_after_drop or 0.0, p.cached_after_drop)
            if isinstance(p, TierPath) and rep == b.reps - 1:
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
class Bench:
    root: str
    reps: int
    write_reps: int
    test_file: str
    test_file_bytes: int
    ref_job: IoJob
    step: Callable[[str], None]
    noise: bytes
    issues: list[str]
    tier_paths: list[TierPath] = field(default_factory=list)
    read_paths: list[ObjectPath] = field(default_factory=list)
    rows: dict[tuple[str, str, str, int], Row] = field(default_factory=dict)
    device_now: dict[tuple[int, int], float] = field(default_factory=dict)
    broken: set[tuple[str, str]] = field(default_factory=set)
    last_write_rep: int = 0
    safetensors: bool = True


def cpu_times() -> list[int] | None:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal)."""
    try:
        with open("/proc/stat") as fh:
            return [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time stolen by the hypervisor between two :func:`cpu_times`."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta)
    return delta[7] / total if total > 0 else None


def objects_per_size(size: int, quick: bool) -> int:
    target, lo, hi = ((96 << 20), 2, 32) if quick else ((512 << 20), 3, 128)
    return max(lo, min(hi, target // size))
