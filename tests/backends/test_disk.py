"""The disk tier: conformance per engine, durability, recovery, corruption, locking.

The kvikio engine needs ``libcuda.so.1`` even in its POSIX compat mode.  On
machines without the NVIDIA driver, :func:`test_kvikio_engine_suite` compiles
the TEST FIXTURE ``fake_libcuda/fake_libcuda.c`` and reruns this file in a
subprocess with the stand-in on ``LD_LIBRARY_PATH`` and
``HYBRIDSTORE_TEST_FAKE_LIBCUDA=1``; in that subprocess every engine-specific
test below runs with ``engine="kvikio"`` (kvikio's real compat path on host
memory).  The main test process never loads the stand-in.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridstore.backends.catalog import Catalog, CatalogRecord
from hybridstore.backends.disk import CATALOG_DIR, DiskTier, segment_name
from hybridstore.backends.engines import (
    ALIGN,
    PosixEngine,
    cuda_driver_usable,
    select_engine,
)
from hybridstore.errors import (
    CapacityError,
    CatalogError,
    ConfigError,
    CorruptObjectError,
    DiskPathError,
    ObjectTooLargeError,
    StoreClosedError,
)
from hybridstore.objects import ObjectKind, aligned_empty, object_key
from hybridstore.testing.tiers import TierConformance
from tests.backends.fake_libcuda import ENV_FLAG, MODE_VAR, build_fake_libcuda, gcc

IN_FAKE_DRIVER = os.environ.get(ENV_FLAG) == "1"
ENGINE = "kvikio" if IN_FAKE_DRIVER else "posix"
SRC = Path(__file__).resolve().parents[2] / "src"
MiB = 1 << 20


def key(i: int, kind: ObjectKind = ObjectKind.PAGE) -> bytes:
    return object_key(kind, i.to_bytes(16, "little"))


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def open_tier(path: Path, capacity: int = 64 * MiB, **kw: object) -> DiskTier:
    kw.setdefault("segment_bytes", 4 * MiB)
    kw.setdefault("io_threads", 4)
    return DiskTier(path, capacity, engine=ENGINE, **kw)  # type: ignore[arg-type]


def engine_round_trip(engine: Any, path: Path, *, file_bytes: int, n: int, offset: int,
                      seed: int) -> tuple[Any, np.ndarray]:
    """Write ``n`` bytes from an unaligned buffer at ``offset``, read them back into an
    unaligned one, and check them and that nothing past ``n`` was written; returns the
    open file and the read buffer."""
    path.write_bytes(b"")
    os.truncate(path, file_bytes)
    f = engine.open(path)
    data = payload(n + 1, seed)
    assert engine.pwrite(f, data[1:], n, offset).result() == n
    engine.fsync(f)
    out = np.zeros(n + 10, np.uint8)
    assert engine.pread(f, out[3:], n, offset).result() == n
    assert np.array_equal(out[3:n + 3], data[1:]) and not out[n + 3:].any()
    return f, out


def run_python(code: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (same environment, ``src`` importable)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                          capture_output=True, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


# ---------------------------------------------------------------------------------
# the stand-in driver: build it, rerun this file under it
# ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fake_libcuda_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TEST FIXTURE: directory holding the compiled stand-in ``libcuda.so.1``."""
    if gcc() is None:
        pytest.skip("gcc is missing: cannot build the stand-in libcuda.so.1 that the kvikio "
                    "engine tests need on machines without the NVIDIA driver")
    return build_fake_libcuda(tmp_path_factory.mktemp("fake_libcuda"))


def fake_driver_env(lib_dir: Path, mode: str = "nodevice") -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib_dir), env.get("LD_LIBRARY_PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(SRC.parent), env.get("PYTHONPATH", "")])
    env[ENV_FLAG] = "1"
    env[MODE_VAR] = mode
    return env


if not IN_FAKE_DRIVER:

    def test_kvikio_engine_suite(fake_libcuda_dir: Path) -> None:
        """Every engine test of this file again, with kvikio's compat engine, in a subprocess."""
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x",
             "-W", "error::pytest.PytestUnraisableExceptionWarning"],
            env=fake_driver_env(fake_libcuda_dir), cwd=SRC.parent, text=True,
            capture_output=True, timeout=600, check=False)
        report = proc.stdout + proc.stderr
        assert proc.returncode == 0, report
        assert " passed" in report and "skipped" not in report, report

    def test_fake_driver_never_loaded_in_this_process(fake_libcuda_dir: Path) -> None:
        with open("/proc/self/maps") as maps:
            assert str(fake_libcuda_dir) not in maps.read()

    def test_auto_engine_without_a_device_picks_posix(fake_libcuda_dir: Path) -> None:
        code = """
            from hybridstore.backends.engines import select_engine, cuda_driver_usable
            assert not cuda_driver_usable()
            print(select_engine("auto", 2).name)
        """
        for mode in ("nodevice", "uninit"):
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                                  env=fake_driver_env(fake_libcuda_dir, mode),
                                  capture_output=True, timeout=120, check=False)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == "posix-odirect", mode

    def test_kvikio_engine_works_with_an_uninitialised_driver(fake_libcuda_dir: Path,
                                                             tmp_path: Path) -> None:
        code = f"""
            import numpy as np
            from hybridstore.backends.disk import DiskTier
            t = DiskTier({str(tmp_path / 'd')!r}, 16 << 20, engine="kvikio",
                         segment_bytes=1 << 20)
            a = np.arange(300_000, dtype=np.uint32).view(np.uint8)
            t.put(bytes(17), a, nbytes=a.nbytes).result()
            assert (t.get(bytes(17)) == a).all()
            print(t.stats()["engine"])
            t.close()
        """
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                              env=fake_driver_env(fake_libcuda_dir, "uninit"),
                              capture_output=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "kvikio-compat"

    def test_select_engine_in_this_process() -> None:
        posix = select_engine("posix", 2)
        assert posix.name == "posix-odirect"
        posix.close()
        auto = select_engine("auto", 2)
        if not cuda_driver_usable():
            assert auto.name == "posix-odirect"
        auto.close()
        with pytest.raises(ConfigError):
            select_engine("nvme", 2)

    def test_kvikio_without_a_driver_is_a_config_error() -> None:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            with pytest.raises(ConfigError, match="libcuda.so.1"):
                select_engine("kvikio", 2)
        else:
            pytest.skip("this machine has a CUDA driver")

else:

    def test_engine_is_kvikio_compat(tmp_path: Path) -> None:
        with open_tier(tmp_path / "d") as tier:
            assert tier.stats()["engine"] == "kvikio-compat"
            assert tier.engine.compat_mode

    def test_kvikio_engine_futures(tmp_path: Path) -> None:
        from hybridstore.errors import BackendIOError

        engine = select_engine("kvikio", 3)
        f, out = engine_round_trip(engine, tmp_path / "f", file_bytes=2 * MiB, n=300_000,
                                   offset=4 * ALIGN, seed=4)
        with pytest.raises(BackendIOError):  # past the end of the file
            engine.pread(f, out, 300_000, 2 * MiB - ALIGN).result()
        engine.close_file(f)
        engine.close()

    def test_kvikio_settings_are_restored_when_the_last_engine_closes(tmp_path: Path) -> None:
        """kvikio.defaults are process-wide: open tiers set them, closing them all restores them."""
        import kvikio.defaults as kd

        from hybridstore.backends.engines.kvikio import KVIKIO_TUNING

        names = ("num_threads", "task_size", "auto_direct_io_read")
        before = {"num_threads": 2, "task_size": 1 << 20, "auto_direct_io_read": False}
        assert all(KVIKIO_TUNING[n] != before[n] for n in names if n in KVIKIO_TUNING)
        with kd.set(before):  # known values to come back to (restored after the test)
            first = DiskTier(tmp_path / "a", 16 * MiB, engine="kvikio", segment_bytes=1 * MiB,
                             io_threads=3)
            tuned = {n: kd.get(n) for n in names}
            assert tuned["num_threads"] == 3
            for name, value in KVIKIO_TUNING.items():
                if f"KVIKIO_{name.upper()}" not in os.environ:
                    assert tuned[name] == value, name
            second = DiskTier(tmp_path / "b", 16 * MiB, engine="kvikio", segment_bytes=1 * MiB,
                              io_threads=5)
            assert kd.get("num_threads") == 5  # the engine opened last wins, as kvikio's set does
            first.close()
            assert kd.get("num_threads") == 5  # the open tier keeps its settings
            second.close()
            assert {n: kd.get(n) for n in names} == before
            third = DiskTier(tmp_path / "c", 16 * MiB, engine="kvikio", segment_bytes=1 * MiB,
                             io_threads=4)
            third.close()
            assert {n: kd.get(n) for n in names} == before


# ---------------------------------------------------------------------------------
# the tier contract, once per engine
# ---------------------------------------------------------------------------------
class _DiskConformance(TierConformance):
    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> DiskTier:
        return DiskTier(tmp_path / "disk", capacity_bytes, engine=ENGINE, segment_bytes=1 * MiB,
                        io_threads=4)


if IN_FAKE_DRIVER:

    class TestKvikioDiskConformance(_DiskConformance):
        """The contract with kvikio's engine (run by ``test_kvikio_engine_suite``)."""

else:

    class TestPosixDiskConformance(_DiskConformance):
        """The contract with the POSIX O_DIRECT engine."""


# ---------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 65536, 3 * MiB + 17])
def test_round_trip_sizes(tmp_path: Path, n: int) -> None:
    with open_tier(tmp_path / "d") as tier:
        data = payload(n, n)
        assert tier.put(key(1), data, nbytes=n, meta=b"m").result() == n
        assert tier.nbytes(key(1)) == n and tier.meta(key(1)) == b"m"
        assert np.array_equal(tier.get(key(1)), data)


def test_unaligned_buffers_bounce_and_never_write_past_nbytes(tmp_path: Path) -> None:
    with open_tier(tmp_path / "d") as tier:
        backing = payload(2 * MiB + 3 * ALIGN, 7)
        src = backing[1:1 + 2 * MiB + 5]  # odd address, odd length
        tier.put(key(1), src, nbytes=src.size).result()
        out_backing = np.full(src.size + 100, 0xAB, dtype=np.uint8)
        out = out_backing[3:]
        assert tier.get_into(key(1), out).result() == src.size
        assert np.array_equal(out[:src.size], src)
        assert (out[src.size:] == 0xAB).all() and out_backing[:3].tolist() == [0xAB] * 3
        aligned = aligned_empty(src.size + ALIGN)
        aligned[src.size:] = 0xCD
        tier.get_into(key(1), aligned).result()
        assert np.array_equal(aligned[:src.size], src) and (aligned[src.size:] == 0xCD).all()


def test_torch_cpu_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with open_tier(tmp_path / "d") as tier:
        src = torch.arange(10_000, dtype=torch.float32)
        tier.put(key(1), src, nbytes=src.numel() * 4).result()
        out = torch.empty(10_000, dtype=torch.float32)
        tier.get_into(key(1), out).result()
        assert torch.equal(out, src)


if not IN_FAKE_DRIVER:  # the stand-in driver has no devices

    @pytest.mark.gpu
    @pytest.mark.parametrize("engine", ["auto", "posix"])
    def test_get_into_device_tensor(tmp_path: Path, engine: str) -> None:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        with DiskTier(tmp_path / "d", 64 * MiB, engine=engine, segment_bytes=4 * MiB) as tier:
            src = payload(5 * MiB + 1, 3)
            tier.put(key(1), src, nbytes=src.size).result()
            out = torch.empty(src.size + 10, dtype=torch.uint8, device="cuda")
            tier.get_into(key(1), out).result()
            assert np.array_equal(out[:src.size].cpu().numpy(), src)


def test_objects_larger_than_a_segment(tmp_path: Path) -> None:
    path = tmp_path / "d"
    big = payload(5 * MiB + 123, 1)
    with open_tier(path, capacity=32 * MiB, segment_bytes=1 * MiB) as tier:
        tier.put(key(1), big, nbytes=big.size).result()
        tier.put(key(2), big[:1000], nbytes=1000).result()
        assert np.array_equal(tier.get(key(1)), big)
        dedicated = segment_name(tier._objects[key(1)].extent.arena)
        assert (path / dedicated).stat().st_size >= big.size
    with open_tier(path, capacity=32 * MiB, segment_bytes=1 * MiB) as tier:
        assert np.array_equal(tier.get(key(1)), big)
        assert tier.delete(key(1)) >= big.size
        assert not tier.contains(key(1))
        assert np.array_equal(tier.get(key(2)), big[:1000])
    # the dedicated segment is removed (counting files would race the tier's background
    # creation of the next 1 MiB segment)
    assert not (path / dedicated).exists()


def test_replace_and_delete(tmp_path: Path) -> None:
    with open_tier(tmp_path / "d") as tier:
        tier.put(key(1), payload(100_000, 1), nbytes=100_000).result()
        newer = payload(50_000, 2)
        tier.put(key(1), newer, nbytes=50_000, meta=b"v2").result()
        assert tier.nbytes(key(1)) == 50_000 and tier.meta(key(1)) == b"v2"
        assert tier.used_bytes == tier.charge(50_000)
        assert np.array_equal(tier.get(key(1)), newer)
        assert tier.delete(key(1)) == tier.charge(50_000)
        assert tier.delete(key(1)) == 0 and tier.used_bytes == 0
        with pytest.raises(KeyError):
            tier.get_into(key(1), np.empty(10, np.uint8))


def test_delete_many_drops_committed_and_cancels_pending_writes(tmp_path: Path) -> None:
    with open_tier(tmp_path / "d") as tier:
        for i in range(3):
            tier.put(key(i), payload(9_000, i), nbytes=9_000).result()
        pending = tier.put(key(3), payload(9_000, 3), nbytes=9_000)
        freed = tier.delete_many([key(0), key(2), key(2), key(3), key(9)])
        assert freed in (2 * tier.charge(9_000), 3 * tier.charge(9_000))  # key 3 may be durable
        pending.result()
        assert [tier.contains(key(i)) for i in range(4)] == [False, True, False, False]
        assert tier.used_bytes == tier.charge(9_000) and tier.delete_many([]) == 0
    with open_tier(tmp_path / "d") as tier:   # the catalog agrees after a reopen
        assert [k for k, _, _ in tier.entries()] == [key(1)]


def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with open_tier(tmp_path / "d") as tier:
        objs = {i: payload(int(n), i) for i, n in
                enumerate(np.random.default_rng(0).integers(1, 600_000, 64))}
        futures = [tier.put(key(i), a, nbytes=a.size) for i, a in objs.items()]
        for f in futures:
            f.result()

        def check(i: int) -> bool:
            return bool(np.array_equal(tier.get(key(i)), objs[i]))

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(check, list(objs) * 3))
        assert tier.stats()["objects"] == 64


# ---------------------------------------------------------------------------------
# budget
# ---------------------------------------------------------------------------------
def test_capacity_budget_holds(tmp_path: Path) -> None:
    capacity = 4 * MiB
    with open_tier(tmp_path / "d", capacity=capacity, segment_bytes=1 * MiB) as tier:
        stored = []
        with pytest.raises(CapacityError):
            for i in range(100):
                tier.put(key(i), payload(300_000, i), nbytes=300_000).result()
                stored.append(i)
                assert tier.used_bytes <= capacity
        assert 0 < len(stored) < 100 and tier.used_bytes <= capacity
        before = (tier.used_bytes, sorted(k for k, _, _ in tier.entries()))
        with pytest.raises(CapacityError):
            tier.put(key(999), payload(300_000, 9), nbytes=300_000)
        assert (tier.used_bytes, sorted(k for k, _, _ in tier.entries())) == before
        tier.delete(key(stored[0]))
        tier.put(key(999), payload(300_000, 9), nbytes=300_000).result()
        with pytest.raises(ObjectTooLargeError):
            tier.charge(capacity + 1)
        with pytest.raises(ObjectTooLargeError):
            tier.put(key(1000), np.zeros(capacity + 1, np.uint8), nbytes=capacity + 1)
        disk_bytes = sum(os.path.getsize(tmp_path / "d" / n)
                         for n in os.listdir(tmp_path / "d") if n.startswith("seg-"))
        assert disk_bytes <= capacity


# ---------------------------------------------------------------------------------
# durability and recovery
# ---------------------------------------------------------------------------------
def test_reopen_in_a_new_process_sees_every_object(tmp_path: Path) -> None:
    path = tmp_path / "d"
    sizes = [1, 4096, 70_000, 2 * MiB + 5, 6 * MiB]
    with open_tier(path) as tier:
        for i, n in enumerate(sizes):
            tier.put(key(i), payload(n, i), nbytes=n, meta=f"meta{i}".encode()).result()
        tier.put_info("layout", b"pages:f16[2,16,8,64]")
    proc = run_python(f"""
        import numpy as np
        from hybridstore.backends.disk import DiskTier
        from hybridstore.objects import ObjectKind, object_key
        tier = DiskTier({str(path)!r}, 64 << 20, engine={ENGINE!r}, segment_bytes=4 << 20)
        sizes = {sizes!r}
        assert sorted(k for k, _, _ in tier.entries()) == sorted(
            object_key(ObjectKind.PAGE, i.to_bytes(16, "little")) for i in range(len(sizes)))
        for i, n in enumerate(sizes):
            k = object_key(ObjectKind.PAGE, i.to_bytes(16, "little"))
            want = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
            assert tier.nbytes(k) == n and tier.meta(k) == f"meta{{i}}".encode()
            assert np.array_equal(tier.get(k), want), i
        assert tier.get_info("layout") == b"pages:f16[2,16,8,64]"
        print(tier.stats()["recovered_objects"], tier.stats()["recovery_dropped"])
        tier.close()
    """)
    assert proc.stdout.split() == [str(len(sizes)), "0"]


def test_killed_before_commit_leaves_no_object(tmp_path: Path) -> None:
    """A torn write: bytes written and synced, process killed before the catalog commit."""
    path = tmp_path / "d"
    proc = run_python(f"""
        import os, signal
        import numpy as np
        from hybridstore.backends import catalog
        from hybridstore.backends.disk import DiskTier
        tier = DiskTier({str(path)!r}, 64 << 20, engine={ENGINE!r}, segment_bytes=4 << 20)
        tier.put(b"A" * 17, np.full(10_000, 1, np.uint8), nbytes=10_000).result()
        def die(self, items, **kw):
            os.kill(os.getpid(), signal.SIGKILL)
        catalog.Catalog.put_many = die
        # 5 MiB > segment_bytes: written into a dedicated segment file of its own
        tier.put(b"B" * 17, np.full(5 << 20, 2, np.uint8), nbytes=5 << 20).result()
        print("not reached")
    """, check=False)
    assert proc.returncode == -9 and "not reached" not in proc.stdout
    assert len([n for n in os.listdir(path) if n.startswith("seg-")]) == 2
    with open_tier(path) as tier:
        assert tier.contains(b"A" * 17) and not tier.contains(b"B" * 17)
        assert [k for k, _, _ in tier.entries()] == [b"A" * 17]
        assert (tier.get(b"A" * 17) == 1).all()
        assert tier.used_bytes == tier.charge(10_000)  # the torn bytes' space is free again
    # the torn object's dedicated segment was removed on reopen
    assert [n for n in os.listdir(path) if n.startswith("seg-")] == [segment_name(0)]


def test_entries_pointing_past_the_file_are_dropped(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "d"
    with open_tier(path) as tier:
        tier.put(key(1), payload(50_000, 1), nbytes=50_000).result()
        seg = tier.catalog.get(key(1))
        assert seg is not None
    cat = Catalog(path / CATALOG_DIR)
    size = os.path.getsize(path / segment_name(seg.segment))
    cat.put(key(2), CatalogRecord(seg.segment, size + 8 * ALIGN, 40_000, 40_960, 0))
    cat.put(key(3), CatalogRecord(77, 0, 4096, 4096, 0))  # segment file missing
    cat.close()
    with caplog.at_level(logging.WARNING), open_tier(path) as tier:
        assert tier.contains(key(1)) and not tier.contains(key(2)) and not tier.contains(key(3))
        assert tier.stats()["recovery_dropped"] == 2
        assert np.array_equal(tier.get(key(1)), payload(50_000, 1))
    assert "too short" in caplog.text and "missing" in caplog.text
    cat = Catalog(path / CATALOG_DIR)
    assert cat.get(key(2)) is None and cat.get(key(3)) is None and len(cat) == 1
    cat.close()


def test_corrupt_byte_is_reported_once_then_dropped(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "d"
    with open_tier(path) as tier:
        for i in range(3):
            tier.put(key(i), payload(200_000, i), nbytes=200_000).result()
        rec = tier.catalog.get(key(1))
        assert rec is not None
        fd = os.open(path / segment_name(rec.segment), os.O_RDWR)
        byte = os.pread(fd, 1, rec.offset + 12_345)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), rec.offset + 12_345)
        os.close(fd)
        with caplog.at_level(logging.WARNING), pytest.raises(CorruptObjectError) as err:
            tier.get(key(1))
        assert err.value.key == key(1) and err.value.expected == rec.checksum
        assert err.value.got != rec.checksum
        assert "checksum" in caplog.text
        assert not tier.contains(key(1)) and tier.nbytes(key(1)) is None
        with pytest.raises(KeyError):
            tier.get(key(1))
        assert tier.stats()["corrupt_dropped"] == 1
        for i in (0, 2):
            assert np.array_equal(tier.get(key(i)), payload(200_000, i))
    with open_tier(path) as tier:
        assert sorted(k for k, _, _ in tier.entries()) == [key(0), key(2)]


def test_unverified_reads_skip_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "d"
    with open_tier(path, verify_checksums=False) as tier:
        tier.put(key(1), payload(10_000, 1), nbytes=10_000).result()
        rec = tier.catalog.get(key(1))
        assert rec is not None
        fd = os.open(path / segment_name(rec.segment), os.O_RDWR)
        os.pwrite(fd, b"\0", rec.offset)
        os.close(fd)
        assert tier.get(key(1))[0] == 0 and tier.contains(key(1))


# ---------------------------------------------------------------------------------
# paths, locking, lifecycle
# ---------------------------------------------------------------------------------
def test_second_opener_in_another_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d"
    with open_tier(path):
        proc = run_python(f"""
            from hybridstore.backends.disk import DiskTier
            from hybridstore.errors import DiskPathError
            try:
                DiskTier({str(path)!r}, 1 << 30, engine="posix")
            except DiskPathError as e:
                print("refused:", e)
        """)
        assert proc.stdout.startswith("refused:") and "in use" in proc.stdout
        with pytest.raises(DiskPathError, match="in use"):
            open_tier(path)  # a second open in this process is refused too
    open_tier(path).close()  # free again after close


def test_an_unlinked_lock_file_keeps_a_second_opener_out(tmp_path: Path) -> None:
    """The lock holds on the directory itself: removing LOCK (a cleanup script, an
    operator) must not let another store in.  flock conflicts between two opens of
    one process exactly as between two processes."""
    path = tmp_path / "d"
    with open_tier(path) as tier:
        tier.put(key(1), payload(5000, 1), nbytes=5000).result()
        os.unlink(path / "LOCK")
        with pytest.raises(DiskPathError, match="in use"):
            open_tier(path)
        (path / "LOCK").write_text("stale\n")      # a LOCK made again, by hand
        with pytest.raises(DiskPathError, match="in use"):
            open_tier(path)
        assert np.array_equal(tier.get(key(1)), payload(5000, 1))
    with open_tier(path) as tier:                    # free again after close
        assert np.array_equal(tier.get(key(1)), payload(5000, 1))


def test_a_loose_existing_directory_is_made_owner_only(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A directory made beforehand with mode 0777 is tightened to 0700 (with a warning);
    a shared scratch directory (sticky bit, as /tmp) is refused and left as it was."""
    path = tmp_path / "d"
    path.mkdir()
    os.chmod(path, 0o777)
    with caplog.at_level(logging.WARNING, logger="hybridstore.backends.disk"):
        open_tier(path).close()
    assert oct(os.stat(path).st_mode & 0o7777) == oct(0o700)
    assert "0777" in caplog.text
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    with pytest.raises(DiskPathError, match="1777"):
        open_tier(scratch)
    assert oct(os.stat(scratch).st_mode & 0o7777) == oct(0o1777)
    assert os.listdir(scratch) == []               # nothing written there


def test_unusable_path_is_a_disk_path_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(DiskPathError, match="disk_path"):
        open_tier(blocker / "sub")
    with pytest.raises(DiskPathError):
        open_tier(blocker)
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(DiskPathError):
            open_tier(ro / "d")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "a", -1, engine="posix")
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "b", 1 * MiB, engine="posix", segment_bytes=1000)
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "c", 1 * MiB, engine="posix", io_threads=0)
    with open_tier(tmp_path / "d") as tier:
        with pytest.raises(ValueError):
            tier.put(b"short", payload(10, 1), nbytes=10)
        with pytest.raises(ValueError):
            tier.put(key(1), payload(10, 1), nbytes=11)
        with pytest.raises(TypeError):
            tier.put(key(1), None, nbytes=10)


def test_closed_tier_refuses_calls_and_keeps_written_objects(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "d")
    futures = [tier.put(key(i), payload(500_000, i), nbytes=500_000) for i in range(8)]
    tier.close()  # waits for the in-flight writes
    assert all(f.done() and f.exception() is None for f in futures)
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.contains(key(1))
    with pytest.raises(StoreClosedError):
        tier.put(key(1), payload(1, 1), nbytes=1)
    with open_tier(tmp_path / "d") as again:
        assert len(list(again.entries())) == 8


def test_read_seconds_is_histate_eq2(tmp_path: Path) -> None:
    with open_tier(tmp_path / "d", ssd_gbps=5.0, h2d_gbps=64.0) as tier:
        assert tier.read_seconds(10**9) == pytest.approx(1 / 5 + 1 / 64)
        assert tier.read_seconds(0) == 0


# ---------------------------------------------------------------------------------
# catalog and engine details
# ---------------------------------------------------------------------------------
def test_catalog_adopts_a_map_another_process_grew(tmp_path: Path) -> None:
    """Processes sharing a directory share its catalog: when one grows the lmdb map,
    the others' next transactions get MDB_MAP_RESIZED and must adopt the new size, not
    fail (the shared-directory kill campaign saw processes die of it on open)."""
    path = tmp_path / "c"
    cat = Catalog(path, map_size=1 << 16)
    cat.put(key(0), CatalogRecord(0, 0, 10, ALIGN, 0, b""))
    size = cat._env.info()["map_size"]
    code = textwrap.dedent(f"""
        from hybridstore.backends.catalog import Catalog, CatalogRecord
        from hybridstore.objects import ObjectKind, object_key
        cat = Catalog({str(path)!r}, map_size=1 << 16)
        first = len(cat)
        cat.put_many((object_key(ObjectKind.PAGE, i.to_bytes(16, "little")),
                      CatalogRecord(0, i * 4096, 10, 4096, i, b"m" * 400))
                     for i in range(first, first + 20_000))
        print(cat._env.info()["map_size"])
    """)
    grown = int(run_python(code).stdout.split()[-1])
    assert grown >= 4 * size                     # the other process grew the map
    assert cat.get(key(20_000)) is not None and len(cat) == 20_001  # reads adopt it
    cat.put(key(0), CatalogRecord(0, 0, 10, ALIGN, 1, b""))         # and so do writes
    assert cat.get(key(0)).checksum == 1 and cat._env.info()["map_size"] > size
    size = cat._env.info()["map_size"]
    assert int(run_python(code).stdout.split()[-1]) >= 2 * size     # grown again: another
    again = Catalog(path)                        # catalog of this process opens (open_db)
    assert len(again) == len(cat) == 40_001
    again.close()
    cat.close()


def test_catalog_versions_and_info(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c", map_size=1 << 16)
    for i in range(3000):  # grows the lmdb map on demand
        cat.put(key(i), CatalogRecord(0, i * ALIGN, 10, ALIGN, i, b"m" * 40))
    cat.put_info("layout", b"abc")
    assert len(cat) == 3000 and cat.get_info("layout") == b"abc" and cat.get_info("x") is None
    assert cat.get(key(5)) == CatalogRecord(0, 5 * ALIGN, 10, ALIGN, 5, b"m" * 40)
    assert cat.delete_many([key(5), key(99_999)]) == 1
    env = cat._env
    with env.begin(write=True) as txn:
        txn.put(key(6), b"\x09" + b"\0" * 60, db=cat._objects)
    with pytest.raises(CatalogError, match="version 9"):
        cat.get(key(6))
    with env.begin(write=True) as txn:
        txn.put(b"format", (99).to_bytes(4, "little"), db=cat._meta)
    cat.close()
    with pytest.raises(CatalogError, match="format version 99"):
        Catalog(tmp_path / "c")


def test_posix_engine_chunks_and_buffered_fallback(tmp_path: Path) -> None:
    for direct in (True, False):
        engine = PosixEngine(3, chunk_bytes=2 * ALIGN, direct=direct)
        f, _ = engine_round_trip(engine, tmp_path / f"f{direct}", file_bytes=4 * MiB, n=100_000,
                                 offset=8 * ALIGN, seed=5)
        engine.close_file(f)
        engine.close()


def test_posix_engine_reports_reads_past_the_end(tmp_path: Path) -> None:
    from hybridstore.errors import BackendIOError

    engine = PosixEngine(2)
    path = tmp_path / "short"
    path.write_bytes(b"\1" * ALIGN)
    f = engine.open(path)
    with pytest.raises(BackendIOError) as err:
        engine.pread(f, aligned_empty(4 * ALIGN), 4 * ALIGN, 0).result()
    assert err.value.expected == 4 * ALIGN and err.value.offset == 0
    engine.close_file(f)
    engine.close()


# -- read_many_into: neighbours in one I/O -----------------------------------------------
def _counting(tier: DiskTier, op: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every ``op`` ("read" / "write") the tier's engine makes."""
    sizes: list[int] = []
    real = getattr(tier.engine, op)

    def counted(file: Any, buf: Any, nbytes: int, offset: int) -> int:
        sizes.append(nbytes)
        return real(file, buf, nbytes, offset)

    monkeypatch.setattr(tier.engine, op, counted)
    return sizes


def _put_run(tier: DiskTier, n: int, nbytes: int, seed: int) -> list[bytes]:
    keys = [key(seed * 1000 + i) for i in range(n)]
    futs = [tier.put(k, payload(nbytes, seed * 1000 + i), nbytes=nbytes) for i, k in enumerate(keys)]
    for f in futs:
        f.result()
    return keys


def test_read_many_into_coalesces_neighbours_and_round_trips(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with open_tier(tmp_path / "d", segment_bytes=16 * MiB) as tier:
        n, nbytes = 40, 60_000                     # slot 64 KiB: padding between neighbours
        keys = _put_run(tier, n, nbytes, 1)
        recs = [tier.catalog.get(k) for k in keys]
        stride = tier.slot_bytes(nbytes)
        assert stride >= nbytes and all(r.slot_length == stride for r in recs)
        sizes = _counting(tier, "read", monkeypatch)
        # destinations spaced like the slots, in the order the keys were written
        dst = aligned_empty(n * stride)
        order = sorted(range(n), key=lambda i: (recs[i].segment, recs[i].offset))
        offsets = [0] * n
        for rank, i in enumerate(order):
            offsets[i] = rank * stride
        assert tier.read_many_into(keys, dst, offsets).result() == n * nbytes
        for i in range(n):
            assert np.array_equal(dst[offsets[i]:offsets[i] + nbytes], payload(nbytes, 1000 + i))
        # runs end only where the allocator's slabs (~1 MiB of slots) do
        assert len(sizes) <= n // 8 and max(sizes) >= 8 * stride
        assert tier._pins == {}
        # spaced differently from the disk: one read per object, same bytes
        sizes.clear()
        dst2 = aligned_empty(n * (stride + 4096))
        fut = tier.read_many_into(keys, dst2, [i * (stride + 4096) for i in range(n)])
        assert fut.result() == n * nbytes and len(sizes) == n
        for i in range(n):
            o = i * (stride + 4096)
            assert np.array_equal(dst2[o:o + nbytes], payload(nbytes, 1000 + i))


def test_read_many_into_drops_each_corrupt_object_and_fails_once_all_reads_are_done(
        tmp_path: Path) -> None:
    path = tmp_path / "d"
    with open_tier(path, segment_bytes=16 * MiB) as tier:
        keys = _put_run(tier, 6, 64 * 1024, 2)
        for bad in (1, 3):
            rec = tier.catalog.get(keys[bad])
            fd = os.open(path / segment_name(rec.segment), os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, rec.offset + 7)[0] ^ 0x55]), rec.offset + 7)
            os.close(fd)
        recs = [tier.catalog.get(k) for k in keys]
        base = min(r.offset for r in recs)
        dst = aligned_empty(6 * 64 * 1024 + (max(r.offset for r in recs) - base))
        offsets = [r.offset - base for r in recs]          # spaced exactly like the disk
        with pytest.raises(CorruptObjectError) as err:
            tier.read_many_into(keys, dst, offsets).result()
        assert err.value.key in (keys[1], keys[3])
        assert not tier.contains(keys[1]) and not tier.contains(keys[3])
        assert tier.stats()["corrupt_dropped"] == 2 and tier._pins == {}
        for i in (0, 2, 4, 5):                              # the good ones landed and stay
            assert np.array_equal(dst[offsets[i]:offsets[i] + 64 * 1024], payload(64 * 1024, 2000 + i))
            assert tier.contains(keys[i])


@pytest.mark.parametrize("verify", [True, False])
def test_read_many_into_catches_a_flip_deep_in_the_last_chunk_of_a_multi_mib_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    """vLLM's load shape: 1.5 MiB chunks read as one multi-MiB run.  A byte flipped in the
    last MiB of the run's last chunk fails the load and drops that chunk only; unverified
    (``verify_checksums=False``) the same bytes land as they are, so it is the checksum
    that catches it."""
    path = tmp_path / "d"
    nbytes = 3 * MiB // 2
    with open_tier(path, capacity=256 * MiB, segment_bytes=32 * MiB,
                   verify_checksums=verify) as tier:
        keys = _put_run(tier, 4, nbytes, 4)
        recs = [tier.catalog.get(k) for k in keys]
        assert len({r.segment for r in recs}) == 1
        base = min(r.offset for r in recs)
        last = max(range(4), key=lambda i: recs[i].offset)
        flip = recs[last].offset + nbytes - 4096 - 123
        fd = os.open(path / segment_name(recs[last].segment), os.O_RDWR)
        os.pwrite(fd, bytes([os.pread(fd, 1, flip)[0] ^ 0x01]), flip)
        os.close(fd)
        sizes = _counting(tier, "read", monkeypatch)
        dst = aligned_empty(max(r.offset for r in recs) + nbytes - base)
        offsets = [r.offset - base for r in recs]        # spaced exactly like the disk
        fut = tier.read_many_into(keys, dst, offsets)
        if verify:
            with pytest.raises(CorruptObjectError) as err:
                fut.result()
            assert err.value.key == keys[last] and not tier.contains(keys[last])
            assert tier.stats()["corrupt_dropped"] == 1
        else:
            assert fut.result() == 4 * nbytes and tier.contains(keys[last])
            assert dst[flip - base] != payload(nbytes, 4000 + last)[flip - recs[last].offset]
        assert sizes[0] > 4 * MiB                        # the chunks came as one run
        for i in range(4):
            if i != last:
                assert np.array_equal(dst[offsets[i]:offsets[i] + nbytes],
                                      payload(nbytes, 4000 + i))
                assert tier.contains(keys[i])


def test_checksum_is_the_one_shot_xxh3_64() -> None:
    """The GIL-releasing helper gives the catalog's digest (the one-shot xxh3_64) at every
    length around xxh3's internal block and stripe sizes."""
    import xxhash

    from hybridstore.backends.disk.objects import checksum

    data = payload(3 * MiB + 17, 9)
    for n in (0, 1, 16, 17, 128, 129, 240, 241, 1024, 1025, 64 * 1024, MiB + 1, len(data)):
        assert checksum(data[:n]) == xxhash.xxh3_64_intdigest(data[:n].tobytes())


def test_read_many_into_checks_before_reading(tmp_path: Path) -> None:
    with open_tier(tmp_path / "d") as tier:
        keys = _put_run(tier, 3, 10_000, 3)
        dst = aligned_empty(3 * 16384)
        dst[:] = 0
        with pytest.raises(KeyError):
            tier.read_many_into(keys + [key(999_999)], dst, [0, 16384, 32768, 0])
        with pytest.raises(ValueError):
            tier.read_many_into(keys, dst, [0, 16384, 3 * 16384 - 100])   # past dst
        with pytest.raises(ValueError):
            tier.read_many_into(keys, dst, [0, 16384])                      # lengths differ
        assert tier._pins == {}
        assert not dst.any()


def test_put_many_writes_neighbours_together_and_each_object_reads_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d"
    n, nbytes = 50, 60_000                         # slot 60 KiB + padding
    datas = [payload(nbytes, 3000 + i) for i in range(n)]
    keys = [key(3000 + i) for i in range(n)]
    with open_tier(path, segment_bytes=16 * MiB) as tier:
        writes = _counting(tier, "write", monkeypatch)
        futs = tier.put_many(keys, datas, nbytes=nbytes, metas=[bytes([i]) for i in range(n)])
        assert [f.result() for f in futs] == [nbytes] * n
        assert len(writes) <= n // 8 and sum(writes) >= n * nbytes
        for i in range(n):
            assert np.array_equal(tier.get(keys[i]), datas[i]) and tier.meta(keys[i]) == bytes([i])
        with pytest.raises(ValueError):
            tier.put_many([keys[0], keys[0]], datas[:2], nbytes=nbytes)
        used = tier.used_bytes
        with pytest.raises(CapacityError):
            tier.put_many([key(i) for i in range(9000, 9000 + 2000)], [datas[0]] * 2000, nbytes=nbytes)
        assert tier.used_bytes == used
    with open_tier(path, segment_bytes=16 * MiB) as tier:     # durable: the catalog has them all
        assert sorted(k for k, _, _ in tier.entries()) == sorted(keys)
        assert np.array_equal(tier.get(keys[-1]), datas[-1])


def test_put_many_writes_straight_from_sources_spaced_like_the_slots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridstore.backends.disk.writer as W  # where put_many takes its bounce buffers

    n, nbytes = 32, 64 * 1024                       # slot = object: one buffer spaced like the slots
    src = aligned_empty(n * nbytes)
    src[:] = payload(n * nbytes, 77)
    keys = [key(7000 + i) for i in range(n)]
    with open_tier(tmp_path / "d", segment_bytes=16 * MiB) as tier:
        def no_bounce(nbytes: int, align: int = 4096) -> np.ndarray:
            raise AssertionError("a bounce buffer was allocated")

        with monkeypatch.context() as m:
            m.setattr(W, "aligned_empty", no_bounce)
            futs = tier.put_many(keys, [src[i * nbytes:(i + 1) * nbytes] for i in range(n)],
                                 nbytes=nbytes)
            assert [f.result() for f in futs] == [nbytes] * n
        for i in range(n):
            assert np.array_equal(tier.get(keys[i]), src[i * nbytes:(i + 1) * nbytes])


# ---------------------------------------------------------------------------------
# faults found by the fault harness (tests/reliability/faults.py)
# ---------------------------------------------------------------------------------
def test_a_read_error_is_retried_object_by_object_and_costs_only_what_keeps_failing(
        tmp_path: Path) -> None:
    """A coalesced read that hit EIO failed the whole load with BackendIOError, every time,
    and dropped nothing: a bad range made its neighbours unloadable for good.  Now each
    object is read again alone: a transient error costs nothing, a lasting one costs its
    object only (CorruptObjectError), once."""
    from tests.reliability.injectors import EngineFault, FaultyEngine

    with open_tier(tmp_path / "d", segment_bytes=16 * MiB) as tier:
        keys = _put_run(tier, 6, 64 * 1024, 3)
        recs = [tier.catalog.get(k) for k in keys]
        engine = FaultyEngine(tier)
        for i, left in ((1, 2), (4, None)):                  # object 1: twice; object 4: always
            engine.faults.append(EngineFault("read", recs[i].segment, recs[i].offset,
                                             recs[i].offset + recs[i].length, left=left))
        base = min(r.offset for r in recs)
        dst = aligned_empty(max(r.offset + r.length for r in recs) - base)
        offsets = [r.offset - base for r in recs]
        with pytest.raises(CorruptObjectError, match="cannot be read") as err:
            tier.read_many_into(keys, dst, offsets).result()
        assert err.value.key == keys[4]
        assert [tier.contains(k) for k in keys] == [True] * 4 + [False, True]
        for i in (0, 1, 2, 3, 5):
            assert np.array_equal(dst[offsets[i]:offsets[i] + 64 * 1024],
                                  payload(64 * 1024, 3000 + i))
        engine.faults.append(EngineFault("read", recs[2].segment, recs[2].offset,
                                         recs[2].offset + 1, left=1))
        assert np.array_equal(tier.get(keys[2]), payload(64 * 1024, 3002))   # get_into too
        assert tier.stats()["corrupt_dropped"] == 1 and tier._pins == {}


def test_a_write_that_finds_the_device_full_is_a_disk_full_error(tmp_path: Path) -> None:
    """ENOSPC under a write (a file system that could not reserve the segment's blocks)
    failed the put with BackendIOError; now it is a DiskFullError (a CapacityError), and
    nothing of the object is visible or held."""
    import errno

    from hybridstore.errors import DiskFullError
    from tests.reliability.injectors import EngineFault, FaultyEngine

    with open_tier(tmp_path / "d") as tier:
        engine = FaultyEngine(tier)
        for op in ("write", "fsync"):
            engine.faults.append(EngineFault(op, -1, 0, 1 << 62, errno_=errno.ENOSPC, left=1))
            with pytest.raises(DiskFullError) as err:
                tier.put(key(1), payload(10_000, 1), nbytes=10_000).result()
            assert isinstance(err.value, CapacityError) and not tier.contains(key(1))
            assert tier.used_bytes == 0 and tier.stats()["pending_writes"] == 0
        tier.put(key(1), payload(10_000, 1), nbytes=10_000).result()
        assert np.array_equal(tier.get(key(1)), payload(10_000, 1))


def test_segments_are_reserved_whole_where_fallocate_is_unsupported(tmp_path: Path) -> None:
    """Without fallocate a segment was a sparse file: a full device then failed each write
    later, one by one.  Now its blocks are written with zeros when it is created, so a full
    device shows up there (DiskFullError, room-making) and never under a write."""
    import errno

    from hybridstore.backends.disk import tier as disk_tier
    from hybridstore.errors import DiskFullError
    from tests.reliability.injectors import no_fallocate

    with no_fallocate(), open_tier(tmp_path / "d", segment_bytes=MiB) as tier:
        tier.put(key(1), payload(10_000, 1), nbytes=10_000).result()
        st = os.stat(tmp_path / "d" / segment_name(0))
        assert st.st_size == MiB and st.st_blocks * 512 >= MiB       # allocated, not sparse
        real = os.pwrite

        def full(fd: int, data: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk_tier.os.pwrite = full                    # the device fills up at segment 2
        try:
            with pytest.raises(DiskFullError):
                tier.put(key(2), payload(3 * MiB, 2), nbytes=3 * MiB)
        finally:
            disk_tier.os.pwrite = real
        assert not tier.contains(key(2))
        assert sorted(n for n in os.listdir(tmp_path / "d") if n.startswith("seg-")) == [
            segment_name(0)]                                        # the refused file is gone
        assert np.array_equal(tier.get(key(1)), payload(10_000, 1))


def test_a_segment_cut_inside_its_last_objects_padding_keeps_that_object(
        tmp_path: Path) -> None:
    """An O_DIRECT read of the last, partial 4 KiB block of an object failed when the file
    ended inside that block after the payload (a load error every time); a reopen dropped
    the object though its bytes were all there."""
    path = tmp_path / "d"
    with open_tier(path) as tier:
        tier.put(key(1), payload(6000, 1), nbytes=6000).result()
        rec = tier.catalog.get(key(1))
        os.truncate(path / segment_name(rec.segment), rec.offset + 6000 + 100)
        assert np.array_equal(tier.get(key(1)), payload(6000, 1))
    with open_tier(path) as tier:
        assert np.array_equal(tier.get(key(1)), payload(6000, 1))


@pytest.mark.parametrize("order", ["damaged-first", "damaged-last"])
def test_records_that_claim_one_slot_keep_the_object_whose_bytes_match(
        tmp_path: Path, order: str) -> None:
    """A damaged record pointing at another object's slot cost the undamaged object when
    its key sorted second (its extent could not be reserved), and kept the damaged one
    (which then failed its checksum): two objects lost for one damaged record."""
    path = tmp_path / "d"
    good, bad = (key(2), key(1)) if order == "damaged-first" else (key(1), key(2))
    with open_tier(path) as tier:
        tier.put(good, payload(9000, 7), nbytes=9000).result()
        tier.put(bad, payload(9000, 8), nbytes=9000).result()
        target, rec = tier.catalog.get(good), tier.catalog.get(bad)
    cat = Catalog(path / CATALOG_DIR)
    cat.put(bad, CatalogRecord(target.segment, target.offset, rec.length, target.slot_length,
                               rec.checksum, rec.meta))
    cat.close()
    with open_tier(path) as tier:
        assert tier.contains(good) and not tier.contains(bad)
        assert np.array_equal(tier.get(good), payload(9000, 7))
        assert tier.stats()["recovery_dropped"] == 1


def test_a_damaged_geometry_record_opens_with_the_configured_size(tmp_path: Path) -> None:
    """It raised struct.error (untyped) and the tier could not be opened at all."""
    path = tmp_path / "d"
    with open_tier(path) as tier:
        tier.put(key(1), payload(9000, 1), nbytes=9000).result()
    cat = Catalog(path / CATALOG_DIR)
    cat.put_info("disk.geometry", b"\x01\x02")
    cat.close()
    with open_tier(path) as tier:
        assert tier.segment_bytes == 4 * MiB
        assert np.array_equal(tier.get(key(1)), payload(9000, 1))


def test_the_catalog_keeps_room_to_commit_on_a_full_device(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full ext4 a put raised CatalogError: the segments had taken every block, and
    lmdb could not commit, not even the deletes that make room.  Now the catalog keeps a
    slack allocated, reserved before any new segment: a segment that would take it is
    refused (DiskFullError, room-making) and nothing of it stays."""
    import errno

    from hybridstore.backends.catalog import SLACK_BYTES
    from hybridstore.errors import DiskFullError

    path = tmp_path / "d"
    with open_tier(path, segment_bytes=MiB) as tier:
        tier.put(key(1), payload(9000, 1), nbytes=9000).result()
        data = path / CATALOG_DIR / "data.mdb"
        assert os.stat(data).st_blocks * 512 >= SLACK_BYTES       # allocated, not sparse
        real = os.posix_fallocate

        def full_for_the_catalog(fd: int, offset: int, nbytes: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith("data.mdb"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, offset, nbytes)

        monkeypatch.setattr(os, "posix_fallocate", full_for_the_catalog)
        with pytest.raises(DiskFullError, match="catalog"):
            tier.put(key(2), payload(2 * MiB, 2), nbytes=2 * MiB)   # needs a new segment
        assert sorted(n for n in os.listdir(path) if n.startswith("seg-")) == [segment_name(0)]
        assert tier.stats()["device_full"]       # it holds what it has until room frees
        tier.delete(key(1))                                         # deletes still commit
        assert not tier.contains(key(1)) and tier.catalog.get(key(1)) is None
