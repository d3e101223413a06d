"""Wrong-typed or out-of-range arguments to every public call raise a typed error from
hybridstore.errors and change nothing (issue 13, item 6: ~14% raised TypeError,
IndexError, AttributeError, ... before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridstore import HybridStore, HybridStoreError, StoreConfig

B = 16
TOKENS = np.arange(4 * B)
BAD = [None, "x", 1.5, -3, 10**30, [1, "a"], {"a": 1}, object(), np.zeros((2, 2)), b"abc",
       True, float("nan"), [], np.array([-1]), (1, 2),
       # found by the fuzz campaign (tests/reliability/fuzz.py): 0-d arrays, tensors without data
       np.array(7), torch.empty(3, dtype=torch.int64, device="meta"),
       torch.arange(3).to_sparse()]
CALLS = {
    "put_kv.tokens": lambda s, p, v: s.put_kv(v, [np.zeros(256, np.uint8)]),
    "put_kv.pages": lambda s, p, v: s.put_kv(TOKENS[:B], v),
    "put_kv_batch.count": lambda s, p, v: s.put_kv_batch(TOKENS, np.zeros((4, 256), np.uint8),
                                                         count=v),
    "put_kv_batch.batch": lambda s, p, v: s.put_kv_batch(TOKENS, v),
    "put_state.state": lambda s, p, v: s.put_state(TOKENS, v),
    "put_state.position": lambda s, p, v: s.put_state(TOKENS, np.zeros(100, np.uint8), position=v),
    "put_kv_page.end": lambda s, p, v: s.put_kv_page(TOKENS, np.zeros(256, np.uint8), end=v),
    "match.tokens": lambda s, p, v: s.release(s.match(v)),
    "match.max_position": lambda s, p, v: s.release(s.match(TOKENS, max_position=v)),
    "match.again": lambda s, p, v: s.release(s.match(TOKENS, again=v)),
    "match_pages.first": lambda s, p, v: s.release(s.match_pages(TOKENS, first=v)),
    "match_pages.stop": lambda s, p, v: s.release(s.match_pages(TOKENS, stop=v)),
    "restorable.max_position": lambda s, p, v: s.restorable(TOKENS, max_position=v),
    "expect.tokens": lambda s, p, v: s.expect(v),
    "expect.max_position": lambda s, p, v: s.expect(TOKENS, max_position=v),
    "expect.in_s": lambda s, p, v: s.expect(TOKENS, in_s=v),
    "finished.tokens": lambda s, p, v: s.finished(v),
    "finished.max_position": lambda s, p, v: s.finished(TOKENS, max_position=v),
    "finished.in_s": lambda s, p, v: s.finished(TOKENS, in_s=v),
    "present_pages": lambda s, p, v: s.present_pages(v),
    "evict.nbytes": lambda s, p, v: s.evict(v),
    "evict.tier": lambda s, p, v: s.evict(10, tier=v),
    "load.plan": lambda s, p, v: s.load(v),
    "load.into": lambda s, p, v: s.load(p, into=v).result(),
    "load.skip_tiers": lambda s, p, v: s.load(p, skip_tiers=v).result(),
    "load.skip_pages": lambda s, p, v: s.load(p, skip_pages=v).result(),
    "release": lambda s, p, v: s.release(v),
    "restore_cost": lambda s, p, v: s.restore_cost(v),
    "checkpoint_positions.cached": lambda s, p, v: s.checkpoint_positions(cached=v, length=100),
    "checkpoint_positions.anchors": lambda s, p, v: s.checkpoint_positions(cached=0, length=100,
                                                                          anchors=v),
    "engine_prefix.keys": lambda s, p, v: s.engine_prefix(v),
    "engine_prefix.prefix": lambda s, p, v: s.engine_prefix([b"a"], prefix=v),
    "engine_prefix.length": lambda s, p, v: s.engine_prefix([b"a"], length=v),
    "prefix_from_block_ids": lambda s, p, v: s.prefix_from_block_ids(v),
    "prefix_from_block_ids.length": lambda s, p, v: s.prefix_from_block_ids([1, 2], length=v),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20,
                      disk_path=str(tmp_path_factory.mktemp("hs")), disk_bytes=16 << 20)
    with HybridStore(cfg) as s:
        s.put_kv(TOKENS, [np.full(256, i, np.uint8) for i in range(4)])
        s.put_state(TOKENS, np.arange(100, dtype=np.uint8))
        plan = s.match(TOKENS)
        yield s, plan
        s.release(plan)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_bad_arguments_raise_typed_errors_and_change_nothing(store, call):
    s, plan = store

    def state():
        return s.stats()["pages"], s.stats()["checkpoints"], s.restorable(TOKENS)

    untyped = []
    for value in BAD:
        before = state()
        try:
            CALLS[call](s, plan, value)     # some values are valid here (e.g. tokens (1, 2))
        except HybridStoreError:
            assert state() == before, f"{call}({value!r:.20}) raised but changed the store"
        except Exception as e:  # noqa: BLE001 - the point: anything else is a defect
            untyped.append(f"{value!r:.20}: {type(e).__name__}: {e}")
    assert not untyped, untyped
    got, st = s.load(plan).result()                # the store still serves its prompt
    assert [int(p[0]) for p in got] == [0, 1, 2, 3] and np.array_equal(st, np.arange(100))
