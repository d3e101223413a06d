"""``hybridstore bench engines --quick``: every row is a real, checked measurement.

One quick run per session (engine imports take ~10 s each on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

for _engine in ("sglang", "vllm"):  # find_spec: importing sglang's __init__ needs its frontend
    if importlib.util.find_spec(_engine) is None:
        pytest.skip(f"{_engine} is not installed (pip install --no-deps {_engine})",
                    allow_module_level=True)
pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")

from hybridstore.bench import threadcpu
from hybridstore.bench.engines.geometry import QWEN3_NEXT
from hybridstore.cli import main

TP1 = QWEN3_NEXT.geometry(1)
QUICK = QWEN3_NEXT.geometry(4)   # the quick run measures TP=4 shards


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("engines")
    rc = main(["bench", "engines", "--quick", "--no-fio", "--json", str(out / "e.json"),
               "--plot", str(out / "e.png"), "--dir", str(out / "disk"), "--no-json-stdout"])
    assert rc == 0
    return json.loads((out / "e.json").read_text()), out


def test_document_and_plot(run) -> None:
    doc, out = run
    assert set(doc) >= {"machine", "versions", "config", "device_limit", "rows", "ratios",
                        "large_batches", "cache_drops", "restart", "policy", "goals", "issues"}
    assert (out / "e.png").stat().st_size > 10_000
    assert not (out / "disk").exists() or not any((out / "disk").iterdir())  # cleaned up


def test_model_sizes_come_from_the_config() -> None:
    # 12 attention layers x K,V x 2 heads x 256 x bf16 x 64 tokens; 36 GDN layers of
    # 32 x 128 x 128 fp32 + 8192 x 3 bf16
    assert TP1.kv_page_bytes == 12 * 2 * 2 * 256 * 2 * 64
    assert TP1.state_bytes == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert QWEN3_NEXT.geometry(4).kv_page_bytes == TP1.kv_page_bytes // 2   # 1 of 2 KV heads


def test_every_row_is_a_checked_measurement(run) -> None:
    doc, _ = run
    rows = doc["rows"]
    builtin = {(r["engine"], r["op"], r["cache"]) for r in rows
               if r["backend"] in ("HiCacheFile", "fs")}
    assert builtin >= {("sglang", "batch_set", "write"), ("sglang", "batch_get", "warm"),
                       ("sglang", "batch_get", "cold"), ("sglang", "batch_get", "restart"),
                       ("sglang", "batch_set_v2[mamba]", "write"),
                       ("sglang", "batch_get_v2[mamba]", "cold"),
                       ("vllm", "submit_store", "write"), ("vllm", "submit_load", "warm"),
                       ("vllm", "submit_load", "cold"), ("vllm", "submit_load", "restart")}
    for r in rows:
        assert r["bit_exact"] is True, r
        assert r["gbps"] > 0 and r["objects_per_s"] > 0, r
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
        # bytes moved per repetition == objects x object bytes
        assert r["bytes_per_rep"] == r["objects_per_rep"] * r["object_bytes"], r
        assert r["geometry"] == "tp4"
        if r["op"].startswith(("batch_set", "batch_get")) and "mamba" not in r["op"]:
            assert r["object_bytes"] == QUICK.kv_page_bytes
        if "mamba" in r["op"]:
            assert r["object_bytes"] == QUICK.state_bytes
        if r["engine"] == "vllm":
            assert r["object_bytes"] >= QUICK.kv_page_bytes
            assert r["cpu_ms_per_mib"] > 0, r      # process CPU per MiB beside GB/s (issue 26)
            pools = r.get("cpu_ms_per_mib_by_pool")
            if threadcpu.snapshot() is not None:  # and where it goes, by thread pool
                assert pools and "MainThread" in pools, r      # the bench's polling loop
                if r["backend"] == "hybridstore" and r["op"] == "submit_load":
                    assert pools.get("hs-disk", 0.0) > 0, r    # the disk tier's reads
                # no pool spends more than the whole process (per-thread clocks are read a
                # moment apart from the process clock, so with some slack)
                assert max(pools.values()) <= 1.5 * r["cpu_ms_per_mib"], r
            if r["backend"] == "hybridstore" and r["op"] == "submit_store":
                assert r["cpu_ms_per_mib_incl_flush"] >= r["cpu_ms_per_mib"], r


def test_ratios_pair_ours_with_the_builtin(run) -> None:
    doc, _ = run
    backends = {(r["engine"], r["backend"]) for r in doc["rows"]}
    for engine, ours, theirs in (("sglang", "hybridstore", "HiCacheFile"),
                                 ("vllm", "hybridstore", "fs")):
        if (engine, ours) not in backends:
            assert any(u["engine"] == engine for u in doc["unavailable"])
            continue
        rs = [r for r in doc["ratios"] if r["engine"] == engine]
        ops = {(r["op"], r["cache"]) for r in rs}
        assert {("submit_store" if engine == "vllm" else "batch_set", "write")} <= ops
        for r in rs:
            assert r["ours"] == ours and r["theirs"] == theirs
            assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and r["ratio"] > 0
        if engine == "vllm":     # CPU per MiB of both tiers, paired per repetition
            for r in rs:
                assert r["cpu_ms_per_mib_ours"] > 0 and r["cpu_ms_per_mib_theirs"] > 0, r
                assert r["cpu_ratio_min"] <= r["cpu_ratio"] <= r["cpu_ratio_max"], r
            assert doc["goals"]["load_cpu_max"] == max(r["cpu_ms_per_mib_ours"] for r in rs
                                                       if r["op"] == "submit_load")
        if engine == "sglang":   # our zero-copy interface against HiCacheFile's legacy one
            assert {("batch_get_v1/batch_get", "cold"), ("batch_set_v1/batch_set", "write")} <= ops
    ours_writes = [r for r in doc["rows"] if r["backend"] == "hybridstore" and r["cache"] == "write"
                   and "mamba" not in r["op"]]
    for r in ours_writes:   # the background SSD writes were waited for and counted
        assert 0 < r["gbps_incl_flush"] <= r["gbps"], r


def test_cold_reads_and_restart(run) -> None:
    doc, _ = run
    assert doc["cache_drops"]
    for d in doc["cache_drops"]:
        for name in ("HiCacheFile", "fs"):
            if name in d:
                assert d[name]["files"] > 0
                assert d[name]["dropped"] in (True, False, None)
    for rs in doc["restart"]:
        for name, r in rs.items():
            if isinstance(r, dict):
                assert (r.get("hit_pages") or r.get("hit_chunks")) > 0, (name, r)


def test_large_batches_against_the_ssd(run) -> None:
    doc, _ = run
    dl = doc["device_limit"]
    assert dl["read_gbps"] > 0 and dl["tool"] in ("fio", "odirect-pool")
    large = doc["large_batches"]
    assert large and all(x["batch_bytes"] >= 4 << 20 for x in large)
    for x in large:
        assert x["share_of_ssd"] == pytest.approx(x["gbps"] / dl["read_gbps"])
    # the pool read the built-in backends' just-written files in every timed repetition
    now = {(d["engine"], d["run"]): d["gbps"] for d in doc["device_now"]}
    assert set(now) == {("sglang", "b8"), ("vllm", "j8")}
    assert all(len(v) == doc["config"]["reps"] and min(v) > 0 for v in now.values())
    assert all(x["share_of_device_now"] > 0 for x in large)


def test_policy_hit_rates(run) -> None:
    doc, _ = run
    pol = doc["policy"]
    assert pol["requests"] > 0 and pol["footprint_bytes"] > 0
    runs = pol["runs"]
    assert {r["policy"] for r in runs} >= {"lru-file"}
    for r in runs:
        assert 0 <= r["token_hit_rate"] <= 1
        assert r["loads_short"] == 0
    lru = sorted((r["budget_share"], r["token_hit_rate"]) for r in runs if r["policy"] == "lru-file")
    assert lru[-1][1] >= lru[0][1]  # a bigger budget never hits less here


def test_the_load_floor_is_measured_for_every_vllm_run(run) -> None:
    """One thread's O_DIRECT reads of a repetition's bytes, with and without the chunk
    checksums, beside the loads (issue 26's CPU goal against what no tier can go under)."""
    doc, _ = run
    floors = doc["load_floor"]
    assert [(f["engine"], f["run"]) for f in floors] == [("vllm", "j8")]
    for f in floors:
        assert f["read_cpu_ms_per_mib"] > 0 and f["checked_cpu_ms_per_mib"] > 0
        assert f["read_gbps"] > 0 and f["chunks_checked"] * f["chunk_bytes"] == f["bytes"]
    g = doc["goals"]
    assert g["load_floor_checked_max"] == max(f["checked_cpu_ms_per_mib"] for f in floors)
