"""FlashStates cost-aware admission: when memory is short, only checkpoints worth more
than the cheapest cached one get in (priced as its eviction prices them)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.policy import (
    FlashStatesAdmission,
    FlashStatesEviction,
    admission_policy,
)
from tests.policy.sessions import PAGE, STATE, Session


@pytest.fixture
def cached() -> tuple[HybridStore, Session]:
    """Two sessions with a few turns each; host memory then counts as full."""
    store = HybridStore(StoreConfig(block_size=16),
                        tiers={"host": AccountingTier("host", 1 << 30, read_gbps=64)})
    a, b = Session(store, "A"), Session(store, "B")
    a.turn(1, 2048)
    b.turn(1, 1500)
    a.turn(2, 300)
    b.turn(2, 200)
    return store, a


def test_refuses_a_low_value_checkpoint_when_full_and_admits_a_high_value_one(cached):
    store, _ = cached
    policy = FlashStatesAdmission(free_bytes=lambda: 0)
    cheapest = policy.eviction.cheapest(store.index, "host")
    assert cheapest is not None
    # 16 tokens of prefix are not worth a checkpoint's memory ...
    assert policy.eviction.price(16, 0, STATE) < cheapest
    assert not policy.admit(store.index, 16, STATE)
    # ... a 64K-token prefix is.
    assert policy.admit(store.index, 65536, STATE)


def test_admits_everything_while_memory_is_not_short(cached):
    store, _ = cached
    assert FlashStatesAdmission(free_bytes=lambda: 1 << 30).admit(store.index, 16, STATE)
    unbound = admission_policy("flashstates")
    assert unbound.admit(store.index, 16, STATE)          # cannot tell memory is short
    unbound.bind(free_bytes=lambda: 0)
    assert not unbound.admit(store.index, 16, STATE)


def test_prices_a_new_checkpoint_over_the_nearest_cached_one_on_its_prompt(cached):
    """Given the prompt, the price is marginal: a state 8 tokens past A's terminal state
    saves 8 tokens of prefill, however long A's context is; a state at the end of a new,
    long prompt saves the whole prefill (over the state plus its still-unneeded KV)."""
    store, a = cached
    policy = FlashStatesAdmission(free_bytes=lambda: 0)
    ix = store.index
    extended = store.prefix(np.concatenate([a.tokens, np.arange(9_000_000, 9_000_008)]))
    assert not policy.admit(ix, extended.length, STATE, prompt=extended)
    assert policy.admit(ix, extended.length, STATE)          # without the prompt: whole prefix

    fresh = store.prefix(np.arange(8_000_000, 8_004_096))
    store.put_kv_sized(fresh, nbytes=PAGE)
    assert policy.context(ix, fresh, fresh.length) == (0, fresh.nblocks * PAGE)
    assert policy.admit(ix, fresh.length, STATE, prompt=fresh)


def test_admission_and_eviction_share_one_price():
    eviction = FlashStatesEviction()
    policy = FlashStatesAdmission(eviction=eviction, free_bytes=lambda: 0)
    assert policy.eviction is eviction
    assert eviction.price(1000, 200, 10) == pytest.approx(eviction.cost.between(200, 1000) / 10)
