"""The fleet model (issue 14, part 3, modelled): N replay nodes, isolated or sharing one
accounting remote pool (``replay/fleet.py``, ``replay/pool.py``)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from hybridstore.cli import main
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.objects import ObjectKind
from hybridstore.replay.fleet import (
    RemoteModel,
    Router,
    fleet,
    fleet_policy,
    parse_nodes,
    replicate,
)
from hybridstore.replay.pool import RemotePool
from hybridstore.replay.sim import ReplayConfig, replay_policy
from hybridstore.replay.synthetic import generate
from hybridstore.replay.trace import Trace

SPEC = "synthetic:agent?sessions=6&turns=6&new=2048&out=128&mutation=0.2&cut=256&gap=30"
TIGHT = {"gpu_gib": 1.0, "host_gib": 0.5, "disk_gib": 1.0}
"""Per-node budgets that evict on SPEC (its KV footprint is 2.4 GiB)."""
HOP = {"gpu_gib": 2.0, "host_gib": 0.5, "disk_gib": 1.0}
"""Budgets where one GPU-only node (vllm-marconi) keeps a good share of SPEC (46 %)."""


@pytest.fixture(scope="module")
def trace() -> Trace:
    return generate(SPEC)


@pytest.mark.parametrize("discipline", ["server", "sequential"])
@pytest.mark.parametrize("name", ["histate", "vllm-marconi"])
def test_one_isolated_node_is_the_plain_replay(trace, name, discipline):
    cfg = ReplayConfig(discipline=discipline, **TIGHT)
    plain = replay_policy(trace, name, cfg, progress=False)
    assert plain.evictions > 0                     # the budgets bind
    for routing in ("round-robin", "affinity"):
        one = fleet_policy(trace, name, cfg, nodes=1, routing=routing, mode="isolated")
        assert one.run.results == plain.results    # request for request, every field
        assert one.run.evictions == plain.evictions
        assert one.node_of == [0] * len(plain.results)


def test_a_pool_that_receives_nothing_changes_nothing(trace):
    """HiState spills to the pool only what the SSD evicts: with an SSD that never fills,
    one node with the pool is the plain replay (its historical checkpoints stay on the
    SSD: they once left it when a remote tier sat below)."""
    cfg = ReplayConfig(discipline="sequential", gpu_gib=0.5, host_gib=1.0, disk_gib=64.0)
    plain = replay_policy(trace, "histate", cfg, progress=False)
    one = fleet_policy(trace, "histate", cfg, nodes=1, routing="affinity", mode="shared")
    assert one.pool is not None and one.pool["puts"] == 0
    assert one.run.results == plain.results


@pytest.mark.parametrize("discipline", ["server", "sequential"])
def test_shared_pool_recovers_the_hits_sessions_lose_when_they_hop(trace, discipline):
    cfg = ReplayConfig(discipline=discipline, **HOP)
    rate = {}
    for mode in ("isolated", "shared"):
        f = fleet_policy(trace, "vllm-marconi", cfg, nodes=4, routing="round-robin", mode=mode)
        hops = sum(a != b for a, b in zip(f.node_of, f.node_of[1:]))
        assert hops == len(f.node_of) - 1            # round robin: every request moves on
        rate[mode] = f.run.summary()["token_hit_rate"]
        if mode == "shared":
            assert f.pool is not None and f.pool["adopted"] > 0
            remote = sum(r.restored_bytes.get("remote", 0) for r in f.run.results)
            assert remote > 0
    one = replay_policy(trace, "vllm-marconi", cfg, progress=False).summary()["token_hit_rate"]
    assert rate["isolated"] < one                    # hopping costs the isolated fleet
    assert rate["shared"] > rate["isolated"]


def test_remote_restores_pay_latency_and_bandwidth(trace):
    cfg = ReplayConfig(discipline="sequential", **HOP)
    slow, fast = (fleet_policy(trace, "vllm-marconi", cfg, nodes=4, routing="round-robin",
                               mode="shared", remote=RemoteModel(gbps=g, latency_ms=ms))
                  for g, ms in ((1.0, 50.0), (100.0, 0.0)))
    assert [r.hit_tokens for r in slow.run.results] == [r.hit_tokens for r in fast.run.results]
    gap = [a.restore_s - b.restore_s for a, b in zip(slow.run.results, fast.run.results)
           if a.restored_bytes.get("remote")]
    assert gap and min(gap) >= 0.05 - 1e-9            # at least the 50 ms round trip


def test_affinity_with_isolated_nodes_is_independent_replays(trace):
    cfg = ReplayConfig(discipline="sequential", **TIGHT)
    f = fleet_policy(trace, "histate", cfg, nodes=3, routing="affinity", mode="isolated")
    by_node: dict[int, list] = {}
    for k, r in zip(f.node_of, f.run.results):
        by_node.setdefault(k, []).append(r)
    assert len(by_node) == 3
    for k, results in by_node.items():
        ids = {r.session for r in results}
        assert all(f.node_of[i] == k for i, r in enumerate(f.run.results) if r.session in ids)
        sub = Trace(name="sub", block_size=trace.block_size,
                    sessions=tuple(s for s in trace.sessions if s.id in ids))
        alone = replay_policy(sub, "histate", cfg, progress=False)
        assert alone.results == results


def test_router_rules():
    rr = Router("round-robin", 3)
    reqs = [r for r in generate("synthetic:agent?sessions=2&turns=3&new=64").requests()]
    assert [rr.node(r, False) for r in reqs] == [0, 1, 2, 0, 1, 2]
    aff = Router("affinity", 2)
    a, b = generate("synthetic:agent?sessions=2&turns=2&new=64").sessions
    assert aff.node(a.requests[0], False) == 0
    assert aff.node(b.requests[0], False) == 1           # the node with fewer sessions
    assert aff.node(a.requests[1], True) == 0            # pinned; its last request unpins
    c = generate("synthetic:agent?sessions=3&turns=1&new=64").sessions[2]
    assert aff.node(c.requests[0], True) == 0            # node 0 is free again
    with pytest.raises(ConfigError):
        Router("random", 2)
    assert parse_nodes("1, 4,16") == [1, 4, 16]
    with pytest.raises(ConfigError):
        parse_nodes("0")


def test_pool_eviction_ownership_and_references():
    pool = RemotePool(300, net_gbps=1.0, latency_s=0.001, h2d_gbps=1.0,
                      sizes={ObjectKind.PAGE: 100})
    a, b = pool.view(1000), pool.view(150)     # a may reference more than the pool holds
    k = [bytes([1]) + bytes([i]) * 16 for i in range(5)]
    a.put(k[0], None, nbytes=100, meta=b"m0")
    assert b.exist_many([k[0], k[1]]) == [True, False]
    assert b.adopt([k[0]]) == [(k[0], 100, b"m0")]
    b.put(k[0], None, nbytes=100)                        # another node's object: a reference
    assert pool.stats()["references"] == 1 and pool.used_bytes == 100
    with pytest.raises(CapacityError):                  # b's own budget (150) is full
        b.put(k[1], None, nbytes=100)
    a.put(k[1], None, nbytes=100)
    a.put(k[2], None, nbytes=100)
    a.put(k[3], None, nbytes=100)                        # the pool drops its oldest, k[0]
    assert not pool.holds(k[0]) and pool.stats()["evicted"] == 1
    assert a.take_lost() == [k[0]] and b.take_lost() == [k[0]]
    assert not b.contains(k[0]) and b.used_bytes == 0
    assert b.adopt([k[2]]) == [(k[2], 100, b"")]
    assert b.delete(k[2]) == 100 and pool.holds(k[2])   # a foreign object is only forgotten
    b.adopt([k[2]])
    assert a.delete(k[2]) == 100 and not pool.holds(k[2])   # the owner removes it for all
    assert b.take_lost() == [k[2]] and a.take_lost() == []
    assert b.read_seconds(10**9) == pytest.approx(0.001 + 1.0 + 1.0)
    assert b.get_info("layout.page") is not None


def test_replicate_gives_copies_their_own_content(trace):
    big = replicate(trace, 3)
    assert big.n_sessions == 3 * trace.n_sessions and big.n_requests == 3 * trace.n_requests
    orig = trace.sessions[0]
    copy = big.session(f"{orig.id}~2")
    for a, b in zip(orig.requests, copy.requests):
        assert (a.input_tokens, a.arrival_s, a.think_s, a.anchors) == \
               (b.input_tokens, b.arrival_s, b.think_s, b.anchors)
        assert len(a.block_ids) == len(b.block_ids)
        assert not np.intersect1d(a.block_ids, b.block_ids).size
    assert replicate(trace, 1) is trace


def test_document_schema_and_cli(tmp_path, trace, capsys):
    small = Trace(name="small", block_size=trace.block_size, sessions=trace.sessions[:3])
    cfg = ReplayConfig(discipline="sequential", **TIGHT)
    doc = fleet(small, ["vllm-marconi"], cfg, [1, 4], progress=False)
    assert set(doc) >= {"trace", "config", "remote", "routing_rules", "nodes", "rows"}
    assert len(doc["rows"]) == 2 * 2 * 2
    want = {"policy": str, "nodes": int, "routing": str, "remote": str, "requests": int,
            "token_hit_rate": float, "ttft_p50_s": float, "ttft_p95_s": float,
            "ttft_p99_s": float, "busy_nodes": int, "max_requests_per_node": int,
            "restored_bytes": dict}
    for row in doc["rows"]:
        for key, kind in want.items():
            assert isinstance(row[key], kind), key
        assert row["requests"] == small.n_requests
        assert 0.0 <= row["token_hit_rate"] <= 1.0
        assert row["ttft_p50_s"] <= row["ttft_p95_s"] <= row["ttft_p99_s"]
        assert (row["pool"] is None) == (row["remote"] == "isolated")
        if row["routing"] == "affinity":                 # fewer sessions than nodes: idle ones
            assert row["busy_nodes"] == min(row["nodes"], small.n_sessions)
        else:
            assert row["busy_nodes"] == min(row["nodes"], small.n_requests)
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    spec = "synthetic:agent?sessions=3&turns=3&new=512&out=64"
    rc = main(["replay", spec, "--nodes", "1,2", "--policy", "vllm-marconi", "--routing",
               "round-robin", "--shared", "--discipline", "sequential", "--json", str(out),
               "--plot", str(png), "--no-progress"])
    assert rc == 0
    got = json.loads(out.read_text())
    assert Counter((r["nodes"], r["routing"], r["remote"]) for r in got["rows"]) == \
        Counter({(1, "round-robin", "shared"): 1, (2, "round-robin", "shared"): 1})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fleet model" in capsys.readouterr().out
    assert main(["replay", spec, "--nodes", "2", "--sweep", "10%", "--no-progress"]) == 2
