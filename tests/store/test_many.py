"""put_kv_many / load_many: one-page puts of unrelated prompts, their write-through as one
batch, and their pages loaded in one pass (straight into rows of one host array)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.errors import InvalidArgumentError, LayoutMismatchError

B = 16
PAGE = 64 << 10          # a 4 KiB multiple: the disk tier's slot is exactly the page


def cfg(tmp_path, **kw) -> StoreConfig:
    base = {"block_size": B, "host_bytes": 4 << 20, "disk_path": str(tmp_path / "ssd"),
            "disk_bytes": 64 << 20, "disk_segment_bytes": 8 << 20, "disk_engine": "posix"}
    base.update(kw)
    return StoreConfig(**base)


def chunks(n: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(32) for _ in range(n)]
    return keys, rng.integers(-128, 128, (n, PAGE), dtype=np.int8)


def test_put_kv_many_then_load_many_from_disk_is_bit_exact_and_read_in_place(tmp_path):
    keys, rows = chunks(24)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        assert store.put_kv_many(prompts, list(rows)) == 24
        assert store.put_kv_many(prompts[:4], list(rows[:4])) == 0     # held: touched only
        store.flush()
        disk = store.tiers["disk"]
        assert all(disk.contains(k) for k in _okeys(store, prompts))   # written through
        store.evict(store.tiers["host"].capacity_bytes, tier="host")  # only the SSD holds them
        reads_before = disk.stats()["reads"] if hasattr(disk, "stats") else None
        dst = np.zeros((30, PAGE), np.int8)
        order = [5, 0, 17, 3, 9, 23, 1]                 # any subset, any order, any rows
        plans = [store.match_pages(prompts[i]) for i in order]
        assert all(len(p.pages) == 1 for p in plans)
        out = store.load_many(plans, [dst[2 + j] for j in range(len(order))]).result()
        for plan in plans:
            store.release(plan)
        for j, i in enumerate(order):
            assert np.array_equal(dst[2 + j], rows[i])
            assert out[j] is not None
        assert not dst[:2].any() and not dst[2 + len(order):].any()   # nothing else written
        if reads_before is not None:
            assert disk.stats()["reads"] > reads_before


def _okeys(store: HybridStore, prompts) -> list[bytes]:
    from hybridstore.objects import ObjectKind, object_key

    return [object_key(ObjectKind.PAGE, p.keys[-1:].astype("<u8").tobytes()) for p in prompts]


def test_load_many_into_separate_buffers_and_from_the_pool(tmp_path):
    keys, rows = chunks(6, seed=3)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        store.put_kv_many(prompts, list(rows))
        plans = [store.match_pages(p) for p in prompts]
        bufs = [np.zeros(PAGE, np.int8) for _ in prompts]     # each its own array
        store.load_many(plans, bufs).result()
        for plan in plans:
            store.release(plan)
        assert all(np.array_equal(b, r) for b, r in zip(bufs, rows))


def test_deferred_write_through_survives_host_eviction_inside_the_batch(tmp_path):
    """A batch larger than the DRAM tier: pages landed early in the batch must stay held
    (as copies in flight) until their write-through starts, or they would be lost."""
    keys, rows = chunks(40, seed=5)            # 40 x 64 KiB = 2.5 MiB > the 1 MiB DRAM tier
    with HybridStore(cfg(tmp_path, host_bytes=1 << 20)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        assert store.put_kv_many(prompts, list(rows)) == 40
        store.flush()
        dst = np.zeros((40, PAGE), np.int8)
        plans = [store.match_pages(p) for p in prompts]
        assert all(len(p.pages) == 1 for p in plans)
        store.load_many(plans, list(dst)).result()
        for plan in plans:
            store.release(plan)
        assert np.array_equal(dst, rows)


def test_many_calls_check_their_arguments(tmp_path):
    keys, rows = chunks(2, seed=7)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        with pytest.raises(InvalidArgumentError):
            store.put_kv_many(prompts, [rows[0]])
        assert store.put_kv_many([], []) == 0
        store.put_kv_many(prompts, list(rows))
        plans = [store.match_pages(p) for p in prompts]
        with pytest.raises(LayoutMismatchError):
            store.load_many(plans, [rows[0].copy()])
        for plan in plans:
            store.release(plan)


def test_a_state_only_load_reads_in_place_into_the_callers_buffer(tmp_path):
    """``into=(None, buf)`` with every page skipped: the checkpoint lands in ``buf`` (read
    straight from the SSD, its slot larger than it), bit-exact, and is what load returns."""
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 1000, 4 * B)
    state = rng.integers(0, 255, (300 << 10) + 123, dtype=np.uint8)    # not a slot size
    with HybridStore(cfg(tmp_path, host_bytes=2 << 20)) as store:
        prompt = store.prefix(tokens)
        store.put_kv(prompt, [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(4)])
        assert store.put_state(prompt, state)
        store.flush()
        disk = store.tiers["disk"]
        assert disk.slot_bytes(state.nbytes) != state.nbytes
        store.evict(store.tiers["host"].capacity_bytes, tier="host")
        reads = disk.stats()["reads"]
        buf = np.full(state.nbytes + 4096, 7, np.uint8)        # more room than the state
        plan = store.match(prompt)
        pages, got = store.load(plan, into=(None, buf[:state.nbytes]),
                                skip_pages=len(plan.pages)).result()
        store.release(plan)
        assert disk.stats()["reads"] == reads + 1                     # the state alone
        assert all(p is None for p in pages)
        assert np.array_equal(buf[:state.nbytes], state) and (buf[state.nbytes:] == 7).all()
        assert np.shares_memory(np.asarray(got), buf)
        plan = store.match(prompt)
        with pytest.raises(LayoutMismatchError):                       # pages are read: need buffers
            store.load(plan, into=(None, buf[:state.nbytes]))
        store.release(plan)


def test_a_put_of_a_page_another_call_has_reserved_leaves_it_to_that_call(tmp_path):
    """put_kv_many copies outside the store lock: while its slots are reserved, a plain put
    of the same page (another engine thread) must neither fail nor store a second copy;
    the reserving call commits it, bit-exact."""
    from hybridstore.objects import ObjectKind
    from hybridstore.store import staged

    keys, rows = chunks(3, seed=5)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        layout = store._landing.layout(ObjectKind.PAGE, rows[0], "page", [])
        with store._lock:                  # put_kv_many's first step, as it runs it
            new = staged.stage(store._landing, store._staging, prompts[:2], layout.nbytes)
        assert len(new.keys) == 2
        assert store.put_kv(prompts[1], [rows[1]]) == 0     # reserved: left to put_kv_many
        assert store.put_kv(prompts[2], [rows[2]]) == 1
        for i, slot in zip(new.index, new.slots):
            layout.pack_into(rows[i], slot)
        with store._lock:
            assert staged.commit(store._landing, store._staging, new, prompts[:2]) == 2
        assert store.stats()["tiers"]["host"]["objects"] == 3
        for prompt, row in zip(prompts, rows):
            plan = store.match_pages(prompt)
            pages, _ = store.load(plan).result()
            store.release(plan)
            assert np.array_equal(np.asarray(pages[0]).view(np.int8).reshape(-1), row)
