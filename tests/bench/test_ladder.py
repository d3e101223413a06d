"""``benchmarks.ladder``: the default, the default told every next use, and the exact bound."""

from __future__ import annotations

import json

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


def test_main_writes_json_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "ladder.json", tmp_path / "ladder.png"
    ladder.main([SPEC, "--budgets", "10%", "--pools", "unified", "--json", str(out),
                 "--plot", str(png)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["trace"], r["pools"]) for r in rows] == [(SPEC, "unified")]
    printed = capsys.readouterr().out
    assert f"| {SPEC} | unified | 10% |" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
