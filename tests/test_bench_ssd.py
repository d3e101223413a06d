"""``hybridstore bench ssd`` in-process on tiny sizes: the document's shape, not its timings.

Also the pieces of the disk tier's data path that the bench drove: the POSIX
engine's striped I/O (:class:`~hybridstore.backends.engines.PieceStream`) and
the checksum that overlaps the reads.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybridstore.backends.disk import DiskTier, aligned_empty
from hybridstore.backends.engines import ALIGN, PosixEngine
from hybridstore.bench import odirect
from hybridstore.bench.ssd import CKPT_BYTES, KV_BLOCK_BYTES, OURS, parse_sizes, run_ssd_bench
from hybridstore.cli import build_parser
from hybridstore.errors import BackendIOError

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
    assert isinstance(dl["method"], str)
    assert ("fio" in dl["method"]) == (odirect.fio_path() is not None)
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
    args = build_parser().parse_args(["bench", "ssd", "--quick", "--dir", "D", "--json", "J",
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
    from hybridstore.bench.ssd import _measure_device

    path = str(tmp_path / "dev.dat")
    odirect.make_test_file(path, 8 * MIB)
    issues: list[str] = []
    dl = _measure_device(path, 8 * MIB, True, False, lambda _: None, issues, cell_seconds=0.02)
    assert issues == []
    assert "python O_DIRECT thread pool" in dl["method"] and "fio" in dl["method"]
    assert _positive(dl["read_gbps"]) and _positive(dl["write_gbps"])
    assert _positive(dl["reference_job"]["gbps"])


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


# ---------------------------------------------------------------------------------
# the data path the bench tuned: striped pieces, checksum overlapping the reads
# ---------------------------------------------------------------------------------
def _file(tmp_path: Path, nbytes: int) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def test_piece_sizes() -> None:
    engine = PosixEngine(8, chunk_bytes=512 * KIB)
    try:
        assert engine.piece_bytes(4 * MIB) == 256 * KIB  # two waves of 8 pieces
        assert engine.piece_bytes(50_000_000) == 512 * KIB
        assert engine.piece_bytes(100) == ALIGN  # small I/Os go whole
        assert engine.piece_bytes(1 * MIB) == 1 * MIB
        assert engine.piece_bytes(1 * MIB, in_place=False) == 256 * KIB  # bounce-sized
        assert engine.piece_bytes(2 * MIB) == 256 * KIB
    finally:
        engine.close()
    small = PosixEngine(3, chunk_bytes=2 * ALIGN)
    try:
        assert small.piece_bytes(10 * MIB) == 2 * ALIGN
        assert small.piece_bytes(100_000, in_place=False) == 2 * ALIGN
    finally:
        small.close()


@pytest.mark.parametrize("direct", [True, False])
def test_pread_stream_pieces_land_in_order(tmp_path: Path, direct: bool) -> None:
    nbytes = 3 * MIB + 4097
    path, data = _file(tmp_path, nbytes + 2 * ALIGN)  # O_DIRECT reads whole 4 KiB blocks
    engine = PosixEngine(4, chunk_bytes=64 * KIB, direct=direct)
    f = engine.open(path)
    try:
        for out in (aligned_empty(nbytes), np.zeros(nbytes + 3, np.uint8)[3:]):  # in place, bounced
            stream = engine.pread_stream(f, out, nbytes, ALIGN)
            seen = 0
            while seen < stream.count:
                landed = stream.wait_prefix(seen + 1)
                assert seen < landed <= stream.count
                end = stream.bounds(landed - 1)[1]
                assert np.array_equal(out[:end], data[ALIGN:ALIGN + end])
                seen = landed
            assert stream.result() == nbytes
            stream.wait_piece(stream.count - 1)
            assert np.array_equal(out, data[ALIGN:ALIGN + nbytes])
    finally:
        engine.close_file(f)
        engine.close()


def test_a_failed_piece_fails_the_stream_after_the_rest_stopped(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 2 * MIB)  # the read below runs past the end of the file
    engine = PosixEngine(4, chunk_bytes=64 * KIB)
    f = engine.open(path)
    try:
        out = aligned_empty(4 * MIB)
        stream = engine.pread_stream(f, out, 4 * MIB, 0)
        with pytest.raises(BackendIOError):
            for i in range(stream.count):
                stream.wait_piece(i)
        with pytest.raises(BackendIOError):
            stream.result()
        with pytest.raises(BackendIOError):
            engine.read(f, out, 4 * MIB, 0)
        assert engine.read(f, out, 2 * MIB, 0) == 2 * MIB  # the engine is still fine
    finally:
        engine.close_file(f)
        engine.close()


def test_concurrent_striped_io_shares_the_pool(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 8 * MIB)
    engine = PosixEngine(3, chunk_bytes=32 * KIB)
    f = engine.open(path)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for j in range(6):
                off = ((k * 7 + j) % 8) * 512 * KIB
                out = aligned_empty(1 * MIB + 100)
                fut = engine.pread(f, out, 1 * MIB + 100, off)
                assert fut.result(timeout=60) == 1 * MIB + 100
                assert np.array_equal(out, data[off:off + 1 * MIB + 100])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not errors, errors
        assert time.monotonic() - t0 < 120
    finally:
        engine.close_file(f)
        engine.close()


def test_verified_reads_of_large_objects_and_corruption(tmp_path: Path) -> None:
    """The streamed checksum equals the one-shot one; a flipped byte is still caught."""
    from hybridstore.backends.base import ObjectKind, object_key
    from hybridstore.backends.disk import segment_name
    from hybridstore.errors import CorruptObjectError

    with DiskTier(tmp_path / "d", 64 * MIB, engine=PosixEngine(4, chunk_bytes=64 * KIB),
                  segment_bytes=8 * MIB) as tier:
        objs = {i: np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
                for i, n in enumerate([3 * MIB + 1, 10 * MIB + 4097, 700 * KIB])}
        keys = {i: object_key(ObjectKind.STATE, i.to_bytes(16, "little")) for i in objs}
        for i, a in objs.items():
            tier.put(keys[i], a, nbytes=a.size).result()
        for i, a in objs.items():
            assert np.array_equal(tier.get(keys[i]), a)
        rec = tier.catalog.get(keys[1])
        assert rec is not None
        fd = os.open(tmp_path / "d" / segment_name(rec.segment), os.O_RDWR)
        pos = rec.offset + rec.length - 3  # in the last piece
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 1]), pos)
        os.close(fd)
        with pytest.raises(CorruptObjectError):
            tier.get(keys[1])
        assert not tier.contains(keys[1])
        assert np.array_equal(tier.get(keys[0]), objs[0])


def test_kvikio_engine_tuning_under_the_stand_in_driver(tmp_path: Path) -> None:
    """O_DIRECT compat reads and 512 KiB tasks, unless the environment says otherwise.

    Runs in a subprocess with the TEST FIXTURE stand-in ``libcuda.so.1`` (as
    tests/backends/test_disk.py does); this process never loads it.
    """
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio is not installed")
    from tests.backends.fake_libcuda import build_fake_libcuda, gcc

    if gcc() is None:
        pytest.skip("gcc is missing: cannot build the stand-in libcuda.so.1")
    lib = build_fake_libcuda(tmp_path / "cuda")
    src = Path(__file__).resolve().parents[1] / "src"
    code = ("import kvikio.defaults as d\n"
            "from hybridstore.backends.engines import KvikioEngine\n"
            "e = KvikioEngine(4)\n"
            "print(e.name, d.get('auto_direct_io_read'), d.get('task_size'),\n"
            "      d.get('num_threads'))\n"
            "e.close()\n")
    base = dict(os.environ,
                PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
                LD_LIBRARY_PATH=os.pathsep.join([str(lib), os.environ.get("LD_LIBRARY_PATH", "")]))
    base.pop("KVIKIO_AUTO_DIRECT_IO_READ", None)
    base.pop("KVIKIO_TASK_SIZE", None)
    for extra, want in (({}, "kvikio-compat True 524288 4"),
                        ({"KVIKIO_TASK_SIZE": "1048576"}, "kvikio-compat True 1048576 4")):
        proc = subprocess.run([sys.executable, "-c", code], env={**base, **extra}, text=True,
                              capture_output=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == want, proc.stdout
