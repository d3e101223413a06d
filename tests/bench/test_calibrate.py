"""``python -m benchmarks calibrate``: SGLang's own radix cache driven over the replay's
requests (issue 15, part 1), checked against an independent oracle."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("sglang") is None:   # not importorskip: sglang/__init__ is skipped
    pytest.skip("SGLang is not installed (pip install --no-deps sglang)", allow_module_level=True)

from benchmarks.calibrate import calibrate, sglang_hits
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


def test_a_tight_budget_costs_sglang_hits_and_the_document_has_every_preset(trace):
    doc = calibrate(trace, [0.05, 50.0], ["vllm-marconi"], max_requests=N)
    tight, roomy = doc["rows"]
    assert set(tight) == {"budget", "sglang_radix_cache", "vllm-marconi", "seconds"}
    assert 0 <= tight["sglang_radix_cache"] < roomy["sglang_radix_cache"] <= 1
    assert 0 <= tight["vllm-marconi"] <= roomy["vllm-marconi"] <= 1
