"""``python -m benchmarks calibrate``: SGLang's own radix cache driven over the replay's
requests (issue 15, part 1), checked against an independent oracle."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("sglang") is None:   # not importorskip: sglang/__init__ is skipped
    pytest.skip("SGLang is not installed (pip install --no-deps sglang)", allow_module_level=True)

from benchmarks.calibrate import calibrate, plot_calibration, sglang_hits
from hybridstore.replay.loaders import load
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import ReplayConfig, merged_requests
from hybridstore.replay.tokens import session_tokens

N = 40


@pytest.fixture(scope="module")
def trace():
    return load(str(weka_sample()))


def test_with_room_for_everything_sglang_hits_the_deepest_earlier_prompt_end(trace):
    """No eviction: SGLang keeps a state at each prompt's end only, so a request hits the
    longest earlier prompt that is a prefix of it."""
    order = merged_requests(trace)[:N]
    its = {s.id: session_tokens(s) for s in trace.sessions}
    toks = [next(its[r.session]) for r in order]
    want = []
    for i, cur in enumerate(toks):
        best = 0
        for prev in toks[:i]:
            if len(prev) <= len(cur) and np.array_equal(cur[:len(prev)], prev):
                best = max(best, len(prev))
        want.append(best)
    got = sglang_hits(trace, ReplayConfig(discipline="sequential", budget=50.0, max_requests=N))
    assert got == want and sum(want) > 0


def test_a_tight_budget_costs_sglang_hits_and_the_document_has_every_preset(trace, tmp_path):
    doc = calibrate(trace, [0.05, 50.0], ["vllm-marconi", "sglang-hicache"], max_requests=N)
    tight, roomy = doc["rows"]
    assert set(tight) == {"budget", "sglang_radix_cache", "vllm-marconi", "sglang-hicache",
                          "diverging", "refused", "seconds"}
    assert 0 <= tight["sglang_radix_cache"] < roomy["sglang_radix_cache"] <= 1
    assert 0 <= tight["vllm-marconi"] <= roomy["vllm-marconi"] <= 1
    # At 5 % some prompts are longer than the KV pool: neither SGLang nor a preset with its
    # split pools holds them; vLLM's one budget lets KV use the Mamba share too.
    refused = tight["refused"]
    assert refused["sglang_radix_cache"] == refused["sglang-hicache"] > 0
    assert 0 < refused["vllm-marconi"] <= refused["sglang_radix_cache"]
    assert set(roomy["refused"].values()) == {0}
    plot_calibration(doc, str(tmp_path / "cal.png"))
    assert (tmp_path / "cal.png").stat().st_size > 10_000


def test_sglang_keeps_its_kv_pool_within_its_size(trace):
    """The driver hands SGLang the KV row a prefill leaves (the matched prefix's indices, then
    fresh ones) and lets its insert free the duplicates: the pool never holds more than its
    size, so a tight budget cannot look roomier than it is."""
    cfg = ReplayConfig(discipline="sequential", budget=0.1, max_requests=N)
    from benchmarks.calibrate import SGLangRadixCache
    from hybridstore.replay.model_presets import model_preset
    from hybridstore.replay.sim import kv_footprint

    model = model_preset(cfg.model)
    size = int(0.1 * kv_footprint(trace, cfg, model) / model.kv_bytes_per_token)
    cache = SGLangRadixCache(size, 8)
    its = {s.id: session_tokens(s) for s in trace.sessions}
    for r in merged_requests(trace)[:N]:
        cache.serve(next(its[r.session]))
        assert cache.kv.available_size() + cache.cache.full_evictable_size() <= size


@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_the_calibrated_preset_is_within_one_point_of_sglangs_own_cache(trace, budget):
    """``sglang-hicache`` follows UnifiedRadixCache's placement and eviction: on the same
    requests and pools its token hit rate is within one point of the real cache's, under
    pressure (both lose hits to eviction at this budget)."""
    doc = calibrate(trace, [budget, 50.0], ["sglang-hicache"], max_requests=N)
    row, roomy = doc["rows"]
    assert row["sglang_radix_cache"] < roomy["sglang_radix_cache"] - 0.01   # the budget bites
    assert abs(row["sglang-hicache"] - row["sglang_radix_cache"]) <= 0.01


def test_extra_buffer_with_room_for_everything_hits_the_deepest_tracked_position(trace):
    """No eviction, SGLang with the Mamba extra buffer (page 64): a request hits the deepest
    position at which an earlier request tracked a state and that its prompt shares. The
    oracle (``tests/policy/test_chunk_track.py``) re-derives the tracked positions from the
    scheduler's rule in plain Python, with no SGLang code; the same oracle checks the
    ``sglang-extra`` preset."""
    from tests.policy.test_chunk_track import extra_buffer_oracle

    order = merged_requests(trace)[:N]
    its = {s.id: session_tokens(s) for s in trace.sessions}
    toks = [next(its[r.session]) for r in order]
    want = extra_buffer_oracle(toks)
    got = sglang_hits(trace, ReplayConfig(discipline="sequential", budget=50.0, max_requests=N),
                      "extra_buffer")
    assert got == want and sum(want) > 0
    # the branch points and the chunks matter on this slice: without either the rule
    # would keep other states
    assert extra_buffer_oracle(toks, branches=False) != want
    assert extra_buffer_oracle(toks, chunk=10**9) != want


@pytest.mark.parametrize("budget", [0.1, 0.2])
def test_sglang_extra_follows_sglangs_extra_buffer_cache(trace, budget):
    """``sglang-extra`` (chunk-track placement, KV up to the last state, split pools,
    ``lru-radix``) against SGLang's cache with the extra buffer, page 64, on the same
    requests and pools: within one point, under pressure."""
    doc = calibrate(trace, [budget, 50.0], ["sglang-extra"], max_requests=N,
                    sglang_mode="extra_buffer")
    row, roomy = doc["rows"]
    assert doc["sglang_mode"] == "extra_buffer"
    assert row["sglang_radix_cache"] < roomy["sglang_radix_cache"] - 0.01   # the budget bites
    assert abs(row["sglang-extra"] - row["sglang_radix_cache"]) <= 0.01
    assert abs(roomy["sglang-extra"] - roomy["sglang_radix_cache"]) <= 0.001
