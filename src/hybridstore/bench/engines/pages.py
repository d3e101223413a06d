"""Section 1 and 3 on SGLang: page and state store/load through ``HiCacheStorage``, warm, cold, restart.

One :class:`SglPageRun` is one geometry (TP rank size) and one batch size.  Per
repetition, for each backend in a rotated order, on the same keys, bytes and
a directory of its own:

1. **store**, node by node as ``write_backup_storage`` does: ``batch_set_v2``
   of the node's Mamba state (keyed by its last page), then ``batch_set`` of
   its pages in batches of ``batch`` pages;
2. ``batch_exists_v2`` over every page with the Mamba probe: the hit must be
   every page;
3. **load (warm)**: ``batch_get`` of every page in batches, ``batch_get_v2`` of
   each state, right after the store (whatever the OS or the backend kept);
4. **load (cold)**: the same after ``posix_fadvise(DONTNEED)`` of every file both
   backends wrote (residency before/after by ``mincore``);
5. in the last repetition, **load (restart)**: each backend closed, a new one
   opened over the same directory, caches dropped again, the same loads.

Every load is compared byte for byte with what was stored (``bit_exact``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridstore.bench.engines import sgl as S
from hybridstore.bench.engines.geometry import Geometry
from hybridstore.bench.engines.pagecache import drop_dir, empty_host_tier
from hybridstore.bench.engines.series import Series

__all__ = ["SglPageRun"]

SECTION = "sglang"
WRITE_MODE_BUILTIN = ("buffered: numpy tofile to a temp file + os.replace, no fsync (the data may "
                      "still be in the page cache when the call returns)")
WRITE_MODE_OURS = "whatever the adapter's batch_set guarantees when it returns (see docs)"


class SglPageRun:
    """SGLang page/state throughput at one geometry and batch size, for every backend."""

    def __init__(self, g: Geometry, *, batch: int, n_pages: int, n_states: int, root: str,
                 names: list[str], issues: list[str], seed: int = 0) -> None:
        s = S.sgl()
        self.g, self.batch, self.n_pages, self.n_states = g, batch, n_pages, n_states
        self.names, self.issues = names, issues
        self.series: dict[tuple[str, str, str], Series] = {}
        self.drops: list[dict[str, Any]] = []
        self.restart: dict[str, Any] = {}
        self.buf = S.PageBuffers.make(n_pages, g.kv_page_bytes, seed)
        self.pool = s.mamba_host(g.linear_layers, g.temporal_shape, g.conv_shape, 2 * n_states)
        self.state_bytes = int(self.pool.size_per_token)
        if self.state_bytes != g.state_bytes:
            raise AssertionError(f"MambaPoolHost slot is {self.state_bytes} B, geometry says "
                                 f"{g.state_bytes} B")
        self.src_slots = list(range(n_states))
        self.dst_slots = list(range(n_states, 2 * n_states))
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.dirs = {n: os.path.join(root, f"sgl-{n}-{g.label}-b{batch}") for n in names}
        rep_bytes = n_pages * g.kv_page_bytes + n_states * g.state_bytes
        # ours: a DRAM tier that holds a repetition (as the page cache can for HiCacheFile)
        self.extras = {
            n: (S.builtin_extra(self.dirs[n]) if n == S.BUILTIN
                else S.ours_extra(self.dirs[n], disk_bytes=4 * rep_bytes + (256 << 20),
                                  host_bytes=2 * rep_bytes + (64 << 20))) for n in names}
        self.backends = {n: self._open(n) for n in names}
        # node j spans pages [ends[j-1], ends[j]); its state is keyed by page ends[j] - 1
        self.ends = [n_pages * (j + 1) // n_states for j in range(n_states)]

    def _open(self, name: str) -> Any:
        os.makedirs(self.dirs[name], exist_ok=True)
        return S.open_backend(name, tp=self.g.tp, model=self.g.model, extra=self.extras[name],
                              mamba_pool=self.pool)

    def _s(self, backend: str, op: str, cache: str, obj: int, batch: int, note: str = "") -> Series:
        key = (backend, op, cache)
        if key not in self.series:
            self.series[key] = Series(SECTION, "sglang", backend, op, cache, self.g.label, obj,
                                      batch, note)
        return self.series[key]

    # -- one repetition ------------------------------------------------------------
    def rep(self, rep: int, timed: bool, step: Callable[[str], None], last: bool) -> None:
        s = S.sgl()
        tokens = torch.arange(self.n_pages * self.g.page_tokens, dtype=torch.int64) + rep * 7919
        keys = s.page_keys(tokens.tolist(), self.g.page_tokens)
        self.buf.stamp(rep)
        for slot in self.src_slots:
            raw = torch.randint(0, 256, (self.state_bytes,), dtype=torch.uint8, generator=self.gen)
            self.pool.set_from_flat_data_page(slot, raw)
        order = self.names[rep % len(self.names):] + self.names[:rep % len(self.names)]
        for name in order:
            step(f"sglang {self.g.label} b{self.batch} rep {rep}: {name} store + warm load")
            self._store(name, keys, rep if timed else None)
            self._exists(name, keys)
            self._load(name, keys, "warm", rep if timed else None)
        step(f"sglang {self.g.label} b{self.batch} rep {rep}: drop page cache, cold loads")
        drops = {n: {**drop_dir(self.dirs[n]), "host_tier": empty_host_tier(self.backends[n])}
                 for n in self.names}
        if timed:
            self.drops.append({"rep": rep, **{n: d for n, d in drops.items()}})
        for name in order:
            self._load(name, keys, "cold", rep if timed else None)
        if last:
            step(f"sglang {self.g.label} b{self.batch}: restart (close, reopen, load)")
            for name in order:
                t0 = time.perf_counter()
                S.close_backend(self.backends[name])
                self.backends[name] = self._open(name)
                opened = time.perf_counter() - t0
                drop = drop_dir(self.dirs[name])
                hit = self._exists(name, keys)
                self._load(name, keys, "restart", rep)
                self.restart[name] = {"reopen_s": opened, "hit_pages": hit,
                                      "resident_after_drop": drop["resident_after"]}
        for name in order:
            self.backends[name].clear()

    def _store(self, name: str, keys: list[str], rep: int | None) -> None:
        s, b, g = S.sgl(), self.backends[name], self.g
        pages = self._s(name, "batch_set", "write", g.kv_page_bytes, self.batch,
                        "legacy batch_set(keys, flat page tensors)")
        states = self._s(name, "batch_set_v2[mamba]", "write", g.state_bytes, 1,
                         "one PoolTransfer(MAMBA, TRAILING_PAGES) per node, prefix_keys given")
        for ser in (pages, states):
            ser.extra["write_mode"] = (WRITE_MODE_BUILTIN if name == S.BUILTIN else WRITE_MODE_OURS)
        lo = 0
        for j, end in enumerate(self.ends):
            t0 = time.perf_counter()
            res = b.batch_set_v2([s.mamba_transfer(keys[end - 1], self.src_slots[j])],
                                 extra_info=s.extra(keys[:end - 1]))
            dt = time.perf_counter() - t0
            ok = all(next(iter(res.values()), [False])) if res else False
            if rep is not None:
                states.add(rep, dt, g.state_bytes, 1)
                states.checks.append(ok)
            for a, z in S.batches(end - lo, self.batch):
                ks = keys[lo + a:lo + z]
                vals = self.buf.pages(self.buf.src, lo + a, lo + z)
                t0 = time.perf_counter()
                ok = b.batch_set(ks, vals)
                dt = time.perf_counter() - t0
                if rep is not None:
                    pages.add(rep, dt, len(ks) * g.kv_page_bytes, len(ks))
                    pages.checks.append(bool(ok))
            lo = end

    def _exists(self, name: str, keys: list[str]) -> int:
        s = S.sgl()
        r = self.backends[name].batch_exists_v2(keys, [s.mamba_probe()])
        hit = int(r.kv_hit_pages)
        if hit != len(keys):
            self.issues.append(f"sglang {self.g.label} {name}: batch_exists_v2 hit {hit} of "
                               f"{len(keys)} stored pages")
        return hit

    def _load(self, name: str, keys: list[str], cache: str, rep: int | None) -> None:
        s, b, g = S.sgl(), self.backends[name], self.g
        pages = self._s(name, "batch_get", cache, g.kv_page_bytes, self.batch,
                        "legacy batch_get(keys, preallocated flat page tensors)")
        states = self._s(name, "batch_get_v2[mamba]", cache, g.state_bytes, 1,
                         "one PoolTransfer(MAMBA) per node into a fresh host slot")
        self.buf.dst.zero_()
        for slot in self.dst_slots:
            self.pool.set_from_flat_data_page(slot, torch.zeros(self.state_bytes, dtype=torch.uint8))
        lo = 0
        for j, end in enumerate(self.ends):
            for a, z in S.batches(end - lo, self.batch):
                ks = keys[lo + a:lo + z]
                dst = self.buf.pages(self.buf.dst, lo + a, lo + z)
                t0 = time.perf_counter()
                got = b.batch_get(ks, dst)
                dt = time.perf_counter() - t0
                if rep is not None:
                    ok = isinstance(got, list) and all(x is not None for x in got)
                    pages.add(rep, dt, len(ks) * g.kv_page_bytes, len(ks))
                    pages.checks.append(ok)
            t0 = time.perf_counter()
            res = b.batch_get_v2([s.mamba_transfer(keys[end - 1], self.dst_slots[j])],
                                 extra_info=s.extra(keys[:end - 1]))
            dt = time.perf_counter() - t0
            if rep is not None:
                states.add(rep, dt, g.state_bytes, 1)
                states.checks.append(bool(res) and all(next(iter(res.values()), [False])))
            lo = end
        if rep is not None:
            exact = bool(torch.equal(self.buf.dst, self.buf.src))
            pages.checks.append(exact)
            same = all(torch.equal(self.pool.get_data_page(d), self.pool.get_data_page(s_))
                       for s_, d in zip(self.src_slots, self.dst_slots))
            states.checks.append(same)
            if not (exact and same):
                self.issues.append(f"sglang {self.g.label} b{self.batch} {name} {cache}: loaded "
                                   f"bytes differ (pages {exact}, states {same})")

    def close(self) -> None:
        for name, b in self.backends.items():
            try:
                b.clear()
                S.close_backend(b)
            except Exception as e:  # noqa: BLE001 - report, close the rest
                self.issues.append(f"sglang {name}: close failed: {e!r}")
        self.backends.clear()
