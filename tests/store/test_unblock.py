"""The evictor's last resort (``Evictor.unblock``): a tier whose KV partition holds only the
last copy of pages that checkpoints held in another tier need.

SGLang-style split pools (``tier_policy="partition"``) with its radix LRU
(``lru-radix``) over real bytes: a DRAM pool above a POSIX disk tier.  The DRAM's state
partition is emptied by hand and the disk copies of the pages are dropped (what the
pools' own evictions leave behind in a replay), so that a dependency-aware ranking of
the DRAM tier offers nothing: its pages are needed by checkpoints only the disk holds.
Before the last resort, the next put raised ``CapacityError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import CapacityError, HybridStore, StoreConfig
from hybridstore.objects import TIER_BITS, ObjectKind, object_key

B = 16                      # tokens per page
PAGE = 256 << 10            # bytes of a page: the DRAM's KV partition holds 8, the disk's 16
STATE = 64 << 10            # bytes of a checkpoint
HOST, DISK = TIER_BITS["host"], TIER_BITS["disk"]


def config(tmp_path) -> StoreConfig:
    return StoreConfig(block_size=B, host_bytes=4 << 20, disk_path=str(tmp_path / "ssd"),
                       disk_bytes=8 << 20, disk_segment_bytes=4 << 20, disk_engine="posix",
                       policy="lru-radix", tier_policy="partition")


def tokens(first: int, nblocks: int) -> np.ndarray:
    return np.arange(first, first + nblocks * B, dtype=np.int64)


def pages_of(seed: int, n: int) -> list[np.ndarray]:
    return [np.full(PAGE, (seed * 16 + k) % 251, np.uint8) for k in range(n)]


def state_of(seed: int) -> np.ndarray:
    return np.full(STATE, 200 + seed, np.uint8)


def page_okeys(store: HybridStore, toks: np.ndarray) -> list[bytes]:
    prompt = store.prefix(toks)
    return [object_key(ObjectKind.PAGE, prompt.key_before(k + 1)) for k in range(prompt.nblocks)]


def state_okey(store: HybridStore, toks: np.ndarray) -> bytes:
    prompt = store.prefix(toks)
    return object_key(ObjectKind.STATE, prompt.key_at(prompt.length))


def put(store: HybridStore, toks: np.ndarray, seed: int, *, state: bool = True):
    pages = pages_of(seed, len(toks) // B)
    store.put_kv(toks, pages)
    st = state_of(seed) if state else None
    if state:
        assert store.put_state(toks, st)
    store.flush()
    return pages, st


def put_two(store: HybridStore, a: np.ndarray, b: np.ndarray):
    """A's and B's pages, then their checkpoints (which the disk then holds too: no later
    page write makes it evict them for KV room)."""
    pa, pb = pages_of(1, len(a) // B), pages_of(2, len(b) // B)
    store.put_kv(a, pa)
    store.put_kv(b, pb)
    sa, sb = state_of(1), state_of(2)
    assert store.put_state(a, sa) and store.put_state(b, sb)
    store.flush()
    return pa, sa, pb, sb


def held(store: HybridStore, okey: bytes) -> int:
    """The tier mask of an object in the index (0: not held)."""
    if okey[0] == ObjectKind.STATE:
        ck = store.index.checkpoint(okey[1:])
        return 0 if ck is None else ck.tiers
    nid = store.index.find_node(okey[1:])
    return 0 if nid < 0 else store.index.page_tiers(nid)


def only_in(store: HybridStore, okeys, tier: str) -> None:
    """Leave each object only in ``tier`` (by the store's own drop: bytes, catalog, index)."""
    for okey in okeys:
        for name in store._res.chain:
            if name != tier and held(store, okey) & TIER_BITS[name]:
                store._res.drop(okey, name)


def assert_loads(store: HybridStore, toks: np.ndarray, pages, st) -> None:
    plan = store.match(toks)
    assert plan.position == len(toks)
    got, got_state = store.load(plan).result()
    assert all(np.array_equal(a, b) for a, b in zip(got, pages)) and len(got) == len(pages)
    assert np.array_equal(got_state, st)
    store.release(plan)


def blocked(store: HybridStore, a: np.ndarray, b: np.ndarray) -> None:
    """The DRAM's KV partition full of A's and B's pages (their only copies), their
    checkpoints on disk only."""
    only_in(store, page_okeys(store, a) + page_okeys(store, b), "host")
    only_in(store, [state_okey(store, a), state_okey(store, b)], "disk")
    res = store._res
    assert res.room("host", ObjectKind.PAGE) < PAGE           # no page fits in DRAM
    assert res.kind_bytes["host"][ObjectKind.STATE] == 0       # and it holds no checkpoint
    assert all(held(store, k) == HOST for k in page_okeys(store, a) + page_okeys(store, b))


def test_a_page_needed_by_checkpoints_on_disk_moves_down_when_the_disk_has_room(tmp_path):
    with HybridStore(config(tmp_path)) as store:
        a, b, c = tokens(0, 4), tokens(10_000, 4), tokens(20_000, 1)
        pa, sa = put(store, a, 1)
        pb, sb = put(store, b, 2)
        blocked(store, a, b)
        put(store, c, 3, state=False)            # before: CapacityError ("... needed ...")
        stats = store.stats()
        assert stats["demotions"] >= 1 and stats["dropped_checkpoints"] == 0
        moved = [k for k in page_okeys(store, a) + page_okeys(store, b) if held(store, k) == DISK]
        assert moved and store.tiers["disk"].contains(moved[0])
        # nothing was lost: both resume whole, their bytes exact, from DRAM and disk
        assert_loads(store, a, pa, sa)
        assert_loads(store, b, pb, sb)
        assert store.index.check_refcounts()
        assert store.tiers["host"].used_bytes <= store.tiers["host"].capacity_bytes


def test_without_room_below_the_page_leaves_with_the_checkpoints_that_need_it(tmp_path):
    cfg = config(tmp_path)
    with HybridStore(cfg) as store:
        d = tokens(50_000, 16)                   # fills the disk's KV partition, pinned
        put(store, d, 9, state=False)
        only_in(store, page_okeys(store, d), "disk")
        pin = store.match_pages(d)
        assert all(held(store, k) == DISK for k in page_okeys(store, d))
        a, b, c = tokens(0, 4), tokens(10_000, 4), tokens(20_000, 1)
        _, _, pb, sb = put_two(store, a, b)      # A is the least recently used
        blocked(store, a, b)
        a_state = state_okey(store, a)
        assert store.tiers["disk"].contains(a_state)
        # B in use while C lands: C's write-through copy finds the disk's KV partition
        # pinned, and the disk's own eviction (unchanged) would take an unpinned state
        # there for it; pinned, B shows what the last resort leaves alone
        plan_b = store.match(b)
        put(store, c, 3, state=False)            # before: CapacityError
        store.release(plan_b)
        stats = store.stats()
        assert stats["demotions"] == 0 and stats["dropped_checkpoints"] == 1
        # A's checkpoint is gone from the index and the disk (its bytes and its catalog
        # record), and its pages with it (SGLang deletes the leaf whole)
        assert store.index.checkpoint(a_state[1:]) is None
        assert not store.tiers["disk"].contains(a_state)
        assert all(held(store, k) == 0 for k in page_okeys(store, a))
        assert store.match(a).position == 0
        # B and the pinned pages are untouched; the new page landed
        assert_loads(store, b, pb, sb)
        assert all(held(store, k) == DISK for k in page_okeys(store, d))
        assert held(store, page_okeys(store, c)[0]) & HOST
        assert store.index.check_refcounts()
        store.release(pin)
    with HybridStore(cfg) as again:              # the catalog agrees: A's state is gone
        assert again.index.checkpoint(a_state[1:]) is None
        assert again.index.checkpoint(state_okey(again, b)[1:]) is not None


def test_pinned_pages_and_their_checkpoints_still_stay(tmp_path):
    with HybridStore(config(tmp_path)) as store:
        d = tokens(50_000, 16)
        put(store, d, 9, state=False)
        only_in(store, page_okeys(store, d), "disk")
        pin = store.match_pages(d)
        a, b, c = tokens(0, 4), tokens(10_000, 4), tokens(20_000, 1)
        pa, sa, _, _ = put_two(store, a, b)
        blocked(store, a, b)
        plan_a = store.match(a)                 # a live plan: A's pages and state stay
        assert plan_a.position == len(a)
        put(store, c, 3, state=False)
        assert store._evictor.dropped_checkpoints == 1
        assert store.index.checkpoint(state_okey(store, b)[1:]) is None   # B went instead
        got, st = store.load(plan_a).result()
        assert all(np.array_equal(x, y) for x, y in zip(got, pa)) and np.array_equal(st, sa)
        e = tokens(30_000, 3)
        put(store, e, 5, state=False)            # the DRAM's KV partition full again
        plans = [store.match_pages(c), store.match_pages(e)]
        assert store._res.room("host", ObjectKind.PAGE) < PAGE
        with pytest.raises(CapacityError, match="pinned"):
            # A pinned, C's and E's pages pinned, the disk's KV partition pinned: nothing
            # may go, and the put is refused with the typed error
            store.put_kv(tokens(40_000, 1), pages_of(6, 1))
        assert store.index.checkpoint(state_okey(store, a)[1:]) is not None
        assert store._evictor.dropped_checkpoints == 1
        store.release(plan_a)
        for plan in plans:
            store.release(plan)
        store.release(pin)
        assert store.index.check_refcounts()
