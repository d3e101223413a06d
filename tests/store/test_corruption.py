"""Corrupt objects on the disk tier: every drop reaches the index (issue 13, item 1)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.disk import segment_name
from hybridstore.errors import CorruptObjectError
from hybridstore.objects import ObjectKind, object_key

B = 16


def _pages(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(n)]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_adjacent_corrupt_pages_read_in_one_io_are_all_forgotten_and_a_reput_heals(tmp_path):
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"),
                      disk_bytes=64 << 20, tier_policy="write-through")
    tokens = np.arange(8 * B, dtype=np.int64)
    pages, state = _pages(1, 8), np.arange(256, dtype=np.uint8)
    with HybridStore(cfg) as store:
        store.put_kv(tokens, pages)
        store.put_state(tokens, state)
        store.flush()
        store.evict(1 << 40, "host")
        disk = store.tiers["disk"]
        prompt = store.prefix(tokens)
        for k in (2, 3, 4):                        # three neighbours: one coalesced read
            rec = disk.catalog.get(object_key(ObjectKind.PAGE, prompt.block_key(k)))
            _flip(tmp_path / "hs" / segment_name(rec.segment), rec.offset + 7)
        plan = store.match(tokens)
        assert plan.position == 8 * B
        with pytest.raises(CorruptObjectError):
            store.load(plan).result()
        store.release(plan)
        assert store.stats()["corrupt"] == 3
        assert store.present_pages(prompt) == 2      # pages 2..4 are gone from index and tier
        plan = store.match(tokens)
        assert plan.position == 0                    # no resume point is left unloadable
        store.release(plan)
        # a re-put heals the prefix: matched and loadable, bit-exact
        store.put_kv(tokens, pages)
        store.put_state(tokens, state)
        plan = store.match(tokens)
        try:
            got, st = store.load(plan).result()
            assert plan.position == 8 * B
            assert all(np.array_equal(a, b) for a, b in zip(got, pages))
            assert np.array_equal(st, state)
        finally:
            store.release(plan)
        assert store.index.check_refcounts()


def test_per_tier_counters_after_a_reopen_count_what_the_disk_kept(tmp_path):
    """Issue 13, item 9: the store's per-tier object and byte counts start from what a
    reopened disk tier lists (they read 0, then went negative on eviction)."""
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"),
                      disk_bytes=64 << 20, tier_policy="write-through")
    tokens = np.arange(4 * B, dtype=np.int64)
    with HybridStore(cfg) as store:
        store.put_kv(tokens, _pages(2, 4))
        store.put_state(tokens, np.arange(100, dtype=np.uint8))
        store.flush()
        before = (store._res.objects["disk"], dict(store._res.kind_bytes["disk"]))
    with HybridStore(cfg) as store:
        assert (store._res.objects["disk"], dict(store._res.kind_bytes["disk"])) == before
        assert store._res.objects["disk"] == store.stats()["tiers"]["disk"]["objects"] == 5
        store.evict(1 << 40, "disk")
        assert store._res.objects["disk"] == 0
        assert all(v == 0 for v in store._res.kind_bytes["disk"].values())
