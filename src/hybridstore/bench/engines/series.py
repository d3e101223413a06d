"""Timings of one (section, backend, operation, cache state) and their row; paired ratios.

A :class:`Series` collects, per repetition, the wall seconds and bytes of every
batch (or job) it timed.  Its row reports, over repetitions, the median
throughput (pages/s and GB/s of that repetition's batches: bytes / summed
seconds), and p50/p99 of the per-batch latencies over all repetitions.
:func:`paired_ratios` divides our throughput by the built-in backend's *of the
same repetition* (they run back to back, in rotated order) and reports the
median of those quotients: the machine is shared and noisy, and a ratio taken
inside one repetition cancels most of that noise.  It does the same for CPU per
MiB, the steadier figure on a shared machine (a busy neighbour stretches wall
time, not the CPU a byte costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridstore.bench.common import median, percentile

__all__ = ["Series", "paired_ratios"]


@dataclass
class Series:
    """One row: ``engine``/``backend``/``op``/``cache`` at one geometry and batch size."""

    section: str
    engine: str
    backend: str
    op: str
    cache: str
    geometry: str
    object_bytes: int
    batch: int
    note: str = ""
    run: str = ""              # the run it belongs to (its page batch): tells state rows apart
    reps: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    flush: dict[int, float] = field(default_factory=dict)   # rep -> seconds to durable
    cpu: dict[int, float] = field(default_factory=dict)     # rep -> process CPU seconds
    pools: dict[int, dict[str, float]] = field(default_factory=dict)  # rep -> pool -> CPU s
    flush_cpu: dict[int, float] = field(default_factory=dict)  # rep -> CPU seconds to durable
    checks: list[bool] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, str, str, int, str]:
        return (self.section, self.engine, self.op, self.cache, self.geometry, self.batch, self.run)

    def add(self, rep: int, seconds: float, nbytes: int, objects: int,
            latency: float | None = None) -> None:
        """One timed batch (or job) of ``objects`` objects, ``nbytes`` bytes in all.

        ``seconds`` counts toward the repetition's throughput; ``latency`` (default
        ``seconds``) toward p50/p99 (concurrent jobs: their share of the wall time,
        and each job's own submit-to-finish time).
        """
        self.reps.setdefault(rep, []).append((seconds, nbytes, objects))
        self.latencies.append(seconds if latency is None else latency)

    def add_cpu(self, rep: int, seconds: float, pools: dict[str, float] | None = None) -> None:
        """Process CPU seconds (every thread) spent while the repetition's calls ran, and
        the same by thread pool where measured (:mod:`hybridstore.bench.threadcpu`)."""
        self.cpu[rep] = self.cpu.get(rep, 0.0) + seconds
        if pools is not None:
            mine = self.pools.setdefault(rep, {})
            for pool, spent in pools.items():
                mine[pool] = mine.get(pool, 0.0) + spent

    def _mib(self, rep: int) -> float:
        return sum(b for _, b, _ in self.reps.get(rep, ())) / (1 << 20)

    def rep_cpu_ms_per_mib(self, flush: bool = False) -> dict[int, float]:
        """CPU milliseconds per MiB moved, per repetition (``flush``: the CPU until durable
        added, where it was measured)."""
        out = {}
        for r, cpu in self.cpu.items():
            mib = self._mib(r)
            if mib > 0 and (not flush or r in self.flush_cpu):
                out[r] = (cpu + (self.flush_cpu.get(r, 0.0) if flush else 0.0)) * 1e3 / mib
        return out

    def pool_cpu_ms_per_mib(self) -> dict[str, float]:
        """CPU milliseconds per MiB moved by each thread pool: the median over the
        repetitions that measured pools (a pool idle in one counts 0 there); pools whose
        median is under 0.001 are left out."""
        reps = {r: mib for r in self.pools if (mib := self._mib(r)) > 0}
        names = {pool for r in reps for pool in self.pools[r]}
        out = {}
        for pool in sorted(names):
            m = median([self.pools[r].get(pool, 0.0) * 1e3 / mib for r, mib in reps.items()])
            if m >= 0.001:
                out[pool] = m
        return out

    def rep_gbps(self) -> dict[int, float]:
        return {r: sum(b for _, b, _ in xs) / max(sum(s for s, _, _ in xs), 1e-12) / 1e9
                for r, xs in self.reps.items()}

    def row(self) -> dict[str, Any]:
        per_rep = list(self.reps.values())
        lat = self.latencies or [float("nan")]
        gbps = list(self.rep_gbps().values()) or [float("nan")]
        pps = [sum(o for _, _, o in xs) / max(sum(s for s, _, _ in xs), 1e-12) for xs in per_rep]
        out: dict[str, Any] = {
            "section": self.section, "engine": self.engine, "backend": self.backend,
            "op": self.op, "cache": self.cache, "geometry": self.geometry,
            "object_bytes": self.object_bytes, "batch_objects": self.batch, "run": self.run,
            "batch_bytes": self.object_bytes * self.batch,
            "reps": len(per_rep), "batches_per_rep": len(per_rep[0]) if per_rep else 0,
            "bytes_per_rep": sum(b for _, b, _ in per_rep[0]) if per_rep else 0,
            "objects_per_rep": sum(o for _, _, o in per_rep[0]) if per_rep else 0,
            "gbps": median(gbps), "objects_per_s": median(pps or [float("nan")]),
            "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
            "bit_exact": all(self.checks) if self.checks else None,
        }
        if self.flush:
            with_flush = [sum(b for _, b, _ in self.reps[r]) /
                          (sum(s for s, _, _ in self.reps[r]) + f) / 1e9
                          for r, f in self.flush.items() if r in self.reps]
            out["gbps_incl_flush"] = median(with_flush)
            out["flush_ms_median"] = median(list(self.flush.values())) * 1e3
        if self.cpu:
            out["cpu_ms_per_mib"] = median(list(self.rep_cpu_ms_per_mib().values()))
        if self.pools:
            out["cpu_ms_per_mib_by_pool"] = self.pool_cpu_ms_per_mib()
        if self.flush_cpu:
            out["cpu_ms_per_mib_incl_flush"] = median(
                list(self.rep_cpu_ms_per_mib(flush=True).values()))
        if self.note:
            out["note"] = self.note
        out.update(self.extra)
        return out


def paired_ratios(series: list[Series], ours: str, theirs: str,
                  across: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``ours / theirs`` GB/s of the same repetition, median over repetitions, per matching row.

    Where both rows measured CPU, ``cpu_ratio`` is ours / theirs CPU per MiB of the
    same repetition (median; below 1: ours costs less CPU per byte), next to each
    side's median CPU ms per MiB.

    ``across`` pairs an operation of ours with a different one of theirs (our zero-copy
    ``batch_get_v1`` against their legacy ``batch_get``: each backend's best interface);
    such a row's ``op`` reads ``"batch_get_v1/batch_get"``.
    """
    by_key: dict[tuple[Any, ...], dict[str, Series]] = {}
    for s in series:
        by_key.setdefault(s.key, {})[s.backend] = s
    pairs: list[tuple[str, Series, Series]] = []
    for key, pair in by_key.items():
        a = pair.get(ours)
        if a is None:
            continue
        if key[2] in (across or {}):
            mapped = (key[0], key[1], (across or {})[key[2]], *key[3:])
            b = by_key.get(mapped, {}).get(theirs)
            label = f"{key[2]}/{mapped[2]}"
        else:
            b, label = pair.get(theirs), key[2]
        if b is not None:
            pairs.append((label, a, b))
    out = []
    for label, a, b in pairs:
        ga, gb = a.rep_gbps(), b.rep_gbps()
        qs = [ga[r] / gb[r] for r in ga if r in gb and gb[r] > 0]
        if not qs:
            continue
        section, engine, _, cache, geometry, batch, run = a.key
        row = {"section": section, "engine": engine, "op": label, "cache": cache,
               "geometry": geometry, "batch_objects": batch, "run": run, "ours": ours,
               "theirs": theirs,
               "ratio": median(qs), "ratio_min": min(qs), "ratio_max": max(qs),
               "reps": len(qs)}
        ca, cb = a.rep_cpu_ms_per_mib(), b.rep_cpu_ms_per_mib()
        cq = [ca[r] / cb[r] for r in ca if r in cb and cb[r] > 0]
        if cq:
            row.update({"cpu_ms_per_mib_ours": median(list(ca.values())),
                        "cpu_ms_per_mib_theirs": median(list(cb.values())),
                        "cpu_ratio": median(cq), "cpu_ratio_min": min(cq),
                        "cpu_ratio_max": max(cq)})
        out.append(row)
    return out
