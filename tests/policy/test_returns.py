"""Predicted returns (``policy="hybridstore"``, ``policy/nextuse.py``): a session just served
is not due again for about its own gap, so under pressure it goes before the one due next.

Sessions that return in turn (an agent fleet in lockstep, HiState's microbenchmark) are the
pattern least-recently-used order gets exactly wrong: it evicts the session whose turn
comes next.  Scenarios on a real store with accounting tiers (``tests/policy/sessions.py``)
and a clock the test advances, bound as an engine or the replay binds theirs.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.policy import eviction_policy
from hybridstore.policy.nextuse import ReturnGaps
from tests.policy.sessions import STATE, B, Session


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store_with_clock(policy: str, clock: Clock, state_slots: int) -> HybridStore:
    eviction = eviction_policy(policy)
    eviction.bind_clock(clock)
    cfg = StoreConfig(block_size=B, tier_policy="partition", policy=policy)
    return HybridStore(cfg, tiers={"host": AccountingTier("host", 2 * state_slots * STATE,
                                                           read_gbps=64)}, eviction=eviction)


def rounds(policy: str) -> tuple[HybridStore, list[Session]]:
    """Sessions A, B, C served in turn every 10 s for three rounds (the last one C's at 80 s);
    A's next turn is due at 90 s, C's not before 110 s."""
    clock = Clock()
    store = store_with_clock(policy, clock, state_slots=12)
    sessions = [Session(store, name) for name in "ABC"]
    for r in range(3):
        for i, s in enumerate(sessions):
            clock.now = 30.0 * r + 10.0 * i
            s.turn(r + 1, 512)
    return store, sessions


@pytest.mark.parametrize("policy, first_to_go", [("hybridstore", "C"), ("histate", "A")])
def test_the_session_just_served_goes_before_the_one_due_next(policy, first_to_go):
    store, (a, b, c) = rounds(policy)
    assert store.evict(STATE, "host") >= STATE
    touched = [s.name for s in (a, b, c) if not all(s.has(t) for t in (1, 2, 3))]
    assert touched == [first_to_go], policy
    assert all(s.has(3) for s in (a, b, c))   # an earlier turn's state (eq. 7: cheap) first


def test_gaps_are_learnt_per_trajectory_and_date_puts_by_their_request():
    store, (a, b, c) = rounds("hybridstore")
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps)
    for s in (a, b, c):
        ck = s.checkpoint(3)
        assert ck is not None
        assert returns.gaps(ck) == (30.0, 30.0)      # two returns, each 30 s after the last
    assert returns.time_of(c.checkpoint(3).created) == 80.0   # C's put is dated by its request
    assert returns.time_of(a.checkpoint(1).created) == 0.0


@pytest.mark.parametrize("last_decode_s, first_to_go", [(2.0, "C"), (40.0, "B")])
def test_the_next_turn_counts_from_the_end_of_the_last(last_decode_s, first_to_go):
    """Sessions A, B, C arrive every 30 s (A at 0, 30, 60; B 10 s and C 20 s later) and the
    engine reports each request finished 2 s after it arrived (``HybridStore.finished``):
    each learns a 28 s return gap, from the end of its turn. At 85 s C is due last (80 + 2 +
    28) and goes first. When B's last turn decodes a long answer (finished 40 s after it
    arrived) B is due at 70 + 40 + 28 = 138 s, later than C: B goes first."""
    clock = Clock()
    store = store_with_clock("hybridstore", clock, state_slots=12)
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps)
    sessions = [Session(store, name) for name in "ABC"]
    for r in range(3):
        for i, s in enumerate(sessions):
            clock.now = 30.0 * r + 10.0 * i
            s.turn(r + 1, 512)
            decode = last_decode_s if (r, s.name) == (2, "B") else 2.0
            assert store.finished(s.tokens, in_s=decode) == s.ends[r + 1]
    a, b, c = sessions
    assert returns.gaps(a.checkpoint(3)) == (28.0, 28.0)   # from each finish to the next turn
    clock.now = 85.0
    assert store.evict(STATE, "host") >= STATE
    touched = [s.name for s in sessions if not all(s.has(t) for t in (1, 2, 3))]
    assert touched == [first_to_go]


def test_a_finish_is_a_finite_time_and_needs_nothing_held():
    """``finished`` takes seconds from now: a bad value is a typed error that changes nothing,
    and a prompt the store holds no state of is a no-op (0)."""
    import math

    from hybridstore.errors import InvalidArgumentError

    store, (a, b, c) = rounds("hybridstore")
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps)
    before = dict(returns._done)
    for bad in (math.inf, -1.0, float("nan"), "1", True):
        with pytest.raises(InvalidArgumentError):
            store.finished(a.tokens, in_s=bad)
    assert returns._done == before
    assert store.finished(np.arange(7 * 10**6, 7 * 10**6 + 40)) == 0


def test_an_overdue_trajectory_ranks_by_its_last_use():
    returns = ReturnGaps()
    assert returns.recency(last=80.0, gap=30.0, now=85.0) == 2 * 85.0 - 110.0   # due at 110
    assert returns.recency(last=50.0, gap=30.0, now=85.0) == 50.0               # overdue: LRU
    assert returns.recency(last=50.0, gap=float("inf"), now=85.0) == 50.0    # no estimate: LRU


def test_a_branch_below_a_branch_point_does_not_inherit_its_gaps():
    """A rewound turn (or another session after a shared prefix) starts a branch whose turns
    follow each other at a cadence of their own: the branch point's gaps say how often
    requests come back *to that point*.  The branch takes the default (the median of every
    trajectory's gaps) until it returns itself; a chain's only child still inherits."""
    store, (a, b, c) = rounds("hybridstore")      # every session's gaps: (30, 30)
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps)
    clock = returns.clock
    assert isinstance(clock, Clock)
    point = a.checkpoint(2)
    forks = []
    for at in (500.0, 1000.0):                    # A rewound to its turn 2, twice
        clock.now = at
        fork = a.fork(2, f"A@{at}")
        assert fork.turn(3, 256) == point.position
        forks.append(fork)
    assert returns.gaps(point) == (30.0, 30.0, 440.0, 500.0)  # back to that point: rarely
    clock.now = 1010.0
    c.turn(4, 256)                                 # C goes on: its turn 4 is an only child
    gaps = returns.expected_gaps(store.index)
    assert gaps[point.key] == 235.0
    default = 30.0                                 # the median of all gaps learnt
    for fork in forks:                             # below a branch point: nothing inherited
        assert returns.gaps(fork.checkpoint(3)) == ()
        assert gaps[fork.checkpoint(3).key] == default
    assert gaps[c.checkpoint(4).key] == gaps[c.checkpoint(3).key] == 30.0   # a chain inherits


def test_a_queued_request_keeps_the_context_it_resumes_from():
    """A session whose next turn waits in the engine's queue looks overdue (its predicted
    return has passed), and overdue reads as gone: least recently used goes first.  The
    engine tells the store what it has queued (``HybridStore.expect``), and that session's
    context is due now: another one goes."""
    store, (a, b, c) = rounds("hybridstore")     # A last at 60 s, B at 70, C at 80: all due
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps) and isinstance(returns.clock, Clock)
    returns.clock.now = 200.0                     # every one overdue: A, the oldest, goes first
    queued = np.concatenate([a.tokens, np.arange(10**6, 10**6 + 8)])
    assert store.expect(queued) == a.ends[3]      # where it would resume; nothing pinned
    assert store.stats()["matches"] == 9 and not store.index.checkpoint(
        a.checkpoint(3).key).pins
    assert returns.expected(a.checkpoint(3)) and not returns.expected(b.checkpoint(3))
    assert store.evict(STATE, "host") >= STATE
    gone = [s.name for s in (a, b, c) if not all(s.has(t) for t in (1, 2, 3))]
    assert gone == ["B"]                          # the least recent of those not queued
    returns.clock.now = 210.0                     # served: the expectation is used up
    assert a.resume_if_appended() == a.ends[3]
    a.turn(4, 64)
    assert not returns.expected(a.checkpoint(3))
    assert store.expect(np.arange(5 * 10**6, 5 * 10**6 + 40)) == 0   # nothing to resume from


def test_a_session_announced_over_goes_first_and_one_announced_back_stays():
    """An orchestrator's announcements (``HybridStore.expect(..., in_s=)``): at 200 s every
    session is overdue and A, the least recent, would go first. C's end announced
    (``math.inf``) goes first instead; A announced back in 30 s is kept until then, and once
    that time has passed without it, the prediction rules again."""
    import math

    store, (a, b, c) = rounds("hybridstore")
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps) and isinstance(returns.clock, Clock)
    returns.clock.now = 200.0
    assert store.expect(c.tokens, in_s=math.inf) == c.ends[3]
    assert store.expect(a.tokens, in_s=30.0) == a.ends[3]
    assert returns.expectation(c.checkpoint(3)) == (math.inf, True)
    assert returns.expectation(a.checkpoint(3)) == (230.0, True)
    assert store.evict(STATE, "host") >= STATE
    assert [s.name for s in (a, b, c) if not all(s.has(t) for t in (1, 2, 3))] == ["C"]
    returns.clock.now = 231.0                     # A did not come: the estimate gives way
    assert returns.expectation(a.checkpoint(3), 231.0) is None
    assert store.evict(2 * STATE, "host") >= STATE
    assert not all(a.has(t) for t in (1, 2, 3))   # A, the least recent, goes next


def test_an_announcement_at_the_clock_reading_of_its_own_resume_holds():
    """An orchestrator announces a session's next turn as soon as the turn is served, at the
    same reading of a coarse clock (the replay's arrival time, a clock in whole seconds).
    The turn resumed there *before* the announcement, so the announcement holds for the
    checkpoint it resumed from and every one above it, not only for the new one below;
    the next resume there, even at that same reading, uses it up."""
    store, (a, b, c) = rounds("hybridstore")
    returns = store._eviction.returns
    assert isinstance(returns, ReturnGaps) and isinstance(returns.clock, Clock)
    returns.clock.now = 200.0
    assert a.turn(4, 512) == a.ends[3]              # resumed from turn 3's state at 200 s
    assert store.expect(a.tokens, in_s=30.0) == a.ends[4]
    for t in (1, 2, 3, 4):
        assert returns.expectation(a.checkpoint(t)) == (230.0, True), t
    assert a.turn(5, 512) == a.ends[4]              # A came back, at the same reading
    assert all(returns.expectation(a.checkpoint(t)) is None for t in (1, 2, 3, 4))


def test_a_session_over_says_nothing_of_the_prefix_it_shares():
    """Sessions after a shared prefix: one's end announced demotes its own branch only;
    the prefix keeps its own ranking, and a later announcement of the other session
    (back in 10 s) holds for the prefix too (the earliest due wins)."""
    import math

    store, (a, b, c) = rounds("hybridstore")
    returns = store._eviction.returns
    clock = returns.clock
    assert isinstance(clock, Clock)
    clock.now = 100.0
    x, y = a.fork(2, "X"), a.fork(2, "Y")
    x.turn(3, 256)
    y.turn(3, 256)
    shared = a.checkpoint(2)
    assert len(shared.children) == 3             # A's turn 3, X's and Y's
    store.expect(x.tokens, in_s=math.inf)
    assert returns.expectation(x.checkpoint(3)) == (math.inf, True)
    assert returns.expectation(shared) is None   # not X's alone
    clock.now = 105.0                            # after Y's own resume there at 100 s
    store.expect(y.tokens, in_s=10.0)
    assert returns.expectation(y.checkpoint(3)) == (115.0, True)
    assert returns.expectation(shared) == (115.0, False)   # bounds, never replaces, its rank


def test_without_the_queue_the_overdue_session_goes_first():
    store, (a, b, c) = rounds("hybridstore")
    store._eviction.returns.clock.now = 200.0
    assert store.evict(STATE, "host") >= STATE
    assert [s.name for s in (a, b, c) if not all(s.has(t) for t in (1, 2, 3))] == ["A"]
