"""The hybrid-state index: matching, token-level covers, refcounts (property tests)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridstore import _native
from hybridstore.errors import InvalidTokensError, PlanReleasedError
from hybridstore.index import keys as K
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import HybridIndex
from tests.twins import extension, needs_native

B = 4
KEY = K.HashKey(b"test-secret-0123456789", 64)
ROOT = KEY.root("test")


def P(tokens, block_size=B):
    return PrefixKeys.from_tokens(list(tokens), block_size=block_size, root=ROOT, hash_key=KEY)


def put_prompt(ix: HybridIndex, tokens, tier="host"):
    prompt = P(tokens)
    for k in range(prompt.nblocks):
        ix.add_page(prompt, k, tier, 64)
    return prompt


def test_append_resumes_at_previous_request_end():
    ix = HybridIndex(B, ROOT)
    turn1 = list(range(1, 11))                     # 10 tokens: blocks 0,1 full, block 2 partial
    put_prompt(ix, turn1)
    ix.add_checkpoint(P(turn1), 10, "host", 128)
    plan = ix.match(P(turn1 + [50, 51, 52]))
    assert plan.position == 10
    assert plan.page_tokens == (4, 4, 2)
    assert plan.recompute_tokens == 3
    assert ix.check_refcounts()
    ix.release(plan)
    assert ix.check_refcounts()


def test_truncation_inside_a_block_uses_a_checkpoint_linked_to_the_later_page():
    """A state captured mid-block (anchor), its block's page put afterwards."""
    ix = HybridIndex(B, ROOT)
    full = list(range(1, 13))
    prompt = P(full)
    ix.add_checkpoint(prompt, 6, "host", 128)        # inside block 1 (tokens 4..7)
    for k in range(prompt.nblocks):
        ix.add_page(prompt, k, "host", 64)
    mutated = full[:6] + [99, 98, 97, 96]             # edit right after the checkpoint
    plan = ix.match(P(mutated))
    assert plan.position == 6
    assert plan.page_keys[-1] == prompt.block_key(1)  # the whole page of block 1, first 2 tokens valid
    assert plan.page_tokens == (4, 2)
    ix.release(plan)


def test_checkpoint_put_with_its_continuation_links_the_existing_page():
    ix = HybridIndex(B, ROOT)
    full = list(range(1, 13))
    prompt = put_prompt(ix, full)
    ix.add_checkpoint(prompt, 7, "host", 128)         # position=7 of a 12-token prompt
    plan = ix.match(P(full[:7] + [5, 5]))
    assert plan.position == 7
    assert plan.page_keys[-1] == prompt.block_key(1)
    ix.release(plan)


def test_missing_page_or_state_falls_back_to_a_shallower_resume_point():
    ix = HybridIndex(B, ROOT)
    full = list(range(1, 17))
    prompt = put_prompt(ix, full)
    ix.add_checkpoint(prompt, 4, "host", 128)
    ix.add_checkpoint(prompt, 12, "host", 128)
    ix.add_checkpoint(prompt, 16, "host", 128)
    assert _pos(ix, full) == 16
    ix.drop_checkpoint_tier(prompt.key_at(16), "host")
    assert _pos(ix, full) == 12
    ix.drop_page_tier(ix.find_node(prompt.block_key(2)), "host")   # page of tokens 8..11
    assert _pos(ix, full) == 4
    assert ix.check_refcounts()


def test_block_id_prompts_match_at_block_ends_only():
    ix = HybridIndex(64, ROOT)
    ids = [11, 12, 13, 14]
    prompt = PrefixKeys.from_block_ids(ids, block_size=64, root=ROOT, hash_key=KEY,
                                     length=250)
    for k in range(prompt.nblocks):
        ix.add_page(prompt, k, "disk", 1)
    ix.add_checkpoint(prompt, 250, "disk", 1)
    ix.add_checkpoint(prompt, 128, "disk", 1)
    query = PrefixKeys.from_block_ids([11, 12, 13, 99], block_size=64, root=ROOT, hash_key=KEY,
                                    length=256)
    plan = ix.match(query)
    assert plan.position == 128
    with pytest.raises(InvalidTokensError):
        ix.add_checkpoint(prompt, 100, "disk", 1)
    ix.release(plan)
    with pytest.raises(PlanReleasedError):
        ix.release(plan)


def test_checkpoint_tree_and_exclusive_pages():
    """Trajectories (HiState Fig. 6): intermediate states, a terminal bundle."""
    ix = HybridIndex(B, ROOT)
    full = list(range(1, 25))
    prompt = put_prompt(ix, full)
    s1 = ix.add_checkpoint(prompt, 8, "host", 1)
    s3 = ix.add_checkpoint(prompt, 24, "host", 1)
    s2 = ix.add_checkpoint(prompt, 14, "host", 1)       # inserted between, inside block 3
    assert s2.parent is s1 and s3.parent is s2 and s1.parent is None
    assert s3.terminal and not s2.terminal
    assert list(ix.ancestors(s3)) == [s2, s1]
    # the terminal bundle: pages after s2's block that only s3 needs
    exclusive = ix.exclusive_pages(s3)
    assert sorted(ix.page_info(n)["block"] for n in exclusive) == [4, 5]
    ix.drop_checkpoint_tier(s2.key, "host")
    assert s3.parent is s1 and s1.children == [s3]


def test_namespaces_never_share_keys():
    a = PrefixKeys.from_tokens([1, 2, 3, 4], block_size=B, root=KEY.root("a"),
                              hash_key=KEY)
    b = PrefixKeys.from_tokens([1, 2, 3, 4], block_size=B, root=KEY.root("b"),
                              hash_key=KEY)
    assert a.block_key(0) != b.block_key(0)


def test_unreferenced_pages_are_forgotten_and_pinned_ones_are_not():
    ix = HybridIndex(B, ROOT)
    prompt = put_prompt(ix, range(1, 9))
    ix.add_checkpoint(prompt, 8, "host", 1)
    plan = ix.match(prompt)
    ix.drop_checkpoint_tier(prompt.key_at(8), "host")
    for k in (1, 0):
        ix.drop_page_tier(ix.find_node(prompt.block_key(k)), "host")
    assert ix.n_pages == 2          # pinned by the plan: still indexed
    ix.release(plan)
    assert ix.n_pages == 0
    assert ix.check_refcounts()


def _pos(ix, tokens):
    plan = ix.match(P(tokens))
    ix.release(plan)
    return plan.position


# ---------------------------------------------------------------------------------------
# Model-based property test
# ---------------------------------------------------------------------------------------
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=18)


class IndexMachine(RuleBasedStateMachine):
    """Random put/match/release/evict against a brute-force model of the same rules.

    The model keeps token prefixes (tuples) instead of hashes: a page is named
    by the prefix it ends, a checkpoint by the prefix it was taken after.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ix = HybridIndex(B, ROOT)
        self.pages: dict[tuple, bool] = {}
        self.ckpts: dict[tuple, set[tuple]] = {}
        self.plans: list = []
        self.prompts: dict[tuple, PrefixKeys] = {}

    def prompt(self, tokens) -> PrefixKeys:
        """One PrefixKeys per token sequence, reused across rules as an engine reuses a
        request's: its cached path must survive other prompts' evictions and id reuse."""
        key = tuple(tokens)
        if key not in self.prompts:
            self.prompts[key] = P(tokens)
        return self.prompts[key]

    # -- operations ----------------------------------------------------------------
    @rule(tokens=prompts, data=st.data())
    def put_page(self, tokens, data):
        prompt = self.prompt(tokens)
        k = data.draw(st.integers(0, prompt.nblocks - 1))
        self.ix.add_page(prompt, k, "host", 10)
        self.model_put(tokens, prompt, k)

    @rule(tokens=prompts, data=st.data())
    def put_run(self, tokens, data):
        """A run of pages in one call (the store's batched put)."""
        prompt = self.prompt(tokens)
        a = data.draw(st.integers(0, prompt.nblocks - 1))
        b = data.draw(st.integers(a + 1, prompt.nblocks))
        nids = self.ix.add_pages(prompt, a, b, "host", 10)
        assert len(nids) == b - a
        for k in range(a, b):
            self.model_put(tokens, prompt, k)

    def model_put(self, tokens, prompt, k):
        """The model's side of holding the page of block ``k``: it covers checkpoints
        inside its block that it begins with."""
        end = prompt.block_end(k)
        page = tuple(tokens[:end])
        self.pages[page] = True
        for c, covers in self.ckpts.items():
            if (len(c) - 1) // B == k and len(c) <= end and page[: len(c)] == c:
                covers.add(page)

    @rule(tokens=prompts, data=st.data())
    def put_state(self, tokens, data):
        p = data.draw(st.integers(1, len(tokens)))
        self.ix.add_checkpoint(self.prompt(tokens), p, "host", 10)
        c = tuple(tokens[:p])
        if c not in self.ckpts:
            k = (p - 1) // B
            end = min((k + 1) * B, len(tokens))
            self.ckpts[c] = {c} | ({tuple(tokens[:end])} if end > p else set())

    @rule(tokens=prompts, limit=st.none() | st.integers(0, 18))
    def match(self, tokens, limit):
        plan = self.ix.match(self.prompt(tokens), limit)
        assert plan.position == self.deepest(tuple(tokens), limit), (tokens, plan)
        if plan.position:
            c = tuple(tokens[: plan.position])
            assert c in self.ckpts                              # its checkpoint is held
            for key, n in zip(plan.page_keys, plan.page_tokens):
                nid = self.ix.find_node(key)
                assert nid >= 0 and self.ix.page_info(nid)["tiers"]   # every page is held
                assert self.ix.page_info(nid)["ntok"] >= n
            assert sum(plan.page_tokens) == plan.position
        self.plans.append(plan)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def release(self, data):
        plan = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        self.ix.release(plan)

    @precondition(lambda self: any(self.pages.values()))
    @rule(data=st.data())
    def evict_page(self, data):
        held = sorted(p for p, v in self.pages.items() if v)
        page = data.draw(st.sampled_from(held))
        nid = self.ix.find_node(P(page).block_key(P(page).nblocks - 1))
        self.ix.drop_page_tier(nid, "host")
        self.pages[page] = False

    @precondition(lambda self: any(self.pages.values()))
    @rule(data=st.data())
    def evict_pages(self, data):
        """Several pages dropped in one call (the store's batched eviction)."""
        held = sorted(p for p, v in self.pages.items() if v)
        pages = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=6, unique=True))
        nids = [self.ix.find_node(P(page).block_key(P(page).nblocks - 1)) for page in pages]
        self.ix.drop_pages_tier(np.asarray(nids, np.int64), "host")
        for page in pages:
            self.pages[page] = False

    @precondition(lambda self: self.ckpts)
    @rule(data=st.data())
    def evict_state(self, data):
        c = data.draw(st.sampled_from(sorted(self.ckpts)))
        self.ix.drop_checkpoint_tier(P(c).key_at(len(c)), "host")
        del self.ckpts[c]

    # -- model ---------------------------------------------------------------------
    def deepest(self, q: tuple, limit: int | None) -> int:
        best = 0
        top = len(q) if limit is None else min(limit, len(q))
        for c, covers in self.ckpts.items():
            p = len(c)
            if p > top or q[:p] != c:
                continue
            kc = (p - 1) // B
            if not all(self.pages.get(q[: (k + 1) * B]) for k in range(kc)):
                continue
            if any(self.pages.get(s) for s in covers):
                best = max(best, p)
        return best

    @invariant()
    def refcounts_equal_a_recount(self):
        assert self.ix.check_refcounts()

    @invariant()
    def checkpoint_tree_follows_prefixes(self):
        by_key = {P(c).key_at(len(c)): c for c in self.ckpts}
        assert set(by_key) == {ck.key for ck in self.ix.checkpoints()}
        for ck in self.ix.checkpoints():
            c = by_key[ck.key]
            if ck.parent is not None:
                parent = by_key[ck.parent.key]
                assert len(parent) < len(c) and c[: len(parent)] == parent
                assert ck in ck.parent.children
            for child in ck.children:
                assert child.parent is ck
            assert ck.terminal == (not ck.children)


    @invariant()
    def key_map_lists_the_live_nodes(self):
        live = self.ix.node_ids()
        assert len(self.ix._ids) == len(live) + 1                 # + the root
        found = np.empty(len(live), np.int64)
        self.ix._ids.get_many(self.ix._klo[live], found)
        assert np.array_equal(found, live)


class PythonTwinIndexMachine(IndexMachine):
    """The same machine on the Python twins of the index's walks and its key map."""

    def __init__(self) -> None:
        self._twins = _native.use_twins(only=("trie", "u64map"))
        self._twins.__enter__()
        super().__init__()

    def teardown(self) -> None:
        self._twins.__exit__(None, None, None)


_MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = _MACHINE_SETTINGS
TestPythonTwinIndexMachine = PythonTwinIndexMachine.TestCase
TestPythonTwinIndexMachine.settings = _MACHINE_SETTINGS


@needs_native("trie")
def test_native_walks_equal_their_python_twins():
    """collect / path in C against the Python loops, on random forests with random states."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        ix = HybridIndex(B, ROOT)
        for _ in range(int(rng.integers(1, 8))):
            toks = rng.integers(0, 3, int(rng.integers(1, 30))).tolist()
            prompt = P(toks)
            ix.add_pages(prompt, 0, prompt.nblocks, "host", 8)
        live = ix.node_ids()
        for nid in live.tolist():
            assert np.array_equal(ix._path(nid), ix._path_py(nid))
        ix._tiers[live[rng.random(len(live)) < 0.6]] = 0
        starts = rng.choice(live, size=min(len(live), 5), replace=False)
        twin = HybridIndex(B, ROOT)
        cols = ("_parent", "_tiers", "_deps", "_pins", "_nchild", "_block")
        for name in cols:
            setattr(twin, name, copy.copy(getattr(ix, name)))
        freed_native = np.frombuffer(extension("trie").collect(
            starts, ix._parent, ix._tiers, ix._deps, ix._pins, ix._nchild, ix._block), np.int64)
        freed_py = twin._collect_py(starts)
        assert sorted(freed_native.tolist()) == sorted(freed_py.tolist())
        for name in cols:
            assert np.array_equal(np.asarray(getattr(ix, name)), np.asarray(getattr(twin, name)))


def test_memory_per_cached_block_is_small():
    ix = HybridIndex(64, ROOT)
    rng = np.random.default_rng(0)
    for _ in range(20):
        prompt = PrefixKeys.from_tokens(rng.integers(0, 50_000, 64 * 500), block_size=64, root=ROOT,
                                         hash_key=KEY)
        for k in range(prompt.nblocks):
            ix.add_page(prompt, k, "host", 1)
    per_block = ix.memory_bytes() / ix.n_pages
    assert ix.n_pages == 10_000
    assert per_block < 400, per_block


def test_cached_path_survives_id_reuse():
    """A PrefixKeys kept across other prompts' evictions (as an engine keeps a request's):
    its cached node ids may be freed and handed to other pages; the index must notice."""
    ix = HybridIndex(B, ROOT)
    prompt = P(range(12))
    x = int(ix.add_pages(P([100, 101, 102, 103]), 0, 1, "host", 10)[0])
    a, b = ix.add_pages(prompt, 0, 2, "host", 10).tolist()
    ix.drop_pages_tier(np.array([a, b]), "host")                  # free list: b, a
    z = int(ix.add_pages(P([200, 201, 202, 203]), 0, 1, "host", 10)[0])   # takes a
    ix.drop_pages_tier(np.array([x]), "host")                     # free list: b, x
    fresh = ix.add_pages(P(range(12)), 0, 2, "host", 10).tolist()  # takes x, b
    assert ix.add_pages(prompt, 0, 2, "host", 10).tolist() == fresh
    ix.add_checkpoint(prompt, 10, "host", 10)
    assert ix.page_info(z)["deps"] == 0 and ix.check_refcounts()


def test_a_prompt_reused_on_a_new_index_at_a_freed_index_address():
    """Issue 26, item 7: path caches were keyed by ``id(index)``; a new index at the
    address of a freed one (a store closed, another opened) trusted the old index's node
    ids for a reused PrefixKeys and lost its pages silently."""
    prompt = P(range(12))
    for _ in range(100):
        old = HybridIndex(B, ROOT)
        old.add_pages(P([100, 101, 102, 103]), 0, 1, "host", 10)   # other ids than a new one's
        old.add_pages(prompt, 0, 3, "host", 10)
        address = id(old)
        del old
        ix = HybridIndex(B, ROOT)
        if id(ix) == address:
            break
    else:
        pytest.skip("no new index got a freed one's address")
    ix.add_pages(prompt, 0, 3, "host", 10)
    assert ix.held_run(prompt) == 3 and ix.n_pages == 3
    plan = ix.pin_pages(prompt, 0, 3)
    assert len(plan.pages) == 3 and ix.check_refcounts()
    ix.release(plan)
