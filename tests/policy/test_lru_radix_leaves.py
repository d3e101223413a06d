"""``lru-radix``: SGLang's KV eviction takes leaves only, each whole with its state."""

from __future__ import annotations

from tests.policy.sessions import PAGE, STATE, B, Session, make_store


def _engine_turn(session: Session, new_tokens: int) -> int:
    """A turn as the replay's engine serves it: match, release the plan (the prefill ran),
    then put the new pages and the state at the end.  The resumed path is refreshed
    before the new pages are put (the put then touches the whole path again)."""
    store = session.store
    resumed = session.begin(new_tokens)
    store.release(session._plan)
    store.put_kv_sized(session._prompt, nbytes=PAGE, first_block=resumed // B)
    store.put_state_sized(session._prompt, nbytes=STATE)
    session.ends[len(session.ends) + 1] = len(session.tokens)
    return resumed


def test_kv_pressure_takes_the_leaf_and_keeps_the_inner_state():
    """States on page boundaries (SGLang's extra buffer), turns served as the replay's
    engine serves them: KV pressure takes A's leaf with S2, the least recently used leaf,
    and S1, now an inner node's state, stays with its path."""
    store = make_store("lru-radix", state_slots=4)      # KV pool: 4 x 1024 tokens, 4 states
    a, b, c = Session(store, "A"), Session(store, "B"), Session(store, "C")
    _engine_turn(a, 1024)                               # S1 on a page boundary
    assert _engine_turn(a, 480) == 1024                 # leaf [1024, 1504), S2
    _engine_turn(b, 1024)
    _engine_turn(c, 2000)                               # needs A's leaf
    assert a.has(1) and not a.has(2)
    assert a.resume_if_appended() == 1024
    assert b.resume_if_appended() == 1024 and c.resume_if_appended() == 2000


def test_a_leaf_goes_whole():
    """SGLang deletes a leaf node at once: the state and every page only it needed, even
    when the allocation needed fewer."""
    store = make_store("lru-radix", state_slots=4)
    a, b = Session(store, "A"), Session(store, "B")
    a.turn(1, 1024)
    a.turn(2, 960)                                      # leaf [1024, 1984): 60 pages
    b.turn(1, 2200)                                     # 4096 - 1984 = 2112 free: 6 pages short
    assert not a.has(2) and a.has(1)
    kv = store.stats()
    assert kv["evictions"] >= 1 + 60


def test_a_reused_ranking_never_takes_an_inner_state():
    """In a large tier the store reuses one ranking for several evictions, so it can reach
    a page after the path below it has grown.  A's states S1 (512) and S2 (1024) are ranked
    while old; A then resumes from S2 and grows a leaf (S3) that needs more room.  The next eviction resumes the
    old ranking at A's path: S1's page is now inside the tree (S2 and S3 need it), and
    SGLang's leaf heap would never offer S1's node, so S1 must stay (it used to be
    evicted there, freeing nothing)."""
    store = make_store("lru-radix", state_slots=16)      # KV: 16 x 1024 tokens = 1024 pages
    old = Session(store, "O")
    _engine_turn(old, 1024)                             # the oldest: goes first
    a = Session(store, "A")
    _engine_turn(a, 512)                                # S1 at 512
    _engine_turn(a, 512)                                # S2 at 1024
    for i in range(7):
        _engine_turn(Session(store, f"F{i}"), 2048)     # the KV pool is full
    _engine_turn(Session(store, "G"), 100)              # evicts O (the ranking is made)
    assert not old.has(1) and a.has(1) and a.has(2)
    assert _engine_turn(a, 1200) == 1024                # S3; room from the next leaves
    assert a.has(1) and a.has(2) and a.has(3)
    assert a.resume_if_forked_at(1) == 512
