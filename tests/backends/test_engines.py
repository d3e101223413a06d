"""The disk tier's data path as the SSD benchmark tuned it: the POSIX engine's striped
I/O (:class:`~hybridstore.backends.engines.PieceStream`), the checksum that overlaps
the reads, and the kvikio engine's tuning (under the stand-in driver)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybridstore.backends.disk import DiskTier
from hybridstore.backends.engines import ALIGN, PosixEngine
from hybridstore.errors import BackendIOError
from hybridstore.objects import ObjectKind, aligned_empty, object_key

KIB, MIB = 1 << 10, 1 << 20


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
        # in place: requests follow the I/O, up to chunk_bytes, in equal parts
        assert engine.piece_bytes(100) == ALIGN  # small I/Os go whole
        assert engine.piece_bytes(512 * KIB) == 512 * KIB
        assert engine.piece_bytes(4 * MIB) == 512 * KIB
        assert engine.piece_bytes(1536 * KIB + ALIGN) == 388 * KIB  # 4 equal requests
        assert engine.piece_bytes(50_000_000) == 512 * KIB
        # a stream (its checksum overlaps the pieces): two waves of 8 pieces
        assert engine.piece_bytes(4 * MIB, stream=True) == 256 * KIB
        assert engine.piece_bytes(1 * MIB, stream=True) == 1 * MIB
        assert engine.piece_bytes(2 * MIB, stream=True) == 256 * KIB
        assert engine.piece_bytes(1 * MIB, in_place=False) == 256 * KIB  # bounce-sized
    finally:
        engine.close()
    large = PosixEngine(8, chunk_bytes=8 * MIB)
    try:
        assert large.piece_bytes(6 * MIB) == 6 * MIB       # one request
        assert large.piece_bytes(12 * MIB) == 6 * MIB      # two equal ones
        assert large.piece_bytes(64 * MIB, in_place=False) == 1 * MIB  # bounce buffers <= 1 MiB
    finally:
        large.close()
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
    from hybridstore.backends.disk import segment_name
    from hybridstore.errors import CorruptObjectError
    from hybridstore.objects import ObjectKind, object_key

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
    """O_DIRECT compat reads and 512 KiB tasks, unless the environment says otherwise
    (``StoreConfig.from_env`` reads it, the engine is told through ``kvikio_keep``).

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
    src = Path(__file__).resolve().parents[2] / "src"
    code = ("import kvikio.defaults as d\n"
            "from hybridstore.backends.engines import select_engine\n"
            "from hybridstore.config import StoreConfig\n"
            "cfg = StoreConfig.from_env(io_threads=4)\n"
            "e = select_engine('kvikio', cfg.io_threads, kvikio_keep=cfg.kvikio_keep)\n"
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


def test_kvikio_keep_names_the_settings_the_environment_gives_kvikio() -> None:
    from hybridstore.backends.engines import KVIKIO_TUNING
    from hybridstore.config import KVIKIO_TUNED, StoreConfig

    assert KVIKIO_TUNED == set(KVIKIO_TUNING)   # config names exactly what the engine tunes
    assert StoreConfig.from_env({}).kvikio_keep == frozenset()
    env = {"KVIKIO_TASK_SIZE": "1048576", "PATH": "/bin"}
    assert StoreConfig.from_env(env).kvikio_keep == {"task_size"}
    both = {"KVIKIO_TASK_SIZE": "1", "KVIKIO_AUTO_DIRECT_IO_READ": "ON"}
    assert StoreConfig.from_env(both).kvikio_keep == set(KVIKIO_TUNING)
    assert StoreConfig.from_env(both, kvikio_keep=frozenset()).kvikio_keep == frozenset()


class _FakeDefaults:
    """kvikio.defaults' get/set on a dict (no kvikio, no driver)."""

    def __init__(self, **values: object) -> None:
        self.values = dict(values)
        self.sets = 0

    def get(self, name: str) -> object:
        if name not in self.values:
            raise KeyError(name)
        return self.values[name]

    def set(self, name: str, value: object) -> None:
        self.values[name] = value
        self.sets += 1


def test_kvikio_settings_hold_while_any_holder_is_open() -> None:
    """Overlapping holders: the last one opened wins, the last one closed restores."""
    import types

    from hybridstore.backends.engines import KvikioSettings

    defaults = _FakeDefaults(num_threads=1, task_size=4 << 20)
    kvikio = types.SimpleNamespace(defaults=defaults)
    settings = KvikioSettings()
    settings.acquire(kvikio, {"num_threads": 8, "task_size": 512 << 10, "no_such": 1})
    assert defaults.values == {"num_threads": 8, "task_size": 512 << 10}  # unknown: skipped
    settings.acquire(kvikio, {"num_threads": 4})
    assert defaults.values["num_threads"] == 4
    settings.release(kvikio)
    assert defaults.values == {"num_threads": 4, "task_size": 512 << 10}
    settings.release(kvikio)
    assert defaults.values == {"num_threads": 1, "task_size": 4 << 20}
    sets = defaults.sets
    settings.acquire(kvikio, {"num_threads": 1})  # already so: nothing is set (no pool reset)
    settings.release(kvikio)
    assert defaults.sets == sets and defaults.values["num_threads"] == 1


def record_preadv(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every ``os.preadv`` from here on (the POSIX engine's read requests),
    until ``monkeypatch`` is undone."""
    sizes: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    return sizes


@pytest.mark.parametrize(("chunk_bytes", "requests"), [
    (8 * MIB, [1536 * KIB]),                  # one request for the run
    (512 * KIB, [512 * KIB] * 3),             # equal requests of at most chunk_bytes
    (1 * MIB, [768 * KIB] * 2),
])
def test_read_many_into_requests_follow_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                chunk_bytes: int, requests: list[int]) -> None:
    """Issue 26: neighbours read with ``read_many_into`` cost requests of the run's size up
    to the engine's ``chunk_bytes`` (the old engine cut every in-place I/O above 1 MiB into
    256 KiB pieces, whatever ``chunk_bytes``)."""
    n, size = 6, 256 * KIB
    tier = DiskTier(str(tmp_path / "d"), 64 * MIB, segment_bytes=16 * MIB,
                    engine=PosixEngine(4, chunk_bytes=chunk_bytes))
    try:
        assert tier.slot_bytes(size) == size          # neighbours' slots touch
        data = np.random.default_rng(3).integers(0, 256, (n, size), dtype=np.uint8)
        keys = [object_key(ObjectKind.PAGE, i.to_bytes(16, "little")) for i in range(n)]
        for f in tier.put_many(keys, list(data), nbytes=size):
            f.result()
        sizes = record_preadv(monkeypatch)
        dst = aligned_empty(n * size)
        tier.read_many_into(keys, dst, [i * size for i in range(n)]).result()
        monkeypatch.undo()
        assert np.array_equal(dst.reshape(n, size), data)
        assert sorted(sizes) == requests
    finally:
        tier.close()
