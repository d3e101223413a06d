"""The disk tier's committer gathers the writes still in flight into one commit (one
device flush for a burst), unless a caller waits for durability (``urgent``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from hybridstore.backends.disk import DiskTier
from hybridstore.backends.disk import writer as W
from hybridstore.backends.engines import posix
from hybridstore.objects import ObjectKind, aligned_empty, object_key

N = 64 << 10


def key(i: int) -> bytes:
    return object_key(ObjectKind.PAGE, i.to_bytes(16, "little"))


def test_a_commit_waits_for_writes_in_flight_unless_someone_is_waiting(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "COMMIT_GATHER_S", 30.0)      # gather as long as writes are in flight
    release = threading.Event()
    slow = posix.PosixEngine._write_in_place

    def write(self, file, piece, offset):
        if offset == 0:                                   # the first object's slot: held back
            assert release.wait(20)
        slow(self, file, piece, offset)

    monkeypatch.setattr(posix.PosixEngine, "_write_in_place", write)
    tier = DiskTier(tmp_path / "d", 8 << 20, engine="posix", segment_bytes=4 << 20)
    try:
        data = aligned_empty(N)            # page-aligned: written in place
        data[:] = 7
        held = tier.put(key(0), data, nbytes=N)            # slot 0: its write blocks
        written: list[Future] = [Future()]
        fast = tier.put_many([key(1)], [data], nbytes=N, written=written)[0]
        written[0].result(timeout=10)                      # landed ...
        time.sleep(0.3)
        assert not fast.done()                             # ... but gathered with slot 0's
        with tier.urgent():
            assert fast.result(timeout=10) == N            # a waiter: committed at once
        assert not held.done() and tier.contains(key(1)) and not tier.contains(key(0))
        release.set()
        assert held.result(timeout=10) == N
    finally:
        release.set()
        tier.close()
    reopened = DiskTier(tmp_path / "d", 8 << 20, engine="posix", segment_bytes=4 << 20)
    try:
        assert reopened.contains(key(0)) and reopened.contains(key(1))
    finally:
        reopened.close()
