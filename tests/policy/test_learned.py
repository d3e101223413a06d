"""Learned resume offsets (``policy/learned.py``): what the store reports at each resume,
what the placement learns from it, and where it then adds states (eq. 3 with the learned
distribution against eq. 4)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.errors import ConfigError
from hybridstore.policy import placement_policy
from hybridstore.policy.base import resume_back
from hybridstore.policy.learned import LearnedOffsets
from hybridstore.policy.placement import BlockAligned, RequestEnd
from tests.policy.sessions import B, STATE, Session


def learned(state_tokens: float, **kw) -> LearnedOffsets:
    return LearnedOffsets(RequestEnd(), block_size=B, state_tokens=state_tokens, **kw)


def brute_gain(probs: np.ndarray, end: int, states: list[int], x: int, block: int) -> float:
    """Expected tokens a state at ``x`` saves, resume by resume (the definition)."""
    total = 0.0
    for b, p in enumerate(probs[:-1]):
        land = end - b * block
        prev = max([s for s in states if s <= land], default=0)
        if prev < x <= land:
            total += p * (x - prev)
    return total


def test_gains_follow_the_definition():
    rng = np.random.default_rng(7)
    policy = learned(10.0, horizon_blocks=12)
    for back in rng.integers(0, 16 * B, size=200):
        policy.on_resume(int(back))
    assert policy.probs.sum() == pytest.approx(1.0) and policy.observed == 200
    end, states = 40 * B, [3 * B, 20 * B, 33 * B, 40 * B]
    gains = policy.gains(end, states)
    for k in range(len(gains)):
        want = brute_gain(policy.probs, end, states, end - k * B, B)
        assert gains[k] == pytest.approx(want)


def test_nothing_is_added_before_evidence_or_when_a_state_costs_more():
    fresh = learned(1.0)
    assert fresh.positions(cached=0, length=1000) == [1000]       # every resume an append so far
    dear = learned(10_000.0)
    for _ in range(300):
        dear.on_resume(2 * B)                                      # all rewrites, 2 blocks back
    assert dear.positions(cached=0, length=1000) == [1000]        # gain ~2,000 < N_s 10,000


def test_rewrites_two_blocks_back_get_a_state_there():
    policy = learned(64.0, max_states=2)
    for _ in range(300):
        policy.on_resume(2 * B)
    # resumes land 2 blocks before the end: a state at 1000 - 32 = 968 (block-aligned: 960)
    # saves ~960 tokens per resume against N_s = 64
    assert policy.positions(cached=0, length=1000) == [(1000 - 2 * B) // B * B, 1000]
    # a resume point right before it leaves little to save: nothing added
    assert policy.positions(cached=950, length=1000) == [1000]


def test_the_learned_mix_decides_which_offsets_pay():
    policy = learned(200.0, max_states=3)
    for i in range(1000):
        policy.on_resume(B if i % 10 == 0 else 0)     # 10 % rewrite one block back
    # a state one block before the end saves 0.1 * (end - B) tokens: pays at 4,000 tokens
    assert policy.positions(cached=0, length=4000) == [4000 - B, 4000]
    assert policy.positions(cached=0, length=1000) == [1000]      # 0.1 * 984 < 200


def test_composes_with_vllm_align_and_forwards_resumes():
    base = BlockAligned(block_size=4 * B, chunk=32 * B, logits_token=True)
    policy = LearnedOffsets(base, block_size=4 * B, state_tokens=32.0)
    assert policy.name == "block-aligned+learned" and policy.resume_horizon == 16 * 4 * B
    for _ in range(300):
        policy.on_resume(3 * B)                        # within one vLLM block before its state
    got = policy.positions(cached=0, length=5000)
    want = base.positions(cached=0, length=5000)
    assert set(want) < set(got) and all(p % (4 * B) == 0 for p in got)
    assert sorted(set(got) - set(want)) == [max(want) - 4 * B]
    assert placement_policy("learned", parts=[RequestEnd()], block_size=B).name == "request-end+learned"
    with pytest.raises(ConfigError):
        LearnedOffsets()
    with pytest.raises(ConfigError):
        learned(1.0, ema=0.0)


def test_the_store_reports_how_far_back_each_resume_landed():
    """Through HybridStore.match: an append reports 0, a rewrite of the last turn the
    tokens of the turn it left behind its walk, a fresh session on a shared prefix "far"."""
    policy = learned(1e9, horizon_blocks=64)       # learns, never adds
    seen: list[int] = []
    policy.on_resume = seen.append                  # type: ignore[method-assign]
    store = HybridStore(StoreConfig(block_size=B, policy="hybridstore"), placement=policy,
                        tiers={"host": AccountingTier("host", 64 * STATE, read_gbps=64)})
    a = Session(store, "A")
    a.turn(1, 40 * B)
    a.turn(2, 10 * B)                               # an append: resumes at S1, leaves nothing
    assert seen == [0]
    # the next request keeps turn 1 and 4 blocks of turn 2, then differs
    a.tokens = a.tokens[: a.ends[1] + 4 * B]
    a.ends = {1: a.ends[1]}
    a.turn(3, 5 * B)
    assert seen[-1] == 6 * B                        # S2 lay 6 blocks past where the walk left it
    s1 = a.checkpoint(1)
    assert s1 is not None
    assert resume_back(s1, 10**9, s1.position, continues=True, horizon=2 * B) == 2 * B + 1
    other = Session(store, "B")
    other.tokens = a.tokens[: a.ends[1]].copy()
    other.turn(1, 100)                              # another conversation after turn 1
    assert seen[-1] == 10 * B                       # the deepest it left: S2, 10 blocks past S1
