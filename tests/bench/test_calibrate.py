"""``python -m benchmarks calibrate``: SGLang's own radix cache and vLLM's own KV cache
manager driven over the replay's requests (issue 15, part 1), each checked against an
independent oracle, and the presets that follow them within a point."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from benchmarks.calibrate import (
    calibrate,
    plot_calibration,
    sglang_hits,
    vllm_cache,
    vllm_run,
)
from hybridstore.replay.loaders import load
from hybridstore.replay.model_presets import model_preset, vllm_hybrid_pages
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import ReplayConfig, merged_requests
from hybridstore.replay.systems import VLLM_MAX_BATCHED_TOKENS
from hybridstore.replay.tokens import session_tokens

# not importorskip: sglang/__init__ is skipped
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="SGLang is not installed (pip install --no-deps sglang)")

N = 40


@pytest.fixture(scope="module")
def trace():
    return load(str(weka_sample()))


@needs_sglang
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


@needs_sglang
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


@needs_sglang
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


@needs_sglang
@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_the_calibrated_preset_is_within_one_point_of_sglangs_own_cache(trace, budget):
    """``sglang-hicache`` follows UnifiedRadixCache's placement and eviction: on the same
    requests and pools its token hit rate is within one point of the real cache's, under
    pressure (both lose hits to eviction at this budget)."""
    doc = calibrate(trace, [budget, 50.0], ["sglang-hicache"], max_requests=N)
    row, roomy = doc["rows"]
    assert row["sglang_radix_cache"] < roomy["sglang_radix_cache"] - 0.01   # the budget bites
    assert abs(row["sglang-hicache"] - row["sglang_radix_cache"]) <= 0.01


@pytest.fixture(scope="module")
def vllm():
    """vLLM's scheduler (skips without vLLM: pip install --no-deps vllm)."""
    return pytest.importorskip("vllm.v1.core.sched.scheduler")


def test_vllm_hybrid_pages_follow_its_block_size_rule():
    """qwen3.5-9b (8 attention layers of 4,196 B/token, 24 recurrent layers of 2.08 MB):
    the attention block is raised to 512 tokens (32 kernel blocks of 16) so that a page
    covers a layer's state; groups of 8 layers, so a state takes 3 blocks."""
    pages = vllm_hybrid_pages(model_preset("qwen3.5-9b"))
    assert (pages.block_tokens, pages.group_layers, pages.attention_groups,
            pages.mamba_groups) == (512, 8, 1, 3)
    m = model_preset("qwen3.5-9b")
    assert pages.block_bytes == pytest.approx(512 * m.kv_bytes_per_token)
    assert 3 * pages.block_bytes >= m.checkpoint_bytes


def test_with_room_for_everything_vllm_hits_its_deepest_align_state(trace, vllm):
    """No eviction: vLLM's align mode keeps a state at every prefill chunk's end and at the
    prompt's last block boundary before its last token, and a request hits the deepest
    such state of an earlier request that prefixes it (below its own last token)."""
    B = vllm_hybrid_pages(model_preset("qwen3.5-9b")).block_tokens
    step = VLLM_MAX_BATCHED_TOKENS // B * B
    order = merged_requests(trace)[:N]
    its = {s.id: session_tokens(s) for s in trace.sessions}
    states: list[tuple[np.ndarray, set[int]]] = []
    want = []
    for cur in (next(its[r.session]) for r in order):
        n = len(cur)
        hit = max((p for prev, ps in states for p in ps
                   if p <= n - 1 and np.array_equal(cur[:p], prev[:p])), default=0)
        want.append(hit)
        last = (n - 1) // B * B
        states.append((cur, set(range(hit + step, last, step)) | ({last} if last > hit else set())))
    got, refused = vllm_run(trace, ReplayConfig(discipline="sequential", budget=50.0,
                                                max_requests=N))
    assert got == want and refused == 0
    assert sum(w % B != 0 for w in want) == 0 and sum(w % step != 0 for w in want) > 0


def test_the_vllm_preset_is_within_one_point_of_vllms_own_cache(trace, vllm, tmp_path):
    """``vllm-marconi`` follows vLLM's align mode and block pool: on the same requests and
    one pool its token hit rate is within one point of the real manager's, under pressure
    (both lose hits to eviction at these budgets).  (At 10-20 % of this 40-request slice
    a few 100K-token prompts fill the pool, and vLLM's fixed overheads, docs/replay.md,
    decide whether a session's prefix survives: not a test of the policy.)"""
    doc = calibrate(trace, [0.3, 0.4, 50.0], ["vllm-marconi"], max_requests=N, engine="vllm")
    *tight, roomy = doc["rows"]
    assert doc["engine"] == "vllm" and "vllm_prefix_cache" in roomy
    for row in tight:
        assert row["vllm_prefix_cache"] < roomy["vllm_prefix_cache"] - 0.01   # the budget bites
        assert abs(row["vllm-marconi"] - row["vllm_prefix_cache"]) <= 0.01
    assert roomy["vllm-marconi"] == roomy["vllm_prefix_cache"]
    plot_calibration(doc, str(tmp_path / "cal.png"))
    assert (tmp_path / "cal.png").stat().st_size > 10_000


def _serve_all(cache, trace, n=N):
    its = {s.id: session_tokens(s) for s in trace.sessions}
    return [cache.serve(next(its[r.session])) for r in merged_requests(trace)[:n]]


def test_vllms_cpu_offloading_restores_what_its_gpu_pool_lost(trace, vllm):
    """vLLM's OffloadingConnector (its real scheduler side and ``CPUOffloadingManager``,
    driven by the real scheduler; the worker's transfers done at once): behind a GPU pool
    that loses hits at 20 %, a CPU tier with room for everything gives every request the
    hit it has with room for everything, the rest restored from the CPU tier; a small CPU
    tier restores less."""
    roomy, _ = vllm_run(trace, ReplayConfig(discipline="sequential", budget=50.0,
                                            max_requests=N))
    gpu, _ = vllm_run(trace, ReplayConfig(discipline="sequential", budget=0.2, max_requests=N))
    big = vllm_cache(trace, ReplayConfig(discipline="sequential", budget=0.2, max_requests=N,
                                         host_ratio=100.0))
    hits = _serve_all(big, trace)
    assert big.offload is not None and big.skipped == 0
    assert sum(gpu) < sum(roomy) and hits == roomy
    assert all(0 <= c <= h for c, h in zip(big.cpu_hits, hits))
    assert sum(big.cpu_hits) > 0
    small = vllm_cache(trace, ReplayConfig(discipline="sequential", budget=0.2, max_requests=N,
                                           host_ratio=1.0))
    assert small.offload._num_chunks < big.offload._num_chunks
    _serve_all(small, trace)
    assert 0 < sum(small.cpu_hits) < sum(big.cpu_hits)


def test_vllm_cpu_follows_vllms_cpu_offloading(trace, vllm):
    """``vllm-cpu`` (the GPU side as ``vllm-marconi``, a host tier of as much as vLLM's CPU
    tier, ranked as vLLM's offloading LRU ranks it) against vLLM with its CPU offloading
    connector, CPU tier 2 x the GPU pool: within a point, request for request but one, at
    budgets where the CPU tier holds what the GPU pool lost (the GPU-only preset is far
    below)."""
    doc = calibrate(trace, [0.1, 0.2], ["vllm-cpu", "vllm-marconi"], max_requests=N,
                    engine="vllm", host_ratio=2.0)
    assert doc["host_ratio"] == 2.0
    for row in doc["rows"]:
        assert row["cpu_hit_rate"] > 0.01                               # the CPU tier serves
        assert row["vllm-marconi"] < row["vllm_prefix_cache"] - 0.05    # and matters
        assert abs(row["vllm-cpu"] - row["vllm_prefix_cache"]) <= 0.01
        assert row["diverging"]["vllm-cpu"] <= 1


def test_vllm_disk_follows_vllms_fs_tier(trace, vllm):
    """``vllm-disk`` (``vllm-cpu`` with a disk tier without a limit behind its host tier)
    against vLLM's ``TieringOffloadingSpec``: its CPU tier as primary and its ``fs`` tier,
    which never evicts, writing real files (promotions back into the CPU tier included).
    Behind a CPU tier as large as the GPU pool at 20 %, vLLM's disk tier keeps every
    request's hit as with room for everything, which its CPU tier alone does not; the
    preset keeps the same, request for request."""
    roomy, _ = vllm_run(trace, ReplayConfig(discipline="sequential", budget=50.0,
                                            max_requests=N))
    cpu, _ = vllm_run(trace, ReplayConfig(discipline="sequential", budget=0.2,
                                          max_requests=N, host_ratio=1.0))
    doc = calibrate(trace, [0.2], ["vllm-disk"], max_requests=N, engine="vllm",
                    host_ratio=1.0, disk=True)
    (row,) = doc["rows"]
    inp = sum(r.input_tokens for r in merged_requests(trace)[:N])
    assert doc["disk"] and sum(cpu) < sum(roomy) - 0.05 * inp
    assert row["vllm_prefix_cache"] == pytest.approx(sum(roomy) / inp)
    assert row["vllm-disk"] == row["vllm_prefix_cache"] and row["diverging"]["vllm-disk"] == 0


@needs_sglang
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


@needs_sglang
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
