"""``lru-radix``: SGLang's KV eviction takes leaves only, each whole with its state."""

from __future__ import annotations

from tests.policy.sessions import PAGE, STATE, B, Session, make_store


def _engine_turn(session: Session, new_tokens: int) -> int:
    """A turn as the replay's engine serves it: match, release the plan (the prefill ran),
    then put the new pages and the state at the end.  The resumed path is refreshed
    before the new pages are put, so its last page is older than the leaf below it."""
    store = session.store
    resumed = session.begin(new_tokens)
    store.release(session._plan)
    store.put_kv_sized(session._prompt, nbytes=PAGE, first_block=resumed // B)
    store.put_state_sized(session._prompt, nbytes=STATE)
    session.ends[len(session.ends) + 1] = len(session.tokens)
    return resumed


def test_an_inner_state_whose_page_is_older_than_its_subtree_stays():
    """States on page boundaries (SGLang's extra buffer): A's second turn resumes from S1
    and stores a deeper leaf, so S1's last page is older than the leaf (the match
    refreshed it before the leaf was put).  SGLang's leaf heap never offers S1's node
    while a leaf hangs below it: KV pressure takes the leaf with S2 and S1 stays (it
    used to be dropped first, for nothing: S2 still needed its page)."""
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
