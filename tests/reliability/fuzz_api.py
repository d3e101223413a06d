"""Fuzz targets of the public API: every :class:`~hybridstore.HybridStore` call with hostile
and edge arguments, the engine-keyed API, :class:`~hybridstore.StoreConfig`, and a
stateful machine that mixes valid and invalid calls.

Rules checked on every call: an error derives from
:class:`~hybridstore.errors.HybridStoreError`; a rejected call changes nothing
(``stats()``, what ``restorable``/``present_pages`` answer, and the bytes loaded, bit-exact).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridstore import HybridStore, StoreConfig
from hybridstore.errors import HybridStoreError
from tests.reliability.fuzz_tally import Tally
from tests.reliability.fuzz_values import (
    FLOATS,
    INTS,
    hostile,
    np_arrays,
    scalars,
    tensors,
    token_like,
)

B = 16
PAGE = 256            # bytes of one page (uint8), the layout of the shared store
STATE = 100


def page_of(tokens: np.ndarray, k: int) -> np.ndarray:
    """The page of block ``k``: a function of the tokens up to its end (bytes are checkable)."""
    seed = hashlib.blake2b(np.asarray(tokens[:(k + 1) * B], "<i8").tobytes(),
                           digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).integers(0, 256, PAGE, np.uint8)


def state_of(tokens: np.ndarray) -> np.ndarray:
    seed = hashlib.blake2b(np.asarray(tokens, "<i8").tobytes() + b"s", digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).integers(0, 256, STATE, np.uint8)


PROMPTS = [np.arange(4 * B, dtype=np.int64),
           np.concatenate([np.arange(4 * B), np.arange(1000, 1000 + 2 * B)]).astype(np.int64),
           np.arange(5000, 5000 + 3 * B + 5, dtype=np.int64)]
"""Prompts the shared store holds (a page of every block, the state at the end); their bytes
are checked.  Calls that may legitimately store something write :data:`W` instead."""
W = np.arange(7000, 7000 + 3 * B + 5, dtype=np.int64)


def put_prompt(store: HybridStore, tokens: np.ndarray) -> None:
    store.put_kv(tokens, [page_of(tokens, k) for k in range(-(-len(tokens) // B))])
    store.put_state(tokens, state_of(tokens))


def snapshot(store: HybridStore, prompts: list[Any]) -> tuple[Any, ...]:
    """What a rejected call must leave unchanged: counters, tiers, and every answer."""
    store.flush()
    stats = store.stats()
    stats.pop("native", None)
    layouts = repr(store._layouts)                     # a rejected first put fixes none
    return (repr(stats), layouts, tuple(tuple(store.restorable(p)) for p in prompts),
            tuple(store.present_pages(p) for p in prompts))


def verify_bytes(store: HybridStore, tokens: np.ndarray, others: list[np.ndarray] = ()
                 ) -> str | None:
    """Load ``tokens``'s plan and compare with the pages and state it was put with.

    The last page of a plan that ends inside a block may be the page of any prompt put
    (``others``) that shares the tokens up to the plan's position (it covers the position).
    """
    plan = store.match(tokens)
    try:
        if not plan.position:
            return None
        pages, state = store.load(plan).result()
        for k, got in enumerate(pages):
            end = min((k + 1) * B, plan.position)
            if not any(np.array_equal(got, page_of(p, k)) for p in [tokens, *others]
                       if len(p) >= end and np.array_equal(p[:end], tokens[:end])):
                return f"page {k} of a {len(tokens)}-token prompt came back different"
        if not np.array_equal(state, state_of(tokens[:plan.position])):
            return f"the state at {plan.position} came back different"
        return None
    finally:
        store.release(plan)


# -- the shared world of the stateless targets ----------------------------------------
class World:
    """A populated store with disk tier, a closed store, and plans of every kind."""

    def __init__(self, root: str) -> None:
        self.root = root
        cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=os.path.join(root, "a"),
                          disk_bytes=16 << 20, disk_segment_bytes=1 << 20, disk_engine="posix",
                          io_threads=2)
        self.a = HybridStore(cfg)
        for p in PROMPTS:
            put_prompt(self.a, p)
        self.a.flush()
        self.other = HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20))
        self.tenant = HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, namespace="t2"))
        for s in (self.other, self.tenant):
            put_prompt(s, PROMPTS[0])
        self.closed = HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20))
        put_prompt(self.closed, PROMPTS[0])
        closed_plan = self.closed.match(PROMPTS[0])
        self.closed.release(closed_plan)
        self.closed.close()
        self.plan = self.a.match(PROMPTS[0])            # live for the whole campaign
        released = self.a.match(PROMPTS[1])
        self.a.release(released)
        self.foreign = [self.other.match(PROMPTS[0]), self.tenant.match(PROMPTS[0])]
        self.plans: list[Any] = [self.plan, released, closed_plan, *self.foreign,
                                 dataclasses.replace(self.plan, position=10**9),
                                 dataclasses.replace(self.plan, plan_id=10**6),
                                 dataclasses.replace(self.plan, page_blob=b"\0" * 48)]
        self.prefixes = [self.tenant.prefix(PROMPTS[0]), self.other.prefix(PROMPTS[0]),
                         self.a.prefix(PROMPTS[2]),
                         self.a.prefix_from_block_ids([1, 2, 3], length=40),
                         self.tenant.engine_prefix(["ab" * 32])]
        self.calls = api_calls(self)

    def close(self) -> None:
        for s in (self.a, self.other, self.tenant):
            s.close()


def _pages_like() -> st.SearchStrategy[Any]:
    good = st.sampled_from([np.zeros(PAGE, np.uint8), np.ones(PAGE, np.uint8)])
    near = st.one_of(np_arrays(["uint8", "int8", "bool", "V1", "S1", "float32"], max_side=PAGE),
                     st.sampled_from([np.zeros(PAGE, np.int8), np.zeros((1, PAGE), np.uint8),
                                      np.zeros(PAGE + 1, np.uint8), np.zeros(2 * PAGE, np.uint8)[::2],
                                      torch.zeros(PAGE, dtype=torch.uint8),
                                      {"": np.zeros(PAGE, np.uint8)}, np.zeros(0, np.uint8)]))
    one = st.one_of(good, near, hostile(3))
    return st.one_of(one, st.lists(one, max_size=5), st.lists(one, max_size=5).map(tuple))


def _states_like() -> st.SearchStrategy[Any]:
    near = st.one_of(np_arrays(["uint8", "float32", "V4", [("a", "<i4"), ("b", "<f2")]],
                               max_side=STATE),
                     st.sampled_from([np.zeros(STATE, np.uint8), np.zeros(STATE, np.int8),
                                      torch.zeros(STATE, dtype=torch.uint8)]),
                     tensors())
    return st.one_of(near, st.dictionaries(st.one_of(st.text(max_size=3), st.integers(), st.none()),
                                           near, max_size=3), hostile(3))


def _into_like(world: World) -> st.SearchStrategy[Any]:
    n = len(world.plan.pages)
    pages = st.one_of(
        st.just([np.empty(PAGE, np.uint8) for _ in range(n)]),
        st.just(np.empty((n, PAGE), np.uint8)),
        st.just(torch.empty((n, PAGE), dtype=torch.uint8)),
        st.integers(0, 6).map(lambda m: np.empty((m, PAGE), np.uint8)),
        st.integers(0, 6).map(lambda m: [np.empty(PAGE, np.uint8)] * m),
        np_arrays(max_side=8), tensors(), hostile(3))
    state = st.one_of(st.just(np.empty(STATE, np.uint8)), np_arrays(max_side=STATE), hostile(2))
    return st.one_of(st.tuples(pages, state), st.tuples(pages, state).map(list),
                     st.tuples(pages, state, state), hostile(3))


def _tiers_like() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(["host", "disk", "device", "HOST", "", "host\0"]),
                     st.lists(st.sampled_from(["host", "disk", "device", "nvme", 1]), max_size=3),
                     hostile(2))


def _tokens_like(world: World) -> st.SearchStrategy[Any]:
    return st.one_of(token_like(), st.sampled_from(world.prefixes), hostile(3),
                     st.sampled_from(PROMPTS).map(lambda p: p.tolist()))


Call = Callable[[HybridStore, World, Any], Any]


def _release_after(store: HybridStore, plan: Any) -> Any:
    store.release(plan)
    return plan


def api_calls(w: World) -> dict[str, tuple[Call, st.SearchStrategy[Any]]]:
    """Every public call, each with the argument it fuzzes and that argument's strategy."""
    T = PROMPTS[0]
    toks, ints, plans = _tokens_like(w), st.one_of(INTS, hostile(2)), \
        st.one_of(st.sampled_from(w.plans), hostile(2))
    opt_ints = st.one_of(st.none(), ints)
    return {
        "put_kv.tokens": (lambda s, w, v: s.put_kv(v, [np.zeros(PAGE, np.uint8)]),
                          st.one_of(token_like(), hostile(3), st.sampled_from(w.prefixes[:2]))),
        "put_kv.pages": (lambda s, w, v: s.put_kv(W[:3 * B], v), _pages_like()),
        "put_kv_batch.batch": (lambda s, w, v: s.put_kv_batch(W[:3 * B], v),
                               st.one_of(_pages_like(),
                                         st.integers(0, 5).map(lambda m: np.zeros((m, PAGE), np.uint8)))),
        "put_kv_batch.count": (lambda s, w, v: s.put_kv_batch(W[:3 * B],
                                                              np.zeros((3, PAGE), np.uint8), count=v),
                               opt_ints),
        "put_kv_page.end": (lambda s, w, v: s.put_kv_page(W, np.zeros(PAGE, np.uint8), end=v),
                            ints),
        "put_kv_sized.nbytes": (lambda s, w, v: s.put_kv_sized(W, nbytes=v), ints),
        "put_kv_sized.first_block": (lambda s, w, v: s.put_kv_sized(W, nbytes=PAGE, first_block=v),
                                     ints),
        "put_state.state": (lambda s, w, v: s.put_state(W[:2 * B + 3], v), _states_like()),
        "put_state.position": (lambda s, w, v: s.put_state(W, np.zeros(STATE, np.uint8),
                                                           position=v), opt_ints),
        "put_state_sized.nbytes": (lambda s, w, v: s.put_state_sized(W, nbytes=v), ints),
        "match.tokens": (lambda s, w, v: _release_after(s, s.match(v)), toks),
        "match.max_position": (lambda s, w, v: _release_after(s, s.match(T, max_position=v)),
                               opt_ints),
        "match_pages.first": (lambda s, w, v: _release_after(s, s.match_pages(T, first=v)), ints),
        "match_pages.stop": (lambda s, w, v: _release_after(s, s.match_pages(T, stop=v)), opt_ints),
        "match_pages.tokens": (lambda s, w, v: _release_after(s, s.match_pages(v)), toks),
        "restorable.tokens": (lambda s, w, v: s.restorable(v), toks),
        "restorable.max_position": (lambda s, w, v: s.restorable(T, max_position=v), opt_ints),
        "present_pages": (lambda s, w, v: s.present_pages(v), toks),
        "expect.tokens": (lambda s, w, v: s.expect(v), toks),
        "expect.max_position": (lambda s, w, v: s.expect(T, max_position=v), opt_ints),
        "expect.in_s": (lambda s, w, v: s.expect(T, in_s=v),
                        st.one_of(st.floats(allow_nan=True, allow_infinity=True), ints)),
        "finished.tokens": (lambda s, w, v: s.finished(v), toks),
        "finished.in_s": (lambda s, w, v: s.finished(T, in_s=v),
                          st.one_of(st.floats(allow_nan=True, allow_infinity=True), ints)),
        "prefix": (lambda s, w, v: s.prefix(v), toks),
        "prefix_from_block_ids": (lambda s, w, v: s.prefix_from_block_ids(v),
                                  st.one_of(st.lists(INTS, max_size=5), token_like(), hostile(3))),
        "prefix_from_block_ids.length": (lambda s, w, v: s.prefix_from_block_ids([1, 2], length=v),
                                         opt_ints),
        "load.plan": (lambda s, w, v: s.load(v).result(), plans),
        "load.into": (lambda s, w, v: s.load(w.plan, into=v).result(), _into_like(w)),
        "load.skip_tiers": (lambda s, w, v: s.load(w.plan, skip_tiers=v).result(), _tiers_like()),
        "load.skip_pages": (lambda s, w, v: s.load(w.plan, skip_pages=v).result(), ints),
        "release": (lambda s, w, v: s.release(v), plans),
        "restore_cost": (lambda s, w, v: s.restore_cost(v), plans),
        "evict.nbytes": (lambda s, w, v: s.evict(v), ints),
        "evict.tier": (lambda s, w, v: s.evict(1, tier=v), _tiers_like()),
        "checkpoint_positions.cached": (lambda s, w, v: s.checkpoint_positions(cached=v, length=100),
                                        ints),
        "checkpoint_positions.length": (lambda s, w, v: s.checkpoint_positions(cached=0, length=v),
                                        ints),
        "checkpoint_positions.anchors": (
            lambda s, w, v: s.checkpoint_positions(cached=0, length=100, anchors=v),
            st.one_of(st.lists(INTS, max_size=4), hostile(3))),
        "flush+stats": (lambda s, w, v: (s.flush(), s.stats()), st.none()),
    }


CALLS_ON_CLOSED = ("put_kv.tokens", "put_state.position", "match.tokens", "match_pages.first",
                   "restorable.tokens", "present_pages", "expect.tokens", "load.plan", "evict.nbytes",
                   "put_kv_sized.nbytes", "flush+stats", "release", "restore_cost")


def api_case(tally: Tally, w: World, name: str, value: Any, *, closed: bool = False,
             check_bytes: bool = False) -> None:
    """One call of the public API; a rejection must leave ``w.a`` unchanged."""
    fn, _ = w.calls[name]
    store = w.closed if closed else w.a
    target = "api"
    tally.case(target)
    before = None if closed else snapshot(w.a, PROMPTS)
    how, _ = tally.run(target, ("closed." if closed else "") + name,
                       lambda: fn(store, w, value), value)
    if closed and how == "ok" and name not in ("flush+stats", "release", "restore_cost"):
        tally.defect(target, "closed." + name, "accepted on a closed store",
                     f"{name} succeeded on a closed store", value)
    if before is not None and how != "ok" and snapshot(w.a, PROMPTS) != before:
        tally.defect(target, name, "a rejected call changed the store",
                     f"{name} raised yet changed stats/answers", value)
    if not w.a.index.is_live(w.plan):
        if name == "release" and value is w.plan:
            w.plan = w.plans[0] = w.a.match(PROMPTS[0])     # released on purpose: match again
        else:
            w.plan = w.plans[0] = w.a.match(PROMPTS[0])
            tally.defect(target, name, "released another plan",
                         f"{name} released the store's live plan", value)
    if check_bytes or how == "defect":
        for p in PROMPTS:
            wrong = verify_bytes(w.a, p)
            if wrong:
                tally.defect(target, name, "wrong bytes", wrong, value)


# -- the engine-keyed API ----------------------------------------------------------------
def sglang_keys(seed: int, n: int) -> list[str]:
    out, prior = [], b""
    for k in range(n):
        prior = hashlib.sha256(prior + f"{seed}:{k}".encode()).digest()
        out.append(prior.hex())
    return out


def engine_key_like() -> st.SearchStrategy[Any]:
    one = st.one_of(st.integers(0, 3).flatmap(lambda s: st.sampled_from(sglang_keys(s, 6))),
                    st.binary(min_size=0, max_size=40), st.text(max_size=70),
                    st.sampled_from(["", "zz" * 32, "AB" * 32, "ab" * 31, "ab" * 33, b"\0" * 36,
                                     "é" * 10]),
                    scalars())
    return st.one_of(st.lists(one, max_size=6), st.lists(one, max_size=6).map(tuple),
                     st.lists(st.binary(min_size=1, max_size=36), max_size=6).map(np.array),
                     hostile(3))


def engine_case(tally: Tally, w: World, data: st.DataObject) -> None:
    """``engine_prefix`` with garbage keys, ``prefix=None`` resolution and length mismatches;
    a put through engine keys loads back bit-exact and resolves from the index."""
    s, target = w.a, "engine"
    tally.case(target)
    seed = data.draw(st.integers(0, 3), "seed")
    chain = sglang_keys(seed, 6)
    mode = data.draw(st.sampled_from(["garbage", "prefix", "length", "roundtrip"]), "mode")
    before = snapshot(s, PROMPTS)
    if mode == "garbage":
        keys = data.draw(engine_key_like(), "keys")
        how, _ = tally.run(target, "engine_prefix.keys", lambda: s.engine_prefix(keys), keys)
    elif mode == "prefix":
        cut = data.draw(st.integers(0, 6), "cut")
        pre = data.draw(st.one_of(st.none(), st.just(chain[:cut]), engine_key_like()), "prefix")
        how, _ = tally.run(target, "engine_prefix.prefix",
                           lambda: s.present_pages(s.engine_prefix(chain[cut:], prefix=pre)), pre)
    elif mode == "length":
        n = data.draw(st.integers(0, 6), "n")
        length = data.draw(st.one_of(st.none(), INTS, FLOATS, hostile(2)), "length")
        how, _ = tally.run(target, "engine_prefix.length",
                           lambda: s.engine_prefix(chain[:n], length=length), (n, length))
    else:
        how = engine_roundtrip(tally, s, chain, data)
    if how != "ok" and snapshot(s, PROMPTS) != before:
        tally.defect(target, mode, "a rejected call changed the store",
                     f"engine {mode} raised yet changed stats/answers")


def engine_roundtrip(tally: Tally, s: HybridStore, chain: list[str], data: st.DataObject) -> str:
    """Put pages (and a state) by engine keys, then load them back through a prefix resolved
    from the index (``prefix=None``)."""
    target = "engine"
    n = data.draw(st.integers(1, 6), "pages")
    pages = [np.full(PAGE, (7 * k + len(chain[0])) % 256, np.uint8) for k in range(n)]
    how, ep = tally.run(target, "engine.put", lambda: s.put_kv(s.engine_prefix(chain[:n]), pages))
    if how != "ok":
        return how
    cut = data.draw(st.integers(0, n - 1), "cut")
    how, tail = tally.run(target, "engine_prefix.resolve",
                          lambda: s.engine_prefix(chain[cut:n], prefix=None))
    if how != "ok":
        return how
    full = s.engine_prefix(chain[:n])
    if not np.array_equal(tail.keys, full.keys):
        tally.defect(target, "engine_prefix.resolve", "wrong resolution",
                     "prefix=None resolved to other keys than the full chain")
    plan = s.match_pages(full)
    try:
        got, _ = s.load(plan).result()
        for k, page in enumerate(got):
            if not np.array_equal(page, pages[k]):
                tally.defect(target, "engine.load", "wrong bytes", f"engine page {k} differs")
    finally:
        s.release(plan)
    return "ok"


# -- StoreConfig ---------------------------------------------------------------------------
CONFIG_FIELDS = {
    "block_size": st.one_of(st.integers(-2, 70000), INTS),
    "namespace": st.one_of(st.text(max_size=5), st.binary(max_size=5)),
    "host_bytes": st.one_of(st.integers(0, 1 << 22), INTS),
    "disk_bytes": st.one_of(st.integers(0, 1 << 26), INTS),
    "device_bytes": st.one_of(st.just(0), INTS),
    "policy": st.one_of(st.sampled_from(["lru", "histate", "marconi", "nope", ""]), st.text(max_size=4)),
    "checkpoint_policy": st.one_of(st.sampled_from(["keep-all", "nope"]), st.text(max_size=4)),
    "tier_policy": st.sampled_from(["write-through", "write-back", "partition", "asymmetric", "x"]),
    "disk_engine": st.sampled_from(["auto", "posix", "kvikio", "x"]),
    "disk_segment_bytes": st.one_of(st.sampled_from([1 << 20, 4 << 20, (1 << 20) + 1, 4096]), INTS),
    "io_threads": st.one_of(st.integers(-1, 300), INTS),
    "pin_host_memory": st.booleans(),
    "h2d_gbps": st.one_of(FLOATS, INTS),
    "ssd_gbps": st.one_of(FLOATS, INTS),
    "verify_checksums": st.booleans(),
    "kvikio_keep": st.one_of(st.frozensets(st.sampled_from(["task_size", "auto_direct_io_read", "x"])),
                             st.sets(st.sampled_from(["task_size"]))),
    "disk_path": st.one_of(st.none(), st.sampled_from(["d", "d/e", "", ".", "a\0b", "d" * 300]),
                           st.text(max_size=6)),
}


@contextmanager
def _in_dir(path: str) -> Any:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def config_case(tally: Tally, root: str, data: st.DataObject) -> None:
    """``StoreConfig(**fields)`` with some fields hostile: a ConfigError, or a config that
    opens a store (or refuses it with a typed error); relative paths stay under ``root``."""
    target = "config"
    tally.case(target)
    names = data.draw(st.sets(st.sampled_from(sorted(CONFIG_FIELDS)), min_size=1, max_size=3),
                      "fields")
    kw = {n: data.draw(st.one_of(CONFIG_FIELDS[n], hostile(2)) if data.draw(st.booleans())
                       else CONFIG_FIELDS[n], n) for n in sorted(names)}
    kw.setdefault("host_bytes", 1 << 20)
    kw.setdefault("disk_bytes", 1 << 24)
    kw.setdefault("disk_segment_bytes", 1 << 20)
    kw.setdefault("io_threads", 2)
    how, cfg = tally.run(target, "StoreConfig", lambda: StoreConfig(**kw), kw)
    if how != "ok":
        return
    sizes = (cfg.host_bytes, cfg.disk_bytes if cfg.disk_path is not None else 0, cfg.device_bytes)
    if max(sizes) > 1 << 26:
        return                                  # a valid config too large to open here
    with tempfile.TemporaryDirectory(dir=root) as tmp, _in_dir(tmp):
        def open_and_use() -> None:
            with HybridStore(cfg) as s:
                s.put_kv(list(range(2 * cfg.block_size)), [np.zeros(64, np.uint8)] * 2)
                s.release(s.match(list(range(2 * cfg.block_size))))
        tally.run(target, "HybridStore(config)", open_and_use, kw)


# -- a stateful machine mixing valid and invalid calls -------------------------------------
class MixedCalls(RuleBasedStateMachine):
    """Valid puts, matches and loads interleaved with hostile calls on a fresh store (its
    layouts not fixed yet); after every rejected call nothing changed, and every prompt
    put loads back bit-exact (or is a clean miss after eviction)."""

    tally: Tally = Tally()
    root: str = tempfile.gettempdir()
    world: World | None = None

    def __init__(self) -> None:
        super().__init__()
        self.tally.runs["stateful"] += 1
        self.tmp = tempfile.mkdtemp(dir=self.root)
        self.store = HybridStore(StoreConfig(block_size=B, host_bytes=64 << 10,
                                             disk_path=os.path.join(self.tmp, "s"),
                                             disk_bytes=256 << 10, disk_segment_bytes=1 << 20,
                                             disk_engine="posix", io_threads=2))
        self.prompts: list[np.ndarray] = []
        self.plans: list[Any] = []
        self.released: list[Any] = []
        self.matched: dict[int, np.ndarray] = {}

    def _call(self, name: str, fn: Callable[[], Any], example: Any) -> tuple[str, Any]:
        self.tally.case("stateful")
        before = snapshot(self.store, self.prompts)
        how, out = self.tally.run("stateful", name, fn, example)
        if how != "ok" and snapshot(self.store, self.prompts) != before:
            self.tally.defect("stateful", name, "a rejected call changed the store",
                              f"{name} raised yet changed stats/answers", example)
        return how, out

    @rule(seed=st.integers(0, 40), blocks=st.integers(1, 5), extra=st.integers(0, B - 1))
    def put(self, seed: int, blocks: int, extra: int) -> None:
        tokens = np.random.default_rng(seed).integers(0, 50, blocks * B + extra)
        tokens[0] = seed % 3                       # prompts share prefixes sometimes
        n = len(tokens) // B
        how, _ = self._call("put_kv", lambda: self.store.put_kv(
            tokens[:n * B], [page_of(tokens, k) for k in range(n)]), None)
        if how == "ok":
            self._call("put_state", lambda: self.store.put_state(tokens, state_of(tokens)), None)
            self.prompts.append(tokens)

    @rule(pages=_pages_like(), blocks=st.integers(1, 3))
    def put_hostile_pages(self, pages: Any, blocks: int) -> None:
        self._call("put_kv.hostile", lambda: self.store.put_kv(np.arange(blocks * B) + 7, pages),
                   pages)

    @rule(state=_states_like())
    def put_hostile_state(self, state: Any) -> None:
        self._call("put_state.hostile", lambda: self.store.put_state(np.arange(B + 3) + 7, state),
                   state)

    @rule(tokens=st.one_of(token_like(), hostile(3)))
    def match_hostile(self, tokens: Any) -> None:
        how, plan = self._call("match.hostile", lambda: self.store.match(tokens), tokens)
        if how == "ok":
            self.plans.append(plan)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = data.draw(st.sampled_from(self.prompts))
        how, plan = self._call("match", lambda: self.store.match(tokens), None)
        if how == "ok":
            self.matched[plan.plan_id] = tokens
            self.plans.append(plan)

    @precondition(lambda self: self.plans)
    @rule(data=st.data(), skip=st.integers(-1, 6), into=st.booleans())
    def load(self, data: st.DataObject, skip: int, into: bool) -> None:
        plan = data.draw(st.sampled_from(self.plans))
        bufs = ([np.empty(PAGE, np.uint8) for _ in plan.pages], np.empty(STATE, np.uint8))
        how, out = self._call("load", lambda: self.store.load(
            plan, into=bufs if into else None, skip_pages=skip).result(), (skip, into))
        tokens = self.matched.get(plan.plan_id)
        if how != "ok" or tokens is None or not plan.position:
            return
        pages, state = out
        for k in range(skip, len(plan.pages)):
            end = min((k + 1) * B, plan.position)
            if not any(np.array_equal(pages[k], page_of(p, k)) for p in self.prompts
                       if len(p) >= end and np.array_equal(p[:end], tokens[:end])):
                self.tally.defect("stateful", "load", "wrong bytes", f"page {k} differs")
        if not np.array_equal(state, state_of(tokens[:plan.position])):
            self.tally.defect("stateful", "load", "wrong bytes", "the state differs")

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        plan = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        self._call("release", lambda: self.store.release(plan), None)
        self.matched.pop(plan.plan_id, None)
        self.released.append(plan)

    @rule(data=st.data())
    def misuse_plan(self, data: st.DataObject) -> None:
        """Released plans, plans of another store, forged plans, non-plans."""
        world = self.world
        choices: list[Any] = list(self.released[-3:])
        if world is not None:
            choices += world.plans[1:]
        plan = data.draw(st.one_of(st.sampled_from(choices), hostile(2)) if choices else hostile(2))
        op = data.draw(st.sampled_from(["load", "release", "restore_cost"]))
        self._call(f"{op}.misused_plan", lambda: (
            self.store.load(plan).result() if op == "load" else
            self.store.release(plan) if op == "release" else self.store.restore_cost(plan)), plan)

    @rule(nbytes=st.one_of(st.integers(0, 1 << 18), INTS, hostile(1)),
          tier=st.one_of(st.sampled_from(["host", "disk"]), _tiers_like()))
    def evict(self, nbytes: Any, tier: Any) -> None:
        self._call("evict", lambda: self.store.evict(nbytes, tier=tier), (nbytes, tier))

    @rule(position=st.one_of(st.none(), INTS, hostile(1)), max_position=st.one_of(st.none(), INTS))
    def hostile_positions(self, position: Any, max_position: Any) -> None:
        t = np.arange(3 * B) + 7
        self._call("put_state.position", lambda: self.store.put_state(
            t, np.zeros(STATE, np.uint8), position=position), position)
        self._call("restorable.max_position", lambda: self.store.restorable(
            t, max_position=max_position), max_position)

    @invariant()
    def bytes_are_exact(self) -> None:
        for tokens in self.prompts[-4:]:
            wrong = verify_bytes(self.store, tokens, self.prompts)
            if wrong:
                self.tally.defect("stateful", "load", "wrong bytes", wrong)

    def teardown(self) -> None:
        for plan in self.plans:
            self.store.release(plan)
        if not self.store.index.check_refcounts():
            self.tally.defect("stateful", "teardown", "refcounts", "pins left after release")
        self.store.close()


def new_world() -> World:
    return World(tempfile.mkdtemp(prefix="hs-fuzz-"))


__all__ = ["CALLS_ON_CLOSED", "HybridStoreError", "MixedCalls", "World", "api_calls", "api_case",
           "config_case", "engine_case", "new_world"]
