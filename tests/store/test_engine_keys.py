"""The engine-keyed store API: pages and states named by an engine's chained page hashes
(SGLang's 64-hex SHA-256 chain, vLLM's block hash + group index), every restorable prefix,
page-range plans, and the chain resolved from the index."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridstore import HybridStore, StoreConfig
from hybridstore.errors import InvalidArgumentError, InvalidTokensError, UnknownPrefixError

B = 4


def sglang_chain(tokens: list[int], page: int = B, prior: str | None = None) -> list[str]:
    """SGLang's page hash chain (``mem_cache/utils.py:get_hash_str``): SHA-256 of the prior
    digest and the page's token ids as uint32 little-endian."""
    out = []
    for s in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        h.update(np.asarray(tokens[s:s + page], "<u4").tobytes())
        prior = h.hexdigest()
        out.append(prior)
    return out


def vllm_chain(tokens: list[int], group: int = 0) -> list[bytes]:
    """vLLM offload keys: a 32-byte chained block hash + 4-byte big-endian group index."""
    out, parent = [], b"\0" * 32
    for s in range(0, len(tokens) - len(tokens) % B, B):
        parent = hashlib.sha256(parent + np.asarray(tokens[s:s + B], "<u4").tobytes()).digest()
        out.append(parent + group.to_bytes(4, "big"))
    return out


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 64, dtype=np.uint8)


def state(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, 48, dtype=np.uint8)


@pytest.fixture
def store():
    with HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20)) as s:
        yield s


@pytest.mark.parametrize("chain", [sglang_chain, vllm_chain])
def test_pages_and_states_round_trip_by_engine_keys(store, chain):
    keys = chain(list(range(24)))
    prompt = store.engine_prefix(keys)
    assert prompt.nblocks == 6 and prompt.length == 24 and prompt.tokens is None
    assert store.put_kv(prompt, [page(i) for i in range(6)]) == 6
    assert store.put_state(store.engine_prefix(keys[:3]), state(3))      # keyed by page 3's hash
    assert store.put_state(prompt, state(6), position=24)
    plan = store.match(prompt)
    try:
        assert plan.position == 24
        pages, st_ = store.load(plan).result()
        assert all(np.array_equal(p, page(i)) for i, p in enumerate(pages))
        assert np.array_equal(st_, state(6))
    finally:
        store.release(plan)
    # the state keyed by page 3 answers a query that stops there
    plan = store.match(store.engine_prefix(keys[:4]), max_position=12)
    try:
        assert plan.position == 12
        assert np.array_equal(store.load(plan).result()[1], state(3))
    finally:
        store.release(plan)


def test_restorable_lists_every_complete_resume_point(store):
    keys = sglang_chain(list(range(40)))
    prompt = store.engine_prefix(keys)
    store.put_kv(prompt, [page(i) for i in range(10)])
    for n in (2, 5, 9):
        store.put_state(store.engine_prefix(keys[:n]), state(n))
    assert store.restorable(prompt) == [8, 20, 36]
    assert store.restorable(prompt, max_position=30) == [8, 20]
    assert store.present_pages(prompt) == 10
    # a page gone from every tier cuts every resume point past it
    plan = store.match(prompt)
    assert plan.position == 36
    store.release(plan)
    other = store.engine_prefix(sglang_chain(list(range(100, 140))))
    assert store.restorable(other) == [] and store.present_pages(other) == 0


def test_restorable_after_eviction_matches_what_is_held(tmp_path):
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20)
    with HybridStore(cfg) as s:
        keys = vllm_chain(list(range(32)))
        prompt = s.engine_prefix(keys)
        s.put_kv(prompt, [page(i) for i in range(8)])
        for n in (2, 4, 8):
            s.put_state(s.engine_prefix(keys[:n]), state(n))
        s.evict(1 << 30, tier="host")
        assert s.restorable(prompt) == [] and s.present_pages(prompt) == 0
        plan = s.match(prompt)
        assert plan.position == 0
        s.release(plan)


def test_prefix_none_resolves_the_chain_from_the_index(store):
    keys = sglang_chain(list(range(32)))
    full = store.engine_prefix(keys)
    store.put_kv(full, [page(i) for i in range(8)])
    tail = store.engine_prefix(keys[5:], prefix=None)
    assert tail.nblocks == 8 and np.array_equal(tail.keys, full.keys)
    assert store.engine_prefix(keys[5:], prefix=keys[:5]).keys.tobytes() == full.keys.tobytes()
    with pytest.raises(UnknownPrefixError, match="prefix"):
        store.engine_prefix(sglang_chain(list(range(50, 58))), prefix=None)
    assert store.stats()["pages"] == 8


def test_namespaces_never_share_engine_keyed_objects():
    keys = sglang_chain(list(range(16)))
    with HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, namespace="tp0")) as a, \
            HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, namespace="tp1")) as b:
        assert not np.array_equal(a.engine_prefix(keys).keys, b.engine_prefix(keys).keys)


def test_match_pages_pins_and_loads_a_page_range(store):
    keys = vllm_chain(list(range(32)))
    prompt = store.engine_prefix(keys)
    store.put_kv(prompt, [page(i) for i in range(8)])
    plan = store.match_pages(prompt, first=3, stop=6)
    try:
        assert (plan.first_page, len(plan.pages), plan.position, plan.state_key) == (3, 3, 24, None)
        assert plan.page_tokens == (B, B, B)
        pages, st_ = store.load(plan).result()
        assert st_ is None and [bytes(p) for p in pages] == [bytes(page(i)) for i in (3, 4, 5)]
        batch = np.zeros((3, 64), np.uint8)
        store.load(plan, into=(batch, None)).result()
        assert all(np.array_equal(batch[i], page(3 + i)) for i in range(3))
        # pinned pages survive eviction until released; the unpinned ones go
        store.evict(1 << 30, tier="host")
        assert store.present_pages(prompt) == 0
        pages, _ = store.load(plan).result()
        assert [bytes(p) for p in pages] == [bytes(page(i)) for i in (3, 4, 5)]
    finally:
        store.release(plan)
    # a range past the held run is clipped there
    store.put_kv(prompt, [page(i) for i in range(8)])
    longer = store.engine_prefix(keys + [b"not stored" + bytes(26)])
    plan = store.match_pages(longer, first=6)
    try:
        assert len(plan.pages) == 2 and plan.first_page == 6 and plan.position == 32
    finally:
        store.release(plan)


def test_engine_keys_survive_a_reopen(tmp_path):
    keys = sglang_chain(list(range(24)))
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"),
                      disk_bytes=16 << 20, tier_policy="write-through")
    with HybridStore(cfg) as s:
        s.put_kv(s.engine_prefix(keys), [page(i) for i in range(6)])
        s.put_state(s.engine_prefix(keys[:4]), state(4))
        s.put_state(s.engine_prefix(keys), state(6))
    with HybridStore(cfg) as s:
        prompt = s.engine_prefix(keys[2:], prefix=None)
        assert s.restorable(prompt) == [16, 24]
        plan = s.match(prompt)
        try:
            pages, st_ = s.load(plan).result()
            assert [bytes(p) for p in pages] == [bytes(page(i)) for i in range(6)]
            assert np.array_equal(st_, state(6))
        finally:
            s.release(plan)


def test_bad_engine_keys_are_typed_errors(store):
    with pytest.raises(InvalidTokensError):
        store.engine_prefix([b"ok", 7])
    with pytest.raises(InvalidTokensError):
        store.engine_prefix([b""])
    with pytest.raises(InvalidTokensError):
        store.engine_prefix([b"a", b"b"], length=3)
    with pytest.raises(InvalidTokensError):
        store.match_pages(store.engine_prefix([b"a"]), first=2, stop=1)
    assert store.stats()["pages"] == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=6, unique=True),
       st.integers(0, 10), st.integers(1, 10))
def test_restorable_agrees_with_match(state_pages, held, query):
    keys = vllm_chain(list(range(40)))
    with HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20)) as s:
        if held:
            s.put_kv(s.engine_prefix(keys[:held]), [page(i) for i in range(held)])
        for n in state_pages:
            if n <= held:
                s.put_state(s.engine_prefix(keys[:n]), state(n))
        prompt = s.engine_prefix(keys[:query])
        points = s.restorable(prompt)
        expect = sorted(n * B for n in state_pages if n <= min(held, query))
        assert points == expect
        plan = s.match(prompt)
        assert plan.position == (points[-1] if points else 0)
        s.release(plan)


@pytest.mark.parametrize("policy", ["lru", "histate", "hybridstore", "flashstates"])
def test_attention_only_eviction_takes_tails_first_and_keeps_heads(policy):
    """With no checkpoints every page is reclaimable; a put or a resume touches the whole
    path, and ties go deepest first, so what survives eviction is always a prefix from
    block 0 (evicting a head page would make every page after it useless)."""
    with HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, policy=policy)) as s:
        a = sglang_chain(list(range(40)))                   # 10 pages
        s.put_kv(s.engine_prefix(a[:6]), [page(i) for i in range(6)])
        plan = s.match_pages(s.engine_prefix(a))            # a later request resumes...
        s.release(plan)
        s.put_kv(s.engine_prefix(a[6:], prefix=a[:6]), [page(i) for i in range(6, 10)])  # ...extends
        b = sglang_chain(list(range(1000, 1040)))
        s.put_kv(s.engine_prefix(b), [page(i) for i in range(10)])
        held = []
        for _ in range(14):                                 # one page at a time
            assert s.evict(1, tier="host") > 0
            runs = [s.present_pages(s.engine_prefix(chain)) for chain in (a, b)]
            # every page still held is usable: it lies in a leading run from block 0
            assert sum(runs) == s.stats()["tiers"]["host"]["objects"]
            held.append(runs)
        assert held[-1] == [0, 6]                           # a (older) went first, tail first
        assert [r[0] for r in held[:10]] == list(range(9, -1, -1))


def test_load_skips_the_pages_the_engine_holds(tmp_path):
    """``skip_pages``: a state-only restore (SGLang's Mamba ``batch_get_v2``) and a resume
    after the engine's own prefix hit (vLLM) read only what is missing, from disk too."""
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"),
                      disk_bytes=16 << 20, tier_policy="write-through")
    keys = vllm_chain(list(range(24)))
    with HybridStore(cfg) as s:
        prompt = s.engine_prefix(keys)
        s.put_kv(prompt, [page(i) for i in range(6)])
        s.put_state(prompt, state(6))
        s.flush()
        s.evict(1 << 30, tier="host")
        plan = s.match(prompt)
        try:
            read0 = s.tiers["disk"].stats()["bytes_read"]
            pages, st_ = s.load(plan, skip_pages=6).result()
            assert pages == [None] * 6 and np.array_equal(st_, state(6))
            assert s.tiers["disk"].stats()["bytes_read"] - read0 == state(6).nbytes
            batch = np.zeros((6, 64), np.uint8)
            sbuf = np.zeros(48, np.uint8)
            s.load(plan, into=(batch, sbuf), skip_pages=4).result()
            assert not batch[:4].any()
            assert np.array_equal(batch[4], page(4)) and np.array_equal(batch[5], page(5))
            assert np.array_equal(sbuf, state(6))
            with pytest.raises(InvalidArgumentError):
                s.load(plan, skip_pages=7)
        finally:
            s.release(plan)
