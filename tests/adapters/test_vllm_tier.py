"""HybridStoreTier's stores straight from vLLM's primary rows to the SSD, driven through
vLLM's own ``SecondaryTierFactory`` and a real ``TieringOffloadingSpec``.

A store job writes the primary rows to the disk tier (the store's DRAM tier stays
empty), completes once the writes returned, and its chunks are found (HIT) once
durable; promotions load them back bit-exact, after a restart too; a write that
fails is a failed key and a later miss, never an exception into vLLM.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from hybridstore.bench.engines import vtier as V

CHUNK = 64 << 10
BLOCK = 16
N = 12


def tier_conf(path, **kw) -> dict:
    conf = {"type": "HybridStoreTier", "module_path": "hybridstore.adapters.vllm",
            "disk_path": str(path), "disk_bytes": 64 << 20, "disk_engine": "posix"}
    conf.update(kw)
    return conf


class Setup:
    def __init__(self, tmp_path, **kw) -> None:
        v = V.vllm()
        self.v = v
        self.conf = tier_conf(tmp_path / "tier", **kw)
        self.spec = v.offloading_spec(chunk_bytes=CHUNK, block_tokens=BLOCK, model="m",
                                      tiers=[self.conf])
        self.primary = V.Primary.make(2 * N, CHUNK)
        rng = np.random.default_rng(0)
        self.primary.array[:N] = rng.integers(-128, 128, (N, CHUNK), dtype=np.int8)
        self.keys = v.chain_keys(N, b"direct")
        self.next_job = 0
        self.tier = self.open()

    def open(self):
        return self.v.factory.SecondaryTierFactory.create_secondary_tier(
            dict(self.conf), self.primary.view, self.spec)

    def run(self, keys, chunks, *, load: bool, rid: str = "r") -> list:
        ctx = self.v.req_context(rid, keys, BLOCK)
        job = self.v.tbase.TransferJob(job_id=self.next_job, keys=keys,
                                       chunk_ids=np.asarray(chunks, np.int64),
                                       is_promotion=load, req_context=ctx)
        self.next_job += 1
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = list(self.tier.get_finished_jobs())
            if done:
                return done
            time.sleep(0.002)
        raise TimeoutError("job did not finish")

    def lookup(self, rid: str = "q") -> list:
        ctx = self.v.req_context(rid, self.keys, BLOCK)
        out = []
        for k in self.keys:
            deadline = time.monotonic() + 30
            while (r := self.tier.lookup(k, ctx)) == self.v.base.LookupResult.RETRY:
                assert time.monotonic() < deadline, "RETRY for ever"
                time.sleep(0.002)
            out.append(r)
        return out

    def settle(self) -> None:
        deadline = time.monotonic() + 30
        while self.tier.has_pending_work():
            assert time.monotonic() < deadline
            list(self.tier.get_finished_jobs())
            time.sleep(0.002)


def test_direct_store_round_trip_and_restart(tmp_path):
    s = Setup(tmp_path)
    HIT = s.v.base.LookupResult.HIT
    try:
        (res,) = s.run(s.keys[:8], range(8), load=False)
        (res2,) = s.run(s.keys[8:], range(8, N), load=False)
        assert res.success and res2.success and res.transfer_bytes == 8 * CHUNK
        s.settle()
        store = s.tier.store
        assert store.tiers["host"].used_bytes == 0            # not copied into our DRAM tier
        assert store.stats()["tiers"]["disk"]["writes"] == N
        assert s.lookup() == [HIT] * N
        order = [3, 0, 11, 7, 1, 2, 4, 5, 6, 8, 9, 10]           # any order, any rows
        (res,) = s.run([s.keys[i] for i in order], [N + j for j in range(N)], load=True, rid="q")
        assert res.success
        assert np.array_equal(s.primary.array[N:], s.primary.array[order])
        s.tier.on_request_finished(s.v.req_context("q", s.keys, BLOCK))
    finally:
        s.tier.shutdown()
    s.primary.array[N:] = 0
    s.tier = s.open()                                           # a restarted engine
    try:
        assert s.lookup("q2") == [HIT] * N
        (res,) = s.run(s.keys, range(N, 2 * N), load=True, rid="q2")
        assert res.success and np.array_equal(s.primary.array[N:], s.primary.array[:N])
    finally:
        s.tier.shutdown()


def test_the_dram_path_is_still_there(tmp_path):
    s = Setup(tmp_path, direct_store=False, host_bytes=8 << 20)
    try:
        (res,) = s.run(s.keys, range(N), load=False)
        assert res.success
        s.settle()
        assert s.tier.store.tiers["host"].used_bytes > 0       # copied into the DRAM tier
        (res,) = s.run(s.keys, range(N, 2 * N), load=True)
        assert res.success and np.array_equal(s.primary.array[N:], s.primary.array[:N])
    finally:
        s.tier.shutdown()


def test_a_failed_write_is_a_failed_key_then_a_miss(tmp_path, monkeypatch):
    from hybridstore.backends.engines import posix
    from hybridstore.errors import BackendIOError

    def broken(self, file, piece, offset):
        raise BackendIOError("injected write failure")

    s = Setup(tmp_path)
    try:
        monkeypatch.setattr(posix.PosixEngine, "_write_in_place", broken)
        monkeypatch.setattr(posix.PosixEngine, "_write_bounced", broken)
        (res,) = s.run(s.keys[:4], range(4), load=False)     # no exception into vLLM
        assert not res.success and not list(res.successful_keys or [])
        s.settle()
        monkeypatch.undo()
        assert s.lookup()[0] == s.v.base.LookupResult.MISS
        (res,) = s.run(s.keys[:4], range(4), load=False)     # stored again once it works
        assert res.success
        s.settle()
        assert s.lookup()[:4] == [s.v.base.LookupResult.HIT] * 4
    finally:
        s.tier.shutdown()


def test_a_load_right_after_a_successful_store_job_is_served(tmp_path, monkeypatch):
    """vLLM's tiering manager promotes a chunk as soon as its store job succeeded, without
    asking this tier first: the chunk is readable then, even while its write is still
    on its way to being durable (issue 26 §2: the load failed)."""
    import os

    sync = os.fdatasync

    def slow_sync(fd):          # durability lags the write by a wide margin
        time.sleep(0.3)
        sync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    s = Setup(tmp_path)
    try:
        (res,) = s.run(s.keys[:4], range(4), load=False)
        assert res.success
        (res,) = s.run(s.keys[:4], range(N, N + 4), load=True, rid="now")   # no lookup first
        assert res.success and sorted(res.successful_keys) == sorted(s.keys[:4])
        assert np.array_equal(s.primary.array[N:N + 4], s.primary.array[:4])
    finally:
        s.tier.shutdown()


def test_io_chunk_bytes_and_verify_checksums_reach_the_store(tmp_path, monkeypatch):
    """Issue 26: the tier takes the disk tier's request size and checksum switch; a load
    job of neighbouring chunks is then read in requests of that size, bit-exact."""
    from tests.backends.test_engines import record_preadv

    s = Setup(tmp_path, io_chunk_bytes=2 * CHUNK, verify_checksums=False)
    try:
        disk = s.tier.store.tiers["disk"]
        assert disk.engine.chunk_bytes == 2 * CHUNK and disk._verify is False
        (res,) = s.run(s.keys, range(N), load=False)
        assert res.success
        s.settle()
        assert s.lookup() == [s.v.base.LookupResult.HIT] * N
        sizes = record_preadv(monkeypatch)
        (res,) = s.run(s.keys, range(N, 2 * N), load=True, rid="q")
        monkeypatch.undo()
        assert res.success and np.array_equal(s.primary.array[N:], s.primary.array[:N])
        assert sizes and max(sizes) == 2 * CHUNK and sum(sizes) == N * CHUNK
    finally:
        s.tier.shutdown()
