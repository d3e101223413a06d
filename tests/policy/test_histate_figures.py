"""HiState's retention scenarios (Fig. 3 and Fig. 7) on a real store, per eviction policy.

Each scenario is a short script of agent turns on a :class:`HybridStore` with
accounting tiers (``tests/policy/sessions.py``).  Sizes: 16-token pages of
16 bytes per token, checkpoints of 1024 token equivalents.
"""

from __future__ import annotations

import pytest

from tests.policy.sessions import STATE, Session, evicted, make_store


def figure7(policy: str) -> tuple[Session, Session, list[str]]:
    """HiState Fig. 7: B keeps S1, S2 (historical) and S3 (terminal), C keeps S6; one must go.

    B's first turn carries a long context (S1 at 2048 tokens); its later
    turns are short (S2 128 tokens on, S3 256 more).  C finished turn 6 (S6)
    after B's turn 2 and waits for a tool while B runs turn 3 and starts
    turn 4, resuming from S3.  Then one checkpoint slot must be freed.
    """
    store = make_store(policy, state_slots=8)
    b, c = Session(store, "B"), Session(store, "C")
    b.turn(1, 2048)
    b.turn(2, 128)
    c.turn(6, 1024)
    b.turn(3, 256)
    assert b.begin(64) == b.ends[3]                 # B's turn 4 resumes from its terminal S3
    assert store.evict(STATE, "host") == STATE      # free one checkpoint slot
    b.finish(4)
    gone = evicted(store, (b, 1), (b, 2), (b, 3), (c, 6))
    assert len(gone) == 1 and store.stats()["evictions"] == 1, gone
    return b, c, gone


def test_fig7_lru_evicts_s1_and_b_misses_when_forking_there():
    b, c, gone = figure7("lru")
    assert gone == ["S1"]
    assert b.resume_if_forked_at(1) == 0           # miss: B recomputes its long prefix
    assert c.resume_if_appended() == c.ends[6]


def test_fig7_lru_refresh_all_evicts_s6_and_c_misses_when_appending():
    b, c, gone = figure7("lru-refresh")
    assert gone == ["S6"]
    assert b.resume_if_forked_at(1) == b.ends[1]
    assert c.resume_if_appended() == 0             # miss: C's latest state was displaced


def test_fig7_histate_sparsifies_s2_and_both_sessions_keep_their_reuse():
    b, c, gone = figure7("histate")
    assert gone == ["S2"]
    assert b.resume_if_forked_at(1) == b.ends[1]
    assert c.resume_if_appended() == c.ends[6]
    # Forking at S2 now resumes from S1 and recomputes only the short gap.
    assert b.resume_if_forked_at(2) == b.ends[1]
    assert b.ends[2] - b.ends[1] == 128


@pytest.mark.parametrize("policy", ["lru", "lru-vllm", "histate"])
def test_fig3a_an_early_checkpoint_until_the_session_forks_there(policy):
    """Fig. 3(a): A saves S1 after a long first turn, advances eight short turns beside D,
    then forks at S1.  LRU has evicted S1 by then; HiState keeps it (it is costly to
    rebuild and refresh-all keeps it recent) and sparsifies the cheap states instead."""
    store = make_store(policy, state_slots=8.5)
    a, d = Session(store, "A"), Session(store, "D")
    a.turn(1, 1536)
    d.turn(1, 1024)
    for t in range(2, 10):
        a.turn(t, 128)
        d.turn(t, 128)
    assert store.stats()["evictions"] > 0
    assert a.resume_if_appended() == a.ends[9]
    if policy == "histate":
        assert a.resume_if_forked_at(1) == a.ends[1]
    else:
        assert not a.has(1) and a.resume_if_forked_at(1) == 0


def figure3b(policy: str, turns: int) -> tuple[Session, Session, Session]:
    """C finishes turn 6 and waits for tool results while A and B append ``turns`` turns each."""
    store = make_store(policy, state_slots=8.5)
    a, b, c = Session(store, "A"), Session(store, "B"), Session(store, "C")
    a.turn(1, 1024)
    b.turn(1, 1024)
    c.turn(6, 1024)
    for t in range(2, 2 + turns):
        a.turn(t, 64)
        b.turn(t, 64)
    assert store.stats()["evictions"] > 0
    assert a.resume_if_appended() == a.tokens.size and b.resume_if_appended() == b.tokens.size
    return a, b, c


@pytest.mark.parametrize("policy", ["lru", "lru-refresh", "histate"])
def test_fig3b_a_slow_session_keeps_its_terminal_state(policy):
    """Fig. 3(b): A's and B's newer checkpoints push C's S6 out under LRU (with or without
    refresh-all); HiState evicts A's and B's cheap intermediate states instead."""
    a, b, c = figure3b(policy, turns=3)
    if policy == "histate":
        assert c.resume_if_appended() == c.ends[6]
    else:
        assert not c.has(6) and c.resume_if_appended() == 0


def test_histate_still_reclaims_a_session_that_stays_cold():
    """§3.3: a stale bundle gets no refresh and eventually ranks below the active sessions'
    checkpoints (recency still counts: tau turns cost into time)."""
    a, b, c = figure3b("histate", turns=6)
    assert not c.has(6)
