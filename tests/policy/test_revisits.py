"""Return odds (``policy/revisits.py``): how likely a trajectory with ``n`` uses is to get
another, learnt past evictions and only from uses old enough to have had their chance.

Scenarios on a real store with accounting tiers (``tests/policy/sessions.py``) and a clock
the test advances, as in ``test_returns.py``.
"""

from __future__ import annotations

import math

import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.errors import ConfigError
from hybridstore.objects import ObjectKind
from hybridstore.policy import eviction_policy
from hybridstore.policy.histate import HybridStoreEviction
from hybridstore.policy.revisits import ReturnOdds
from tests.policy.sessions import STATE, B, Session


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store_with_clock(clock: Clock, *, slots: int = 64, **params: object) -> HybridStore:
    eviction = eviction_policy("hybridstore", **params)
    eviction.bind_clock(clock)
    cfg = StoreConfig(block_size=B, tier_policy="partition", policy="hybridstore")
    return HybridStore(cfg, tiers={"host": AccountingTier("host", 2 * slots * STATE,
                                                           read_gbps=64)}, eviction=eviction)


def policy_of(store: HybridStore) -> HybridStoreEviction:
    ev = store._eviction
    assert isinstance(ev, HybridStoreEviction) and ev.odds is not None
    return ev


def three_turns() -> tuple[Clock, HybridStore, ReturnOdds, Session]:
    """Session A's turns 1-3 at 10, 20 and 30 s on a roomy store."""
    clock = Clock()
    store = store_with_clock(clock)
    odds = policy_of(store).odds
    assert odds is not None
    a = Session(store, "A")
    for turn in (1, 2, 3):
        clock.now = 10.0 * turn
        a.turn(turn, 4 * B)
    return clock, store, odds, a


def test_a_trajectory_counts_its_uses_and_goes_on_counting_after_its_eviction():
    """A session's third turn is its trajectory's third use; once everything it held is
    evicted, its fourth turn finds the count of its evicted end on its path (the ghost
    list) and is the fourth use, not the first of a new trajectory."""
    clock, store, odds, a = three_turns()
    ck = a.checkpoint(3)
    assert ck is not None and odds.count(ck) == 3
    store.evict(1 << 40, "host")                 # nothing pinned: everything goes
    assert not a.has(1) and not a.has(3)
    clock.now = 40.0
    assert a.turn(4, 4 * B) == 0                 # a miss: the context was evicted
    assert odds.count(a.checkpoint(4)) == 4


@pytest.mark.parametrize("stored", [False, True])
def test_a_return_the_store_keeps_nothing_of_still_counts(stored):
    """After A's context is evicted, its fourth request resumes nothing and stores nothing
    (a prompt the engine would not cache): it is still the trajectory's fourth use, counted
    at the next lookup, so the fifth turn is the fifth use and turn 3 counts as returned."""
    clock, store, odds, a = three_turns()
    store.evict(1 << 40, "host")
    clock.now = 40.0
    assert a.begin(4 * B) == 0                   # a miss
    if stored:
        a.finish(4)
    else:                                        # nothing put
        store.release(a._plan)
        a.ends[4] = len(a.tokens)
    clock.now = 50.0
    a.turn(5, 4 * B)
    assert odds.count(a.checkpoint(5)) == 5
    # each of the uses 3 and 4 was followed by another (counted when each came)
    assert [len(odds._back[n]) for n in (1, 2, 3, 4)] == [1, 1, 1, 1]


def test_a_fork_below_a_shared_prefix_starts_its_own_count():
    """B resumes A's first turn while A's trajectory is the only one through it: the store
    cannot tell that from A rewinding, so it is A's fourth use. Once the turn-1 state is
    a branch point (a prefix two sessions share), C's request there starts a trajectory."""
    clock, store, odds, a = three_turns()
    b = a.fork(1, "B")                           # another session on A's first turn
    clock.now = 35.0
    b.turn(2, 4 * B)
    assert odds.count(a.checkpoint(3)) == 3
    assert odds.count(b.checkpoint(2)) == 4      # a rewind of A, as far as the store knows
    c = a.fork(1, "C")                           # a third: the turn-1 state is a branch point
    clock.now = 36.0
    c.turn(2, 4 * B)
    assert odds.count(c.checkpoint(2)) == 1


def one_turn_crowd(clock: Clock, store: HybridStore, n: int, at: float, tag: str) -> list[Session]:
    crowd = []
    for i in range(n):
        clock.now = at + 0.1 * i
        s = Session(store, f"{tag}{i}")
        s.turn(1, 4 * B)
        crowd.append(s)
    return crowd


def regulars(clock: Clock, store: HybridStore, until: float) -> list[Session]:
    """Three sessions that come back every 30 s (at 0, 30, ..., staggered by 1 s)."""
    rs = [Session(store, f"R{i}") for i in range(3)]
    t, turn = 0.0, 1
    while t <= until:
        for i, r in enumerate(rs):
            clock.now = t + i
            r.turn(turn, 4 * B)
        t += 30.0
        turn += 1
    return rs


def test_the_odds_of_a_one_turn_trajectory_are_learnt_once_its_chance_has_passed():
    """Twenty sessions make one request at 5-7 s and never return; three others come at 0, 1
    and 2 s and return every 30 s. The return horizon is the 90th percentile of the learnt
    gaps (30 s): at 32 s only the regulars' first uses are old enough to count (two, both
    followed: ``p_1`` is 1); at 92 s all 23 first uses are, 3 of them followed, and ``p_1``
    is their Wilson bound; the regulars' fourth uses are too recent to settle anything."""
    clock = Clock()
    store = store_with_clock(clock)
    odds = policy_of(store).odds
    returns = policy_of(store).returns
    rs = regulars(clock, store, until=0.0)
    crowd = one_turn_crowd(clock, store, 20, 5.0, "O")
    odds.settle(clock.now, returns.recent_gaps())
    assert odds.odds(crowd[0].checkpoint(1)) == 1.0          # no gap learnt yet: nothing settled
    for i, r in enumerate(rs):
        clock.now = 30.0 + i
        r.turn(2, 4 * B)
    odds.settle(clock.now, returns.recent_gaps())
    assert odds.odds(crowd[0].checkpoint(1)) == 1.0          # 32 s: R0's and R1's first uses
    for turn in (3, 4):
        for i, r in enumerate(rs):
            clock.now = 30.0 * (turn - 1) + i
            r.turn(turn, 4 * B)
    odds.settle(clock.now, returns.recent_gaps())
    p1 = odds.odds(crowd[0].checkpoint(1))
    assert p1 == pytest.approx(_wilson(3, 23), rel=1e-9)
    assert p1 < 0.35
    assert odds.odds(rs[0].checkpoint(4)) == 1.0


def _wilson(k: int, m: int, z: float = 2.0) -> float:
    p = k / m
    return (p + z * z / (2 * m) + z * math.sqrt(p * (1 - p) / m + z * z / (4 * m * m))) / (1 + z * z / m)


@pytest.mark.parametrize("return_odds, first", [(True, "O"), (False, "R")])
def test_a_first_turn_unlikely_to_be_followed_goes_before_an_overdue_regular(return_odds, first):
    """At 125 s the regulars (30 s gaps, last served at 90-92 s, due at 120-122 s) are
    overdue, and ranked by their last use; a crowd that came at 110 s is not due before
    140 s by the pooled gap. Without the odds the regulars go first; with them the crowd,
    whose first uses were followed 3 times in 23 before, goes first."""
    clock = Clock()
    store = store_with_clock(clock, return_odds=return_odds)
    one_turn_crowd(clock, store, 20, 0.0, "O")
    rs = regulars(clock, store, until=90.0)
    late = one_turn_crowd(clock, store, 5, 110.0, "L")
    clock.now = 125.0
    ev = store._eviction
    owner = {s.checkpoint(1).key: "O" for s in late}
    owner.update({r.checkpoint(4).key: "R" for r in rs})
    order = [owner[v.ref] for v in ev.victims(store.index, "host", ObjectKind.STATE)
             if v.ref in owner]
    assert order[0] == first, order


def test_bad_parameters_are_config_errors():
    with pytest.raises(ConfigError):
        ReturnOdds(classes=0)
    with pytest.raises(ConfigError):
        ReturnOdds(horizon=1.5)
    with pytest.raises(ConfigError):
        ReturnOdds(z=-1.0)
