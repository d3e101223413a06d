"""The replay dates uses by its simulated time (``sim.SimClock``), so ``hybridstore``'s
predicted returns work in it: sessions in lockstep (HiState's microbenchmark) are the
pattern least-recently-used order gets exactly wrong."""

from __future__ import annotations

from hybridstore.replay.loaders import load
from hybridstore.replay.sim import ReplayConfig, replay_policy


def test_sessions_in_lockstep_keep_their_contexts_under_hybridstore():
    trace = load("synthetic:agent?sessions=12&turns=8&new=4096")
    cfg = ReplayConfig(discipline="sequential", budget=0.1)
    hit = {name: replay_policy(trace, name, cfg, progress=False).summary()["token_hit_rate"]
           for name in ("hybridstore", "vllm-marconi", "histate")}
    # LRU order evicts exactly the session due next: the others keep almost nothing
    assert max(hit["vllm-marconi"], hit["histate"]) < 0.02, hit
    assert hit["hybridstore"] > 0.08, hit


def _whole_misses(run) -> int:
    """Requests after a session's first that hit nothing: their session was gone whole."""
    return sum(1 for r in run.results if r.index > 0 and r.hit_tokens == 0)


def test_room_comes_from_the_session_due_last_not_a_reused_ranking():
    """24 agent sessions in lockstep at 10 % with one budget (issue 27): a use moves a
    session to the end of ``hybridstore``'s order (its next use is a round away), so a
    ranking made before it is stale for it.  Reusing one (the store's shortcut for large
    tiers) skipped the sessions served since it was made, exactly those due last, and
    evicted the ones due next, whole: 224 of the 360 later requests then missed entirely
    and the token hit rate was 0.207.  Ranked afresh, the room comes from the sessions
    just served (0.270, 202)."""
    trace = load("synthetic:agent?mutation=0.05")
    cfg = ReplayConfig(discipline="sequential", budget=0.1, pools="unified")
    run = replay_policy(trace, "hybridstore", cfg, progress=False)
    assert run.summary()["token_hit_rate"] > 0.25
    assert _whole_misses(run) < 215


def test_a_rewound_session_keeps_its_new_branch():
    """Agents that rewind to an earlier turn and go on from there (``synthetic:rewind``, 10 %
    with one budget; issue 27): the branch written after a rewind used to inherit the gaps
    of the checkpoint it left from, which learns how often requests come back *to that
    point* (rarely), so the live branch looked due far off and went first: 0.143.  A branch
    below a branch point now starts from the default gap (``policy/nextuse.py``): 0.458."""
    trace = load("synthetic:rewind")
    cfg = ReplayConfig(discipline="sequential", budget=0.1, pools="unified")
    hit = {name: replay_policy(trace, name, cfg, progress=False).summary()["token_hit_rate"]
           for name in ("hybridstore", "histate")}
    assert hit["hybridstore"] > 0.4, hit
    assert hit["hybridstore"] > hit["histate"] + 0.2, hit
