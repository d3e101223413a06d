"""Section 5: token hit rate under one SSD byte budget, ours vs plain LRU file eviction.

A replayed agent trace (the bundled WEKA sample by default) is turned into
SGLang's own page keys: per request its token ids
(:func:`hybridstore.replay.tokens.session_tokens`) are cut into 64-token pages
and hashed with SGLang's ``get_hash_str`` (SHA-256 of the prior digest and the
page's ids as uint32 LE).  Each request then makes the calls SGLang makes for
it, through the backend's ``HiCacheStorage`` methods:

1. ``batch_exists_v2(keys, [MAMBA probe, TRAILING_PAGES])``: the hit is the
   deepest restorable prefix (KV pages held *and* a Mamba state at its end);
2. the prefetch of the hit: its pages through SGLang's legacy
   ``_generic_page_get`` (``batch_get``, 128 pages per call) and
   ``batch_get_v2`` of the state at its end (so recency follows use, as in
   SGLang);
3. the write-back (``write_backup_storage``): ``batch_set_v2`` of the Mamba
   state at the request's last full page, then ``_generic_page_set``
   (``batch_set``) of the pages from the hit on (an existing key is only touched).

The built-in is ``HiCacheFile`` with its ``LRUFileEvictor``
(``storage/file/lru_file_evictor.py``) capped by ``max_size`` = the budget:
one LRU list over every ``.bin`` file (KV pages and Mamba states alike,
refreshed by reads and by re-writes of existing keys), evicting from the
least recently used end down to ``eviction_ratio`` (0.9) of the cap when a
write would exceed it.  Ours is ``HybridStoreHiCache`` with ``disk_bytes`` =
the budget and a DRAM tier of 2 MiB (a landing zone for a 128-page batch
and a few states; write-through puts every object on the SSD, and a copy
still in DRAM can serve a hit after the SSD evicted it, so ours may hold up
to 2 MiB more than the budget), under each of its eviction policies given.

Sizes are the model's divided by ``scale`` (Qwen3-Next at 1/384: 4 KiB pages
and 196.5 KiB states, keeping its ratio of state to page bytes), so a budget
sweep runs in a minute or two; the hit rates depend on the byte ratios, not the
absolute sizes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridstore.bench.engines import sgl as S
from hybridstore.bench.engines.geometry import PAGE_TOKENS, HybridShape

__all__ = ["PolicyWorkload", "make_workload", "replay_system"]

DEFAULT_SCALE = 384
OURS_HOST_BYTES = 2 << 20
"""Our DRAM tier in the replay: a landing zone for a 128-page batch (512 KiB) and a few states."""


@dataclass
class PolicyWorkload:
    """Page keys per request (in arrival order) and the footprint of all of them."""

    trace: str
    keys: list[list[str]]
    input_tokens: list[int]
    page_bytes: int
    state_bytes: int
    footprint_bytes: int
    scale: int


def make_workload(shape: HybridShape, trace_spec: str | None, max_requests: int,
                  scale: int = DEFAULT_SCALE) -> PolicyWorkload:
    """The first ``max_requests`` arrivals of the trace as SGLang page keys (scaled sizes)."""
    from hybridstore.replay.loaders import load
    from hybridstore.replay.model_presets import model_preset
    from hybridstore.replay.samples import weka_sample
    from hybridstore.replay.tokens import session_tokens

    s = S.sgl()
    trace = load(trace_spec or str(weka_sample()))
    arrivals = trace.arrivals()[:max_requests]
    wanted = {(r.session, r.index) for r in arrivals}
    tokens: dict[tuple[str, int], np.ndarray] = {}
    for sid in {r.session for r in arrivals}:
        sess = trace.session(sid)
        for i, toks in enumerate(session_tokens(sess)):
            if (sid, i) in wanted:
                tokens[(sid, i)] = toks
    preset = model_preset(shape.preset).scaled(scale)
    page_bytes = preset.page_bytes(PAGE_TOKENS)
    state_bytes = preset.checkpoint_bytes + preset.checkpoint_bytes % 2
    keys: list[list[str]] = []
    last: dict[str, tuple[np.ndarray, list[str]]] = {}
    for r in arrivals:
        toks = tokens[(r.session, r.index)]
        n = len(toks) // PAGE_TOKENS
        prev = last.get(r.session)
        reuse = 0
        if prev is not None:  # appends share their prefix: hash only the new pages
            ptoks, pkeys = prev
            m = min(len(pkeys), n) * PAGE_TOKENS
            diff = np.flatnonzero(ptoks[:m] != toks[:m])
            reuse = (int(diff[0]) if diff.size else m) // PAGE_TOKENS
            ks = pkeys[:reuse]
        else:
            ks = []
        if n > reuse:
            ks = ks + s.page_keys(toks[reuse * PAGE_TOKENS:n * PAGE_TOKENS].tolist(), PAGE_TOKENS,
                                  ks[-1] if ks else None)
        keys.append(ks)
        last[r.session] = (toks, ks)
    pages = {k for ks in keys for k in ks}
    states = {ks[-1] for ks in keys if ks}
    return PolicyWorkload(trace=trace.name, keys=keys,
                          input_tokens=[r.input_tokens for r in arrivals], page_bytes=page_bytes,
                          state_bytes=state_bytes,
                          footprint_bytes=len(pages) * page_bytes + len(states) * state_bytes,
                          scale=scale)


def replay_system(wl: PolicyWorkload, *, backend: str, policy: str | None, budget: int,
                  root: str, step: Callable[[str], None]) -> dict[str, Any]:
    """Replay the workload through one backend under ``budget`` SSD bytes; its hit rate."""
    s = S.sgl()
    t_layers, t_elems = 1, (wl.state_bytes - 4) // 4      # fp32 temporal + a 2-element bf16 conv
    pool = s.mamba_host(t_layers, (t_elems,), (2,), 2)
    assert int(pool.size_per_token) == wl.state_bytes
    # one attention layer, one KV head of page_bytes / (64 tokens x K,V x bf16) dims
    head_dim = wl.page_bytes // (PAGE_TOKENS * 2 * 2)
    batch = S.STORAGE_BATCH_SIZE
    kv = s.kv_host(layers=1, heads=1, head_dim=head_dim, page_size=PAGE_TOKENS, pages=2 * batch)
    slots = kv.alloc(2 * batch * PAGE_TOKENS)
    src_idx, dst_idx = slots[:batch * PAGE_TOKENS], slots[batch * PAGE_TOKENS:]
    name = f"{backend}-{policy or 'lru-file'}-{budget}"
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    extra = (S.builtin_extra(path, max_size=budget) if backend == S.BUILTIN else
             S.ours_extra(path, disk_bytes=budget, host_bytes=OURS_HOST_BYTES, policy=policy))
    b = S.open_backend(backend, tp=1, model="replay", extra=extra, kv_pool=kv, mamba_pool=pool)
    gen = torch.Generator().manual_seed(7)
    for i in range(batch):
        kv.set_from_flat_data_page(int(src_idx[i * PAGE_TOKENS]), torch.randint(
            0, 256, (wl.page_bytes,), dtype=torch.uint8, generator=gen).view(torch.bfloat16))
    pool.set_from_flat_data_page(0, torch.randint(0, 256, (wl.state_bytes,), dtype=torch.uint8,
                                                  generator=gen))
    hit_tokens = loaded_short = 0
    t0 = time.perf_counter()
    try:
        for i, keys in enumerate(wl.keys):
            if i % 25 == 0:
                step(f"policy {name}: request {i}/{len(wl.keys)}")
            if not keys:
                continue
            hit = int(b.batch_exists_v2(keys, [s.mamba_probe()]).kv_hit_pages)
            if hit:
                got = 0
                for lo, hi in S.batches(hit, batch):
                    got += s.page_get(b, kv, keys[lo:hi], dst_idx[:(hi - lo) * PAGE_TOKENS],
                                      keys[:lo])
                st = b.batch_get_v2([s.mamba_transfer(keys[hit - 1], 1)],
                                    extra_info=s.extra(keys[:hit - 1]))
                if got < hit or not all(next(iter(st.values()), [False])):
                    loaded_short += 1
                hit_tokens += hit * PAGE_TOKENS
            n = len(keys)
            b.batch_set_v2([s.mamba_transfer(keys[n - 1], 0)], extra_info=s.extra(keys[:n - 1]))
            for lo, hi in S.batches(n - hit, batch):
                s.page_set(b, kv, keys[hit + lo:hit + hi], src_idx[:(hi - lo) * PAGE_TOKENS],
                           keys[:hit + lo])
        # ours: SSD copies refused for want of room (a state that stays in DRAM only)
        skipped = (b.store_stats().get("store", {}).get("skipped_copies", 0)
                   if backend != S.BUILTIN else None)
    finally:
        b.clear()
        S.close_backend(b)
    total = sum(wl.input_tokens)
    return {"backend": backend, "policy": policy or "lru-file", "budget_bytes": budget,
            "budget_share": budget / wl.footprint_bytes, "token_hit_rate": hit_tokens / total,
            "hit_tokens": hit_tokens, "input_tokens": total, "requests": len(wl.keys),
            "loads_short": loaded_short, "skipped_copies": skipped,
            "seconds": time.perf_counter() - t0}
