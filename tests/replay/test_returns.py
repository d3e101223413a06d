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
