"""``python -m benchmarks index`` in a tiny configuration: the JSON document's shape and real
properties of its results (same matched prefixes as the peers, identical native/twin keys),
never its timings.  Peer-specific checks skip when the peer cannot be imported here."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.__main__ import build_parser
from benchmarks.index import BLOCK, OPS, IndexBenchConfig, run_index_bench
from benchmarks.peers import PeerUnavailable, import_sglang_radix, import_vllm_prefix
from hybridstore import _native

TINY = IndexBenchConfig(prompt_tokens=(1024, 4096), reps=3, cached_blocks=(256,), block_reps=3,
                        turns=4, memory_blocks=2048, match_reps=5, hash_reps=3)


def _available(load: object) -> str | None:
    try:
        load()  # type: ignore[operator]
    except PeerUnavailable as e:
        return str(e)
    return None


SGLANG_MISSING = _available(import_sglang_radix)
VLLM_MISSING = _available(import_vllm_prefix)


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, object]:
    tmp = tmp_path_factory.mktemp("bench-index")
    doc = run_index_bench(str(tmp / "index.json"), str(tmp / "index.png"), config=TINY,
                          echo_json=False)
    return doc, json.loads((tmp / "index.json").read_text()), tmp


def test_document(bench) -> None:
    doc, on_disk, tmp = bench
    assert on_disk == json.loads(json.dumps(doc))
    assert set(doc) >= {"machine", "config", "peers", "prompt_length", "cached_blocks", "hashing",
                        "memory", "match_128k", "goals", "issues"}
    assert (tmp / "index.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for peer in ("sglang", "vllm"):
        info = doc["peers"][peer]
        assert isinstance(info["available"], bool)
        if not info["available"]:
            assert info["unavailable"]
    assert {g: set(v) >= {"value", "goal", "met"} for g, v in doc["goals"].items()} == {
        "match_128k_ms": True, "vs_sglang_min_ratio": True, "bytes_per_block": True}


def test_rows(bench) -> None:
    doc = bench[0]
    points = {(r["shape"], r["prompt_tokens"], r["op"]) for r in doc["prompt_length"]}
    assert points == {(s, t, op) for s in TINY.shapes for t in TINY.prompt_tokens for op in OPS}
    blocks = {(r["cached_blocks"], r["op"]) for r in doc["cached_blocks"]}
    assert blocks == {(256, op) for op in OPS}
    for r in doc["prompt_length"] + doc["cached_blocks"]:
        ours = r["hybridstore"]
        assert _positive(ours["ms_median"]) and ours["ms_p90"] >= ours["ms_median"], r
        assert ours["n"] == (TINY.reps if r["sweep"] == "prompt_tokens" else TINY.block_reps)
        if r["op"] == "evict":
            assert len(ours["evicted_checkpoints"]) == ours["n"]
            assert set(r["evicted_tokens"]) >= {"hybridstore"}
        for peer in ("sglang", "vllm"):
            if doc["peers"][peer]["available"]:
                assert _positive(r[peer]["ms_median"]) and _positive(r[peer]["ratio"]), r
            else:
                assert peer not in r


def test_hybridstore_matches_its_own_puts(bench) -> None:
    """Every cached prompt matches whole; a branch at block b matches b blocks."""
    doc = bench[0]
    for r in doc["prompt_length"] + doc["cached_blocks"]:
        if r["op"] == "match" and "matched_tokens" in r:
            assert r["matched_tokens"]["hybridstore"] == [r["prompt_tokens"]] * len(
                r["matched_tokens"]["hybridstore"])
        if r["op"] == "match_branch" and "matched_tokens" in r:
            assert all(t % BLOCK == 0 and t < r["prompt_tokens"]
                       for t in r["matched_tokens"]["hybridstore"])


@pytest.mark.skipif(SGLANG_MISSING is not None, reason=f"sglang: {SGLANG_MISSING}")
def test_same_matched_prefix_as_sglang(bench) -> None:
    doc = bench[0]
    rows = [r for r in doc["prompt_length"] + doc["cached_blocks"] if r["op"].startswith("match")]
    assert rows
    for r in rows:
        assert r["matched_tokens"]["sglang"] == r["matched_tokens"]["hybridstore"], r
    assert not [i for i in doc["issues"] if "matched prefixes differ" in i]


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"vllm: {VLLM_MISSING}")
def test_same_matched_prefix_as_vllm(bench) -> None:
    doc = bench[0]
    for r in doc["prompt_length"] + doc["cached_blocks"]:
        if r["op"].startswith("match"):
            assert r["matched_tokens"]["vllm"] == r["matched_tokens"]["hybridstore"], r
    hashing = doc["hashing"]["vllm"]
    assert _positive(hashing["sha256"]["gbps"])


def test_hashing_native_equals_twin(bench) -> None:
    h = bench[0]["hashing"]["hybridstore"]
    assert _positive(h["python_gbps"])
    if _native.available()["hashing"]:
        assert h["keys_identical"] is True and _positive(h["native_gbps"])


def test_memory(bench) -> None:
    mem = bench[0]["memory"]
    ours = mem["hybridstore"]
    assert ours["pages"] == TINY.memory_blocks
    assert _positive(ours["bytes_per_block_index"])
    assert _positive(ours["bytes_per_block_tracemalloc"])
    for peer in ("sglang", "vllm"):
        if "unavailable" not in mem[peer]:
            assert mem[peer]["blocks"] == TINY.memory_blocks
            assert _positive(mem[peer]["bytes_per_block"])


def test_match_128k(bench) -> None:
    m = bench[0]["match_128k"]
    assert m["prompt_tokens"] == 128 * 1024 and m["hit_positions"] == [m["prompt_tokens"]]


def test_cli_parses() -> None:
    argv = ["index", "--json", "j", "--plot", "p.png", "--quick"]
    args = build_parser().parse_args(argv)
    assert (args.json, args.plot, args.quick) == ("j", "p.png", True)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        IndexBenchConfig(prompt_tokens=(100,))
    with pytest.raises(ValueError):
        IndexBenchConfig(peers=("lmcache",))
