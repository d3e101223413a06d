"""Index figures shared by ``hybridstore bench core`` and ``python -m benchmarks index``.

* :func:`bench_match`: ``HybridStore.match()`` latency on a 128K-token prompt at
  ``block_size=64`` (2048 pages and a checkpoint at its end, held by an
  accounting-only host tier), with hashing, split into hashing and index walk.
* :func:`bench_hashing`: :func:`~hybridstore.index.keys.chain_hash_tokens`
  native vs its numpy twin, in GB/s of uint32 token ids, and whether both give
  the same keys.
* :func:`bench_index_memory`: bytes per cached block of a
  :class:`~hybridstore.index.trie.HybridIndex` with >= 100K pages, by its own
  accounting and by ``tracemalloc``.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from hybridstore import _native
from hybridstore.backends.accounting import AccountingTier
from hybridstore.bench.common import median, no_gc, percentile
from hybridstore.config import StoreConfig
from hybridstore.index import keys as K
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import HybridIndex
from hybridstore.store import HybridStore

__all__ = ["GOAL_HASH_GBPS", "GOAL_INDEX_BYTES", "GOAL_MATCH_MS", "INDEX_PAGES", "MATCH_BLOCK",
           "MATCH_TOKENS", "VOCAB", "bench_hashing", "bench_index_memory", "bench_match"]

MATCH_TOKENS = 128 * 1024        # 131072 tokens
MATCH_BLOCK = 64
INDEX_PROMPT_BLOCKS = 16         # index-memory workload: independent 1024-token prompts
INDEX_PAGES = 102_400
PAGE_BYTES = 64 * 1024
GOAL_MATCH_MS = 0.5
GOAL_HASH_GBPS = 1.0
GOAL_INDEX_BYTES = 200
VOCAB = 150_000


# ---------------------------------------------------------------------------------
# match latency
# ---------------------------------------------------------------------------------
def bench_match(reps: int, rng: np.random.Generator, step: Callable[[str], None]) -> dict[str, Any]:
    cfg = StoreConfig(block_size=MATCH_BLOCK, host_bytes=1 << 40, pin_host_memory=False)
    store = HybridStore(cfg, tiers={"host": AccountingTier("host", 1 << 40, read_gbps=cfg.h2d_gbps)})
    try:
        tokens = rng.integers(0, VOCAB, MATCH_TOKENS, dtype=np.uint32)
        nblocks = MATCH_TOKENS // MATCH_BLOCK
        step("match: filling the index")
        prompt = store.prefix(tokens)
        page = np.zeros(PAGE_BYTES // 1024, np.uint8)  # accounting tier: sizes only
        t0 = time.perf_counter()
        store.put_kv(prompt, [page] * nblocks)
        put_kv_s = time.perf_counter() - t0
        store.put_state(prompt, {"ssm": np.zeros(64, np.float32)})

        total, hashing, walk, trie_walk, release = [], [], [], [], []
        positions = set()
        step("match: timing")
        for i in range(reps + 3):  # 3 warm-up rounds
            with no_gc():
                t0 = time.perf_counter()
                plan = store.match(tokens)
                t1 = time.perf_counter()
                store.release(plan)
                t2 = time.perf_counter()
                pk = store.prefix(tokens)
                t3 = time.perf_counter()
                plan2 = store.match(pk)
                t4 = time.perf_counter()
                store.release(plan2)
                pk2 = store.prefix(tokens)
                _ = pk2.lo_array  # the index's map keys, as match() builds them
                walker = getattr(store.index, "_walk_ids", None)
                t5 = time.perf_counter()
                if walker is not None:
                    walker(pk2)
                t6 = time.perf_counter()
            positions.add(plan.position)
            if i < 3:
                continue
            total.append((t1 - t0) * 1e3)
            release.append((t2 - t1) * 1e3)
            hashing.append((t3 - t2) * 1e3)
            walk.append((t4 - t3) * 1e3)
            if walker is not None:
                trie_walk.append((t6 - t5) * 1e3)
        out: dict[str, Any] = {
            "prompt_tokens": MATCH_TOKENS, "block_size": MATCH_BLOCK, "pages": nblocks,
            "ms_median": median(total), "ms_p90": percentile(total, 90.0),
            "hash_ms_median": median(hashing), "hash_ms_p90": percentile(hashing, 90.0),
            "walk_ms_median": median(walk), "walk_ms_p90": percentile(walk, 90.0),
            "release_ms_median": median(release),
            "goal_ms": GOAL_MATCH_MS, "reps": len(total),
            "hit_positions": sorted(positions),
            "setup_put_kv_s": put_kv_s,
            "note": ("ms: HybridStore.match(uint32 token ids) with hashing; hash: store.prefix() "
                     "alone; walk: store.match() of a pre-hashed PrefixKeys (index walk, "
                     "completeness check, pins, ResumePlan); index_walk: HybridIndex._walk_ids "
                     "alone; host tier: AccountingTier (sizes only)"),
        }
        if trie_walk:
            out["index_walk_ms_median"] = median(trie_walk)
        return out
    finally:
        store.close()


# ---------------------------------------------------------------------------------
# hashing throughput
# ---------------------------------------------------------------------------------
def bench_hashing(reps: int, rng: np.random.Generator, step: Callable[[str], None]) -> dict[str, Any]:
    tokens = rng.integers(0, VOCAB, MATCH_TOKENS, dtype=np.uint32)
    key = K.HashKey.generate(MATCH_BLOCK)
    root = key.root("")
    nbytes = tokens.nbytes

    def gbps_of(inner: int) -> list[float]:
        out = []
        for _ in range(reps):
            with no_gc():
                t0 = time.perf_counter()
                for _ in range(inner):
                    K.chain_hash_tokens(tokens, MATCH_BLOCK, root, key)
                out.append(nbytes * inner / (time.perf_counter() - t0) / 1e9)
        return out

    native = None
    same = None
    if _native.available()["hashing"]:
        step("hashing: native")
        with _native.use_twins(False, only=["hashing"]):
            K.chain_hash_tokens(tokens, MATCH_BLOCK, root, key)
            native = gbps_of(10)
            keys_native = K.chain_hash_tokens(tokens, MATCH_BLOCK, root, key)
    step("hashing: python twin")
    with _native.use_twins(only=["hashing"]):
        K.chain_hash_tokens(tokens, MATCH_BLOCK, root, key)
        python = gbps_of(1)
        keys_python = K.chain_hash_tokens(tokens, MATCH_BLOCK, root, key)
    if native is not None:
        same = bool(np.array_equal(keys_native, keys_python))
    out: dict[str, Any] = {
        "tokens": MATCH_TOKENS, "block_size": MATCH_BLOCK, "token_dtype": "uint32",
        "native_gbps": median(native) if native else None,
        "native_gbps_p90": percentile(native, 10.0) if native else None,
        "python_gbps": median(python), "python_gbps_p90": percentile(python, 10.0),
        "ratio": (median(native) / median(python)) if native else None,
        "native_ms_median": (nbytes / median(native) / 1e6) if native else None,
        "python_ms_median": nbytes / median(python) / 1e6,
        "keys_identical": same, "goal_gbps": GOAL_HASH_GBPS, "reps": reps,
    }
    if native is None:
        out["note"] = "the native extension is not built (python setup.py build_ext --inplace)"
    return out


# ---------------------------------------------------------------------------------
# index memory
# ---------------------------------------------------------------------------------
def bench_index_memory(rng: np.random.Generator, step: Callable[[str], None],
                       pages: int = INDEX_PAGES) -> dict[str, Any]:
    blocks = INDEX_PROMPT_BLOCKS
    nprompts = -(-pages // blocks)
    per = blocks * MATCH_BLOCK
    all_tokens = rng.integers(0, VOCAB, nprompts * per, dtype=np.uint32)
    key = K.HashKey.generate(MATCH_BLOCK)
    root = key.root("")
    step(f"index memory: {nprompts * blocks} pages under tracemalloc")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        index = HybridIndex(MATCH_BLOCK, root)
        for i in range(nprompts):
            pk = PrefixKeys.from_tokens(all_tokens[i * per:(i + 1) * per], block_size=MATCH_BLOCK,
                                        root=root, hash_key=key)
            for b in range(blocks):
                index.add_page(pk, b, "host", PAGE_BYTES)
        build_s = time.perf_counter() - t0
        del pk
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    pages = index.n_pages
    mem = index.memory_bytes()
    return {
        "pages": pages, "prompts": nprompts, "blocks_per_prompt": blocks,
        "bytes_per_block_index": mem / pages,
        "bytes_per_block_tracemalloc": traced / pages,
        "index_memory_bytes": mem, "tracemalloc_bytes": traced,
        "build_s_traced": build_s, "goal_bytes": GOAL_INDEX_BYTES,
        "note": ("HybridIndex.add_page of every block of independent 1024-token prompts; "
                 "tracemalloc: bytes still traced after the prompts were dropped "
                 "(build time is under tracemalloc, so slower than untraced)"),
    }
