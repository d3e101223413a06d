"""``benchmarks.ladder``: the default, the default told every next use, and the exact bound."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import ladder
from hybridstore.replay.loaders import load
from hybridstore.replay.sim import ReplayConfig, replay_policy

SPEC = "synthetic:agent?sessions=4&turns=6"


@pytest.mark.parametrize("pools", ["unified", "split"])
def test_rungs_are_the_replays_and_the_bound(pools):
    trace = load(SPEC)
    rows = ladder.ladder(trace, [0.1, 0.2], pools, label="agent", progress=False)
    assert [(r["trace"], r["pools"], r["budget"]) for r in rows] == [("agent", pools, 0.1),
                                                                     ("agent", pools, 0.2)]
    for r in rows:
        cfg = ReplayConfig(discipline="sequential", pools=pools, budget=r["budget"])
        plain = replay_policy(trace, "hybridstore", cfg, progress=False).summary()["token_hit_rate"]
        assert r["hybridstore"] == plain
        told = ReplayConfig(discipline="sequential", pools=pools, budget=r["budget"], resume_hints=0.0)
        assert r["announced"] == replay_policy(trace, "hybridstore", told,
                                               progress=False).summary()["token_hit_rate"]
        # the exact bound holds every replay of the engine, told or not
        assert r["hybridstore"] <= r["bound_engine_pool"] + 1e-12 <= r["bound"] + 1e-12
        assert r["announced"] <= r["bound_engine_pool"] + 1e-12
        parts = r["information"] + r["engine_pool"] + r["states_and_placement"]
        assert parts == pytest.approx(r["bound"] - r["hybridstore"])
        assert r["engine_pool"] >= 0 and r["states_and_placement"] >= -1e-12
        assert r["share"] == pytest.approx(r["hybridstore"] / r["bound"])
        assert r["lost_returns"] >= 0 and r["lost_requests"] >= 0


def test_main_writes_json_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "ladder.json", tmp_path / "ladder.png"
    ladder.main([SPEC, "--budgets", "10%", "--pools", "unified", "--json", str(out),
                 "--plot", str(png)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["trace"], r["pools"]) for r in rows] == [(SPEC, "unified")]
    printed = capsys.readouterr().out
    assert f"| {SPEC} | unified | 10% |" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_late_returns_counts_the_contexts_lost_whole_and_how_late_they_came():
    trace = load("synthetic:agent?sessions=2&turns=5")
    cfg = ReplayConfig(discipline="sequential", pools="unified", budget=0.1)
    d = cfg.full_model().decode_s_per_token
    ours = replay_policy(trace, "hybridstore", cfg, progress=False).results
    s = trace.sessions[0]
    # the fifth request of the first session: lost by the default, restored when told
    i = next(k for k, r in enumerate(ours) if (r.session, r.index) == (s.id, 4))
    ours = [replace(r, hit_tokens=0) if k == i else replace(r, hit_tokens=max(r.hit_tokens, 1))
            for k, r in enumerate(ours)]
    told = [replace(r, hit_tokens=r.input_tokens // 2) for r in ours]
    got = ladder.late_returns(trace, ours, told, d)
    total = sum(r.input_tokens for r in ours)
    assert got["lost_requests"] == 1
    assert got["lost_returns"] == pytest.approx((ours[i].input_tokens // 2) / total)
    # its gap from the end of turn 4 over the median of the session's three gaps before it
    gaps = [b.arrival_s - a.arrival_s - d * a.output_tokens for a, b in zip(s.requests, s.requests[1:])]
    assert got["lost_gap_ratio"] == pytest.approx(gaps[3] / np.median(gaps[:3]))
    # nothing lost whole: no ratio to report, and nothing counted
    none = ladder.late_returns(trace, told, told, d)
    assert none["lost_requests"] == 0 and none["lost_returns"] == 0 and none["lost_gap_ratio"] is None
    assert none["gap_ratio"] == got["gap_ratio"] > 0
