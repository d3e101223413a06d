"""The sequential discipline, budgets as a fraction of the KV footprint, and the sweep
(issue 15, parts 2 and 4), on the bundled WEKA sample."""

from __future__ import annotations

import hashlib
import json
import math
from itertools import pairwise

import numpy as np
import pytest

from hybridstore.cli import main
from hybridstore.errors import ConfigError
from hybridstore.replay.loaders import load
from hybridstore.replay.model_presets import model_preset, vllm_hybrid_pages
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import (
    ReplayConfig,
    kv_footprint,
    merged_requests,
    replay,
    tier_budgets,
    tiering_of,
)
from hybridstore.replay.sweep import parse_budgets, sweep
from hybridstore.replay.systems import preset
from hybridstore.replay.tokens import session_tokens

N = 60


@pytest.fixture(scope="module")
def trace():
    return load(str(weka_sample()))


@pytest.fixture(scope="module")
def tokens(trace):
    """The synthesized token ids of the first N requests by trace time, in that order."""
    order = merged_requests(trace)[:N]
    its = {s.id: session_tokens(s) for s in trace.sessions}
    return order, [next(its[r.session]) for r in order]


def test_merged_order_is_by_time_and_keeps_each_session_in_order(trace):
    order = merged_requests(trace)
    assert len(order) == trace.n_requests
    seen: dict[str, int] = {}
    for r in order:
        assert seen.get(r.session, -1) == r.index - 1
        seen[r.session] = r.index
    starts = [r.arrival_s for r in order if r.index == 0]
    assert starts == sorted(starts)


def test_sequential_unlimited_hits_exactly_what_an_independent_oracle_finds(trace, tokens):
    """Unlimited keeps a state at every block end and every request end: a request's hit is
    the deepest of those, over all earlier requests, that its own tokens share."""
    order, toks = tokens
    B = trace.block_size
    want = []
    for i, cur in enumerate(toks):
        best = 0
        for prev in toks[:i]:
            n = min(len(prev), len(cur))
            diff = np.flatnonzero(prev[:n] != cur[:n])
            lcp = int(diff[0]) if diff.size else n
            cands = [lcp // B * B]
            if lcp == len(prev):
                cands.append(len(prev))
            best = max(best, *cands)
        want.append(best)
    cfg = ReplayConfig(discipline="sequential", max_requests=N)
    run = replay(trace, ["unlimited"], cfg, progress=False)["unlimited"]
    assert [(r.session, r.index) for r in run.results] == [(r.session, r.index) for r in order]
    got = [r.hit_tokens for r in run.results]
    assert got == want
    assert sum(got) > 0 and all(r.queue_s == 0 for r in run.results)


def test_the_kv_footprint_counts_every_distinct_prefix_block_once(trace, tokens):
    _, toks = tokens
    B = trace.block_size
    distinct = set()
    for t in toks:
        for end in range(B, len(t) + B, B):
            distinct.add(hashlib.blake2b(t[:min(end, len(t))].tobytes()).digest())
    model = model_preset("qwen3.5-9b")
    got = kv_footprint(trace, ReplayConfig(max_requests=N), model)
    assert got == len(distinct) * model.page_bytes(B)


def test_budgets_size_the_tiers_as_the_engines_split_them(trace):
    model = model_preset("qwen3.5-9b")
    fp = 10 << 30
    seq = ReplayConfig(discipline="sequential", budget=0.1, mamba_ratio=0.9)
    (only,) = tier_budgets(preset("vllm-disk"), seq, 1.0, fp)
    assert only.name == "device" and only.capacity_bytes == int(0.1 * fp * 1.9)
    # SGLang's split pools: states get ratio / (1 + ratio) of the cache
    assert tiering_of(preset("sglang-hicache"), seq).state_share == pytest.approx(0.9 / 1.9)
    assert tiering_of(preset("sglang-hicache"), ReplayConfig()).state_share == 0.5
    assert tiering_of(preset("vllm-disk"), seq).state_share is None
    split = ReplayConfig(discipline="sequential", budget=0.1, pools="split")
    unified = ReplayConfig(discipline="sequential", budget=0.1, pools="unified")
    assert tiering_of(preset("histate"), split).state_share == pytest.approx(0.9 / 1.9)
    assert tiering_of(preset("histate"), split).historical_to_ssd     # the rest is the preset's
    assert tiering_of(preset("sglang-hicache"), unified).state_share is None
    # the server discipline splits the same total over the preset's tiers, by the GiB ratios
    srv = ReplayConfig(budget=0.1, gpu_gib=1, host_gib=3, disk_gib=0)
    tiers = tier_budgets(preset("vllm-disk"), srv, 4.0, fp)
    assert [t.name for t in tiers] == ["device", "host"]
    assert sum(t.capacity_bytes for t in tiers) == pytest.approx(0.1 * fp * 1.9 / 4, abs=2)
    assert tiers[1].capacity_bytes == pytest.approx(3 * tiers[0].capacity_bytes, rel=1e-6)
    # unlimited ignores the budget; a budget needs the footprint
    assert tier_budgets(preset("unlimited"), seq, 1.0, fp)[0].capacity_bytes >= 1 << 60
    with pytest.raises(ConfigError):
        tier_budgets(preset("vllm-disk"), seq, 1.0, None)
    del model


def test_a_host_ratio_adds_a_host_tier_behind_the_budget(trace):
    """``host_ratio`` (vLLM's ``--kv-offloading-size`` as a multiple of its GPU pool): the
    first tier keeps the whole budget, a host tier gets ``host_ratio`` times it, in either
    discipline; presets without a host tier are unchanged; the host tier serves hits the
    GPU-only budget loses."""
    fp = 10 << 30
    for discipline in ("sequential", "server"):
        cfg = ReplayConfig(discipline=discipline, budget=0.1, host_ratio=2.0)
        tiers = tier_budgets(preset("vllm-cpu"), cfg, 1.0, fp)
        assert [(t.name, t.capacity_bytes) for t in tiers] == [
            ("device", int(0.1 * fp * 1.9)), ("host", int(2 * 0.1 * fp * 1.9))]
        assert [t.name for t in tier_budgets(preset("vllm-disk"), cfg, 1.0, fp)] == \
            ["device", "host"]
        (only,) = tier_budgets(preset("vllm-marconi"), cfg, 1.0, fp)
        block = vllm_hybrid_pages(model_preset("qwen3.5-9b")).block_bytes   # vLLM's pool:
        assert only.capacity_bytes == int((int(0.1 * fp * 1.9 // block) - 1) * block)  # less block 0
    # a disk tier behind it (vLLM's fs tier: no limit)
    inf = ReplayConfig(discipline="sequential", budget=0.1, host_ratio=2.0, disk_ratio=math.inf)
    *_, disk = tier_budgets(preset("vllm-disk"), inf, 1.0, fp)
    assert disk.name == "disk" and disk.capacity_bytes >= 1 << 60
    assert [t.name for t in tier_budgets(preset("vllm-cpu"), inf, 1.0, fp)] == ["device", "host"]
    with pytest.raises(ConfigError):
        ReplayConfig(discipline="sequential", budget=0.1, disk_ratio=1.0)   # no host tier
    gpu = ReplayConfig(discipline="sequential", budget=0.1, max_requests=40)
    cpu = ReplayConfig(discipline="sequential", budget=0.1, max_requests=40, host_ratio=2.0)
    alone = replay(trace, ["vllm-cpu"], gpu, progress=False)["vllm-cpu"].summary()
    behind = replay(trace, ["vllm-cpu"], cpu, progress=False)["vllm-cpu"].summary()
    assert "host" not in alone["restored_bytes"] and behind["restored_bytes"]["host"] > 0
    assert behind["token_hit_rate"] > alone["token_hit_rate"] + 0.05


def test_the_cli_takes_host_and_disk_ratios(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", "--discipline", "sequential", "--budget", "10%", "--host-ratio", "1",
                 "--disk-ratio", "inf", "--policy", "vllm-disk,vllm-cpu", "--max-requests", "20",
                 "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["host_ratio"] == 1.0 and doc["config"]["disk_ratio"] == math.inf
    for bad in (["--host-ratio", "-1"], ["--disk-ratio", "x"]):
        with pytest.raises(SystemExit):
            main(["replay", "--budget", "10%", *bad])


@pytest.mark.parametrize("bad", [{"discipline": "fifo"}, {"budget": 0}, {"budget": -1.0},
                                 {"pools": "shared"}, {"host_ratio": -1.0},
                                 {"host_ratio": 1.0, "disk_ratio": -1.0},
                                 {"budget": float("nan")}, {"mamba_ratio": -0.5},
                                 {"state_scale": 0.0}, {"state_scale": -1.0},
                                 {"state_scale": float("inf")}, {"state_scale": float("nan")},
                                 {"model": "no-such-model"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        ReplayConfig(**bad)


def test_a_state_scale_changes_the_states_bytes_and_nothing_else(trace, tmp_path):
    """``--state-scale``: checkpoints that many times the model's own, KV and compute as they
    were, the footprint (KV only) unchanged, vLLM's hybrid block following the state."""
    base = model_preset("qwen3.5-9b")
    half = ReplayConfig(discipline="sequential", budget=0.1, state_scale=0.5).full_model()
    assert half.checkpoint_bytes == base.checkpoint_bytes // 2
    assert (half.kv_bytes_per_token, half.active_params, half.prefill_flops) == \
        (base.kv_bytes_per_token, base.active_params, base.prefill_flops)
    assert ReplayConfig().full_model() is base
    assert vllm_hybrid_pages(half).block_tokens == vllm_hybrid_pages(base).block_tokens // 2
    cfg = ReplayConfig(discipline="sequential", budget=0.1, max_requests=N)
    assert kv_footprint(trace, cfg, half) == kv_footprint(trace, cfg, base)
    out = tmp_path / "r.json"
    assert main(["replay", "--discipline", "sequential", "--budget", "10%", "--state-scale", "0.25",
                 "--policy", "hybridstore", "--max-requests", "20", "--json", str(out),
                 "--no-progress"]) == 0
    assert json.loads(out.read_text())["config"]["state_scale"] == 0.25
    for bad in ("0", "-1", "inf", "x"):
        with pytest.raises(SystemExit):
            main(["replay", "--state-scale", bad])


def test_a_tight_budget_evicts_and_hits_less_and_unlimited_bounds_everyone(trace):
    names = ["unlimited", "vllm-marconi", "sglang-hicache", "histate"]
    roomy = replay(trace, names, ReplayConfig(discipline="sequential", budget=50.0,
                                              max_requests=N), progress=False)
    tight = replay(trace, names, ReplayConfig(discipline="sequential", budget=0.05,
                                              max_requests=N), progress=False)
    ref = roomy["unlimited"].summary()["token_hit_rate"]
    assert tight["unlimited"].summary()["token_hit_rate"] == ref
    ref_p99 = roomy["unlimited"].summary()["ttft_p99_s"]
    assert roomy["unlimited"].summary()["service_p99_s"] == ref_p99     # no queue here
    for name in names[1:]:
        r, t = roomy[name].summary(), tight[name].summary()
        assert r["evictions"] == 0 and t["evictions"] > 0, name
        assert t["token_hit_rate"] < r["token_hit_rate"] <= ref + 1e-12, name
        assert t["ttft_p99_s"] >= r["ttft_p99_s"] >= ref_p99 - 1e-9, name


def test_parse_budgets():
    assert parse_budgets("5%, 10%,0.4") == [0.05, 0.1, 0.4]
    for bad in ("", "x%", "0", "-5%", "inf"):
        with pytest.raises(ConfigError):
            parse_budgets(bad)


def test_the_sweep_document_and_its_command(trace, tmp_path):
    doc = sweep(trace, ["vllm-marconi"], ReplayConfig(discipline="sequential", max_requests=30),
                [0.05, 0.5], progress=False)
    rows = {(r["policy"], r["budget"]): r for r in doc["rows"]}
    assert set(rows) == {(p, b) for p in ("unlimited", "vllm-marconi") for b in (0.05, 0.5)}
    assert rows[("unlimited", 0.05)]["token_hit_rate"] == rows[("unlimited", 0.5)]["token_hit_rate"]
    assert rows[("vllm-marconi", 0.05)]["token_hit_rate"] <= rows[("vllm-marconi", 0.5)]["token_hit_rate"]
    assert doc["kv_footprint_bytes"] > 0
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["replay", "--discipline", "sequential", "--sweep", "5%,50%", "--policy",
               "vllm-marconi", "--max-requests", "30", "--json", str(out), "--plot", str(png),
               "--no-progress"])
    def decisions(rows):   # everything but the wall-clock rate
        return [{k: v for k, v in r.items() if k != "requests_per_s"} for r in rows]

    assert rc == 0
    assert decisions(json.loads(out.read_text())["rows"]) == decisions(doc["rows"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["replay", "--sweep", "5%,x"]) == 2
    assert main(["replay", "--budget", "0%"]) == 2


@pytest.mark.parametrize("name", ["histate", "hybridstore", "vllm-marconi", "marconi", "flashstates"])
def test_split_pools_never_fail_a_put(trace, name):
    """Issue 15, part 5: under SGLang's strict split pools a page partition full of pages the
    retained checkpoints need must not end the replay with CapacityError."""
    cfg = ReplayConfig(discipline="sequential", budget=0.05, pools="split", max_requests=N)
    run = replay(trace, [name], cfg, progress=False)[name]
    assert len(run.results) == N and run.evictions > 0
    assert 0 < run.summary()["token_hit_rate"] <= 1


def test_divergence_points_agree_with_the_synthesized_tokens(trace, tmp_path):
    """Block-level divergence from the chained ids equals the one read off the token ids."""
    from hybridstore.replay.divergence import divergence

    B = trace.block_size
    backs = []
    for s in trace.sessions:
        toks = list(session_tokens(s))
        for prev, cur in pairwise(toks):
            n = min(len(prev), len(cur))
            diff = np.flatnonzero(prev[:n] != cur[:n])
            lcp = int(diff[0]) if diff.size else n
            backs.append(len(prev) - lcp // B * B)
    doc = divergence(trace)
    assert doc["pairs"] == len(backs) == trace.n_requests - len(trace.sessions)
    got = [b["count"] for b in doc["bins"]]
    edges = [(b["from_tokens"], b["to_tokens"] or 1 << 62) for b in doc["bins"]]
    assert got == [sum(lo <= x < hi for x in backs) for lo, hi in edges]
    assert doc["appends"] == sum(x < B for x in backs) and doc["appends"] > 0.8 * len(backs)
    out, png = tmp_path / "div.json", tmp_path / "div.png"
    assert main(["replay", "--divergence", "--json", str(out), "--plot", str(png)]) == 0
    assert json.loads(out.read_text())["traces"][0]["bins"] == json.loads(json.dumps(doc["bins"]))
    assert png.read_bytes()[:4] == b"\x89PNG"
