"""``benchmarks.returns``: the odds of a session's return by its time away, from a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import returns
from hybridstore.replay.loaders import load
from hybridstore.replay.model_presets import model_preset

SPEC = "synthetic:agent?sessions=4&turns=6"


def test_gaps_run_from_the_end_of_each_turn_to_the_next_arrival():
    trace = load(SPEC)
    d = model_preset("qwen3.5-9b").decode_s_per_token
    g, rel = returns.gaps(trace, d, 5)
    want = [b.arrival_s - a.arrival_s - d * a.output_tokens
            for s in trace.sessions for a, b in zip(s.requests, s.requests[1:])]
    assert g.tolist() == pytest.approx(want)
    # each session's first gap has no cadence yet; the others are over their median so far
    s = trace.sessions[0]
    first = [b.arrival_s - a.arrival_s - d * a.output_tokens for a, b in zip(s.requests, s.requests[1:])]
    assert len(rel) == len(g) - len(trace.sessions)
    assert rel[0] == pytest.approx(first[1] / first[0])
    assert rel[1] == pytest.approx(first[2] / np.median(first[:2]))


def test_odds_count_the_open_gaps_that_close_within_the_horizon():
    g = np.array([5.0, 20.0, 40.0, 100.0, 500.0])
    rows = returns.odds_by_away(g, (0.0, 30.0, 1000.0), 30.0)
    assert [(r["away"], r["open"]) for r in rows] == [(0.0, 5), (30.0, 3), (1000.0, 0)]
    assert rows[0]["returns"] == pytest.approx(2 / 5)     # 5 and 20 close by 30 s
    assert rows[1]["returns"] == pytest.approx(1 / 3)     # of 40, 100, 500: 40 by 60 s
    assert rows[2]["returns"] is None
    # in cadences: within as many more (at least one)
    rel = returns.odds_by_away(np.array([0.5, 1.5, 3.0, 9.0]), (0.0, 2.0), None)
    assert rel[0]["returns"] == pytest.approx(1 / 4) and rel[1]["returns"] == pytest.approx(1 / 2)


def test_main_writes_json_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "returns.json", tmp_path / "returns.png"
    returns.main([SPEC, "--within", "30,120", "--json", str(out), "--plot", str(png)])
    doc = json.loads(out.read_text())["traces"][0]
    assert doc["trace"] == SPEC and sorted(doc["by_seconds"]) == ["120", "30"]
    assert doc["gaps"] == sum(len(s.requests) - 1 for s in load(SPEC).sessions)
    assert f"| {SPEC} | 30 s |" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad", ["0", "-5", "x", ","])
def test_bad_horizons_are_refused(bad):
    with pytest.raises(SystemExit):
        returns.main([SPEC, "--within", bad])
