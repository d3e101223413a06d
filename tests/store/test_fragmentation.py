"""A put that finds enough free bytes but no contiguous slot (fragmentation): the disk
tier moves the objects of one window elsewhere (compaction, nothing lost); a tier that
cannot frees one window of neighbours instead of the policy's order, and gives up at
once when every window holds what must stay (nothing evicted for nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.objects import ObjectKind, object_key

B = 16
PAGE = 4096
SLAB_PAGES = 32          # an 8 MiB tier has 128 KiB slabs (1/64): 32 pages of 4 KiB each
SLABS = 64
FULL = SLABS - 1         # slabs filled with pages; one left free (128 KiB: no 200 KiB slot)
PAGES = FULL * SLAB_PAGES


def cfg(tmp_path, shared: bool = False) -> StoreConfig:
    return StoreConfig(block_size=B, host_bytes=16 << 20, disk_path=str(tmp_path / "ssd"),
                       disk_bytes=8 << 20, disk_segment_bytes=8 << 20, disk_engine="posix",
                       policy="lru", disk_shared=shared)


def _fragmented(store: HybridStore, pinned_slabs: range):
    """PAGES pages in slabs 0..FULL-1 of the disk tier; one page of each slab in
    ``pinned_slabs`` pinned by a live plan."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, PAGES * B)
    prompt = store.prefix(tokens)
    store.put_kv(prompt, [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(PAGES)])
    store.flush()
    plans = [store.match_pages(prompt, first=k * SLAB_PAGES, stop=k * SLAB_PAGES + 1)
             for k in pinned_slabs]
    return prompt, plans


@pytest.mark.parametrize("pinned", [range(4), range(FULL)])
def test_state_put_into_a_fragmented_disk_tier(tmp_path, pinned):
    with HybridStore(cfg(tmp_path)) as store:
        prompt, plans = _fragmented(store, pinned)
        disk = store.tiers["disk"]
        before = store._evictor.evictions
        state = np.random.default_rng(2).integers(0, 255, 200 << 10, dtype=np.uint8)
        assert store.put_state(prompt, state)      # lands in DRAM whatever the SSD does
        store.flush()
        on_disk = disk.contains(object_key(ObjectKind.STATE, prompt.key_at(prompt.length)))
        evicted = store._evictor.evictions - before
        if len(pinned) == 4:
            # slabs 4.. are free to go: after one pass in the policy's order, one window
            # (two slabs of pages) is enough; the policy's order alone emptied the tier
            assert on_disk and store._copies.skipped_copies == 0
            assert evicted <= PAGES // 4          # far from emptying the tier
        else:
            # a pinned page in every slab: no window can be evicted, but pages can move
            # (a pin keeps a page in the store, not in its slot): the disk tier moves
            # those of one window into the holes the policy's pass left, and the copy
            # lands without emptying the tier
            assert on_disk and store._copies.skipped_copies == 0
            assert store.stats()["relocations"] >= 1
            assert evicted <= PAGES // 4          # far from emptying the tier
            assert len(list(disk.entries())) >= PAGES - PAGES // 4
        for plan in plans:
            store.release(plan)
        out = store.match(prompt)            # the state is held (in DRAM at least)
        assert out.position == prompt.length
        _, got = store.load(out).result()
        store.release(out)
        assert np.array_equal(np.asarray(got).view(np.uint8).reshape(-1), state)


def test_allocator_window_is_the_cheapest_movable_one():
    a = SlabAllocator(budget_bytes=8 << 20, arena_bytes=8 << 20, alignment=4096)  # 128 KiB slabs
    small = [a.alloc(4096) for _ in range(FULL * 32)]    # slabs 0-62, slab 63 free
    assert all(e is not None for e in small)
    assert a.alloc(200 << 10) is None                    # 128 KiB free: not enough bytes
    for e in small[32 * (FULL - 1):]:
        a.free(e)                                        # slabs 62 and 63 free: a window
    assert a.window(200 << 10, lambda e: True) == []
    for e in small[32 * (FULL - 1):]:
        a.reserve(e)
    keep = {e for e in small if e.offset % (128 << 10) == 0 and e.offset < (4 << 17)}
    got = a.window(200 << 10, lambda e: e not in keep)
    assert got is not None and not set(got) & keep
    assert sum(e.length for e in got) == 32 * 4096      # one slab of pages, next to slab 63
    for e in got:
        a.free(e)
    big = a.alloc(200 << 10)
    assert isinstance(big, Extent)
    blocked = {e for e in small if e.offset % (128 << 10) == 0} | {big}
    assert a.window(200 << 10, lambda e: e not in blocked) is None


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_fragmented_disk_tier_moves_pages_instead_of_evicting_them(tmp_path, shared):
    """Pages of two prompts written in turn fill the disk tier; evicting one prompt's
    leaves 4 KiB holes only.  A state's disk copy then needs a 200 KiB slot: the tier
    moves the pages of one window into the holes (compaction) and evicts nothing; in a
    directory shared with other processes too (the window lies in this process's own
    segment)."""
    n = 1024                                      # 2 x 1024 pages of 4 KiB: the whole tier
    rng = np.random.default_rng(3)
    a_tokens, b_tokens = rng.integers(0, 1000, n * B), rng.integers(1000, 2000, n * B)
    a_pages = [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(n)]
    with HybridStore(cfg(tmp_path, shared)) as store:
        disk = store.tiers["disk"]
        for i in range(n):
            store.put_kv_page(a_tokens, a_pages[i], end=(i + 1) * B)
            store.put_kv_page(b_tokens, rng.integers(0, 255, PAGE, dtype=np.uint8),
                              end=(i + 1) * B)
            if i % 64 == 63:
                store.flush()
        store.flush()
        assert len(list(disk.entries())) == 2 * n
        store.release(store.match_pages(a_tokens))          # A is the more recent
        assert store.evict(n * PAGE, tier="disk") >= n * PAGE
        assert store.present_pages(a_tokens) == n
        on_disk = len(list(disk.entries()))
        assert on_disk == n                                 # B's pages left the SSD
        evictions = store.stats()["evictions"]
        state = rng.integers(0, 255, 200 << 10, dtype=np.uint8)
        assert store.put_state(a_tokens, state)
        store.flush()
        stats = store.stats()
        assert stats["relocations"] >= 1 and store._copies.skipped_copies == 0
        assert stats["evictions"] == evictions              # nothing evicted for room
        assert disk.contains(object_key(ObjectKind.STATE, store.prefix(a_tokens).key_at(n * B)))
        assert len(list(disk.entries())) == n + 1
        store.evict(1 << 40, tier="host")                   # loads come from the SSD now
        plan = store.match(a_tokens)
        assert plan.position == n * B
        pages, got = store.load(plan).result()
        store.release(plan)
        assert np.array_equal(np.asarray(got).view(np.uint8).reshape(-1), state)
        flat = np.concatenate([np.asarray(p).view(np.uint8).reshape(-1) for p in pages])
        assert np.array_equal(flat, np.concatenate(a_pages))
