"""The exact bound in the server discipline (``hybridstore replay --headroom --discipline server``)."""

from __future__ import annotations

import json

import pytest

from hybridstore.cli import main
from hybridstore.errors import ConfigError
from hybridstore.replay.loaders import load
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.server_bound import server_headroom
from hybridstore.replay.sim import ReplayConfig, replay_policy


@pytest.fixture(scope="module")
def sample():
    return load(str(weka_sample()))


def rows(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["rows"]}


def test_unlimited_serves_as_the_replay_does_and_the_bound_keeps_at_least_the_default(sample):
    # 10/20/40 GiB on the bundled sample: its 451 K-token prompts need 14.1 GiB of KV, more
    # than the GPU pool, so every cache (the replay's engine refuses them) recomputes them.
    cfg = ReplayConfig(gpu_gib=10, host_gib=20, disk_gib=40)
    doc = server_headroom(sample, cfg)
    got = rows(doc)
    assert all(r["converged"] for r in doc["rows"])
    assert doc["requests"] == 645
    # the same events as the replay: unlimited's tail (whole prefills and their queue) to
    # the microsecond; pages are full blocks only (the replay also hits partial last
    # blocks), so the bound's hits and median are a little under the replay's
    unl = replay_policy(sample, "unlimited", cfg, progress=False).summary()
    assert got["unlimited"]["ttft_p99_s"] == pytest.approx(unl["ttft_p99_s"], abs=1e-6)
    assert got["unlimited"]["token_hit_rate"] == pytest.approx(unl["token_hit_rate"], abs=1e-3)
    # 70 GiB hold every page that comes back: free states keep unlimited's hits and tail
    assert got["free_state"]["token_hit_rate"] == pytest.approx(got["unlimited"]["token_hit_rate"])
    assert got["free_state"]["ttft_p99_s"] == pytest.approx(unl["ttft_p99_s"])
    # held to the engine's GPU pool the bound refuses the prompts the replay refuses, and
    # its tail is far above unlimited's: no cache meets 1.3x here
    hs = replay_policy(sample, "hybridstore", cfg, progress=False).summary()
    assert got["bound"]["refused_requests"] == hs["refused_requests"] == 5
    assert got["bound"]["p99_vs_unlimited"] > 2.0
    assert hs["token_hit_rate"] <= got["bound"]["token_hit_rate"] < got["free_state"]["token_hit_rate"]


def test_a_smaller_store_keeps_less_under_the_bound(sample):
    big = rows(server_headroom(sample, ReplayConfig(gpu_gib=10, host_gib=20, disk_gib=40)))
    small = rows(server_headroom(sample, ReplayConfig(gpu_gib=1, host_gib=2, disk_gib=4)))
    assert small["bound"]["token_hit_rate"] < big["bound"]["token_hit_rate"]
    assert small["free_state"]["token_hit_rate"] < big["free_state"]["token_hit_rate"]
    assert small["bound"]["refused_requests"] > big["bound"]["refused_requests"]


def test_the_server_headroom_takes_tier_budgets_not_fractions(sample):
    with pytest.raises(ConfigError, match="--gpu-gib"):
        server_headroom(sample, ReplayConfig(budget=0.1))
    with pytest.raises(ConfigError, match="--gpu-gib"):
        server_headroom(sample, ReplayConfig(discipline="sequential", gpu_gib=10))


def test_the_cli_writes_the_server_headroom_and_its_tail_plot(tmp_path, capsys):
    out, png = tmp_path / "h.json", tmp_path / "h.png"
    assert main(["replay", "--headroom", "--discipline", "server", "--gpu-gib", "10",
                 "--host-gib", "20", "--disk-gib", "40", "--no-progress",
                 "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["unlimited", "free_state", "bound"]
    assert len(doc["rows"][2]["ttft_s"]) == 645
    assert png.stat().st_size > 10_000
    assert "p99/unl" in capsys.readouterr().out
    # without --discipline, --headroom is the sequential bound, as before
    assert main(["replay", "--headroom", "--sweep", "10%", "--no-progress",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["budget"] == 0.1
