"""Abandoned-branch demotion (``policy="hybridstore"``): the dead end of a rewritten turn goes first.

Scenarios on a real store with accounting tiers (``tests/policy/sessions.py``): an
agent rewrites its last turn (the prompt leaves the previous turn's checkpoint after
its parent), a caller's lookup stops before a branch (not a rewrite), a sibling
session continues a shared prefix (a live branch), and the eviction order that follows.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore.policy.base import abandoned_branches
from tests.policy.sessions import STATE, Session, make_store


def rewrite(session: Session, turn: int, new_tokens: int) -> None:
    """The session's next request keeps its context up to turn ``turn`` and rewrites the rest."""
    session.tokens = session.tokens[: session.ends[turn]]
    session.ends = {t: p for t, p in session.ends.items() if p <= session.ends[turn]}
    session.turn(max(session.ends) + 1, new_tokens)


def two_turns(policy: str) -> Session:
    """A session of a long first turn and a short second one (resumed from S1: S1 has a
    hit, S2 none)."""
    a = Session(make_store(policy, state_slots=16), "A")
    a.turn(1, 4096)
    a.turn(2, 256)
    return a


def test_the_rewritten_turns_checkpoint_is_abandoned_and_ranked_never_used():
    a = two_turns("hybridstore")
    s1, s2 = a.checkpoint(1), a.checkpoint(2)
    assert s1 is not None and s2 is not None and s1.hits == 1 and s2.atime > 0
    e1, e2 = a.ends[1], a.ends[2]
    assert abandoned_branches(s1, e2, e2, continues=False) == [s2]    # passed over: off its path
    assert abandoned_branches(s1, e1, e2, continues=False) == []      # a lookup stopping at S1
    assert abandoned_branches(s1, e1 + 100, e1, continues=True) == [s2]   # goes on differently
    assert abandoned_branches(s1, e1 + 8, e1, continues=False) == []  # ends inside the block
    rewrite(a, 1, 100)                 # turn 2 rewritten: resumes at S1, leaves S2
    assert s2.atime == 0 and s1.atime > 0
    assert a.checkpoint(2) is not None   # demoted, not dropped


def test_histate_alone_keeps_the_dead_ends_recency():
    a = two_turns("histate")
    s2 = a.checkpoint(2)
    assert s2 is not None
    before = s2.atime
    rewrite(a, 1, 300)
    assert s2.atime == before > 0


def test_a_lookup_that_stops_before_a_branch_leaves_it_alone():
    a = two_turns("hybridstore")
    store = a.store
    s2 = a.checkpoint(2)
    assert s2 is not None
    atime = s2.atime
    # An engine's lookup of the same context capped before S2 (vLLM asks per chunk).
    plan = store.match(store.prefix(a.tokens), max_position=a.ends[1])
    store.release(plan)
    assert plan.position == a.ends[1] and s2.atime == atime
    # The whole prompt again resumes at S2: S2 is on its path.
    plan = store.match(store.prefix(np.concatenate([a.tokens, np.arange(10**9, 10**9 + 40)])))
    store.release(plan)
    assert plan.position == a.ends[2] and s2.atime > atime


def test_a_branch_someone_resumed_from_is_a_live_session_not_a_dead_end():
    store = make_store("hybridstore", state_slots=16)
    a = Session(store, "A")
    a.turn(1, 1024)
    b = a.fork(1, "B")                 # B shares A's first turn (a common prefix)
    b.turn(2, 512)
    b.turn(3, 256)                     # B resumed from its own S2: its branch is live
    b2, b3 = b.checkpoint(2), b.checkpoint(3)
    assert b2 is not None and b3 is not None and b2.hits == 1
    atimes = (b2.atime, b3.atime)
    a.turn(2, 512)                     # A resumes at the shared S1 and leaves B's branch
    assert (b2.atime, b3.atime) == atimes


def test_a_branch_reaching_far_past_the_divergence_is_not_an_edit():
    """Another conversation after a shared system prompt: its first turn (never resumed
    yet) goes on far past where a new prompt leaves it; its next turn may still come."""
    store = make_store("hybridstore", state_slots=16)
    a = Session(store, "A")
    a.turn(1, 1024)                    # a shared system prompt
    b = a.fork(1, "B")
    b.turn(2, 2048)                    # B's first question and answer, not resumed yet
    b2 = b.checkpoint(2)
    assert b2 is not None and b2.hits == 0
    atime = b2.atime
    a.turn(2, 512)                     # A leaves B's branch at the shared prefix
    assert b2.atime == atime
    s1 = a.checkpoint(1)
    assert s1 is not None
    assert abandoned_branches(s1, a.ends[2], a.ends[1], continues=True) == []


def test_branches_at_a_prefix_many_sessions_continue_are_other_sessions_not_edits():
    """A document several conversations ask about (Mooncake's shape): each question is a
    short branch after the shared checkpoint, never resumed yet, and a new question leaves
    them all there.  They are other sessions whose next turns may come, not the dead ends
    of a rewritten turn (measured: docs/replay.md, "Branches at a shared prefix")."""
    store = make_store("hybridstore", state_slots=16)
    doc = Session(store, "D")
    doc.turn(1, 4096)                  # the shared document
    asked = [doc.fork(1, name) for name in ("B", "C", "E")]
    for q in asked:
        q.turn(2, 256)                 # short questions: within REWRITE_SPAN of the document
    tips = [q.checkpoint(2) for q in asked]
    assert all(ck is not None and ck.hits == 0 for ck in tips)
    atimes = [ck.atime for ck in tips]
    s1 = doc.checkpoint(1)
    assert s1 is not None and len(s1.children) == 3
    assert abandoned_branches(s1, doc.ends[1] + 256, doc.ends[1], continues=True) == []
    doc.turn(2, 256)                   # another question leaves the three at the document
    assert [ck.atime for ck in tips] == atimes


def test_one_sibling_beside_the_rewritten_turn_still_counts_as_an_edit():
    """An agent that rewrites its last turn twice: the second rewrite leaves the original
    turn (already a dead end) and the first rewrite, two children of its resume point."""
    a = two_turns("hybridstore")
    rewrite(a, 1, 100)                 # the first rewrite: S2 is a dead end
    first = a.checkpoint(2)
    assert first is not None and first.atime > 0
    rewrite(a, 1, 120)                 # the second: leaves the first rewrite too
    assert first.atime == 0


@pytest.mark.parametrize("policy, first_to_go", [("hybridstore", "A2"), ("histate", "C1")])
def test_under_pressure_the_dead_end_goes_before_an_idle_live_session(policy, first_to_go):
    store = make_store(policy, state_slots=6)
    c = Session(store, "C")
    c.turn(1, 2048)                    # an idle session, its next turn still to come
    a = Session(store, "A")
    a.turn(1, 3072)
    a.turn(2, 256)
    a2, c1 = a.checkpoint(2), c.checkpoint(1)
    assert a2 is not None and c1 is not None
    rewrite(a, 1, 256)                 # A's turn 2 is rewritten: A2 is a dead end
    assert store.evict(STATE, "host") >= STATE
    gone = [name for name, ck in (("C1", c1), ("A2", a2)) if store.index.checkpoint(ck.key) is None]
    assert gone == [first_to_go], policy
    assert c.resume_if_appended() == (c.ends[1] if first_to_go == "A2" else 0)
