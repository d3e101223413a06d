"""The public API end to end: bytes through DRAM and disk, restarts, errors, threads."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from hybridstore import (
    CapacityError,
    InvalidArgumentError,
    ConfigError,
    DiskPathError,
    HybridStore,
    InvalidTokensError,
    LayoutMismatchError,
    MisalignedPageError,
    ObjectTooLargeError,
    PlanReleasedError,
    StoreClosedError,
    StoreConfig,
    UnknownTierError,
)

B = 16
RNG = np.random.default_rng(1234)
TOKENS = RNG.integers(0, 150_000, 400).astype(np.int64)


PAGE_BYTES = 2 * 2 * B * 4 * 8 * 2
"""Bytes of one page of :func:`page_of`."""


def page_of(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, B, 4, 8, generator=g).to(torch.bfloat16)


def state_of(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gdn.0": torch.randn(4, 16, 16, generator=g),
            "conv.0": torch.randint(-5, 5, (4, 3), generator=g, dtype=torch.int32)}


def cfg(tmp_path, **kw) -> StoreConfig:
    base = dict(block_size=B, host_bytes=8 << 20, disk_path=str(tmp_path / "ssd"),
                disk_bytes=256 << 20, disk_segment_bytes=4 << 20, disk_engine="posix")
    base.update(kw)
    return StoreConfig(**base)


def put_conversation(store: HybridStore, tokens, positions):
    """Pages of every block, a checkpoint at each position; returns the truth."""
    prompt = store.prefix(tokens)
    pages = [page_of(k) for k in range(prompt.nblocks)]
    store.put_kv(prompt, pages)
    states = {}
    for p in positions:
        states[p] = state_of(p)
        assert store.put_state(prompt, states[p], position=p)
    return pages, states


def assert_restored(store, query, pages, states, expect):
    plan = store.match(query)
    assert plan.position == expect
    got_pages, got_state = store.load(plan).result()
    assert len(got_pages) == -(-expect // B)
    for k, page in enumerate(got_pages):
        assert page.dtype == torch.bfloat16 and torch.equal(page, pages[k])
    assert set(got_state) == set(states[expect])
    for name, t in got_state.items():
        assert t.dtype == states[expect][name].dtype and torch.equal(t, states[expect][name])
    store.release(plan)


def test_round_trip_and_resume_of_a_mutated_prompt(tmp_path):
    with HybridStore(cfg(tmp_path)) as store:
        pages, states = put_conversation(store, TOKENS[:300], [100, 203, 300])
        assert_restored(store, TOKENS[:300], pages, states, 300)
        # truncation inside block 12 (tokens 192..207) right after the checkpoint at 203
        mutated = np.concatenate([TOKENS[:205], [1, 2, 3]])
        assert_restored(store, mutated, pages, states, 203)
        # an edit before every checkpoint but the first
        edited = TOKENS[:300].copy()
        edited[150] += 1
        assert_restored(store, edited, pages, states, 100)
        assert store.match(TOKENS[50:80]).position == 0


def test_numpy_pages_and_single_tensor_states(tmp_path):
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        prompt = store.prefix(TOKENS[:32])
        pages = [np.arange(B * 6, dtype=np.float16).reshape(B, 6) + k for k in range(2)]
        store.put_kv(prompt, pages)
        state = np.full((3, 5), 7, dtype=np.int64)
        store.put_state(prompt, state)
        plan = store.match(TOKENS[:40])
        got, st = store.load(plan).result()
        assert plan.position == 32 and isinstance(st, np.ndarray) and st.dtype == np.int64
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, pages))
        store.release(plan)


def test_everything_spills_to_disk_and_comes_back_bit_exact(tmp_path):
    config = cfg(tmp_path, host_bytes=1 << 20)           # far less than the data
    tokens = RNG.integers(0, 150_000, 6000)
    with HybridStore(config) as store:
        pages, states = put_conversation(store, tokens, [1000, 2011, 6000])
        store.flush()
        stats = store.stats()
        assert stats["evictions"] > 0
        assert stats["tiers"]["host"]["used_bytes"] <= config.host_bytes
        assert_restored(store, tokens, pages, states, 6000)
        assert store.stats()["loaded_bytes"]["disk"] > 0


def test_reopen_in_a_new_process_makes_the_disk_matchable(tmp_path):
    config = cfg(tmp_path)
    with HybridStore(config) as store:
        pages, states = put_conversation(store, TOKENS[:300], [100, 203, 300])
    torch.save({"pages": pages, "states": states}, tmp_path / "truth.pt")
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from hybridstore import HybridStore, StoreConfig
        cfg = StoreConfig(block_size={B}, host_bytes=8 << 20, disk_path={str(tmp_path / 'ssd')!r},
                          disk_bytes=256 << 20, disk_segment_bytes=4 << 20, disk_engine="posix")
        truth = torch.load({str(tmp_path / 'truth.pt')!r})
        tokens = np.array({TOKENS[:300].tolist()!r})
        query = np.concatenate([tokens[:205], [5, 5]])
        with HybridStore(cfg) as store:
            plan = store.match(query)
            pages, state = store.load(plan).result()
            assert plan.position == 203, plan
            assert all(torch.equal(p, truth["pages"][k]) for k, p in enumerate(pages))
            assert all(torch.equal(state[n], truth["states"][203][n]) for n in state)
            store.release(plan)
        print("REOPENED-OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REOPENED-OK" in out.stdout, out.stderr


def test_load_into_caller_buffers(tmp_path):
    with HybridStore(cfg(tmp_path)) as store:
        pages, states = put_conversation(store, TOKENS[:64], [64])
        plan = store.match(TOKENS[:64])
        bufs = [torch.empty_like(pages[0]) for _ in range(4)]
        sbuf = {n: torch.empty_like(t) for n, t in states[64].items()}
        got_pages, got_state = store.load(plan, into=(bufs, sbuf)).result()
        assert got_pages[0] is bufs[0] and got_state is sbuf
        assert all(torch.equal(bufs[k], pages[k]) for k in range(4))
        assert all(torch.equal(sbuf[n], states[64][n]) for n in sbuf)
        with pytest.raises(LayoutMismatchError):
            store.load(plan, into=([torch.empty(3)] * 4, sbuf))
        store.release(plan)


def test_write_back_writes_disk_only_on_eviction(tmp_path):
    config = cfg(tmp_path, tier_policy="write-back", host_bytes=1 << 20)
    tokens = RNG.integers(0, 150_000, 6000)
    with HybridStore(config) as store:
        pages, states = put_conversation(store, tokens, [6000])
        assert store.stats()["tiers"]["disk"]["objects"] > 0      # DRAM overflowed: written back
        assert_restored(store, tokens, pages, states, 6000)


def test_evict_and_refcounts(tmp_path):
    with HybridStore(cfg(tmp_path, disk_path=None)) as store:
        put_conversation(store, TOKENS[:128], [128])
        plan = store.match(TOKENS[:128])
        store.evict(1 << 30, tier="host")
        again = store.match(TOKENS[:128])
        assert again.position == 128                  # pinned: nothing the plan needs went
        store.release(again)
        store.release(plan)
        freed = store.evict(1 << 30, tier="host")
        assert freed > 0
        assert store.stats()["tiers"]["host"]["used_bytes"] == 0
        assert store.match(TOKENS[:128]).position == 0
        assert store.index.check_refcounts()
        with pytest.raises(UnknownTierError):
            store.evict(1, tier="tape")


class TestBadInputChangesNothing:
    def test_misaligned_page(self, tmp_path):
        with HybridStore(cfg(tmp_path)) as store:
            with pytest.raises(MisalignedPageError):
                store.put_kv_page(TOKENS[:40], page_of(0), end=20)
            with pytest.raises(MisalignedPageError):
                store.put_kv(TOKENS[:20], [page_of(0)] * 3)
            assert store.stats()["pages"] == 0

    def test_layout_mismatch(self, tmp_path):
        with HybridStore(cfg(tmp_path)) as store:
            pages, states = put_conversation(store, TOKENS[:32], [32])
            before = store.stats()["tiers"]["host"]["used_bytes"]
            with pytest.raises(LayoutMismatchError, match="bfloat16"):
                store.put_kv(TOKENS[:48], page_of(3).float())
            with pytest.raises(LayoutMismatchError):
                store.put_state(TOKENS[:48], {"gdn.0": torch.zeros(4, 16, 16)})
            assert store.stats()["tiers"]["host"]["used_bytes"] == before
            assert_restored(store, TOKENS[:32], pages, states, 32)

    def test_a_rejected_first_put_fixes_no_layout(self, tmp_path):
        """Issue 13, item 6: put_kv([good, bad]) on an empty store raised, yet fixed the page
        layout from the good page, so the store then rejected the layout the caller meant."""
        with HybridStore(cfg(tmp_path)) as store:
            with pytest.raises(LayoutMismatchError):
                store.put_kv(TOKENS[:32], [page_of(0), page_of(1).float()])
            assert store.stats()["pages"] == 0
            float_pages = [page_of(0).float(), page_of(1).float()]
            assert store.put_kv(TOKENS[:32], float_pages) == 2     # no layout was fixed

    def test_a_plan_of_another_store_or_a_copy_is_not_live_here(self, tmp_path):
        """Issue 13 fuzz: ``release(plan)`` with another store's plan of the same plan id
        released this store's plan (and ``load`` read its pins as "in no tier")."""
        with HybridStore(cfg(tmp_path, disk_path=None)) as a, \
                HybridStore(cfg(tmp_path, disk_path=None, namespace="b")) as b:
            pages, states = put_conversation(a, TOKENS[:32], [32])
            put_conversation(b, TOKENS[:48], [48])
            mine, theirs = a.match(TOKENS[:32]), b.match(TOKENS[:48])
            assert mine.plan_id == theirs.plan_id
            forged = dataclasses.replace(mine, position=16)
            for plan in (theirs, forged):
                with pytest.raises(PlanReleasedError):
                    a.release(plan)
                with pytest.raises(PlanReleasedError):
                    a.load(plan)
                with pytest.raises(PlanReleasedError):
                    a.restore_cost(plan)
            got, state = a.load(mine).result()               # still pinned, still whole
            assert all(torch.equal(x, y) for x, y in zip(got, pages))
            a.release(mine)
            b.release(theirs)
            assert a.index.check_refcounts() and b.index.check_refcounts()

    def test_a_sized_put_on_a_byte_store_is_refused_before_anything_changes(self, tmp_path):
        """Issue 13 fuzz: ``put_kv_sized`` on pages a byte store held changed their recorded
        size (loads then read the wrong bytes), and took any ``nbytes`` (TypeError)."""
        with HybridStore(cfg(tmp_path)) as store:
            pages, states = put_conversation(store, TOKENS[:32], [32])
            plan = store.match(TOKENS[:32])
            cost = store.restore_cost(plan)
            store.release(plan)
            for call in (lambda: store.put_kv_sized(TOKENS[:32], nbytes=8),
                         lambda: store.put_state_sized(TOKENS[:32], nbytes=8),
                         lambda: store.put_kv_sized(TOKENS[:32], nbytes="8"),
                         lambda: store.put_kv_sized(TOKENS[:32], nbytes=PAGE_BYTES,
                                                    first_block=None)):
                with pytest.raises(InvalidArgumentError):
                    call()
            plan = store.match(TOKENS[:32])
            assert store.restore_cost(plan) == cost
            store.release(plan)
            assert_restored(store, TOKENS[:32], pages, states, 32)

    def test_touching_held_pages_keeps_their_size(self):
        """An accounting store: a second sized put of held pages does not resize them."""
        from hybridstore.backends.accounting import AccountingTier

        tiers = {"host": AccountingTier("host", 1 << 20, read_gbps=64)}
        with HybridStore(StoreConfig(block_size=B), tiers=tiers) as store:
            store.put_kv_sized(TOKENS[:32], nbytes=100)
            store.put_kv_sized(TOKENS[:32], nbytes=300)
            store.put_state_sized(TOKENS[:32], nbytes=50)
            plan = store.match(TOKENS[:32])
            assert store.restore_cost(plan)["host"][0] == 2 * 100 + 50
            store.release(plan)

    def test_a_tensor_without_data_is_refused_before_a_layout_is_fixed(self, tmp_path):
        """Issue 13 fuzz: a meta-device state raised TypeError while being packed, after the
        empty store had fixed its state layout from it."""
        with HybridStore(cfg(tmp_path)) as store:
            for bad in (torch.empty(4, 16, 16, device="meta"), torch.ones(4, 16).to_sparse()):
                with pytest.raises(LayoutMismatchError):
                    store.put_state(TOKENS[:16], {"gdn.0": bad})
                with pytest.raises(LayoutMismatchError):
                    store.put_kv(TOKENS[:16], bad)
            pages, states = put_conversation(store, TOKENS[:32], [32])   # any layout still
            assert_restored(store, TOKENS[:32], pages, states, 32)

    def test_nul_byte_in_disk_path_is_a_config_error(self, tmp_path):
        with pytest.raises(ConfigError, match="NUL"):
            StoreConfig(disk_path=str(tmp_path) + "/a\0b")

    def test_object_larger_than_a_tier(self, tmp_path):
        with HybridStore(cfg(tmp_path, host_bytes=64 << 10)) as store:
            with pytest.raises(ObjectTooLargeError):
                store.put_state(TOKENS[:10], {"s": torch.zeros(1 << 20)})
            assert store.stats()["checkpoints"] == 0

    def test_bad_tokens_and_positions(self, tmp_path):
        with HybridStore(cfg(tmp_path)) as store:
            with pytest.raises(InvalidTokensError):
                store.match(np.array([1.5, 2.0]))
            with pytest.raises(InvalidTokensError):
                store.put_state(TOKENS[:10], state_of(1), position=11)

    def test_use_after_close(self, tmp_path):
        store = HybridStore(cfg(tmp_path))
        store.close()
        with pytest.raises(StoreClosedError):
            store.match(TOKENS[:10])
        with pytest.raises(StoreClosedError):
            store.put_kv(TOKENS[:16], page_of(0))

    def test_released_plan(self, tmp_path):
        with HybridStore(cfg(tmp_path)) as store:
            plan = store.match(TOKENS[:10])
            store.release(plan)
            with pytest.raises(PlanReleasedError):
                store.load(plan)


    @pytest.mark.parametrize("where", ["host", "host-batch", "disk", "load_many"])
    def test_a_plan_released_and_evicted_while_its_load_is_queued(self, tmp_path, where,
                                                                  monkeypatch):
        """The load fails with PlanReleasedError (match again), not a bare KeyError, and
        the store goes on: the prompt put again loads back bit-exact."""
        with HybridStore(cfg(tmp_path)) as store:
            tokens = TOKENS[:4 * B]
            pages = [page_of(k) for k in range(4)]
            store.put_kv(tokens, pages)
            if where == "disk":
                for _ in range(2):
                    store.evict(1 << 30, tier="host")
                    store.flush()
            gate = threading.Event()
            run = store._loader.run

            def queued(*args, **kw):           # the load's I/O starts once the gate opens
                assert gate.wait(30)
                return run(*args, **kw)

            monkeypatch.setattr(store._loader, "run", queued)
            try:
                plan = store.match_pages(tokens)
                assert len(plan.pages) == 4
                assert set(store.restore_cost(plan)) == {"disk" if where == "disk" else "host"}
                if where == "load_many":
                    fut = store.load_many([plan], [torch.empty_like(p) for p in pages])
                else:
                    batch = torch.empty(4, *pages[0].shape, dtype=pages[0].dtype)
                    fut = store.load(plan, (batch, None) if where == "host-batch" else None)
                store.release(plan)
                for _ in range(2):      # write-back: the first spills to disk, then drops
                    for tier in ("host", "disk"):
                        store.evict(1 << 30, tier=tier)
                        store.flush()
                assert store.present_pages(tokens) == 0, store.stats()["tiers"]
            finally:
                gate.set()
            with pytest.raises(PlanReleasedError, match="match again"):
                fut.result()
            store.put_kv(tokens, pages)
            plan = store.match_pages(tokens)
            got = store.load_many([plan], [torch.empty_like(p) for p in pages]).result()
            store.release(plan)
            assert all(torch.equal(g, p) for g, p in zip(got, pages))

    @pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
    def test_unwritable_disk_path_non_root(self, tmp_path):
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(DiskPathError):
            HybridStore(cfg(tmp_path, disk_path=str(ro / "x")))

    def test_disk_path_that_is_a_file(self, tmp_path):
        f = tmp_path / "file"
        f.write_bytes(b"x")
        with pytest.raises(DiskPathError):
            HybridStore(cfg(tmp_path, disk_path=str(f / "sub")))

    def test_everything_pinned_is_a_capacity_error(self, tmp_path):
        with HybridStore(cfg(tmp_path, disk_path=None, host_bytes=1 << 20)) as store:
            tokens = RNG.integers(0, 150_000, 16 * 20)
            pages = [np.full(64 << 10, k, np.uint8) for k in range(15)]
            store.put_kv(tokens[: 16 * 15], pages)
            store.put_state(tokens[: 16 * 15], np.ones(64 << 10, np.uint8))   # 16 slots: DRAM full
            plan = store.match(tokens)
            assert plan.position == 16 * 15
            with pytest.raises(CapacityError, match="pinned"):
                store.put_kv(tokens[: 16 * 16], np.zeros(64 << 10, np.uint8))
            got, state = store.load(plan).result()
            assert all(np.array_equal(a, b) for a, b in zip(got, pages)) and state.min() == 1
            store.release(plan)


def test_threads_put_match_load_concurrently(tmp_path):
    errors = []
    with HybridStore(cfg(tmp_path, host_bytes=2 << 20)) as store:
        def worker(w: int):
            try:
                rng = np.random.default_rng(w)
                base = rng.integers(0, 150_000, 160)
                for turn in range(6):
                    tokens = np.concatenate([base, rng.integers(0, 150_000, 16 * turn)])
                    prompt = store.prefix(tokens)
                    plan = store.match(prompt)
                    pages, state = store.load(plan).result()
                    for k, page in enumerate(pages):
                        assert torch.equal(page, page_of(int(prompt.keys[k, 0] % 100_000)))
                    store.release(plan)
                    store.put_kv(prompt, [page_of(int(prompt.keys[k, 0] % 100_000))
                                          for k in range(prompt.nblocks)])
                    store.put_state(prompt, state_of(len(tokens)))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert store.index.check_refcounts()


def test_asymmetric_tiering_keeps_the_terminal_state_in_dram(tmp_path):
    """HiState §3.1: historical checkpoints move to SSD, the terminal one stays in DRAM."""
    from hybridstore.index.trie import TIER_BITS

    with HybridStore(cfg(tmp_path, tier_policy="asymmetric")) as store:
        pages, states = put_conversation(store, TOKENS[:300], [100, 203, 300])
        where = {ck.position: ck.tiers for ck in store.index.checkpoints()}
        assert where[300] == TIER_BITS["host"]
        assert where[100] == where[203] == TIER_BITS["disk"]
        assert_restored(store, np.concatenate([TOKENS[:205], [1]]), pages, states, 203)
        cost = store.restore_cost(plan := store.match(TOKENS[:300]))
        store.release(plan)
        assert set(cost) == {"host"} and cost["host"][0] > 0


def test_static_partition_caps_states_at_half_of_dram(tmp_path):
    config = cfg(tmp_path, disk_path=None, tier_policy="partition", host_bytes=1 << 20)
    with HybridStore(config) as store:
        tokens = RNG.integers(0, 150_000, 16 * 100)
        prompt = store.prefix(tokens)
        store.put_kv(prompt, [page_of(k) for k in range(100)])
        for p in range(16, 16 * 100 + 1, 16):
            store.put_state(prompt, {"s": torch.full((16 << 10,), p % 256, dtype=torch.uint8)}, position=p)
            assert store._res.kind_bytes["host"][2] <= config.host_bytes // 2
        assert store.stats()["checkpoints"] < 100
        plan = store.match(tokens)
        _, state = store.load(plan).result()
        assert int(state["s"][0]) == plan.position % 256
        store.release(plan)


def test_load_skips_objects_resident_in_skipped_tiers(tmp_path):
    """``skip_tiers``: what an engine already holds is not read; the rest is, bit-exact."""
    from hybridstore.errors import UnknownTierError

    cfg = StoreConfig(block_size=16, host_bytes=8 << 20, disk_path=str(tmp_path / "d"),
                      disk_bytes=64 << 20)
    toks = np.arange(1, 65, dtype=np.int64)
    pages = [np.full(4096, i, np.uint8) for i in range(4)]
    state = np.arange(1000, dtype=np.float32)
    with HybridStore(cfg) as store:
        store.put_kv(toks, pages)
        store.put_state(toks, state)
        store.flush()
        plan = store.match(toks)
        try:
            got_pages, got_state = store.load(plan, skip_tiers=("host",)).result()
            assert got_pages == [None] * 4 and got_state is None
            with pytest.raises(UnknownTierError):
                store.load(plan, skip_tiers=("gpu",))
        finally:
            store.release(plan)
        store.evict(1 << 40, "host")            # now the fastest holder is the disk tier
        plan = store.match(toks)
        try:
            got_pages, got_state = store.load(plan, skip_tiers=("host",)).result()
            assert all(np.array_equal(g, p) for g, p in zip(got_pages, pages))
            assert np.array_equal(got_state, state)
        finally:
            store.release(plan)
