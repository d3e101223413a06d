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


def _put(store: HybridStore, keys: list[bytes], rows) -> list:
    """One single-page prompt per key, its row put: the vLLM tier's chunks."""
    prompts = [store.engine_prefix([k], prefix=()) for k in keys]
    store.put_kv_many(prompts, list(rows))
    return prompts


def _okeys(store: HybridStore, prompts) -> list[bytes]:
    from hybridstore.objects import ObjectKind, object_key

    return [object_key(ObjectKind.PAGE, p.keys[-1:].astype("<u8").tobytes()) for p in prompts]


def test_load_many_into_separate_buffers_and_from_the_pool(tmp_path):
    keys, rows = chunks(6, seed=3)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = _put(store, keys, rows)
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


def test_load_rows_lands_each_page_in_its_row_from_disk_and_pool(tmp_path):
    """``load_rows``: pages from the SSD (read in place, neighbours together) and from the
    pinned pool land bit-exact in the rows asked for, on the calling thread; nothing else
    of the array is written."""
    keys, rows = chunks(24, seed=13)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        assert store.put_kv_many(prompts, list(rows)) == 24
        store.flush()
        store.evict(store.tiers["host"].capacity_bytes, tier="host")    # only the SSD
        disk = store.tiers["disk"]
        reads = disk.stats()["reads"]
        dst = np.zeros((40, PAGE), np.int8)
        order = [3, 4, 5, 6, 0, 17, 21, 23, 9]
        at = [10, 11, 12, 13, 39, 0, 25, 7, 30]
        plans = [store.match_pages(prompts[i]) for i in order]
        loads = store.stats()["loads"]
        assert store.load_rows(plans, dst, at) is None         # done when it returns
        for plan in plans:
            store.release(plan)
        for i, r in zip(order, at):
            assert np.array_equal(dst[r], rows[i])
        untouched = np.ones(len(dst), bool)
        untouched[at] = False
        assert not dst[untouched].any()
        assert disk.stats()["reads"] - reads == len(order)
        assert store.stats()["loads"] == loads + 1
        # the same from the pinned pool: copied out of its slots, nothing read
        more_keys, more = chunks(3, seed=29)
        fresh = _put(store, more_keys, more)
        reads = disk.stats()["reads"]
        plans = [store.match_pages(p) for p in fresh]
        store.load_rows(plans, dst, [1, 2, 3])
        for plan in plans:
            store.release(plan)
        assert np.array_equal(dst[1:4], more)
        assert disk.stats()["reads"] == reads


def test_load_rows_takes_a_torch_array_of_rows(tmp_path):
    torch = pytest.importorskip("torch")
    keys, rows = chunks(3, seed=17)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = [store.engine_prefix([k], prefix=()) for k in keys]
        store.put_kv_many(prompts, [torch.from_numpy(r) for r in rows])   # a torch layout
        store.flush()
        store.evict(store.tiers["host"].capacity_bytes, tier="host")
        plans = [store.match_pages(p) for p in prompts]
        dst = torch.zeros((4, PAGE), dtype=torch.int8)
        store.load_rows(plans, dst, [3, 1, 0])
        for plan in plans:
            store.release(plan)
        assert np.array_equal(dst.numpy()[[3, 1, 0]], rows)


def test_load_rows_checks_its_arguments_before_reading(tmp_path):
    from hybridstore.errors import PlanReleasedError

    keys, rows = chunks(2, seed=19)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = _put(store, keys, rows)
        plans = [store.match_pages(p) for p in prompts]
        dst = np.zeros((4, PAGE), np.int8)
        bad = [
            (InvalidArgumentError, (plans, dst, [0, 4])),                 # a row past the end
            (InvalidArgumentError, (plans, dst, [0, -1])),
            (InvalidArgumentError, (plans, dst, [0.0, 1.0])),             # not row numbers
            (InvalidArgumentError, (plans, dst, 3)),
            (LayoutMismatchError, (plans, dst, [0])),                     # one row for two pages
            (LayoutMismatchError, (plans, np.zeros((4, PAGE), np.int16), [0, 1])),   # dtype
            (LayoutMismatchError, (plans, np.zeros((4, PAGE // 2), np.int8), [0, 1])),
            (LayoutMismatchError, (plans, np.zeros((4, 2 * PAGE), np.int8)[:, ::2], [0, 1])),
            (InvalidArgumentError, (["not a plan"], dst, [0])),
        ]
        frozen = np.zeros((4, PAGE), np.int8)
        frozen.flags.writeable = False
        bad.append((LayoutMismatchError, (plans, frozen, [0, 1])))
        for error, call in bad:
            with pytest.raises(error):
                store.load_rows(*call)
            assert not dst.any()
        for plan in plans:                                   # the plans were not touched
            assert store.index.is_live(plan)
        store.load_rows(plans, dst, [2, 0])
        store.release(plans[0])
        with pytest.raises(PlanReleasedError):
            store.load_rows(plans, dst, [2, 0])
        store.release(plans[1])
        assert np.array_equal(dst[[2, 0]], rows)
        assert store.load_rows([], dst, []) is None


def test_load_rows_of_a_corrupt_page_raises_and_forgets_it(tmp_path):
    """A page whose bytes on the SSD changed fails its checksum: load_rows raises
    CorruptObjectError once every read has finished, the page is dropped (a new match
    no longer finds it), and the other pages' rows hold their bytes."""
    from hybridstore.errors import CorruptObjectError

    keys, rows = chunks(4, seed=23)
    with HybridStore(cfg(tmp_path)) as store:
        prompts = _put(store, keys, rows)
        store.flush()
        store.evict(store.tiers["host"].capacity_bytes, tier="host")
        disk = store.tiers["disk"]
        okey = _okeys(store, prompts[2:3])[0]
        rec = disk._objects[okey].record
        with open(disk._segment_path(rec.segment), "r+b") as f:
            f.seek(rec.offset + 100)
            f.write(b"\xff" * 8)
        plans = [store.match_pages(p) for p in prompts]
        dst = np.zeros((4, PAGE), np.int8)
        with pytest.raises(CorruptObjectError):
            store.load_rows(plans, dst, [0, 1, 2, 3])
        for plan in plans:
            store.release(plan)
        for i in (0, 1, 3):
            assert np.array_equal(dst[i], rows[i])
        assert not disk.contains(okey)
        assert len(store.match_pages(prompts[2]).pages) == 0
