"""Per-pool thread CPU (``bench/threadcpu.py``): the CPU a pool burns is found under its name."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridstore.bench import threadcpu

pytestmark = pytest.mark.skipif(threadcpu.snapshot() is None,
                                reason="no per-thread schedstat in /proc here")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    data = b"x" * 65536
    while time.thread_time() < end:
        hashlib.sha256(data).digest()


def test_the_cpu_a_pool_burns_is_counted_under_its_name() -> None:
    with ThreadPoolExecutor(2, thread_name_prefix="burner") as pool:
        list(pool.map(lambda _: None, range(2)))           # the threads exist before
        before = threadcpu.snapshot()
        list(pool.map(_burn, [0.15, 0.15]))
        after = threadcpu.snapshot()
    spent = threadcpu.by_pool(before, after)
    assert spent is not None
    assert 0.25 <= spent["burner"] <= 0.6, spent            # 2 x 0.15 s of thread CPU
    assert spent.get("MainThread", 0.0) < 0.1, spent        # it only waited


def test_a_thread_started_meanwhile_counts_from_zero() -> None:
    burned, release = threading.Event(), threading.Event()

    def work() -> None:
        _burn(0.1)
        burned.set()
        release.wait(10)

    before = threadcpu.snapshot()
    t = threading.Thread(target=work, name="late-1")
    t.start()
    try:
        assert burned.wait(10)
        spent = threadcpu.by_pool(before, threadcpu.snapshot())   # while it still lives
    finally:
        release.set()
        t.join()
    assert spent is not None
    assert 0.08 <= spent["late"] <= 0.3, spent


def test_pool_names_drop_the_thread_index() -> None:
    assert threadcpu.pool_name("hs-disk_3") == "hs-disk"
    assert threadcpu.pool_name("hybridstore-tier_12") == "hybridstore-tier"
    assert threadcpu.pool_name("late-1") == "late"
    assert threadcpu.pool_name("MainThread") == "MainThread"
    assert threadcpu.pool_name("_7") == "_7"


def test_no_snapshot_gives_no_breakdown() -> None:
    assert threadcpu.by_pool(None, threadcpu.snapshot()) is None
    assert threadcpu.by_pool(threadcpu.snapshot(), None) is None


def test_the_calling_threads_time_leaves_out_reading_the_others() -> None:
    """With hundreds of threads alive, reading their times costs the calling thread more
    than what it does between start and stop; :class:`PoolClock` counts only the latter,
    and no pool spends more than the process did meanwhile."""
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, name=f"idle-{i}") for i in range(300)]
    for t in idle:
        t.start()
    try:
        t0 = time.thread_time()
        for _ in range(5):
            threadcpu.snapshot()
        reading = (time.thread_time() - t0) / 5
        clock = threadcpu.PoolClock()
        clock.start()
        cpu0 = time.process_time()
        _burn(0.002)
        cpu = time.process_time() - cpu0
        spent = clock.stop()
    finally:
        stop.set()
        for t in idle:
            t.join()
    assert spent is not None
    assert reading > 0.0005, reading                       # the case this guards against
    assert spent["MainThread"] <= cpu + 0.0005, (spent, cpu, reading)
    assert spent["MainThread"] >= 0.0019, spent
