"""``python -m benchmarks ssd`` in-process on tiny sizes: the document's shape, not its timings.

The pieces of the disk tier's data path that the bench drove (striped I/O,
streamed checksums, kvikio's tuning) are tested in tests/backends/test_engines.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from hybridstore.bench import odirect
from benchmarks.__main__ import build_parser
from benchmarks.ssd import CKPT_BYTES, KV_BLOCK_BYTES, OURS, parse_sizes, run_ssd_bench
from hybridstore.bench.device import TOOL_FIO, TOOL_POOL, measure_device

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 1 * MIB + 5]  # one unaligned size: tails and bounces on every path


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: object) -> bool:
    return _num(x) and x > 0  # type: ignore[operator]


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    tmp = tmp_path_factory.mktemp("ssd")
    json_path, png = tmp / "ssd.json", tmp / "ssd.png"
    plot = str(png) if _importable("matplotlib") else None
    doc = run_ssd_bench(json_path=str(json_path), disk_dir=str(tmp / "disk"), plot_path=plot,
                        quick=True, sizes=SIZES, reps=2, objects=2, print_json=False,
                        cell_seconds=0.1, device_file_bytes=32 * MIB)
    return doc, json.loads(json_path.read_text()), tmp


@pytest.mark.slow
def test_json_file_is_the_returned_document(bench) -> None:
    doc, on_disk, tmp = bench
    assert on_disk == json.loads(json.dumps(doc))
    assert set(doc) >= {"machine", "versions", "config", "disk", "device_limit", "results",
                        "unavailable", "host", "host_pool", "target", "issues"}
    assert doc["issues"] == [], doc["issues"]
    assert not os.listdir(tmp / "disk"), "the bench left files behind"


@pytest.mark.slow
def test_device_limit(bench) -> None:
    dl = bench[0]["device_limit"]
    assert _positive(dl["read_gbps"]) and _positive(dl["write_gbps"])
    assert isinstance(dl["method"], str) and dl["method"]
    if odirect.fio_path() is not None:  # fio on PATH measured the device (no issue was raised)
        assert (dl["tool"], dl["fallback"]) == (TOOL_FIO, None)
    else:
        assert (dl["tool"], dl["fallback"]) == (TOOL_POOL, "fio not found")
    cells = {(r["rw"], r["block_bytes"], r["iodepth"]) for r in dl["matrix"]}
    assert {rw for rw, _, _ in cells} == {"read", "randread", "write", "randwrite"}
    for r in dl["matrix"]:
        assert _positive(r["gbps"]) and _positive(r["gbps_median"]), r
        assert _num(r["p50_ms"]) and _num(r["p99_ms"])
    best = dl["best_read"]
    assert len(best["samples_gbps"]) == 3  # the matrix run, then twice more
    assert dl["read_gbps"] == pytest.approx(float(np.median(best["samples_gbps"])))


@pytest.mark.slow
def test_results(bench) -> None:
    doc = bench[0]
    rows = doc["results"]
    seen = set()
    for r in rows:
        assert set(r) >= {"path", "op", "object_bytes", "gbps", "p50_ms", "p99_ms", "cache"}, r
        assert r["object_bytes"] in SIZES
        assert _positive(r["gbps"]) and _positive(r["p50_ms"]) and _positive(r["p99_ms"]), r
        assert r["p99_ms"] >= r["p50_ms"], r
        assert _positive(r["vs_device_limit"]), r
        if r["op"] == "read" and r["path"] != "device-ref":
            assert _positive(r["vs_device_now"]), r
        if r["path"] not in (OURS, "device-ref"):
            assert _positive(r["vs_hybridstore"]), r
        if r["cache"] == "cold-dropped":
            frac = r.get("page_cache_after_drop")
            assert frac is None or 0 <= frac <= 0.05, r  # the drop really evicted the file
        seen.add((r["path"], r["op"], r["cache"], r["object_bytes"]))
    for size in SIZES:
        assert (OURS, "read", "cold-odirect", size) in seen
        assert (OURS, "write", "durable (O_DIRECT + fdatasync + catalog commit)", size) in seen
        assert ("device-ref", "read", "cold-odirect", size) in seen
        readers = ["torch.load", "numpy.fromfile"]
        if _importable("safetensors.torch"):
            readers.append("safetensors")
        for path in readers:
            assert (path, "read", "cold-dropped", size) in seen
            assert (path, "read", "warm", size) in seen
    ours = {r["path"] for r in rows} - {"device-ref", "torch.load", "torch.save", "safetensors",
                                        "numpy.fromfile", "numpy.save"}
    assert all(p.startswith("hybridstore") or "dali" in p for p in ours), ours
    for u in doc["unavailable"]:
        assert set(u) >= {"path", "op", "reason"} and u["reason"]


@pytest.mark.slow
def test_dali_rows(bench) -> None:
    if not _importable("nvidia.dali.fn"):
        pytest.skip("nvidia.dali is not importable (pip install nvidia-dali-cuda120)")
    doc = bench[0]
    dali = {(r["cache"], r["object_bytes"]) for r in doc["results"] if "dali" in r["path"]}
    for size in SIZES:
        assert ("cold-odirect", size) in dali and ("warm", size) in dali


@pytest.mark.slow
def test_kvikio_rows_or_reasons(bench) -> None:
    doc = bench[0]
    paths = {r["path"] for r in doc["results"]} | {u["path"] for u in doc["unavailable"]}
    assert {"hybridstore-kvikio-compat", "hybridstore-kvikio-gds"} <= paths
    assert "dali-numpy-gpu" in paths


@pytest.mark.slow
def test_host_pool_and_target(bench) -> None:
    doc = bench[0]
    host = doc["host_pool"]
    assert {(r["path"], r["op"]) for r in host} >= {("numpy.copyto", "copy"),
                                                    ("hybridstore-hostpool", "put"),
                                                    ("hybridstore-hostpool", "get_into")}
    for r in host:
        assert _positive(r["gbps"]) and _positive(r["p50_ms"]), r
        if r["path"] == "hybridstore-hostpool" and r["op"] in ("put", "get_into"):
            assert _positive(r["vs_memcpy"]), r
    assert isinstance(doc["host"]["pinned"], bool)
    assert doc["target"]["rows"] == []  # no object of 4 MiB or more in this run


@pytest.mark.slow
def test_plot_is_a_png(bench) -> None:
    if not _importable("matplotlib"):
        pytest.skip("matplotlib is not installed (the bench extra): no plot")
    png = bench[2] / "ssd.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------
def test_cli_parses_bench_ssd() -> None:
    args = build_parser().parse_args(["ssd", "--quick", "--dir", "D", "--json", "J",
                                      "--plot", "P.png", "--sizes", "4K,ckpt", "--no-fio"])
    assert (args.quick, args.dir, args.json, args.plot, args.no_fio) == (True, "D", "J", "P.png",
                                                                          True)
    assert parse_sizes(args.sizes) == [4096, CKPT_BYTES]


def test_parse_sizes() -> None:
    assert parse_sizes("4K, 4M,1G,kv,checkpoint,123,1.5M,64KiB") == [
        4096, 4 * MIB, 1 << 30, KV_BLOCK_BYTES, CKPT_BYTES, 123, 3 * MIB // 2, 64 * KIB]
    assert KV_BLOCK_BYTES == 576 * (1_100_000_000 // 32_768) and CKPT_BYTES == 50_000_000
    with pytest.raises(ValueError):
        parse_sizes("0")


def test_device_fallback_without_fio(tmp_path: Path) -> None:
    """The O_DIRECT thread pool measures the device when fio is absent (or refused)."""
    path = str(tmp_path / "dev.dat")
    odirect.make_test_file(path, 8 * MIB)
    issues: list[str] = []
    dl = measure_device(path, 8 * MIB, True, False, lambda _: None, issues, cell_seconds=0.02)
    assert issues == []
    assert (dl["tool"], dl["fallback"]) == (TOOL_POOL, "fio disabled (--no-fio)")
    assert "python O_DIRECT thread pool" in dl["method"]
    assert _positive(dl["read_gbps"]) and _positive(dl["write_gbps"])
    assert _positive(dl["reference_job"]["gbps"])


FAKE_FIO = """#!{python}
# TEST FIXTURE: a stand-in fio. --version prints a version; a job file gets one JSON
# result per job section at {gbps} GB/s, or exit status 1 when FAKE_FIO_FAIL is set.
import json, os, sys
if sys.argv[1:] == ["--version"]:
    print("fio-fake-3.0")
    sys.exit(0)
if os.environ.get("FAKE_FIO_FAIL"):
    sys.stderr.write("fake fio: refused")
    sys.exit(1)
jobs = []
for line in open(sys.argv[-1]):
    line = line.strip()
    if line.startswith("[j"):
        name = line[1:-1]
        side = {{"bw_bytes": {gbps} * 1e9, "iops": 1.0,
                 "clat_ns": {{"percentile": {{"50.000000": 1e6, "99.000000": 2e6}}}}}}
        jobs.append({{"jobname": name, "read": side, "write": side}})
print("note: fake")
print(json.dumps({{"jobs": jobs}}))
"""


def _fake_fio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gbps: float) -> None:
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fio = bin_dir / "fio"
    fio.write_text(FAKE_FIO.format(python=sys.executable, gbps=gbps))
    fio.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    assert odirect.fio_path() == str(fio)


def test_device_limit_by_fio_when_fio_is_on_path(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The structured ``tool``, not a substring of the method, says who measured."""
    _fake_fio(tmp_path, monkeypatch, gbps=1.25)
    path = str(tmp_path / "dev.dat")
    odirect.make_test_file(path, 8 * MIB)
    issues: list[str] = []
    dl = measure_device(path, 8 * MIB, True, True, lambda _: None, issues, cell_seconds=0.02)
    assert issues == []
    assert (dl["tool"], dl["fallback"]) == (TOOL_FIO, None)
    assert dl["method"].startswith("fio-fake-3.0")
    assert dl["read_gbps"] == dl["write_gbps"] == pytest.approx(1.25)
    assert len(dl["best_read"]["samples_gbps"]) == 3


def test_device_limit_falls_back_when_fio_fails(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fio(tmp_path, monkeypatch, gbps=1.25)
    monkeypatch.setenv("FAKE_FIO_FAIL", "1")
    path = str(tmp_path / "dev.dat")
    odirect.make_test_file(path, 8 * MIB)
    issues: list[str] = []
    dl = measure_device(path, 8 * MIB, True, True, lambda _: None, issues, cell_seconds=0.02)
    assert (dl["tool"], dl["fallback"]) == (TOOL_POOL, "fio failed")
    assert len(issues) == 1 and "fio failed" in issues[0]
    assert _positive(dl["read_gbps"]) and _positive(dl["write_gbps"])


def test_pool_run_on_extents(tmp_path: Path) -> None:
    path = str(tmp_path / "f.dat")
    odirect.make_test_file(path, 4 * MIB)
    job = odirect.IoJob("read", 256 * KIB, 3)
    r = odirect.pool_run(None, job, extents=[(path, 0, 300_000), (path, 2 * MIB, 5)],
                         total_bytes=3 * MIB)
    assert r["bytes"] >= 3 * MIB and _positive(r["gbps"])
    w = odirect.pool_run(path, odirect.IoJob("randwrite", 64 * KIB, 2), file_bytes=4 * MIB,
                         seconds=0.05)
    assert _positive(w["gbps"]) and w["direct"] in (True, False)


def test_drop_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 * MIB))
    path.read_bytes()
    odirect.drop_page_cache(str(path))
    frac = odirect.cached_fraction(str(path))
    assert frac is None or 0.0 <= frac <= 1.0
