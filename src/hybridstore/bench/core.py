"""``hybridstore bench core``: the core figures of the store, measured side by side.

What is measured (every figure is repeated and reported as its median and p90):

1. **Tier throughput** of 64 KiB pages and 50 MiB checkpoints: a plain numpy
   copy of the same sizes (the ``memcpy`` reference), the host pool
   (:class:`~hybridstore.backends.host.HostPool` ``put`` / ``get_into``), the
   disk tier (:class:`~hybridstore.backends.disk.DiskTier` with the POSIX
   ``O_DIRECT`` engine: a batch of ``put`` futures, each ``.result()`` awaited
   (durable: written, ``fdatasync``'ed, catalog committed), then ``get_into``),
   and the :class:`~hybridstore.HybridStore` facade (``put_kv``/``put_state``,
   then ``match`` + ``load(into=...)`` served by the host pool, and by the disk
   after ``store.evict(..., tier="host")``).  Each repetition runs every path
   once, in turn, so ratios to the memcpy of the *same* repetition cancel most of
   the noise of a shared machine.
2. **match() latency** on a 128K-token prompt at ``block_size=64`` (2048 pages
   and a checkpoint at its end, held by an accounting-only host tier), with
   hashing included, and split into hashing and index walk.
3. **Hashing throughput**: :func:`~hybridstore.index.keys.chain_hash_tokens`
   native vs its numpy twin, in GB/s of uint32 token ids.
4. **Index memory per cached block** with >= 100K pages:
   ``HybridIndex.memory_bytes() / n_pages`` and a ``tracemalloc`` figure.

Throughput is bytes moved per second of wall time, in GB/s (1e9 bytes/s);
``gbps_p90`` is the throughput of the 90th-percentile (slow) repetition.
"""

from __future__ import annotations

import gc
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridstore.backends.disk import DiskTier
from hybridstore.backends.host import HostPool
from hybridstore.bench.common import (
    aligned,
    emit,
    fmt_bytes,
    fs_type,
    json_safe,
    machine_info,
    median,
    o_direct_works,
    percentile,
    stdout_console,
)
from hybridstore.bench.common import timed as _timed
from hybridstore.bench.index_figures import (
    VOCAB,
    bench_hashing,
    bench_index_memory,
    bench_match,
)
from hybridstore.config import StoreConfig
from hybridstore.index.prefix import PrefixKeys
from hybridstore.objects import ObjectKind, object_key
from hybridstore.store import HybridStore

__all__ = ["run_core_bench"]

KIB = 1 << 10
MIB = 1 << 20
PAGE_BYTES = 64 * KIB
CKPT_BYTES = 50 * MIB
STORE_BLOCK = 64                 # tokens per page of the facade's stores
PAGES_PER_PROMPT = 64            # facade page workload: 4096-token prompts of 64 pages


# ---------------------------------------------------------------------------------
# 1. tier throughput
# ---------------------------------------------------------------------------------
@dataclass
class _Series:
    """One row of the tier table: repeated timings of one path and operation."""

    tier: str
    path: str
    op: str
    object_bytes: int
    note: str = ""
    seconds: list[float] = field(default_factory=list)
    bytes_moved: list[int] = field(default_factory=list)
    vs_memcpy: list[float] = field(default_factory=list)
    objects_per_rep: int = 0

    def add(self, seconds: float, nbytes: int, nobjects: int, memcpy_gbps: float | None) -> float:
        self.seconds.append(seconds)
        self.bytes_moved.append(nbytes)
        self.objects_per_rep = nobjects
        gbps = nbytes / seconds / 1e9
        if memcpy_gbps:
            self.vs_memcpy.append(gbps / memcpy_gbps)
        return gbps

    def row(self) -> dict[str, Any]:
        gbps = [b / s / 1e9 for b, s in zip(self.bytes_moved, self.seconds)]
        out: dict[str, Any] = {
            "tier": self.tier, "path": self.path, "op": self.op,
            "object_bytes": self.object_bytes,
            "gbps_median": median(gbps),
            "gbps_p90": percentile(gbps, 10.0),  # the 90th-percentile (slow) repetition
            "reps": len(gbps),
            "objects_per_rep": self.objects_per_rep,
            "bytes_per_rep": int(median([float(b) for b in self.bytes_moved])),
            "ms_per_object_median": median(self.seconds) * 1e3 / max(self.objects_per_rep, 1),
        }
        if self.vs_memcpy:
            out["vs_memcpy_median"] = median(self.vs_memcpy)
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class _Workload:
    """Buffers of one object size: ``n`` objects of ``size`` bytes, and store prompts."""

    name: str
    size: int
    n: int
    src: np.ndarray
    dst: np.ndarray
    store_prompts: list[tuple[list[Any], dict[str, Any]]]    # (pages, state) to put
    store_targets: list[tuple[list[Any], dict[str, Any]]]    # (pages, state) to load into
    store_batches: list[tuple[Any, dict[str, Any]]]          # the same memory, page-major
    src_batches: list[tuple[Any, dict[str, Any]]]            # store_prompts, page-major
    store_bytes: int                                         # bytes of one facade rep
    store_objects: int
    tokens_per_prompt: int

    def views(self, buf: np.ndarray) -> list[np.ndarray]:
        return [buf[i * self.size:(i + 1) * self.size] for i in range(self.n)]


def _page_tensor(buf: np.ndarray) -> Any:
    """A 64 KiB bfloat16 KV page ``(2, 64, 256)`` viewing ``buf`` (no copy)."""
    import torch

    return torch.from_numpy(buf).view(torch.bfloat16).view(2, STORE_BLOCK, PAGE_BYTES // (4 * STORE_BLOCK))


def _same_bytes(a: Any, b: Any) -> bool:
    """Bit-exact equality of two CPU tensors (random bytes hold NaNs, so not ``torch.equal``)."""
    import torch

    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _state_dict(buf: np.ndarray) -> dict[str, Any]:
    """A recurrent-state checkpoint ``{"ssm": float32[...]}`` viewing ``buf``."""
    import torch

    return {"ssm": torch.from_numpy(buf).view(torch.float32)}


def _make_workload(name: str, size: int, n: int, rng: np.random.Generator) -> _Workload:
    """``n`` objects of ``size`` bytes; the facade workload moves objects of that size too.

    Pages: ``n // 64`` prompts of 64 pages + a 64 KiB checkpoint at the end.
    Checkpoints: ``n`` one-block prompts, each one 64 KiB page + the checkpoint.
    """
    if size == PAGE_BYTES:
        prompts = max(1, n // PAGES_PER_PROMPT)
        pages_per, state_bytes = PAGES_PER_PROMPT, PAGE_BYTES
        n = prompts * PAGES_PER_PROMPT
    else:
        prompts, pages_per, state_bytes = n, 1, size
    data_bytes = max(n * size, prompts * (pages_per * PAGE_BYTES + state_bytes))
    src = aligned(data_bytes)
    src[:] = np.frombuffer(rng.bytes(data_bytes), dtype=np.uint8)
    dst = aligned(data_bytes, fill=1)

    def carve(buf: np.ndarray) -> list[tuple[list[Any], dict[str, Any]]]:
        out, off = [], 0
        for _ in range(prompts):
            pages = []
            for _ in range(pages_per):
                pages.append(_page_tensor(buf[off:off + PAGE_BYTES]))
                off += PAGE_BYTES
            out.append((pages, _state_dict(buf[off:off + state_bytes])))
            off += state_bytes
        return out

    def batches(buf: np.ndarray) -> list[tuple[Any, dict[str, Any]]]:
        """Each prompt's pages as one ``(pages, 2, 64, 256)`` tensor over the same bytes."""
        out, off = [], 0
        for _ in range(prompts):
            span = buf[off:off + pages_per * PAGE_BYTES]
            import torch

            rows = torch.from_numpy(span).view(torch.bfloat16).view(pages_per, -1)
            out.append((rows.view(pages_per, *_page_tensor(span[:PAGE_BYTES]).shape),
                        _state_dict(buf[off + pages_per * PAGE_BYTES:][:state_bytes])))
            off += pages_per * PAGE_BYTES + state_bytes
        return out

    return _Workload(name=name, size=size, n=n, src=src, dst=dst,
                     store_prompts=carve(src), store_targets=carve(dst), store_batches=batches(dst),
                     src_batches=batches(src),
                     store_bytes=prompts * (pages_per * PAGE_BYTES + state_bytes),
                     store_objects=prompts * (pages_per + 1),
                     tokens_per_prompt=pages_per * STORE_BLOCK)


class _TierBench:
    """Runs every throughput path of one workload, repetition by repetition."""

    def __init__(self, wl: _Workload, root_dir: str, rng: np.random.Generator,
                 issues: list[str]) -> None:
        self.wl = wl
        self.rng = rng
        self.issues = issues
        self.series: dict[tuple[str, str, str], _Series] = {}
        working = wl.n * wl.size + wl.store_bytes
        host_bytes = 2 * working + (256 * MIB)
        disk_bytes = 4 * working + (1024 * MIB)
        self._opened: list[Any] = []
        try:
            self.pool = self._open(HostPool(host_bytes))
            self.disk = self._open(DiskTier(os.path.join(root_dir, f"{wl.name}-tier"), disk_bytes,
                                            engine="posix"))
            base = dict(block_size=STORE_BLOCK, host_bytes=host_bytes, disk_engine="posix")
            self.store_host = self._open(HybridStore(StoreConfig(**base)))
            # The default DRAM/SSD policy is write-through (every put also goes to disk).
            self.store_disk = self._open(HybridStore(StoreConfig(
                **base, disk_path=os.path.join(root_dir, f"{wl.name}-store"),
                disk_bytes=disk_bytes)))
        except BaseException:
            self.close()
            raise
        self._rep = 0

    def _open(self, obj: Any) -> Any:
        self._opened.append(obj)
        return obj

    # -- bookkeeping --------------------------------------------------------------
    def _series(self, tier: str, path: str, op: str, note: str = "") -> _Series:
        key = (tier, path, op)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = _Series(tier, path, op, self.wl.size, note)
        return s

    def _keys(self) -> list[bytes]:
        return [object_key(ObjectKind.PAGE, struct.pack("<QQ", self._rep, i)) for i in range(self.wl.n)]

    def _record(self, timed: bool, tier: str, path: str, op: str, seconds: float, nbytes: int,
                nobjects: int, memcpy: float | None, note: str = "") -> None:
        if timed:
            self._series(tier, path, op, note).add(seconds, nbytes, nobjects, memcpy)

    # -- one repetition of every path ---------------------------------------------
    def rep(self, timed: bool, step: Callable[[str], None]) -> None:
        wl = self.wl
        src, dst = wl.views(wl.src), wl.views(wl.dst)
        total = wl.n * wl.size
        self._rep += 1

        # reference: a numpy copy of the same objects into touched, aligned memory
        step("memcpy")

        def memcpy() -> None:
            for s, d in zip(src, dst):
                np.copyto(d, s)

        t = _timed(memcpy)
        mc = total / t / 1e9
        self._record(timed, "reference", "numpy.copyto", "copy", t, total, wl.n, None,
                     "memcpy of the same objects into prefaulted aligned memory")

        # host pool
        step("host pool")
        keys = self._keys()
        pool = self.pool
        t = _timed(lambda: [pool.put(k, s, nbytes=wl.size) for k, s in zip(keys, src)])
        self._record(timed, "host", "HostPool", "put", t, total, wl.n, mc)
        t = _timed(lambda: [pool.get_into(k, d).result() for k, d in zip(keys, dst)])
        self._record(timed, "host", "HostPool", "get_into", t, total, wl.n, mc)
        for k in keys:
            pool.delete(k)

        # disk tier, POSIX O_DIRECT engine
        step("disk tier")
        disk = self.disk

        def disk_put() -> None:
            futs = [disk.put(k, s, nbytes=wl.size) for k, s in zip(keys, src)]
            for f in futs:
                f.result()

        def disk_get() -> None:
            futs = [disk.get_into(k, d) for k, d in zip(keys, dst)]
            for f in futs:
                f.result()

        t = _timed(disk_put)
        self._record(timed, "disk", f"DiskTier[{disk.engine.name}]", "put", t, total, wl.n, mc,
                     "batch of put() futures, each .result() awaited: written, fdatasync'ed, "
                     "catalog committed")
        t = _timed(disk_get)
        self._record(timed, "disk", f"DiskTier[{disk.engine.name}]", "get_into", t, total, wl.n, mc,
                     "cold read (O_DIRECT) + xxh3 checksum verify")
        if not np.array_equal(dst[-1], src[-1]):
            self.issues.append(f"{wl.name}: DiskTier.get_into returned different bytes")
        # the same objects again, neighbours coalesced (what store.load and write-through use)
        offsets = [i * wl.size for i in range(wl.n)]
        wl.dst[:] = 1
        t = _timed(lambda: disk.read_many_into(keys, wl.dst, offsets).result())
        self._record(timed, "disk", f"DiskTier[{disk.engine.name}]", "read_many_into", t, total,
                     wl.n, mc, "one call: objects back to back in a segment (spaced like their "
                     "destinations) read with one request of up to 8 MiB, then each checksum")
        if not (np.array_equal(dst[-1], src[-1]) and np.array_equal(dst[0], src[0])):
            self.issues.append(f"{wl.name}: DiskTier.read_many_into returned different bytes")
        for k in keys:
            disk.delete(k)

        def disk_put_many() -> None:
            for f in disk.put_many(keys, src, nbytes=wl.size):
                f.result()

        t = _timed(disk_put_many)
        self._record(timed, "disk", f"DiskTier[{disk.engine.name}]", "put_many", t, total, wl.n, mc,
                     "one call: adjacent slots written with one request of up to 8 MiB; each "
                     "future awaited (written, fdatasync'ed, catalog committed)")
        if not np.array_equal(disk.get(keys[-1]), src[-1]):
            self.issues.append(f"{wl.name}: DiskTier.put_many stored different bytes")
        for k in keys:
            disk.delete(k)

        # the facade, host pool only
        step("store (host)")
        self._store_rep(self.store_host, "host", timed, mc)
        # the facade with a disk tier (write-through), loads after evicting DRAM
        step("store (disk)")
        self._store_rep(self.store_disk, "disk", timed, mc)

    def _prompts(self, store: HybridStore) -> list[PrefixKeys]:
        """Random prompts hashed by ``store`` (each store keys tokens with its own secret)."""
        wl = self.wl
        return [store.prefix(self.rng.integers(0, VOCAB, wl.tokens_per_prompt, dtype=np.uint32))
                for _ in wl.store_prompts]

    def _store_rep(self, store: HybridStore, where: str, timed: bool, mc: float) -> None:
        wl = self.wl
        prompts = self._prompts(store)  # hashing is measured on its own (section 3)

        def put(batched: bool = False) -> None:
            for pk, (pages, state) in zip(prompts, wl.src_batches if batched else wl.store_prompts):
                if batched:
                    store.put_kv_batch(pk, pages)
                else:
                    store.put_kv(pk, pages)
                store.put_state(pk, state)
            if where == "disk":
                store.flush()

        short: list[int] = []

        def load(batched: bool = False) -> None:
            for pk, target in zip(prompts, wl.store_batches if batched else wl.store_targets):
                plan = store.match(pk)
                try:
                    if plan.position != pk.length:
                        short.append(plan.position)
                    store.load(plan, into=target).result()
                finally:
                    store.release(plan)

        note_put = (f"put_kv of {wl.tokens_per_prompt // STORE_BLOCK} pages + put_state per "
                    "prompt (pre-hashed prompts)")
        if where == "disk":
            note_put += "; write-through, then flush() until durable on disk"
        t = _timed(put)
        self._record(timed, where, "HybridStore", "put_kv+put_state", t, wl.store_bytes,
                     wl.store_objects, mc, note_put)
        self._empty(store, where, "put_kv")
        t = _timed(lambda: put(batched=True))
        self._record(timed, where, "HybridStore", "put_kv_batch+put_state", t, wl.store_bytes,
                     wl.store_objects, mc, note_put.replace("put_kv of", "put_kv_batch (one "
                     "page-major tensor) of") + "; the loads below read what it stored")
        if where == "disk":
            store.evict(1 << 62, tier="host")
            left = store.tiers["host"].used_bytes
            if left:
                self.issues.append(f"{wl.name}: evict(host) left {left} bytes in the host pool")
        t = _timed(load)
        self._record(timed, where, "HybridStore", "match+load", t, wl.store_bytes, wl.store_objects,
                     mc, "match + load(into=preallocated tensors).result() + release"
                     + ("; served by the disk tier (cold, O_DIRECT)" if where == "disk" else ""))
        last_pages, last_state = wl.store_targets[-1]
        want_pages, want_state = wl.store_prompts[-1]
        if not (_same_bytes(last_pages[-1], want_pages[-1])
                and _same_bytes(last_state["ssm"], want_state["ssm"])):
            self.issues.append(f"{wl.name}/{where}: load() returned different bytes")
        wl.dst[:] = 1                                   # the batch must write every byte again
        t = _timed(lambda: load(batched=True))
        self._record(timed, where, "HybridStore", "match+load(batch)", t, wl.store_bytes,
                     wl.store_objects, mc, "match + load(into=one page-major tensor per prompt)"
                     ".result() + release: one gather per layout entry"
                     + ("; served by the disk tier (cold, O_DIRECT)" if where == "disk" else ""))
        if not (_same_bytes(last_pages[-1], want_pages[-1]) and _same_bytes(last_pages[0], want_pages[0])
                and _same_bytes(last_state["ssm"], want_state["ssm"])):
            self.issues.append(f"{wl.name}/{where}: load(batch) returned different bytes")
        if short:
            self.issues.append(f"{wl.name}/{where}: match() resumed at {short[:3]} instead of the "
                               "prompt end")
        # empty the store again so the next repetition reuses its arenas / segments
        self._empty(store, where, "the loads")

    def _empty(self, store: HybridStore, where: str, after: str) -> None:
        """Evict everything from every tier (and say so when something stays)."""
        for tier in list(store.tiers):
            store.evict(1 << 62, tier=tier)
        for tier, obj in store.tiers.items():
            if obj.used_bytes:
                self.issues.append(f"{self.wl.name}/{where}: after {after}, evicting everything "
                                   f"left the {tier} tier using {obj.used_bytes} bytes "
                                   f"({store.stats()['pages']} pages in the index)")

    def direct_io(self) -> bool | None:
        """Whether the disk tier's segment files were opened with O_DIRECT (None: unknown)."""
        files = getattr(self.disk, "_files", None)
        if not files:
            return None
        flags = [getattr(f, "direct", None) for f in list(files.values())]
        return None if None in flags else all(flags)

    def close(self) -> None:
        for obj in reversed(self._opened):
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - report, keep closing the rest
                self.issues.append(f"{self.wl.name}: closing {type(obj).__name__} failed: {e!r}")
        self._opened.clear()


# ---------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------
def _print_report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="hybridstore bench core: tier throughput (GB/s, median of reps)")
    for col in ("tier", "path", "op", "object", "objs/rep", "GB/s median", "GB/s p90",
                "vs memcpy", "reps"):
        t.add_column(col, justify="right" if col not in ("tier", "path", "op") else "left")
    for r in doc["tiers"]:
        vs = r.get("vs_memcpy_median")
        t.add_row(r["tier"], r["path"], r["op"], fmt_bytes(r["object_bytes"]),
                  str(r["objects_per_rep"]), f"{r['gbps_median']:.2f}", f"{r['gbps_p90']:.2f}",
                  "" if vs is None else f"{vs:.2f}x", str(r["reps"]))
    console.print(t)

    def ok(good: bool | None) -> str:
        return "" if good is None else ("[green]yes[/green]" if good else "[red]no[/red]")

    m, h, ix = doc["match"], doc["hashing"], doc["index_memory"]
    g = Table(title="match latency, hashing, index memory")
    for col in ("figure", "median", "p90", "goal", "met"):
        g.add_column(col, justify="left" if col == "figure" else "right")
    g.add_row(f"match() {m['prompt_tokens']} tokens, B={m['block_size']} (ms)", f"{m['ms_median']:.3f}",
              f"{m['ms_p90']:.3f}", f"<= {m['goal_ms']}", ok(m["ms_median"] <= m["goal_ms"]))
    g.add_row("  hashing alone (ms)", f"{m['hash_ms_median']:.3f}", f"{m['hash_ms_p90']:.3f}", "", "")
    g.add_row("  match of pre-hashed prompt (ms)", f"{m['walk_ms_median']:.3f}",
              f"{m['walk_ms_p90']:.3f}", "", "")
    if "index_walk_ms_median" in m:
        g.add_row("  index walk alone (ms)", f"{m['index_walk_ms_median']:.3f}", "", "", "")
    if h["native_gbps"] is not None:
        g.add_row("hashing native (GB/s of uint32 ids)", f"{h['native_gbps']:.2f}",
                  f"{h['native_gbps_p90']:.2f}", f">= {h['goal_gbps']}",
                  ok(h["native_gbps"] >= h["goal_gbps"]))
    g.add_row("hashing python twin (GB/s)", f"{h['python_gbps']:.3f}", f"{h['python_gbps_p90']:.3f}",
              "", "")
    if h["ratio"] is not None:
        g.add_row("  native / python", f"{h['ratio']:.1f}x", "", "", "")
    g.add_row(f"index bytes/block, memory_bytes() ({ix['pages']} pages)",
              f"{ix['bytes_per_block_index']:.1f}", "", f"<= {ix['goal_bytes']}",
              ok(ix["bytes_per_block_index"] <= ix["goal_bytes"]))
    g.add_row("index bytes/block, tracemalloc", f"{ix['bytes_per_block_tracemalloc']:.1f}", "",
              f"<= {ix['goal_bytes']}", ok(ix["bytes_per_block_tracemalloc"] <= ix["goal_bytes"]))
    console.print(g)
    d = doc["disk"]
    console.print(f"disk: {d['dir']} ({d['fs_type']}), engine {d['engine']}, O_DIRECT "
                  f"{d['o_direct']}: reads {d['reads']}")
    for issue in doc["issues"]:
        console.print(f"[yellow]issue:[/yellow] {issue}")


def run_core_bench(json_path: str | None = None, disk_dir: str | None = None,
                   quick: bool = False) -> dict[str, Any]:
    """Run the core benchmark, print a table and the JSON document, return the document.

    Args:
        json_path: also write the JSON document here.
        disk_dir: directory for the disk tiers (a fresh subdirectory is made in
            it and removed afterwards); a temp dir when ``None``.
        quick: fewer repetitions and smaller batches (about a minute on 2 cores).

    Returns:
        ``{"machine", "config", "disk", "tiers", "match", "hashing",
        "index_memory", "issues"}`` (see the module docstring).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    reps = 3 if quick else 7
    match_reps = 30 if quick else 200
    hash_reps = 5 if quick else 15
    n_pages = 256 if quick else 1024
    n_ckpts = 1 if quick else 4
    rng = np.random.default_rng(20240607)
    issues: list[str] = []
    out_console = stdout_console()
    err_console = Console(stderr=True)

    if disk_dir is not None:
        os.makedirs(disk_dir, exist_ok=True)
    root_dir = tempfile.mkdtemp(prefix="hybridstore-bench-", dir=disk_dir)
    started = time.perf_counter()
    steps_total = 2 * (reps + 1) * 5 + 2 + 2 + 1
    tiers_rows: list[dict[str, Any]] = []
    o_direct = o_direct_works(root_dir)
    engine_name = None
    host_pinned = False
    direct_seen: list[bool | None] = []
    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("bench core", total=steps_total)

            def step(what: str) -> None:
                progress.update(task, advance=1, description=what)

            for name, size, n in (("page", PAGE_BYTES, n_pages), ("checkpoint", CKPT_BYTES, n_ckpts)):
                wl = _make_workload(name, size, n, rng)
                bench = _TierBench(wl, root_dir, rng, issues)
                try:
                    engine_name = bench.disk.engine.name
                    host_pinned = bench.pool.is_pinned
                    for r in range(reps + 1):  # repetition 0 warms up (arenas, segments)
                        bench.rep(timed=r > 0,
                                  step=lambda what, r=r, name=name: step(
                                      f"{name} {fmt_bytes(size)} rep {r}/{reps}: {what}"))
                    direct_seen.append(bench.direct_io())
                    tiers_rows.extend(s.row() for s in bench.series.values())
                finally:
                    bench.close()
                del wl, bench
                gc.collect()
            match = bench_match(match_reps, rng, step)
            hashing = bench_hashing(hash_reps, rng, step)
            index_memory = bench_index_memory(rng, step)
    finally:
        shutil.rmtree(root_dir, ignore_errors=True)

    direct = (all(bool(d) for d in direct_seen) if direct_seen and None not in direct_seen
              else o_direct)
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "config": {"quick": quick, "reps": reps, "warmup_reps": 1, "match_reps": match_reps,
                   "hash_reps": hash_reps, "page_objects_per_rep": n_pages,
                   "checkpoint_objects_per_rep": n_ckpts, "gbps_unit": "1e9 bytes/s",
                   "gbps_p90": "throughput of the 90th-percentile (slowest 10%) repetition",
                   "vs_memcpy": "median over reps of (path GB/s / numpy memcpy GB/s of the "
                                "same rep)",
                   "elapsed_s": None},
        "disk": {
            "dir": root_dir, "fs_type": fs_type(os.path.dirname(root_dir) or "."),
            "engine": engine_name, "o_direct": bool(direct),
            "reads": ("cold: the POSIX engine opens segments with O_DIRECT, bypassing the OS "
                      "page cache (a hypervisor or device cache below may still serve them)"
                      if direct else
                      "WARM: the file system refused O_DIRECT, reads may come from the page "
                      "cache"),
            "verify_checksums": True,
        },
        "host": {"pinned": bool(host_pinned),
                 "note": ("arenas page-locked with cudaHostRegister" if host_pinned else
                          "pageable mmap arenas (pinning needs a CUDA device)")},
        "tiers": tiers_rows,
        "match": match,
        "hashing": hashing,
        "index_memory": index_memory,
        "issues": issues,
    }
    doc["config"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    doc = json_safe(doc)
    _print_report(doc, out_console)
    emit(doc, json_path=json_path)
    return doc
