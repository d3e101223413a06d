"""``hybridstore bench core --quick`` in-process: the JSON document's shape, not its timings."""

from __future__ import annotations

import json
import math

import pytest

from hybridstore import _native
from hybridstore.bench.core import CKPT_BYTES, PAGE_BYTES, run_core_bench


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, str, object]:
    tmp = tmp_path_factory.mktemp("bench")
    json_path = tmp / "core.json"
    disk_dir = tmp / "disk"
    doc = run_core_bench(json_path=str(json_path), disk_dir=str(disk_dir), quick=True)
    return doc, json.loads(json_path.read_text()), str(disk_dir), tmp


@pytest.mark.slow
def test_json_file_is_the_returned_document(bench) -> None:
    doc, on_disk, _, _ = bench
    assert on_disk == json.loads(json.dumps(doc))
    assert set(doc) >= {"machine", "tiers", "match", "hashing", "index_memory", "disk", "issues"}
    assert isinstance(doc["issues"], list)


@pytest.mark.slow
def test_machine(bench) -> None:
    m = bench[0]["machine"]
    assert m["cpu_count"] >= 1
    for key in ("python", "torch", "numpy"):
        assert isinstance(m[key], str) and m[key]


@pytest.mark.slow
def test_tier_rows(bench) -> None:
    doc = bench[0]
    rows = doc["tiers"]
    seen = set()
    for r in rows:
        assert set(r) >= {"tier", "path", "op", "object_bytes", "gbps_median", "gbps_p90", "reps"}
        assert r["object_bytes"] in (PAGE_BYTES, CKPT_BYTES)
        assert _positive(r["gbps_median"]) and _positive(r["gbps_p90"]), r
        assert r["gbps_p90"] <= r["gbps_median"] * (1 + 1e-9), r  # p90 is the slow tail
        assert isinstance(r["reps"], int) and r["reps"] >= 1
        if r["tier"] != "reference":
            assert _positive(r["vs_memcpy_median"]), r
        seen.add((r["tier"], r["path"].split("[")[0], r["op"], r["object_bytes"]))
    for size in (PAGE_BYTES, CKPT_BYTES):
        assert ("reference", "numpy.copyto", "copy", size) in seen
        assert ("host", "HostPool", "put", size) in seen
        assert ("host", "HostPool", "get_into", size) in seen
        assert ("disk", "DiskTier", "put", size) in seen
        assert ("disk", "DiskTier", "get_into", size) in seen
        assert ("disk", "DiskTier", "read_many_into", size) in seen
        assert ("disk", "DiskTier", "put_many", size) in seen
        for tier in ("host", "disk"):
            assert (tier, "HybridStore", "put_kv+put_state", size) in seen
            assert (tier, "HybridStore", "put_kv_batch+put_state", size) in seen
            assert (tier, "HybridStore", "match+load", size) in seen
    disk = doc["disk"]
    assert isinstance(disk["o_direct"], bool)
    assert isinstance(disk["reads"], str) and disk["reads"]


@pytest.mark.slow
def test_match(bench) -> None:
    m = bench[0]["match"]
    assert m["prompt_tokens"] == 128 * 1024 and m["block_size"] == 64
    assert m["goal_ms"] == 0.5
    for key in ("ms_median", "ms_p90", "hash_ms_median", "walk_ms_median"):
        assert _positive(m[key]), (key, m[key])
    assert m["ms_p90"] >= m["ms_median"]
    assert m["hit_positions"] == [m["prompt_tokens"]]  # the checkpoint at the end was found


@pytest.mark.slow
def test_hashing(bench) -> None:
    h = bench[0]["hashing"]
    assert h["goal_gbps"] == 1.0
    assert _positive(h["python_gbps"])
    if _native.available()["hashing"]:
        assert _positive(h["native_gbps"]) and _positive(h["ratio"])
        assert h["keys_identical"] is True
    else:
        assert h["native_gbps"] is None


@pytest.mark.slow
def test_index_memory(bench) -> None:
    ix = bench[0]["index_memory"]
    assert ix["pages"] >= 100_000
    assert ix["goal_bytes"] == 200
    assert _positive(ix["bytes_per_block_index"])
    assert _positive(ix["bytes_per_block_tracemalloc"])


@pytest.mark.slow
def test_temp_dirs_are_removed(bench) -> None:
    import os

    _, _, disk_dir, _ = bench
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("name", ["ssd", "index"])
def test_moved_benches_point_to_python_m_benchmarks(name, capsys) -> None:
    """``hybridstore bench ssd|index`` left the package: one line says where, exit status 2."""
    from hybridstore.cli import main

    assert main(["bench", name, "--quick", "--json", "x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"python -m benchmarks {name}" in err[0]
    with pytest.raises(SystemExit):
        main(["bench", "core", "--no-such-flag"])  # the package's own commands stay strict
