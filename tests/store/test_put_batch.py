"""store.put_kv_batch: a page-major batch into the pool a run at a time (stage_many +
one scatter per layout entry): bytes, held pages, pressure, write-through, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridstore import (
    HybridStore,
    LayoutMismatchError,
    MisalignedPageError,
    StoreConfig,
)
from hybridstore.backends import gather as G
from hybridstore.backends.alloc import SlabAllocator
from hybridstore.backends.host import HostPool
from hybridstore.errors import CapacityError
from tests.twins import native_or_twin, needs_native, running

native = native_or_twin("gather")

B = 16
RNG = np.random.default_rng(91)


def cfg(tmp_path, **kw) -> StoreConfig:
    base = dict(block_size=B, host_bytes=8 << 20, disk_path=None)
    if kw.get("disk_path"):
        base.update(disk_bytes=256 << 20, disk_segment_bytes=4 << 20, disk_engine="posix")
    base.update(kw)
    return StoreConfig(**base)


def batch_of(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Pages of fp32 K and bf16 V (two entries of different dtypes and sizes), page-major."""
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(n, 2, B, 8, generator=g),
            "v": torch.randn(n, 2, B, 4, generator=g).to(torch.bfloat16)}


def state_of(seed: int) -> dict[str, torch.Tensor]:
    return {"ssm": torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))}


def loaded(store: HybridStore, tokens: np.ndarray) -> tuple[dict[str, torch.Tensor], int]:
    """The plan's pages as a batch (and how many), loaded from whatever tier holds them."""
    plan = store.match(tokens)
    n = len(plan.pages)
    out = {"k": torch.empty(n, 2, B, 8), "v": torch.empty(n, 2, B, 4, dtype=torch.bfloat16)}
    store.load(plan, into=(out, {"ssm": torch.empty(4, 16)})).result()
    store.release(plan)
    return out, n


def test_batch_round_trips_exactly_and_equals_put_kv_of_the_rows(tmp_path):
    tokens = RNG.integers(0, 150_000, 37 * B + 5)          # a partial last page
    nblocks = -(-len(tokens) // B)
    batch = batch_of(nblocks, 1)
    with HybridStore(cfg(tmp_path)) as a, HybridStore(cfg(tmp_path)) as b:
        assert a.put_kv_batch(tokens, batch) == nblocks
        assert b.put_kv(tokens, [{k: v[i] for k, v in batch.items()} for i in range(nblocks)]) == nblocks
        for store in (a, b):
            assert store.put_state(tokens, state_of(3))
        got_a, n = loaded(a, tokens)
        got_b, _ = loaded(b, tokens)
        assert n == nblocks
        for name in batch:
            assert torch.equal(got_a[name], batch[name]) and torch.equal(got_b[name], batch[name])
        sa, sb = a.stats(), b.stats()
        assert sa["pages"] == sb["pages"] == nblocks
        assert sa["tiers"]["host"]["used_bytes"] == sb["tiers"]["host"]["used_bytes"]
        assert a.tiers["host"]._pending == {}
        assert a.index.check_refcounts()


def test_count_and_held_pages(tmp_path):
    tokens = RNG.integers(0, 150_000, 24 * B)
    batch = batch_of(24, 2)
    with HybridStore(cfg(tmp_path)) as store:
        # The first 10 blocks, from the batch's first 10 rows.
        assert store.put_kv_batch(tokens[: 10 * B], batch, count=10) == 10
        # Then the whole prompt: the 10 held pages are touched, 14 land.
        assert store.put_kv_batch(tokens, batch) == 14
        # The last 4 blocks again from a 4-row batch: all held.
        assert store.put_kv_batch(tokens, {k: v[-4:] for k, v in batch.items()}) == 0
        store.put_state(tokens, state_of(4))
        got, n = loaded(store, tokens)
        assert n == 24 and all(torch.equal(got[k], batch[k]) for k in batch)


def test_bad_batches_store_nothing(tmp_path):
    tokens = RNG.integers(0, 150_000, 8 * B)
    with HybridStore(cfg(tmp_path)) as store:
        store.put_kv_batch(tokens, batch_of(8, 5))            # the store's page layout
        before = store.stats()
        other = RNG.integers(0, 150_000, 8 * B)
        bad = [
            {"k": torch.randn(8, 2, B, 8), "v": torch.randn(7, 2, B, 4).to(torch.bfloat16)},  # rows
            {"k": torch.randn(8, 2, B, 8), "v": torch.randn(8, 2, B, 4)},                      # dtype
            {"k": torch.randn(8, 2, B, 8)},                                                   # entries
            {"k": torch.randn(8, 2, B, 16)[..., ::2],
             "v": torch.randn(8, 2, B, 4).to(torch.bfloat16)},                                # strided
        ]
        for batch in bad:
            with pytest.raises(LayoutMismatchError):
                store.put_kv_batch(other, batch)
        with pytest.raises(MisalignedPageError):
            store.put_kv_batch(other, batch_of(9, 6))           # more pages than blocks
        with pytest.raises(MisalignedPageError):
            store.put_kv_batch(other, batch_of(8, 6), count=0)
        assert store.stats()["pages"] == before["pages"]
        assert store.stats()["tiers"]["host"] == before["tiers"]["host"]
        assert store.tiers["host"]._pending == {}


def test_a_failed_copy_gives_every_reserved_slot_back(tmp_path, monkeypatch):
    import hybridstore.store.landing as S

    tokens = RNG.integers(0, 150_000, 12 * B)
    with HybridStore(cfg(tmp_path)) as store:
        pool = store.tiers["host"]
        store.put_kv_batch(tokens[: 4 * B], batch_of(4, 7))
        used, pages = pool.used_bytes, store.stats()["pages"]

        def boom(*args, **kw):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(S, "scatter_rows", boom)
        with pytest.raises(RuntimeError, match="copy failed"):
            store.put_kv_batch(tokens, batch_of(12, 7))
        assert pool.used_bytes == used and pool._pending == {}
        assert store.stats()["pages"] == pages and store.index.check_refcounts()
        monkeypatch.undo()
        assert store.put_kv_batch(tokens, batch_of(12, 7)) == 8


def test_under_pressure_runs_evict_older_prompts_and_the_newest_loads_exactly(tmp_path):
    with HybridStore(cfg(tmp_path, host_bytes=200 * 4096 + (1 << 20))) as store:
        for r in range(12):
            tokens = RNG.integers(0, 150_000, 40 * B)
            batch = batch_of(40, 100 + r)
            store.put_kv_batch(tokens, batch)
            assert store.put_state(tokens, state_of(r))
            assert store.index.check_refcounts()
        assert store.stats()["evictions"] > 0
        got, n = loaded(store, tokens)
        assert n == 40 and all(torch.equal(got[k], batch[k]) for k in batch)
        assert store.tiers["host"].used_bytes <= store.tiers["host"].capacity_bytes


def test_write_through_puts_the_rows_on_disk(tmp_path):
    tokens = RNG.integers(0, 150_000, 20 * B)
    batch = batch_of(20, 9)
    with HybridStore(cfg(tmp_path, disk_path=str(tmp_path / "ssd"))) as store:
        store.put_kv_batch(tokens, batch)
        store.put_state(tokens, state_of(9))
        store.flush()
        store.evict(store.tiers["host"].used_bytes, tier="host")   # the disk copies stay
        assert store.tiers["host"].used_bytes == 0
        got, n = loaded(store, tokens)
        assert n == 20 and all(torch.equal(got[k], batch[k]) for k in batch)


def test_a_numpy_batch_of_one_entry(tmp_path):
    tokens = RNG.integers(0, 150_000, 6 * B)
    batch = RNG.integers(0, 255, (6, 3000), dtype=np.uint8)
    with HybridStore(cfg(tmp_path)) as store:
        assert store.put_kv_batch(tokens, batch) == 6
        store.put_state(tokens, np.zeros(16, np.float32))
        plan = store.match(tokens)
        out = np.empty_like(batch)
        store.load(plan, into=(out, np.empty(16, np.float32))).result()
        store.release(plan)
        assert np.array_equal(out, batch)


# -- the pool and allocator halves ----------------------------------------------------
def test_pool_stage_many_is_all_or_nothing():
    pool = HostPool(1 << 20, pin=False, arena_bytes=1 << 18)
    keys = [bytes([1]) + i.to_bytes(16, "little") for i in range(300)]
    with pytest.raises(CapacityError):
        pool.stage_many(keys, 4096)                       # 300 x 4 KiB > 1 MiB
    assert pool.used_bytes == 0 and pool._pending == {}
    with pytest.raises(ValueError):
        pool.stage_many([keys[0], keys[0]], 64)
    arenas, which, offsets = pool.stage_many(keys[:10], 100)
    data = RNG.integers(0, 255, (10, 100), dtype=np.uint8)
    G.scatter_rows(arenas, which, offsets, np.arange(10, dtype=np.int64), 0, 100, data)
    with pytest.raises(ValueError):
        pool.stage_many(keys[5:12], 100)                  # 5..9 already reserved
    pool.commit_many(keys[:10])
    for i in range(10):
        assert np.array_equal(pool.view(keys[i]), data[i])
    pool.stage_many(keys[10:14], 100)
    pool.abort_many(keys[10:14] + [keys[99]])               # unreserved keys are skipped
    assert pool._pending == {} and pool.stats()["objects"] == 10
    pool.close()


def test_alloc_many_takes_all_or_nothing():
    a = SlabAllocator(budget_bytes=1 << 20, arena_bytes=1 << 18, alignment=4096)
    assert a.alloc_many(4096, 300) is None and a.used_bytes == 0
    got = a.alloc_many(4096, 200)
    assert got is not None and len({(e.arena, e.offset) for e in got}) == 200
    assert a.used_bytes == 200 * 4096
    for e in got:
        a.free(e)
    assert a.used_bytes == 0


# -- the scatter primitive -------------------------------------------------------------
@needs_native("gather")
def test_native_scatter_equals_its_numpy_twin():
    rng = np.random.default_rng(6)
    for _ in range(100):
        n, nbytes, entry = int(rng.integers(1, 30)), int(rng.integers(1, 48)), int(rng.integers(0, 16))
        src = rng.integers(0, 256, (n + 3, nbytes + int(rng.integers(0, 5))), dtype=np.uint8)
        # distinct, non-overlapping object places in three destinations
        size = entry + nbytes
        dests_a = [np.zeros(size * (n + 4), np.uint8) for _ in range(3)]
        which = rng.integers(0, 3, n).astype(np.int64)
        offsets = np.zeros(n, np.int64)
        for w in range(3):
            mine = np.flatnonzero(which == w)
            offsets[mine] = rng.permutation(n + 4)[: len(mine)] * size
        rows = rng.integers(0, n + 3, n).astype(np.int64)
        dests_b = [d.copy() for d in dests_a]
        with running("gather", native=True):
            G.scatter_rows(dests_a, which, offsets, rows, entry, nbytes, src)
        with running("gather", native=False):
            G.scatter_rows(dests_b, which, offsets, rows, entry, nbytes, src)
        assert all(np.array_equal(x, y) for x, y in zip(dests_a, dests_b))
        for w, o, r in zip(which, offsets, rows):
            assert np.array_equal(dests_a[w][o + entry:o + entry + nbytes], src[r, :nbytes])


def test_scatter_checks_bounds_before_copying(native):
    dst = [np.zeros(100, np.uint8)]
    src = np.full((4, 8), 9, np.uint8)
    one = np.zeros(1, np.int64)
    cases = [(np.array([1]), one, one), (one, np.array([95]), one), (one, one, np.array([4]))]
    for which, offsets, rows in cases:
        ok = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
        with pytest.raises(IndexError):
            G.scatter_rows(dst, np.concatenate([ok[0], which]).astype(np.int64),
                           np.concatenate([ok[1], offsets]).astype(np.int64),
                           np.concatenate([ok[2], rows]).astype(np.int64), 0, 8, src)
        assert not dst[0].any()                            # the valid first row was not copied
    with pytest.raises(ValueError):
        G.scatter_rows(dst, one, one, one, 0, 9, src)        # a row is only 8 bytes
    frozen = np.zeros(100, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, TypeError)):
        G.scatter_rows([frozen], one, one, one, 0, 8, src)   # destinations must be writable


def test_alloc_many_gives_the_run_back_when_mapping_an_arena_fails():
    calls = []

    def on_new_arena(arena_id: int, nbytes: int) -> None:
        calls.append(arena_id)
        if len(calls) == 2:
            raise OSError(12, "cannot map the arena")

    a = SlabAllocator(budget_bytes=4 << 20, arena_bytes=1 << 20, alignment=4096,
                      on_new_arena=on_new_arena)
    with pytest.raises(OSError):
        a.alloc_many(64 << 10, 40)                   # 40 x 64 KiB needs a second arena
    assert a.used_bytes == 0
    got = a.alloc_many(64 << 10, 8)
    assert got is not None and a.used_bytes == 8 * (64 << 10)


def test_pool_commit_many_commits_nothing_when_a_key_was_not_reserved():
    pool = HostPool(1 << 20, pin=False, arena_bytes=1 << 18)
    keys = [bytes([1]) + i.to_bytes(16, "little") for i in range(4)]
    pool.stage_many(keys[:3], 100)
    with pytest.raises(KeyError):
        pool.commit_many(keys)
    assert pool.stats()["objects"] == 0 and len(pool._pending) == 3
    pool.commit_many(keys[:3])
    assert pool.stats()["objects"] == 3 and pool._pending == {}
    pool.close()
