"""write_kv_many: pages written from the caller's buffers straight to the disk tier.

The pinned pool is not filled, the caller's buffer is free once ``written`` completes,
the index holds a page once it is durable, and the bytes come back exactly (after a
reopen too).  A write that fails or finds no room is a miss, never an exception."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore
from hybridstore.errors import BackendIOError, InvalidArgumentError, UnknownTierError
from hybridstore.objects import aligned_empty
from tests.backends.test_engines import record_preadv
from tests.store.test_many import PAGE, cfg, chunks


def load_rows(store: HybridStore, prompts, n: int) -> np.ndarray:
    dst = np.zeros((n, PAGE), np.int8)
    plans = [store.match_pages(p) for p in prompts]
    assert [len(p.pages) for p in plans] == [1] * n
    try:
        store.load_many(plans, [dst[i] for i in range(n)]).result()
    finally:
        for plan in plans:
            store.release(plan)
    return dst


def test_pages_go_to_disk_only_and_come_back_bit_exact(tmp_path):
    keys, rows = chunks(20)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        put = store.write_kv_many(prompts, list(rows))
        assert put.new == list(range(20)) and not put.held and not put.refused
        for w in put.written:
            assert w.result() is None               # the rows may be reused from here on
        for d in put.durable:
            d.result()
        assert store.present_pages(prompts[3]) == 1  # indexed once durable
        assert store.tiers["host"].used_bytes == 0   # the pinned pool was not filled
        assert store.stats()["tiers"]["disk"]["writes"] == 20
        again = store.write_kv_many(prompts[:5], list(rows[:5]))
        assert again.held == list(range(5)) and not again.new     # held: touched only
        assert np.array_equal(load_rows(store, prompts, 20), rows)
    with HybridStore(cfg(tmp_path)) as store:          # a restart finds them
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        assert np.array_equal(load_rows(store, prompts, 20), rows)


def test_flush_indexes_every_direct_write(tmp_path):
    keys, rows = chunks(12, seed=1)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        store.write_kv_many(prompts, [rows[i] for i in range(12)])
        store.flush()
        assert store.stats()["pages"] == 12
        assert all(store.present_pages(p) == 1 for p in prompts)


def test_no_room_and_failed_writes_are_misses(tmp_path, monkeypatch):
    keys, rows = chunks(40, seed=2)
    # room for 16 pages: the rest are refused or evict others, none raises
    with HybridStore(cfg(tmp_path, disk_bytes=1 << 20, disk_segment_bytes=1 << 20)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        put = store.write_kv_many(prompts, list(rows))
        for d in put.durable:
            d.exception()
        store.flush()
        held = [i for i, p in enumerate(prompts) if store.present_pages(p)]
        assert 0 < len(held) <= 16
        assert np.array_equal(load_rows(store, [prompts[i] for i in held], len(held)),
                              rows[held])
    from hybridstore.backends.engines import posix

    def broken(self, file, piece, offset):
        raise BackendIOError("injected write failure")

    keys, rows = chunks(6, seed=3)
    with HybridStore(cfg(tmp_path / "b")) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        monkeypatch.setattr(posix.PosixEngine, "_write_in_place", broken)
        monkeypatch.setattr(posix.PosixEngine, "_write_bounced", broken)
        put = store.write_kv_many(prompts, list(rows))
        assert all(w.exception() is not None for w in put.written)
        store.flush()
        monkeypatch.undo()
        assert store.stats()["direct_write_failures"] == 6
        assert all(store.present_pages(p) == 0 for p in prompts)    # misses
        put = store.write_kv_many(prompts, list(rows))               # and may be stored again
        store.flush()
        assert np.array_equal(load_rows(store, prompts, 6), rows)


def test_bad_tiers_are_refused(tmp_path):
    keys, rows = chunks(2, seed=4)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        with pytest.raises(InvalidArgumentError):
            store.write_kv_many(prompts, list(rows), tier="host")
        with pytest.raises(UnknownTierError):
            store.write_kv_many(prompts, list(rows), tier="remote")
        with pytest.raises(InvalidArgumentError):
            store.write_kv_many(prompts, list(rows[:1]))


MIB = 1 << 20


@pytest.mark.parametrize(("io_chunk_bytes", "requests"), [
    (8 * MIB, [6 * MIB]),            # the run of neighbours is one request
    (2 * MIB, [2 * MIB] * 3),        # the fewest equal requests of at most io_chunk_bytes
    (4 * MIB, [3 * MIB] * 2),
])
def test_a_run_of_neighbours_is_read_in_requests_that_follow_it(tmp_path, monkeypatch,
                                                                io_chunk_bytes, requests):
    """Issue 26: a load of chunks written side by side (vLLM's tier: write_kv_many, then
    load_many into rows of one array) reads them with requests that follow the run, up
    to ``io_chunk_bytes`` each; before, every run was cut into 256 KiB preads whatever
    the run and the setting."""
    n = 6
    rng = np.random.default_rng(7)
    keys = [rng.bytes(32) for _ in range(n)]
    rows = rng.integers(-128, 128, (n, MIB), dtype=np.int8)
    config = cfg(tmp_path, disk_bytes=256 << 20, disk_segment_bytes=64 << 20,
                 io_chunk_bytes=io_chunk_bytes)
    with HybridStore(config) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        put = store.write_kv_many(prompts, list(rows))
        for d in put.durable:
            d.result()
        dst = aligned_empty(n * MIB).view(np.int8).reshape(n, MIB)  # page-aligned, as vLLM's
        plans = [store.match_pages(p) for p in prompts]
        sizes = record_preadv(monkeypatch)
        try:
            store.load_many(plans, [dst[i] for i in range(n)]).result()
        finally:
            for plan in plans:
                store.release(plan)
        assert np.array_equal(dst, rows)
        assert sorted(sizes) == requests
