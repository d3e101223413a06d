"""``chunk-track``: SGLang's extra-buffer placement (one state per prefill chunk, or the
branch point inside it), and the ``sglang-extra`` preset that uses it."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore.errors import ConfigError
from hybridstore.policy import placement_policy


def test_one_state_per_chunk_at_its_last_grid_position():
    p = placement_policy("chunk-track", block_size=64, chunk=1024)
    # chunks [128, 1152), [1152, 2176), [2176, 2500): the last one ends off the grid
    assert p.positions(cached=128, length=2500) == [1152, 2176, 2496]
    # a last chunk shorter than the grid tracks nothing; so does a short segment
    assert p.positions(cached=0, length=1024 + 40) == [1024]
    assert p.positions(cached=64, length=100) == []


def test_the_branch_point_replaces_its_chunks_state():
    p = placement_policy("chunk-track", block_size=64, chunk=1024)
    # the branch (floored to the grid) inside the first chunk replaces that chunk's state;
    # the later chunks keep theirs
    assert p.positions(cached=0, length=2500, anchors=[700]) == [640, 2048, 2496]
    # a branch at a chunk's end or outside the segment changes nothing
    assert p.positions(cached=0, length=2500, anchors=[1024]) == [1024, 2048, 2496]
    assert p.positions(cached=1024, length=2500, anchors=[512]) == [2048, 2496]


def test_bad_parameters_are_refused():
    with pytest.raises(ConfigError):
        placement_policy("chunk-track", block_size=64, chunk=32)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def extra_buffer_oracle(prompts: list[np.ndarray], chunk: int = 8192, grid: int = 64,
                        branches: bool = True) -> list[int]:
    """Per-request hits of SGLang's extra-buffer cache with room for everything, derived
    in plain Python from the scheduler's rule: a request hits the deepest state an earlier
    one left on its prefix; its prefill from there tracks one state per ``chunk`` at the
    chunk's last grid position, or at the branch point (the KV the tree holds, i.e. the
    longest prefix shared with an earlier inserted key, floored to the grid, where it runs
    past the hit) when that lies inside the chunk; the insert stops at that state."""
    states: list[np.ndarray] = []       # the inserted keys, each ending at a state
    hits = []
    for cur in prompts:
        hit = max((len(k) for k in states if len(k) <= len(cur)
                   and np.array_equal(cur[:len(k)], k)), default=0)
        kv = max((_lcp(cur, k) for k in states), default=0) // grid * grid
        branch = kv if kv > hit and branches else None
        hits.append(hit)
        s = hit
        while s < len(cur):
            e = min(s + chunk, len(cur))
            if e - s >= grid:
                t = branch if branch is not None and s < branch < e else s + (e - s) // grid * grid
                states.append(cur[:t])
            s = e
    return hits


def test_sglang_extra_with_room_for_everything_matches_the_oracle():
    """The preset (placement, branch hint, KV kept only up to the last state) hits exactly
    what SGLang's extra-buffer rule keeps, request by request, on the bundled sample."""
    from hybridstore.replay.loaders import load
    from hybridstore.replay.samples import weka_sample
    from hybridstore.replay.sim import ReplayConfig, merged_requests, replay
    from hybridstore.replay.tokens import session_tokens

    trace = load(str(weka_sample()))
    n = 60
    order = merged_requests(trace)[:n]
    its = {s.id: session_tokens(s) for s in trace.sessions}
    want = extra_buffer_oracle([next(its[r.session]) for r in order])
    run = replay(trace, ["sglang-extra"], ReplayConfig(discipline="sequential", budget=50.0,
                                                      max_requests=n), progress=False)
    got = [r.hit_tokens for r in run["sglang-extra"].results]
    assert got == want and sum(want) > 0


def test_sglang_extra_keeps_no_kv_past_its_last_state():
    from hybridstore.replay.model_presets import model_preset
    from hybridstore.replay.systems import preset

    p = preset("sglang-extra")
    assert p.kv_to_last_state and p.branch and p.tier_policy == "partition"
    place = p.placement(model_preset("qwen3.5-9b"), 64)
    assert place.positions(cached=0, length=1000) == [960]
