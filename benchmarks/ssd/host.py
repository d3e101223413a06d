"""The host pool: copies into and out of the pinned DRAM pool, against numpy and torch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.ssd.availability import cuda_available
from benchmarks.ssd.sizes import size_label
from hybridstore.bench.common import aligned, median, no_gc, percentile


def bench_host(sizes: Sequence[int], reps: int, step: Callable[[str], None],
                unavailable: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    from hybridstore.backends.host import HostPool
    from hybridstore.objects import ObjectKind, object_key

    rows: list[dict[str, Any]] = []
    cuda = cuda_available()
    counts = {s: max(2, min(64, (256 << 20) // s)) for s in sizes}
    need = max((counts[s] + 2) * s for s in sizes)  # a put replaces a key: one slot extra
    pool = HostPool(need + need // 2 + (64 << 20), arena_bytes=256 << 20, pin=True)
    pinned = pool.is_pinned
    try:
        for size in sizes:
            n = counts[size]
            src = aligned(size, 7)
            dst = aligned(size)
            keys = [object_key(ObjectKind.PAGE, (size * 7919 + i).to_bytes(16, "little"))
                    for i in range(n)]
            for k in keys:
                pool.put(k, src, nbytes=size)
            series: dict[str, list[float]] = {}
            lat: dict[str, list[float]] = {}
            ratios: dict[str, list[float]] = {}

            def timed(name: str, fn: Callable[[int], None]) -> float:
                secs = []
                with no_gc():
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
                    "path": path, "op": op, "object_bytes": size, "gbps": median(gs),
                    "gbps_p10": percentile(gs, 10.0), "p50_ms": percentile(lat[name], 50.0) * 1e3,
                    "p99_ms": percentile(lat[name], 99.0) * 1e3, "reps": len(gs),
                    "objects_per_rep": n}
                if name in ratios:
                    ref = "vs_torch_pinned" if op in ("h2d", "d2h") else "vs_memcpy"
                    row[ref] = median(ratios[name])
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
