"""The session-level headroom model (``hybridstore replay --headroom``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridstore.cli import main
from hybridstore.replay.bound import belady_hits
from hybridstore.replay.headroom import headroom, session_hit_rate
from hybridstore.replay.loaders import load
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import ReplayConfig, merged_requests
from hybridstore.replay.trace import Request


def req(session: str, index: int, ids: list[int]) -> Request:
    return Request(session=session, index=index, arrival_s=float(index), input_tokens=4 * len(ids),
                   output_tokens=1, block_size=4, block_ids=np.array(ids, dtype=np.int64))


def test_session_belady_keeps_the_context_that_returns_first_and_lru_does_not():
    # Room for two 4-block contexts; C never returns, A returns before B.
    reqs = [req("A", 0, [1, 2, 3, 4]), req("B", 0, [11, 12, 13, 14]), req("C", 0, [21, 22, 23, 24]),
            req("A", 1, [1, 2, 3, 4, 5]), req("B", 1, [11, 12, 13, 14, 15])]
    total = 3 * 16 + 2 * 20
    assert session_hit_rate(reqs, None, "lru", 4) == 32 / total       # unlimited: both return
    assert session_hit_rate(reqs, 8, "lru", 4) == 0.0                  # C pushed A out, A pushed B
    assert session_hit_rate(reqs, 8, "session_belady", 4) == 16 / total   # B went at C's arrival
    assert session_hit_rate(reqs, 3, "session_belady", 4) == 0.0          # no context fits


def test_session_belady_is_no_bound_the_page_bound_keeps_more():
    # Two 4-block contexts alternate in room for 6 blocks: whole contexts keep only the
    # one just served, which never returns next; the exact bound keeps one context and
    # half the other (4 and 2 blocks at the returns).
    reqs = [req(s, i, [base + k for k in range(4)])
            for i in range(3) for s, base in (("A", 10), ("B", 20))]
    total = sum(r.input_tokens for r in reqs)
    prompts = [r.block_ids for r in reqs]
    exact = belady_hits(prompts, 6)
    assert exact.tolist() == [0, 0, 4, 2, 4, 2]
    assert session_hit_rate(reqs, 6, "session_belady", 4) == 0.0 < exact.sum() * 4 / total == 0.5


@pytest.fixture(scope="module")
def trace():
    return load(str(weka_sample()))


def test_unlimited_is_what_each_session_shares_with_its_previous_request(trace):
    reqs = merged_requests(trace)
    prev: dict[str, np.ndarray] = {}
    hit = 0
    for r in reqs:
        blocks = r.block_ids[: r.input_tokens // trace.block_size]
        if r.session in prev:
            p = prev[r.session]
            n = 0
            while n < min(len(p), len(blocks)) and p[n] == blocks[n]:
                n += 1
            hit += trace.block_size * n
        prev[r.session] = blocks
    expected = hit / sum(r.input_tokens for r in reqs)
    doc = headroom(trace, [0.05, 1.0], ReplayConfig(discipline="sequential"), progress=False)
    lo, hi = doc["rows"]
    assert hi["session_unlimited"] == pytest.approx(expected)
    assert hi["lru"] == hi["session_belady"] == pytest.approx(expected)     # everything fits
    assert lo["lru"] <= lo["session_belady"] < lo["session_unlimited"]


@pytest.mark.parametrize("pools", ["unified", "split"])
def test_the_exact_bound_is_above_every_session_order_and_below_unlimited(trace, pools):
    budgets = [0.02, 0.05, 0.1, 0.2]
    doc = headroom(trace, budgets, ReplayConfig(discipline="sequential", pools=pools),
                   states=[0, 1, 8, 200], progress=False)
    rows = doc["rows"]
    for r in rows:
        assert max(r["lru"], r["session_belady"]) <= r["bound"] <= r["unlimited"]
        assert r["session_unlimited"] <= r["unlimited"]     # pages of older branches hit too
        assert r["bound_holding_states"]["0"] == r["bound"]
        # held to the engine (prompts over its KV pool store nothing, a prompt's KV is
        # resident while it prefills): never above the free bound
        assert r["bound_engine_pool"] <= r["bound"]
    assert [r["bound"] for r in rows] == sorted(r["bound"] for r in rows)
    assert rows[0]["refused"] > 0 and rows[0]["bound_engine_pool"] < rows[0]["bound"]
    assert rows[-1]["bound"] - rows[-1]["bound_engine_pool"] < 0.01   # room to spare at 20 %
    tight = rows[1]
    assert tight["bound"] > tight["session_belady"] + 0.03    # the old "clairvoyant" was no bound
    held = [tight["bound_holding_states"][k] for k in ("0", "1", "8", "200")]
    if pools == "unified":      # states eat the one pool: fewer pages, a lower bound
        assert held[0] >= held[1] >= held[2] > held[3]
    else:                       # their own pool: free while they fit, impossible past it
        kv_per_token = doc["page_bytes"] / trace.block_size
        room = 0.05 * 0.9 * doc["footprint_tokens"] * kv_per_token / doc["state_bytes"]
        assert held[:3] == [tight["bound"]] * 3 and 8 <= room < 200 and held[3] is None


def test_the_command_writes_its_document(tmp_path):
    out, png = tmp_path / "h.json", tmp_path / "h.png"
    assert main(["replay", "--headroom", "--sweep", "10%", "--pools", "split", "--max-requests", "80",
                 "--hold-states", "0,3", "--json", str(out), "--plot", str(png), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["pools"] == "split" and doc["requests"] == 80 and len(doc["rows"]) == 1
    assert doc["rows"][0]["bound"] >= doc["rows"][0]["session_belady"]
    assert list(doc["rows"][0]["bound_holding_states"]) == ["0", "3"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
