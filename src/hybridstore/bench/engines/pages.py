"""Sections 1 and 3 on SGLang: page and state store/load through ``HiCacheStorage``.

One :class:`SglPageRun` is one geometry (a TP rank's shard) and one batch
size.  The host side is SGLang's own: a ``MHATokenToKVPoolHost``
(``page_first_direct``, the model's KV shape) and a ``MambaPoolHost`` (its GDN
state shapes), registered with each backend as ``attach_storage_backend``
does.  Per repetition, for each backend in a rotated order, on the same keys,
bytes and a directory of its own:

1. **store**, node by node as ``write_backup_storage`` does: ``batch_set_v2``
   of the node's Mamba state (keyed by its last page, ``prefix_keys`` given),
   then its pages in batches of ``batch`` pages through SGLang's legacy
   ``HiCacheController._generic_page_set`` (``get_data_page`` copies +
   ``batch_set``); for ours also the zero-copy ``batch_set_v1`` (other keys);
2. ``batch_exists_v2`` over every page with the Mamba probe: the hit must be
   every page;
3. **load (warm)**: ``_generic_page_get`` (``batch_get`` into fresh flat
   pages + ``set_from_flat_data_page``) and ``batch_get_v2`` of each state, right
   after the store; ours also ``batch_get_v1`` straight into the host pool;
4. **load (cold)**: the same after ``posix_fadvise(DONTNEED)`` of every file both
   backends wrote (``mincore`` before/after) and our DRAM tier emptied;
   Before the cold loads the O_DIRECT pool reads HiCacheFile's just-written files at
   the SSD limit's best cell (``device_now``: the device on this data, now);
5. in the last repetition, **load (restart)**: each backend closed, a new one
   opened over the same directory, caches dropped again, the same loads.

Every load is compared byte for byte with what was stored (``bit_exact``).
``HiCacheFile`` has no ``batch_*_v1`` (the base class's stub returns ``None``),
so the v1 rows are ours alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridstore.bench.engines import sgl as S
from hybridstore.bench.engines.geometry import Geometry
from hybridstore.bench.engines.pagecache import (
    device_now,
    drop_dir,
    empty_host_tier,
    flush_store,
)
from hybridstore.bench.engines.series import Series

__all__ = ["SglPageRun"]

SECTION = "sglang"
WRITE_MODE_BUILTIN = ("buffered: numpy tofile to a temp file + os.replace, no fsync (the data may "
                      "still be in the page cache when the call returns)")
WRITE_MODE_OURS = ("put_kv into the DRAM tier, write-through to the SSD in the background "
                   "(O_DIRECT, fdatasync); returns before the SSD write completes")


class SglPageRun:
    """SGLang page/state throughput at one geometry and batch size, for every backend."""

    def __init__(self, g: Geometry, *, batch: int, n_pages: int, n_states: int, root: str,
                 names: list[str], issues: list[str], seed: int = 0,
                 ref_job: Any = None) -> None:
        s = S.sgl()
        self.g, self.batch, self.n_pages, self.n_states = g, batch, n_pages, n_states
        self.names, self.issues = names, issues
        self.series: dict[tuple[str, str, str], Series] = {}
        self.drops: list[dict[str, Any]] = []
        self.ref_job = ref_job
        self.device_now: list[float] = []
        self.restart: dict[str, Any] = {}
        ps = g.page_tokens
        # host pages: [0, n) stored, [n, 2n) loaded into (legacy and v1 alike)
        self.kv = s.kv_host(layers=g.attn_layers, heads=g.kv_heads, head_dim=g.head_dim,
                            page_size=ps, pages=2 * n_pages)
        slots = self.kv.alloc(2 * n_pages * ps)
        self.src_idx, self.dst_idx = slots[:n_pages * ps], slots[n_pages * ps:]
        page_bytes = self.kv.get_data_page(int(self.src_idx[0])).numel() * 2
        if page_bytes != g.kv_page_bytes:
            raise AssertionError(f"host KV page is {page_bytes} B, geometry says {g.kv_page_bytes}")
        gen = torch.Generator().manual_seed(seed)
        self.src = torch.randint(0, 256, (n_pages, g.kv_page_bytes), dtype=torch.uint8,
                                 generator=gen)
        self.pool = s.mamba_host(g.linear_layers, g.temporal_shape, g.conv_shape, 2 * n_states)
        self.state_bytes = int(self.pool.size_per_token)
        if self.state_bytes != g.state_bytes:
            raise AssertionError(f"MambaPoolHost slot is {self.state_bytes} B, geometry says "
                                 f"{g.state_bytes} B")
        self.src_slots = list(range(n_states))
        self.dst_slots = list(range(n_states, 2 * n_states))
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.dirs = {n: os.path.join(root, f"sgl-{n}-{g.label}-b{batch}") for n in names}
        rep_bytes = 2 * n_pages * g.kv_page_bytes + n_states * g.state_bytes  # legacy + v1
        self.rep_bytes = n_pages * g.kv_page_bytes
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
                              kv_pool=self.kv, mamba_pool=self.pool)

    def _s(self, backend: str, op: str, cache: str, obj: int, batch: int, note: str) -> Series:
        key = (backend, op, cache)
        if key not in self.series:
            self.series[key] = Series(SECTION, "sglang", backend, op, cache, self.g.label, obj,
                                      batch, note, run=f"b{self.batch}")
            if cache == "write":
                self.series[key].extra["write_mode"] = (
                    WRITE_MODE_BUILTIN if backend == S.BUILTIN else WRITE_MODE_OURS)
        return self.series[key]

    def _idx(self, which: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        ps = self.g.page_tokens
        return which[lo * ps:hi * ps]

    # -- one repetition ------------------------------------------------------------
    def rep(self, rep: int, timed: bool, step: Callable[[str], None], last: bool) -> None:
        s = S.sgl()
        ps = self.g.page_tokens
        tokens = (torch.arange(self.n_pages * ps, dtype=torch.int64) + rep * 7919).tolist()
        keys = s.page_keys(tokens, ps)
        v1_keys = s.page_keys(tokens, ps, "%064x" % (rep + 1))   # another chain, same bytes
        self.src[:, :8] = (torch.arange(self.n_pages, dtype=torch.int64) + (rep << 32)).view(
            torch.uint8).view(self.n_pages, 8)
        for i in range(self.n_pages):
            self.kv.set_from_flat_data_page(int(self.src_idx[i * ps]), self.src[i].view(torch.bfloat16))
        for slot in self.src_slots:
            raw = torch.randint(0, 256, (self.state_bytes,), dtype=torch.uint8, generator=self.gen)
            self.pool.set_from_flat_data_page(slot, raw)
        r = rep if timed else None
        order = self.names[rep % len(self.names):] + self.names[:rep % len(self.names)]
        for name in order:
            step(f"sglang {self.g.label} b{self.batch} rep {rep}: {name} store + warm load")
            self._store(name, keys, r)
            self._flush(name, "batch_set", r)
            if name != S.BUILTIN:
                self._store_v1(name, v1_keys, r)
                self._flush(name, "batch_set_v1", r)
            self._exists(name, keys)
            self._load(name, keys, "warm", r)
            if name != S.BUILTIN:
                self._load_v1(name, v1_keys, "warm", r)
        step(f"sglang {self.g.label} b{self.batch} rep {rep}: drop page cache, cold loads")
        drops = {n: {**drop_dir(self.dirs[n]), "host_tier": empty_host_tier(self.backends[n])}
                 for n in self.names}
        if timed:
            self.drops.append({"rep": rep, **drops})
        if timed and self.ref_job is not None and S.BUILTIN in self.dirs:
            # the device on the data just written, now (O_DIRECT: no page cache filled)
            got = device_now(self.dirs[S.BUILTIN], self.ref_job, max_bytes=self.rep_bytes)
            if got is not None:
                self.device_now.append(got)
        for name in order:
            self._load(name, keys, "cold", r)
            if name != S.BUILTIN:
                self._load_v1(name, v1_keys, "cold", r)
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
                        "HiCacheController._generic_page_set: get_data_page copies + "
                        "batch_set(keys, flat pages)")
        states = self._s(name, "batch_set_v2[mamba]", "write", g.state_bytes, 1,
                         "one PoolTransfer(MAMBA, TRAILING_PAGES) per node, prefix_keys given")
        lo = 0
        for j, end in enumerate(self.ends):
            t0 = time.perf_counter()
            res = b.batch_set_v2([s.mamba_transfer(keys[end - 1], self.src_slots[j])],
                                 extra_info=s.extra(keys[:end - 1]))
            dt = time.perf_counter() - t0
            if rep is not None:
                states.add(rep, dt, g.state_bytes, 1)
                states.checks.append(bool(res) and all(next(iter(res.values()), [False])))
            for a, z in S.batches(end - lo, self.batch):
                t0 = time.perf_counter()
                ok = s.page_set(b, self.kv, keys[lo + a:lo + z],
                                self._idx(self.src_idx, lo + a, lo + z), keys[:lo + a])
                dt = time.perf_counter() - t0
                if rep is not None:
                    pages.add(rep, dt, (z - a) * g.kv_page_bytes, z - a)
                    pages.checks.append(ok)
            lo = end

    def _flush(self, name: str, op: str, rep: int | None) -> None:
        """Wait for our store's background SSD writes; the time goes to ``op``'s row."""
        dt = flush_store(self.backends[name])
        if dt is not None and rep is not None:
            self.series[(name, op, "write")].flush[rep] = dt

    def _store_v1(self, name: str, keys: list[str], rep: int | None) -> None:
        s, b, g = S.sgl(), self.backends[name], self.g
        ser = self._s(name, "batch_set_v1", "write", g.kv_page_bytes, self.batch,
                      "zero-copy batch_set_v1(keys, host_indices) from the host pool")
        for a, z in S.batches(self.n_pages, self.batch):
            t0 = time.perf_counter()
            res = b.batch_set_v1(keys[a:z], self._idx(self.src_idx, a, z), s.extra(keys[:a]))
            dt = time.perf_counter() - t0
            if rep is not None:
                ser.add(rep, dt, (z - a) * g.kv_page_bytes, z - a)
                ser.checks.append(bool(res) and all(res))

    def _exists(self, name: str, keys: list[str]) -> int:
        s = S.sgl()
        r = self.backends[name].batch_exists_v2(keys, [s.mamba_probe()])
        hit = int(r.kv_hit_pages)
        if hit != len(keys):
            self.issues.append(f"sglang {self.g.label} {name}: batch_exists_v2 hit {hit} of "
                               f"{len(keys)} stored pages")
        return hit

    def _clear_dst(self) -> None:
        ps = self.g.page_tokens
        zero = torch.zeros(self.g.kv_page_bytes, dtype=torch.uint8).view(torch.bfloat16)
        for i in range(self.n_pages):
            self.kv.set_from_flat_data_page(int(self.dst_idx[i * ps]), zero)

    def _dst_exact(self) -> bool:
        ps = self.g.page_tokens
        return all(torch.equal(self.kv.get_data_page(int(self.dst_idx[i * ps])).view(torch.uint8),
                               self.src[i]) for i in range(self.n_pages))

    def _load(self, name: str, keys: list[str], cache: str, rep: int | None) -> None:
        s, b, g = S.sgl(), self.backends[name], self.g
        pages = self._s(name, "batch_get", cache, g.kv_page_bytes, self.batch,
                        "HiCacheController._generic_page_get: batch_get(keys, fresh flat pages) "
                        "+ set_from_flat_data_page")
        states = self._s(name, "batch_get_v2[mamba]", cache, g.state_bytes, 1,
                         "one PoolTransfer(MAMBA) per node into a fresh host slot")
        self._clear_dst()
        for slot in self.dst_slots:
            self.pool.set_from_flat_data_page(slot, torch.zeros(self.state_bytes, dtype=torch.uint8))
        lo = 0
        for j, end in enumerate(self.ends):
            for a, z in S.batches(end - lo, self.batch):
                t0 = time.perf_counter()
                got = s.page_get(b, self.kv, keys[lo + a:lo + z],
                                 self._idx(self.dst_idx, lo + a, lo + z), keys[:lo + a])
                dt = time.perf_counter() - t0
                if rep is not None:
                    pages.add(rep, dt, (z - a) * g.kv_page_bytes, z - a)
                    pages.checks.append(got == z - a)
            t0 = time.perf_counter()
            res = b.batch_get_v2([s.mamba_transfer(keys[end - 1], self.dst_slots[j])],
                                 extra_info=s.extra(keys[:end - 1]))
            dt = time.perf_counter() - t0
            if rep is not None:
                states.add(rep, dt, g.state_bytes, 1)
                states.checks.append(bool(res) and all(next(iter(res.values()), [False])))
            lo = end
        if rep is not None:
            exact = self._dst_exact()
            pages.checks.append(exact)
            same = all(torch.equal(self.pool.get_data_page(d), self.pool.get_data_page(s_))
                       for s_, d in zip(self.src_slots, self.dst_slots))
            states.checks.append(same)
            if not (exact and same):
                self.issues.append(f"sglang {self.g.label} b{self.batch} {name} {cache}: loaded "
                                   f"bytes differ (pages {exact}, states {same})")

    def _load_v1(self, name: str, keys: list[str], cache: str, rep: int | None) -> None:
        s, b, g = S.sgl(), self.backends[name], self.g
        ser = self._s(name, "batch_get_v1", cache, g.kv_page_bytes, self.batch,
                      "zero-copy batch_get_v1(keys, host_indices) into the host pool")
        self._clear_dst()
        for a, z in S.batches(self.n_pages, self.batch):
            t0 = time.perf_counter()
            res = b.batch_get_v1(keys[a:z], self._idx(self.dst_idx, a, z), s.extra(keys[:a]))
            dt = time.perf_counter() - t0
            if rep is not None:
                ser.add(rep, dt, (z - a) * g.kv_page_bytes, z - a)
                ser.checks.append(bool(res) and all(res))
        if rep is not None:
            exact = self._dst_exact()
            ser.checks.append(exact)
            if not exact:
                self.issues.append(f"sglang {self.g.label} b{self.batch} {name} v1 {cache}: "
                                   "loaded bytes differ")

    def close(self) -> None:
        for name, b in self.backends.items():
            try:
                b.clear()
                S.close_backend(b)
            except Exception as e:  # noqa: BLE001 - report, close the rest
                self.issues.append(f"sglang {name}: close failed: {e!r}")
        self.backends.clear()
