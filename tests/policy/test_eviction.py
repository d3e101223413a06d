"""Eviction policies: what every ranking must offer, and what each one is for."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.index.trie import TIER_BITS, HybridIndex
from hybridstore.objects import ObjectKind
from hybridstore.policy import (
    EVICTION_POLICIES,
    FlashStatesEviction,
    HiStateEviction,
    MarconiEviction,
    PrefillCost,
    eviction_policy,
)
from hybridstore.policy.units import units_of
from tests.policy.sessions import PAGE, STATE, Session

POLICIES = sorted(EVICTION_POLICIES)


def busy_store(policy: str, seed: int, *, host: int = 48 * STATE, disk: int = 96 * STATE) -> HybridStore:
    """Write-through DRAM + SSD under pressure: shared system prompt, forks, request ends
    inside blocks, resumes (hits) and evictions on both tiers."""
    rng = np.random.default_rng(seed)
    store = HybridStore(StoreConfig(block_size=16, policy=policy, tier_policy="write-through"),
                        tiers={"host": AccountingTier("host", host, read_gbps=64),
                               "disk": AccountingTier("disk", disk, read_gbps=5)})
    system = Session(store, "system")
    system.turn(0, 100)
    sessions = [system.fork(0, f"s{i}") for i in range(4)]
    for round_ in range(1, 9):
        for s in list(sessions):
            s.turn(round_, int(rng.integers(20, 400)))
            if rng.random() < 0.2:
                sessions.append(s.fork(int(rng.choice(list(s.ends))), f"{s.name}.{round_}"))
    assert store.stats()["evictions"] > 0
    return store


def held(index: HybridIndex, tier: str) -> set[tuple[ObjectKind, object]]:
    bit = TIER_BITS[tier]
    objs = {(ObjectKind.PAGE, int(n)) for n in index.page_table(tier)["ids"]}
    objs |= {(ObjectKind.STATE, ck.key) for ck in index.checkpoints() if ck.tiers & bit}
    return objs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [1, 2])
def test_victims_offer_each_held_object_exactly_once(policy, seed):
    store = busy_store(policy, seed)
    for tier in ("host", "disk"):
        offered = [(v.kind, v.ref) for v in store._eviction.victims(store.index, tier)]
        assert len(offered) == len(set(offered)), "an object was offered twice"
        assert set(offered) == held(store.index, tier)


@pytest.mark.parametrize("policy", POLICIES)
def test_evicting_through_the_store_keeps_the_index_consistent(policy):
    store = busy_store(policy, 3)
    for tier in ("host", "disk"):
        before = store.tiers[tier].used_bytes
        freed = store.evict(before // 2, tier)
        assert freed > 0 and store.tiers[tier].used_bytes == before - freed
        assert store.index.check_refcounts()
        assert set(v.ref for v in store._eviction.victims(store.index, tier)) <= \
            {ref for _, ref in held(store.index, tier)}


def stranded(policy: str) -> int:
    """Checkpoints kept without their KV, summed over a run of one-turn sessions under pressure."""
    store = HybridStore(StoreConfig(block_size=16, policy=policy),
                        tiers={"host": AccountingTier("host", 10 * STATE, read_gbps=64)})
    sessions = [Session(store, f"s{i}") for i in range(20)]
    count = 0
    for i, s in enumerate(sessions):
        s.turn(1, 200 + 37 * i)
        count += sum(1 for o in sessions[: i + 1] if o.has(1) and o.resume_if_forked_at(1) != o.ends[1])
    assert store.stats()["evictions"] > 0
    return count


def test_plain_lru_strands_checkpoints_without_their_kv():
    """Dependency misses (FlashStates): vLLM's per-object LRU drops the KV pages of a
    retained checkpoint (they are older than it), leaving the checkpoint unusable."""
    assert stranded("lru-vllm") > 0


@pytest.mark.parametrize("policy", ["lru", "lru-refresh", "histate", "flashstates", "marconi",
                                    "lru-radix"])
def test_dependency_aware_policies_never_strand_a_checkpoint(policy):
    assert stranded(policy) == 0


@pytest.mark.parametrize("policy", ["lru", "lru-refresh", "histate", "flashstates", "marconi"])
def test_orphan_pages_go_first_and_a_requests_pending_kv_last(policy):
    """Reclaimable pages older than the newest checkpoint can resume nothing: first.  Pages
    put after it are a request's KV whose checkpoint is still to come: last (offering
    them first is how a checkpoint lands without its KV)."""
    store = store_for(policy)
    ix = store.index
    orphan = store.prefix(np.arange(3_000_000, 3_000_064))       # 4 pages nothing needs
    store.put_kv_sized(orphan, nbytes=PAGE)
    Session(store, "done").turn(1, 300)                           # a checkpoint after them
    pending = store.prefix(np.arange(4_000_000, 4_000_160))      # 10 pages, no checkpoint yet
    store.put_kv_sized(pending, nbytes=PAGE)
    order = [v.ref for v in store._eviction.victims(ix, "host") if v.kind == ObjectKind.PAGE]
    assert len(order) == len(set(order)) == ix.n_pages
    assert set(order[:4]) == set(ix._walk_ids(orphan).tolist())
    assert set(order[-10:]) == set(ix._walk_ids(pending).tolist())


def chain(store: HybridStore) -> Session:
    """One session of four turns, the last resumed (hit) at its terminal state."""
    s = Session(store, "A")
    s.turn(1, 1000)
    s.turn(2, 200)
    s.turn(3, 200)
    s.turn(4, 37)                                   # resumes from S3, ends inside a block
    return s


def store_for(policy: str) -> HybridStore:
    return HybridStore(StoreConfig(block_size=16, policy=policy),
                       tiers={"host": AccountingTier("host", 1 << 30, read_gbps=64)})


@pytest.mark.parametrize("policy,refreshes", [("lru", False), ("lru-refresh", True), ("histate", True)])
def test_refresh_all_on_hit(policy, refreshes):
    store = store_for(policy)
    s = chain(store)
    hit = s.checkpoint(3)
    assert hit.hits == 1
    older = [s.checkpoint(1), s.checkpoint(2)]
    assert all(ck.atime == hit.atime for ck in older) == refreshes
    assert s.checkpoint(4).atime > hit.atime     # the new terminal was put after the hit


def test_histate_learns_how_often_resumes_hit_terminal_states():
    store = store_for("histate")
    q0 = store._eviction.terminal_prob
    chain(store)                                  # three resumes, each at the terminal state
    assert store._eviction.terminal_prob > q0
    s = Session(store, "B")
    s.turn(1, 500)
    s.turn(2, 500)
    q1 = store._eviction.terminal_prob
    store.match(store.prefix(np.concatenate([s.tokens[: s.ends[1]], [7, 7, 7]])))  # internal hit
    assert store._eviction.terminal_prob < q1


def test_histate_offers_a_terminal_bundle_as_state_then_its_last_kv_segment():
    store = store_for("histate")
    s = chain(store)
    policy = HiStateEviction(tau=1e9)            # cost dominates: the cheapest unit goes first
    victims = list(policy.victims(store.index, "host"))
    terminal = s.checkpoint(4)
    at = victims.index((ObjectKind.STATE, terminal.key))
    segment = store.index.exclusive_pages(terminal)
    assert segment and [v.ref for v in victims[at + 1: at + 1 + len(segment)]] == segment
    assert all(v.kind == ObjectKind.PAGE for v in victims[at + 1: at + 1 + len(segment)])


def test_histate_costs_follow_eq7_access_model():
    store = store_for("histate")
    s = chain(store)
    ix = store.index
    policy = HiStateEviction(tau=1.0, kv_bytes_per_token=PAGE / 16, terminal_prob=0.8)
    units = {u.ck.position: u for u in units_of(ix, "host")}
    ctx = policy.prepare(ix, "host", ix.page_table("host"), list(units.values()))
    p1, p2, p3, p4 = (s.ends[t] for t in (1, 2, 3, 4))
    q, internal = 0.8, 0.2 / (p4 - 1)
    assert policy.expected_recompute(s.checkpoint(4), ctx) == pytest.approx(q * (p4 - p3))
    assert policy.expected_recompute(s.checkpoint(2), ctx) == pytest.approx(internal * (p3 - p2) * (p2 - p1))
    assert policy.expected_recompute(s.checkpoint(1), ctx) == pytest.approx(internal * (p2 - p1) * p1)
    # eq. 7: H = t + tau * C / M, M in KV-token equivalents
    u = units[p2]
    assert policy.score(ix, u, ctx) == pytest.approx(
        u.ck.atime + policy.expected_recompute(u.ck, ctx) / (STATE / (PAGE / 16)))


def test_marconi_trades_recency_for_flop_efficiency():
    """A long, old prefix outranks a short, recent one once FLOP efficiency weighs enough."""
    def order(alpha: float) -> list[str]:
        store = store_for("lru")
        old, new = Session(store, "old"), Session(store, "new")
        old.turn(1, 8000)
        new.turn(1, 40)
        policy = MarconiEviction(alpha=alpha, flops=PrefillCost(per_token=1.0, per_context_token=1e-3))
        names = {old.checkpoint(1).key: "old", new.checkpoint(1).key: "new"}
        return [names[v.ref] for v in policy.victims(store.index, "host") if v.kind == ObjectKind.STATE]

    assert order(0.0) == ["old", "new"]          # recency only: LRU over units
    assert order(10.0) == ["new", "old"]


def test_flashstates_price_and_idle_decay():
    cost = PrefillCost(per_token=1.0, per_context_token=0.5)
    assert cost.between(0, 10) == pytest.approx(10 + 0.5 * 100 / 2)
    assert cost.between(0, 4) + cost.between(4, 10) == pytest.approx(cost.between(0, 10))
    store = store_for("lru")
    s = Session(store, "A")
    s.turn(1, 1000)
    policy = FlashStatesEviction(cost=cost, half_life=50.0)
    ix = store.index
    [unit] = [u for u in units_of(ix, "host") if u.ck.position == 1000]
    pages = ix.page_table("host")
    fresh = policy.score(ix, unit, policy.prepare(ix, "host", pages, [unit]))
    assert fresh == pytest.approx(cost.between(0, 1000) / unit.nbytes)
    for _ in range(50):                           # 50 ticks of other activity
        Session(store, "other").turn(1, 16)
    pages = ix.page_table("host")
    idle = policy.score(ix, unit, policy.prepare(ix, "host", pages, [unit]))
    assert idle == pytest.approx(fresh * 0.5 ** ((ix.now() - unit.ck.atime) / 50.0))
    assert idle < fresh / 2


def test_registry_builds_every_policy_with_parameters():
    assert eviction_policy("histate", tau=10.0).tau == 10.0
    assert not eviction_policy("lru-vllm").dependency_aware
    assert all(eviction_policy(n).dependency_aware for n in POLICIES if n != "lru-vllm")


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "lru"])
def test_victims_of_one_kind_keep_the_full_order(policy):
    """``kind=`` (the store's partitioned evictions) filters without reordering."""
    store = busy_store(policy, 4)
    # eq. 7 counts only the bytes of the partition asked for in M_x, so its order may
    # differ by kind (test_histate_prices_the_partition_it_frees): the same objects
    reorders = isinstance(store._eviction, HiStateEviction)
    for tier in ("host", "disk"):
        every = list(store._eviction.victims(store.index, tier))
        for kind in ObjectKind:
            got = list(store._eviction.victims(store.index, tier, kind=kind))
            if kind == ObjectKind.PAGE and store._eviction.states_free_pages:
                # the checkpoints whose eviction frees pages are named among them
                assert {v.ref for v in got if v.kind != kind} <= \
                    {v.ref for v in every if v.kind != kind}
                got = [v for v in got if v.kind == kind]
            want = [v for v in every if v.kind == kind]
            if reorders:
                assert len(got) == len(set(got)) and set(got) == set(want)
            else:
                assert got == want


def test_histate_prices_the_partition_it_frees():
    """Eq. 7 under split pools: for KV room ``M_x`` counts the unit's pages only.  A newer
    short bundle next to a 1,024-token-equivalent state goes before an older long one
    while the state's bytes count (one tier, or state room: C/M = q 40/1072 against
    q 2000/3024), and after it for KV room, where it frees only its few pages (q 40/48
    against q): recency decides there."""
    store = store_for("histate")
    old, new = Session(store, "old"), Session(store, "new")
    old.turn(1, 2000)
    new.turn(1, 40)
    gap = new.checkpoint(1).atime - old.checkpoint(1).atime
    assert gap > 0
    # q = 0.5: the cost terms differ by 0.31 tau (whole unit) and 0.08 tau (pages only)
    policy = HiStateEviction(tau=5.0 * gap, kv_bytes_per_token=PAGE / 16, terminal_prob=0.5)
    names = {old.checkpoint(1).key: "old", new.checkpoint(1).key: "new"}

    def order(kind):
        return [names[v.ref] for v in policy.victims(store.index, "host", kind)
                if v.kind == ObjectKind.STATE]

    assert order(None) == ["new", "old"]
    assert order(ObjectKind.STATE) == ["new", "old"]
    assert order(ObjectKind.PAGE) == ["old", "new"]
    [unit] = [u for u in units_of(store.index, "host") if u.ck.key == new.checkpoint(1).key]
    assert unit.freed(None) == unit.nbytes == unit.freed(ObjectKind.PAGE) + unit.freed(ObjectKind.STATE)
    assert unit.freed(ObjectKind.STATE) == STATE and unit.freed(ObjectKind.PAGE) == 3 * PAGE


def test_plain_lru_takes_a_prompts_tail_before_its_head():
    """vLLM's block pool frees a request's blocks in reverse: among pages used at the same
    time the deepest goes first (the head is what every later page needs)."""
    store = store_for("lru-vllm")
    prompt = store.prefix(np.arange(5_000_000, 5_000_200))
    store.put_kv_sized(prompt, nbytes=PAGE)
    order = [int(v.ref) for v in store._eviction.victims(store.index, "host", ObjectKind.PAGE)]
    assert order == store.index._walk_ids(prompt).tolist()[::-1]


def test_radix_lru_evicts_the_least_recently_used_leaf_with_its_state():
    """SGLang's KV eviction (``UnifiedRadixCache``, split pools): the least recently used
    leaf goes, its Mamba state with it, and no more than the allocation needs; the older
    session's inner state, its path and a newer session stay.  Plain LRU drops the leaf's
    KV and strands its state in the state pool."""
    from tests.policy.sessions import make_store

    for policy in ("lru-radix", "lru-vllm"):
        store = make_store(policy, state_slots=4)      # KV pool: 4 x 1024 tokens, 4 states
        a, b, c = Session(store, "A"), Session(store, "B"), Session(store, "C")
        a.turn(1, 1000)
        a.turn(2, 480)                                 # A's leaf: [1000, 1480), state S2
        b.turn(1, 1000)
        c.turn(1, 2000)                                # needs ~430 tokens of A's leaf
        if policy == "lru-vllm":
            assert a.has(2) and a.resume_if_appended() < a.ends[2]    # stranded
            continue
        assert not a.has(2) and a.has(1)
        assert a.resume_if_appended() == 1000          # S1 and its whole path stay
        assert b.resume_if_appended() == 1000 and c.resume_if_appended() == 2000
        # only the leaf's state and as many of its pages as the allocation needed
        assert store.stats()["evictions"] <= 1 + (480 // 16 + 1)


def test_vllm_running_state_order():
    """vLLM's align mode (``running_state``): of what one prompt stored, the KV past its last
    state goes first (vLLM never caches a partial last block), then the chunk-end state its
    prefill moved past (released at the next chunk), then its pages tail first, then its
    last state; plain LRU keeps the put order (pages, then states)."""
    from hybridstore.policy.lru_vllm import PlainLRUEviction

    for running in (True, False):
        store = HybridStore(StoreConfig(block_size=16), eviction=PlainLRUEviction(running_state=running),
                            tiers={"host": AccountingTier("host", 1 << 30, read_gbps=64)})
        prompt = store.prefix(np.arange(7_000_000, 7_000_200))     # 200 tokens, 13 pages
        store.put_kv_sized(prompt, nbytes=PAGE)
        for p in (64, 160):                                        # a chunk end, the last boundary
            store.put_state_sized(prompt, nbytes=STATE, position=p)
        other = store.prefix(np.arange(8_000_000, 8_000_040))      # a later prompt's put
        store.put_kv_sized(other, nbytes=PAGE)
        got = [(v.kind, v.ref if v.kind == ObjectKind.PAGE else store.index.checkpoint(v.ref).position)
               for v in store._eviction.victims(store.index, "host")]
        ids = store.index._walk_ids(prompt).tolist()
        pages = [(ObjectKind.PAGE, i) for i in ids[::-1]]
        states = [(ObjectKind.STATE, 64), (ObjectKind.STATE, 160)]
        mine = [g for g in got if g[0] == ObjectKind.STATE or g[1] in ids]
        if running:   # pages 10..12 (tokens 160-200) no state needs
            assert mine == pages[:3] + states[:1] + pages[3:] + states[1:]
        else:
            assert mine == pages + states


def test_vllm_offload_tier_order():
    """In an offloading tier (``offload_tiers``) ``running_state`` ranks as vLLM's CPU
    offloading LRU: what one request stored goes tail first, a state just before the KV
    block ending at it (KV no state needs first, as on the device); a state that a later
    request passed without using it keeps its older rank while the KV it shares moves on."""
    from hybridstore.policy.lru_vllm import PlainLRUEviction

    store = HybridStore(StoreConfig(block_size=16),
                        eviction=PlainLRUEviction(running_state=True, offload_tiers=("host",)),
                        tiers={"host": AccountingTier("host", 1 << 30, read_gbps=64)})
    toks = np.arange(7_000_000, 7_000_200)
    prompt = store.prefix(toks)                                    # 200 tokens, 13 pages
    store.put_kv_sized(prompt, nbytes=PAGE)
    for p in (64, 160):
        store.put_state_sized(prompt, nbytes=STATE, position=p)
    ids = store.index._walk_ids(prompt).tolist()

    def order() -> list[tuple[ObjectKind, int]]:
        got = [(v.kind, v.ref if v.kind == ObjectKind.PAGE
                else store.index.checkpoint(v.ref).position)
               for v in store._eviction.victims(store.index, "host")]
        return [g for g in got if g[0] == ObjectKind.STATE or g[1] in ids]

    page = {b: (ObjectKind.PAGE, ids[b]) for b in range(13)}
    s64, s160 = (ObjectKind.STATE, 64), (ObjectKind.STATE, 160)
    other = store.prefix(np.arange(8_000_000, 8_000_040))          # a later prompt's put
    store.put_kv_sized(other, nbytes=PAGE)
    assert order() == ([page[12], page[11], page[10], s160] + [page[b] for b in range(9, 3, -1)]
                       + [s64, page[3], page[2], page[1], page[0]])
    # a later prompt shares the first 128 tokens (pages 0-7) without using either state
    later = store.prefix(np.concatenate([toks[:128], np.arange(9_000_000, 9_000_072)]))
    store.put_kv_sized(later, nbytes=PAGE)
    assert order() == ([page[12], page[11], page[10], s160, page[9], page[8], s64]
                       + [page[b] for b in range(7, -1, -1)])
    # the GPU block pool's order is unchanged on a tier not named
    gpu = PlainLRUEviction(running_state=True)
    assert [v for v in gpu.victims(store.index, "host")] != \
        [v for v in store._eviction.victims(store.index, "host")]
