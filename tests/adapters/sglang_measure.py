"""Page store / load rates through SGLang's own HiCache controller: hybridstore vs ``HiCacheFile``.

``python -m tests.adapters.sglang_measure [--pages 32] [--rounds 4]`` (with
``PYTHONPATH=src:.``) prints one JSON line per backend and path.  Both backends sit
behind the same real ``HybridCacheController`` (``sglang_harness``): a store is
``write_storage`` of ``pages`` host pages until the backup ack, a load is
``prefetch_from_storage`` of the same prompt pumped to completion, and every load
is checked bit for bit.  The rates count the time the controller spends in its
page functions (``page_set_func`` for a store; ``page_get_func`` for a load:
the backend's ``batch_set``/``batch_get`` plus the controller's own copies between
flat pages and the host pool on the legacy path, or ``batch_set_v1`` /
``batch_get_v1``) and in the backend's ``batch_exists``; the controller's queueing
and tree work around them is the same for every backend and is left out.  Warm numbers on one
machine (the OS page cache holds ``HiCacheFile``'s files; hybridstore serves loads
from its DRAM tier and writes its SSD tier behind); cold and restart figures are
``hybridstore bench engines``' job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from tests.adapters.sglang_harness import build_engine

STORE_CALLS = ("page_set_func",)
LOAD_CALLS = ("batch_exists", "page_get_func")

BACKENDS = {
    "hybridstore": {"backend_name": "hybridstore", "module_path": "hybridstore.adapters.sglang",
                    "class_name": "HybridStoreHiCache", "hicache_storage_pass_prefix_keys": True},
    "HiCacheFile": {"backend_name": "file", "module_path": "sglang.srt.mem_cache.hicache_storage",
                    "class_name": "HiCacheFile"},
}


def _time_calls(obj: Any, names: tuple[str, ...],
                spent: dict[str, float] | None = None) -> dict[str, float]:
    """Wrap methods of ``obj`` (as instance attributes: the controller calls them through
    the instance) so that the seconds spent in each are summed into ``spent``."""
    spent = {} if spent is None else spent
    for name in names:
        method = getattr(obj, name)

        def timed(*args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _m(*args, **kw)
            finally:
                spent[_n] = spent.get(_n, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)
    return spent


def measure(backend: str, path: str, *, pages: int = 32, rounds: int = 4, page_size: int = 64,
            kv_layers: int = 12, kv_heads: int = 2, head_dim: int = 256,
            interface_v1: bool = False) -> dict[str, Any]:
    """Median store and load rates of ``rounds`` prompts of ``pages`` pages.

    The default page is a Qwen3-Next-80B-A3B KV page at TP 1: 12 full-attention
    layers x 2 KV heads x 256 dims x K,V x bf16 x 64 tokens = 1.5 MiB.
    """
    cfg = dict(BACKENDS[backend], prefetch_threshold=page_size)
    if backend == "hybridstore":
        cfg.update(disk_path=path, host_bytes=4 * rounds * pages * (3 << 19), disk_bytes=8 << 30)
    else:
        cfg["file_storage_path"] = path
    if interface_v1:
        cfg["interface_v1"] = 1
    e = build_engine(cfg, page_size=page_size, tokens=pages * page_size, host_ratio=rounds + 2.0,
                     kv_layers=kv_layers, kv_heads=kv_heads, head_dim=head_dim)
    spent = _time_calls(e.controller, ("page_set_func", "page_get_func"))
    _time_calls(e.backend, ("batch_exists",), spent)
    try:
        gen = torch.Generator().manual_seed(1)
        store_s, load_s, nbytes = [], [], 0
        for _ in range(rounds):
            toks = torch.randint(0, 1 << 20, (pages * page_size,), generator=gen).tolist()
            slots, want = e.fill(pages, gen)
            nbytes = sum(p.numel() for p in want)
            spent.clear()
            e.controller.write_storage(slots, toks, e.hashes(toks), [])
            op = e.controller.ack_backup_queue.get(timeout=60)
            store_s.append(sum(spent.get(c, 0.0) for c in STORE_CALLS))
            assert op.completed_tokens == len(toks)
            e.kv_host.free(slots)
            spent.clear()
            r = e.prefetch(toks, timeout=60)
            load_s.append(sum(spent.get(c, 0.0) for c in LOAD_CALLS))
            assert len(r["pages"]) == pages and all(torch.equal(a, b) for a, b in zip(r["pages"], want))
    finally:
        e.close()
    med = statistics.median
    return {"backend": backend, "path": "interface_v1" if interface_v1 else "legacy",
            "pages": pages, "page_bytes": nbytes // pages,
            "store_pages_per_s": pages / med(store_s), "load_pages_per_s": pages / med(load_s),
            "store_gb_per_s": nbytes / med(store_s) / 1e9, "load_gb_per_s": nbytes / med(load_s) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where both backends write (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for backend in BACKENDS:
            for v1 in (False, True) if backend == "hybridstore" else (False,):
                print(json.dumps(measure(backend, f"{d}/{backend}{int(v1)}", pages=args.pages,
                                         rounds=args.rounds, interface_v1=v1)), flush=True)


if __name__ == "__main__":
    main()
