"""Section 2 and 3 on vLLM: store/load jobs of a ``SecondaryTierManager``, warm, cold, restart.

One :class:`VllmJobRun` is one chunk size and one job size (chunks per job).
Per repetition, for each tier in a rotated order, on the same keys, the same
primary-tier bytes and a directory of its own: every store job of the
repetition is submitted at once (as the tiering manager cascades completed
CPU stores), then every key is looked up, then every load job (promotions)
is submitted at once into the other half of the primary view: warm right
after the store, cold after ``posix_fadvise(DONTNEED)`` of every file of both
tiers, and in the last repetition after a restart (tier shut down, a new one
built over the same directory).  Throughput is bytes over the wall time of
all jobs of the repetition, CPU per MiB the process's CPU time (every thread)
over that wall time per MiB moved; latency is per job, from ``submit_*`` to its
``JobResult`` in ``get_finished_jobs()``.  The last repetition also measures the
load floor (:func:`~hybridstore.bench.engines.floor.load_floor`): one thread reading a
repetition's bytes with ``O_DIRECT`` in the disk tier's coalesced requests, with and
without the checksum of every chunk, no tier at all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hybridstore.backends.disk.objects import COALESCE_BYTES
from hybridstore.bench.engines import vtier as V
from hybridstore.bench.engines.floor import load_floor
from hybridstore.bench.engines.geometry import Geometry
from hybridstore.bench.engines.pagecache import (
    device_now,
    drop_dir,
    empty_host_tier,
    flush_store,
)
from hybridstore.bench.engines.series import Series
from hybridstore.errors import ConfigError

__all__ = ["VllmJobRun"]

SECTION = "vllm"


def chunk_bytes_of(g: Geometry) -> int:
    """The primary tier's chunk: one KV page rounded up to vLLM's region alignment."""
    a = V.vllm().alignment
    return -(-g.kv_page_bytes // a) * a


class VllmJobRun:
    """vLLM tier job throughput at one chunk size and job size, for every tier."""

    def __init__(self, g: Geometry, *, job_chunks: int, n_chunks: int, root: str,
                 names: list[str], issues: list[str], reps: int, seed: int = 0,
                 ref_job: Any = None) -> None:
        v = V.vllm()
        self.g, self.job_chunks, self.n = g, job_chunks, n_chunks
        self.names, self.issues = names, issues
        self.chunk_bytes = chunk_bytes_of(g)
        self.rep_bytes = n_chunks * self.chunk_bytes
        self.series: dict[tuple[str, str, str], Series] = {}
        self.drops: list[dict[str, Any]] = []
        self.ref_job = ref_job
        self.device_now: list[float] = []
        self.restart: dict[str, Any] = {}
        self.floor: dict[str, Any] | None = None
        self.root = root
        self.primary = V.Primary.make(2 * n_chunks, self.chunk_bytes)
        rng = np.random.default_rng(seed)
        self.primary.array[:n_chunks] = rng.integers(-128, 128, (n_chunks, self.chunk_bytes),
                                                     dtype=np.int8)
        self.disk_bytes = (reps + 2) * n_chunks * self.chunk_bytes + (256 << 20)
        self.host_bytes = 2 * n_chunks * self.chunk_bytes + (64 << 20)  # holds a repetition
        self.dirs = {n: os.path.join(root, f"vllm-{n}-{g.label}-j{job_chunks}") for n in names}
        self.spec = v.offloading_spec(chunk_bytes=self.chunk_bytes, block_tokens=g.page_tokens,
                                      model=g.model, tiers=[V.tier_dict(n, self.dirs[n], disk_bytes=self.disk_bytes,
                                                                        host_bytes=self.host_bytes)
                                                            for n in names])
        self.tiers = {n: self._open(n) for n in names}

    def _open(self, name: str) -> V.Tier:
        os.makedirs(self.dirs[name], exist_ok=True)
        return V.Tier(name, self.dirs[name], self.primary, self.spec, self.disk_bytes,
                      self.host_bytes)

    def _s(self, backend: str, op: str, cache: str) -> Series:
        key = (backend, op, cache)
        if key not in self.series:
            self.series[key] = Series(SECTION, "vllm", backend, op, cache, self.g.label,
                                      self.chunk_bytes, self.job_chunks,
                                      "all jobs of a repetition submitted at once; latency per "
                                      "job from submit to its JobResult",
                                      run=f"j{self.job_chunks}")
        return self.series[key]

    def _jobs(self, keys: list[bytes], base: int, tag: str) -> list[tuple[list[bytes], np.ndarray, Any]]:
        """One job per ``job_chunks`` keys, each with its own request context (``tag-j``)."""
        v = V.vllm()
        out = []
        for j, lo in enumerate(range(0, self.n, self.job_chunks)):
            ks = keys[lo:lo + self.job_chunks]
            ctx = v.req_context(f"{tag}-{j}", keys[:lo + len(ks)], self.g.page_tokens)
            out.append((ks, np.arange(base + lo, base + lo + len(ks), dtype=np.int64), ctx))
        return out

    def rep(self, rep: int, timed: bool, step: Callable[[str], None], last: bool) -> None:
        v = V.vllm()
        keys = v.chain_keys(self.n, f"rep{rep}".encode())
        self.primary.array[:self.n, :8] = (np.arange(self.n, dtype=np.int64) + (rep << 32)).view(
            np.int8).reshape(self.n, 8)
        order = self.names[rep % len(self.names):] + self.names[:rep % len(self.names)]
        r = rep if timed else None
        for name in order:
            step(f"vllm {self.g.label} j{self.job_chunks} rep {rep}: {name} store + warm load")
            self._run(name, keys, rep, "store", "write", r)
            cpu0 = time.process_time()
            dt = flush_store(self.tiers[name].tier)
            if dt is not None and r is not None:
                ser = self.series[(name, "submit_store", "write")]
                ser.flush[r] = dt
                ser.flush_cpu[r] = time.process_time() - cpu0
            self._run(name, keys, rep, "load", "warm", r)
        step(f"vllm {self.g.label} j{self.job_chunks} rep {rep}: drop page cache, cold loads")
        drops = {n: {**drop_dir(self.dirs[n]), "host_tier": empty_host_tier(self.tiers[n].tier)}
                 for n in self.names}
        if timed:
            self.drops.append({"rep": rep, **drops})
        if timed and self.ref_job is not None and V.BUILTIN in self.dirs:
            # the device on the data just written, now (O_DIRECT: no page cache filled)
            got = device_now(self.dirs[V.BUILTIN], self.ref_job, max_bytes=self.rep_bytes)
            if got is not None:
                self.device_now.append(got)
        for name in order:
            self._run(name, keys, rep, "load", "cold", r)
        if last:
            step(f"vllm {self.g.label} j{self.job_chunks}: restart (shutdown, new tier, load), "
                 "load floor")
            self._floor()
            for name in order:
                t0 = time.perf_counter()
                self.tiers[name].close()
                self.tiers[name] = self._open(name)
                opened = time.perf_counter() - t0
                drop = drop_dir(self.dirs[name])
                hit = self._run(name, keys, rep, "load", "restart", rep)
                self.restart[name] = {"reopen_s": opened, "hit_chunks": hit,
                                      "resident_after_drop": drop["resident_after"]}

    def _floor(self) -> None:
        """The load floor for a repetition's bytes in runs of as many chunks as one
        coalesced read of the disk tier takes."""
        run = max(1, COALESCE_BYTES // self.chunk_bytes) * self.chunk_bytes
        try:
            self.floor = load_floor(os.path.join(self.root, f"floor-{self.g.label}.dat"),
                                    self.rep_bytes, run_bytes=run, chunk_bytes=self.chunk_bytes)
        except (ConfigError, OSError) as e:
            self.issues.append(f"vllm {self.g.label} j{self.job_chunks}: no load floor: {e}")

    def _run(self, name: str, keys: list[bytes], rep: int, op: str, cache: str,
             timed_rep: int | None) -> int:
        """Store or load every chunk; a load is looked up first, per request (untimed).

        Returns the chunks the lookups hit (loads) or stored (stores).
        """
        load = op == "load"
        tier = self.tiers[name]
        jobs = self._jobs(keys, self.n if load else 0, f"r{rep}-{op}-{cache}")
        hit = self.n
        if load:
            self.primary.array[self.n:] = 0
            hit = sum(tier.lookup(ks, ctx) for ks, _, ctx in jobs)
            if hit != self.n:
                self.issues.append(f"vllm {self.g.label} {name} {cache}: lookups hit {hit} of "
                                   f"{self.n} stored chunks")
        wall, lat, ok, cpu, pools = tier.run_jobs(jobs, load=load)
        for _, _, ctx in jobs:
            tier.tier.on_request_finished(ctx)
        if timed_rep is None:
            return hit
        ser = self._s(name, f"submit_{op}", cache)
        total = self.n * self.chunk_bytes
        # throughput over the wall time of all jobs; the per-job latencies in the rows' p50/p99
        share = wall / len(lat)
        for dt, (ks, _, _) in zip(lat, jobs):
            ser.add(timed_rep, share, len(ks) * self.chunk_bytes, len(ks), latency=dt)
        ser.add_cpu(timed_rep, cpu, pools)
        ser.checks.append(all(ok))
        if load:
            exact = bool(np.array_equal(self.primary.array[self.n:], self.primary.array[:self.n]))
            ser.checks.append(exact)
            if not exact:
                self.issues.append(f"vllm {self.g.label} {name} {cache}: loaded bytes differ")
        assert sum(len(ks) for ks, _, _ in jobs) * self.chunk_bytes == total
        return hit

    def close(self) -> None:
        for name, t in self.tiers.items():
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - report, close the rest
                self.issues.append(f"vllm {name}: shutdown failed: {e!r}")
        self.tiers.clear()
