"""store.load into one page-major batch: bytes, sources (pool, disk, mixed), skips, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridstore import HybridStore, LayoutMismatchError, StoreConfig
from hybridstore.backends import gather as G
from hybridstore.backends.host import HostPool
from tests.twins import native_or_twin, needs_native, running

native = native_or_twin("gather")

B = 16
RNG = np.random.default_rng(77)


def cfg(tmp_path, **kw) -> StoreConfig:
    base = dict(block_size=B, host_bytes=8 << 20, disk_path=str(tmp_path / "ssd"),
                disk_bytes=256 << 20, disk_segment_bytes=4 << 20, disk_engine="posix")
    base.update(kw)
    return StoreConfig(**base)


def page_of(seed: int) -> dict[str, torch.Tensor]:
    """A per-layer page: fp32 K, bf16 V (two entries of different dtypes and sizes)."""
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(2, B, 8, generator=g),
            "v": torch.randn(2, B, 4, generator=g).to(torch.bfloat16)}


def state_of(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ssm": torch.randn(4, 16, generator=g)}


def put_prompt(store: HybridStore, tokens: np.ndarray):
    prompt = store.prefix(tokens)
    pages = [page_of(k) for k in range(prompt.nblocks)]
    store.put_kv(prompt, pages)
    state = state_of(len(tokens))
    assert store.put_state(prompt, state)
    return pages, state


def empty_batch(n: int, fill: float = 0.0) -> dict[str, torch.Tensor]:
    return {"k": torch.full((n, 2, B, 8), fill), "v": torch.full((n, 2, B, 4), fill, dtype=torch.bfloat16)}


def assert_rows(batch, pages, rows) -> None:
    for i in rows:
        assert torch.equal(batch["k"][i], pages[i]["k"]) and torch.equal(batch["v"][i], pages[i]["v"])


def test_batch_equals_per_page_and_plain_loads_from_the_pool(tmp_path):
    tokens = RNG.integers(0, 150_000, 40 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        pages, state = put_prompt(store, tokens)
        plan = store.match(tokens)
        n = len(plan.page_keys)
        batch, sbuf = empty_batch(n + 3, fill=-7.0), {"ssm": torch.empty(4, 16)}
        got, got_state = store.load(plan, into=(batch, sbuf)).result()
        assert got is batch and got_state is sbuf
        assert_rows(batch, pages, range(n))
        assert torch.equal(sbuf["ssm"], state["ssm"])
        assert bool((batch["k"][n:] == -7.0).all())           # rows past the plan untouched
        plain, _ = store.load(plan).result()
        assert all(torch.equal(p["k"], batch["k"][i]) for i, p in enumerate(plain))
        store.release(plan)
        assert store.tiers["host"]._refs == {}                 # every slot hold was dropped


def put_half_in_dram(store: HybridStore, tokens: np.ndarray):
    """Put a prompt, write it to disk, then evict about half of its pages from DRAM."""
    pages, state = put_prompt(store, tokens)
    store.flush()
    store.evict(store.tiers["host"].used_bytes // 2, tier="host")
    return pages, state


def test_batch_from_disk_and_from_a_mix_of_tiers(tmp_path):
    tokens = RNG.integers(0, 150_000, 48 * B)
    with HybridStore(cfg(tmp_path)) as store:
        pages, state = put_half_in_dram(store, tokens)
        plan = store.match(tokens)
        n = len(plan.page_keys)
        assert plan.position == len(tokens)
        costs = store.restore_cost(plan)
        assert "disk" in costs and "host" in costs
        batch = empty_batch(n)
        store.load(plan, into=(batch, {"ssm": torch.empty(4, 16)})).result()
        assert_rows(batch, pages, range(n))
        store.release(plan)
        store.evict(1 << 40, tier="host")                     # everything from disk now
        plan = store.match(tokens)
        batch = empty_batch(n)
        _, st = store.load(plan, into=(batch, {"ssm": torch.empty(4, 16)})).result()
        assert_rows(batch, pages, range(n))
        assert torch.equal(st["ssm"], state["ssm"])
        store.release(plan)


def test_skipped_tier_leaves_its_rows_untouched(tmp_path):
    tokens = RNG.integers(0, 150_000, 20 * B)
    with HybridStore(cfg(tmp_path)) as store:
        pages, _ = put_half_in_dram(store, tokens)
        plan = store.match(tokens)
        n = len(plan.page_keys)
        in_host = [i for i, nid in enumerate(plan.page_ids)
                   if store.index.page_info(nid)["tiers"] & 2]
        assert 0 < len(in_host) < n
        batch = empty_batch(n, fill=3.0)
        store.load(plan, into=(batch, {"ssm": torch.empty(4, 16)}), skip_tiers=("host",)).result()
        for i in range(n):
            if i in in_host:
                assert bool((batch["k"][i] == 3.0).all())
            else:
                assert torch.equal(batch["k"][i], pages[i]["k"])
        store.release(plan)


def test_numpy_batch_of_a_single_tensor_layout(tmp_path):
    tokens = RNG.integers(0, 150_000, 6 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        prompt = store.prefix(tokens)
        pages = [np.arange(B * 6, dtype=np.float16).reshape(B, 6) + k for k in range(6)]
        store.put_kv(prompt, pages)
        store.put_state(prompt, np.full((3, 5), 9, dtype=np.int64))
        plan = store.match(tokens)
        batch = np.zeros((6, B, 6), np.float16)
        got, st = store.load(plan, into=(batch, np.zeros((3, 5), np.int64))).result()
        assert got is batch and all(np.array_equal(batch[k], pages[k]) for k in range(6))
        assert int(st.sum()) == 9 * 15
        store.release(plan)


@pytest.mark.parametrize("bad", [
    lambda n: empty_batch(n - 1),                                     # too few rows
    lambda n: {"k": torch.empty(n, 2, B, 8)},                         # an entry missing
    lambda n: {**empty_batch(n), "k": torch.empty(n, 2, B, 8, dtype=torch.float16)},   # dtype
    lambda n: {**empty_batch(n), "k": torch.empty(n, 2, B, 9)},       # shape
    lambda n: {**empty_batch(n), "k": torch.empty(2, B, 8, n).permute(3, 0, 1, 2)},   # layout
])
def test_bad_batches_are_refused_before_anything_is_read(tmp_path, bad):
    tokens = RNG.integers(0, 150_000, 8 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        put_prompt(store, tokens)
        plan = store.match(tokens)
        loads = store.stats()["loads"]
        with pytest.raises(LayoutMismatchError):
            store.load(plan, into=(bad(len(plan.page_keys)), {"ssm": torch.empty(4, 16)}))
        assert store.stats()["loads"] == loads and store.tiers["host"]._refs == {}
        store.release(plan)


# -- the gather primitive ------------------------------------------------------------
def _random_case(rng):
    sources = [rng.integers(0, 256, int(rng.integers(64, 4096)), dtype=np.uint8) for _ in range(3)]
    n = int(rng.integers(1, 40))
    nbytes = int(rng.integers(1, 48))
    entry = int(rng.integers(0, 16))
    which = rng.integers(0, 3, n).astype(np.int64)
    offsets = np.array([rng.integers(0, sources[w].nbytes - entry - nbytes + 1) for w in which],
                       np.int64)
    rows = rng.permutation(n + 5)[:n].astype(np.int64)
    return sources, which, offsets, rows, entry, nbytes


@needs_native("gather")
def test_native_gather_equals_its_numpy_twin():
    rng = np.random.default_rng(5)
    for _ in range(100):
        sources, which, offsets, rows, entry, nbytes = _random_case(rng)
        a = np.zeros((len(rows) + 5, nbytes + 3), np.uint8)
        b = a.copy()
        with running("gather", native=True):
            G.gather_rows(sources, which, offsets, rows, entry, nbytes, a)
        with running("gather", native=False):
            G.gather_rows(sources, which, offsets, rows, entry, nbytes, b)
        assert np.array_equal(a, b)
        for i, (w, o, r) in enumerate(zip(which, offsets, rows)):
            assert np.array_equal(a[r, :nbytes], sources[w][o + entry:o + entry + nbytes])


def test_gather_checks_bounds_before_copying(native):
    src = [np.arange(100, dtype=np.uint8)]
    dst = np.zeros((4, 8), np.uint8)
    one = np.zeros(1, np.int64)
    cases = [(np.array([1]), one, one), (one, np.array([95]), one), (one, one, np.array([4]))]
    for which, offsets, rows in cases:
        with pytest.raises(IndexError):
            G.gather_rows(src, which.astype(np.int64), offsets.astype(np.int64),
                          rows.astype(np.int64), 0, 8, dst)
        assert not dst.any()
    with pytest.raises(ValueError):
        G.gather_rows(src, one, one, one, 0, 9, dst)           # a row is only 8 bytes


def test_pool_pin_many_holds_nothing_when_a_key_is_missing():
    pool = HostPool(1 << 20, pin=False, arena_bytes=1 << 16)
    pool.put(b"a" * 17, np.arange(64, dtype=np.uint8), nbytes=64).result()
    with pytest.raises(KeyError):
        pool.pin_many([b"a" * 17, b"b" * 17])
    assert pool._refs == {}
    pool.pin_many([b"a" * 17])
    arenas, which, offsets = pool.locate([b"a" * 17])
    assert np.array_equal(arenas[which[0]][offsets[0]:offsets[0] + 64], np.arange(64, dtype=np.uint8))
    pool.unpin_many([b"a" * 17])
    assert pool._refs == {}
    pool.close()


def test_device_batch_path_copies_only_filled_rows(tmp_path):
    """The GPU branch of the batch gather (staged host rows, one copy per run of filled
    rows), driven with a CPU tensor standing in for device memory: rows of skipped pages
    (here: 1 and 4..5) must keep their bytes."""
    from hybridstore.layout import Target

    tokens = RNG.integers(0, 150_000, 8 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        pages, _ = put_prompt(store, tokens)
        plan = store.match(tokens)
        okeys = [bytes((1,)) + k for k in plan.page_keys]
        pool = store.tiers["host"]
        keep = [0, 2, 3, 6, 7]
        pool.pin_many([okeys[i] for i in keep])
        try:
            batch = empty_batch(8, fill=5.0)
            targets = [Target(t.spec, t.buffer, None)      # "device": no host view
                       for t in store._layouts[1].batch_targets(batch, 8)]
            rows = {"host": ([okeys[i] for i in keep], keep)}
            store._loader.gather_batch(rows, None, [], targets, 8)
        finally:
            pool.unpin_many([okeys[i] for i in keep])
        assert_rows(batch, pages, keep)
        for i in (1, 4, 5):
            assert bool((batch["k"][i] == 5.0).all()) and bool((batch["v"][i] == 5.0).all())
        store.release(plan)


def test_zero_dim_state_entries_load_into_buffers(tmp_path):
    """A state dict with a scalar entry (a step counter) restores into caller buffers."""
    tokens = RNG.integers(0, 150_000, 4 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        prompt = store.prefix(tokens)
        store.put_kv(prompt, [page_of(k) for k in range(4)])
        store.put_state(prompt, {"ssm": torch.ones(4, 16), "step": np.array(8)})
        plan = store.match(tokens)
        sbuf = {"ssm": torch.empty(4, 16), "step": np.array(0)}
        store.load(plan, into=(empty_batch(4), sbuf)).result()
        assert int(sbuf["step"]) == 8 and bool((sbuf["ssm"] == 1).all())
        store.release(plan)


def test_a_failed_load_drops_every_pool_hold(tmp_path):
    """The checkpoint vanished behind the index's back: load raises, and the page slots
    it had already held are released (no slot stays pinned forever)."""
    from hybridstore import CorruptObjectError
    from hybridstore.objects import ObjectKind, object_key

    tokens = RNG.integers(0, 150_000, 6 * B)
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        put_prompt(store, tokens)
        plan = store.match(tokens)
        pool = store.tiers["host"]
        pool.delete(object_key(ObjectKind.STATE, plan.state_key))
        with pytest.raises(CorruptObjectError):
            store.load(plan, into=(empty_batch(6), {"ssm": torch.empty(4, 16)})).result()
        assert pool._refs == {}
        store.release(plan)
