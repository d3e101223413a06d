"""What a disk tier directory occupies on the device: it grows with use and scales with the
budget (issue 26, item 4), and a full file system costs what a put needs, not the tier
(item 6)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.backends.disk import DiskTier, segment_name
from hybridstore.backends.disk import tier as disk_tier
from hybridstore.backends.disk.objects import segment_bytes_for
from hybridstore.errors import CapacityError, DiskFullError
from hybridstore.objects import ObjectKind, object_key

MiB = 1 << 20


def allocated(path: Path) -> int:
    """Bytes the file system allocated to everything under ``path``."""
    return sum(os.stat(os.path.join(root, name)).st_blocks * 512
               for root, _, names in os.walk(path) for name in names)


def key(i: int) -> bytes:
    return object_key(ObjectKind.PAGE, i.to_bytes(16, "little"))


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("budget", [64 * MiB, 1 << 30, 64 << 30])
def test_a_new_store_takes_room_as_it_is_used(tmp_path: Path, budget: int) -> None:
    """A new directory took ~266 MB at its first put whatever its budget (a 256 MiB segment
    reserved whole, and the catalog's slack for its records), and 67 MB of a 64 MiB budget.
    Now the segment file grows as its objects need room: a few MiB."""
    cfg = StoreConfig(block_size=16, host_bytes=16 * MiB, disk_path=str(tmp_path / "d"),
                      disk_bytes=budget, disk_engine="posix")
    toks = np.arange(64) + 3
    pages = [np.full((2, 16, 64), i, np.float32) for i in range(4)]
    with HybridStore(cfg) as store:
        store.put_kv(toks, pages)
        store.flush()
        assert store.stats()["tiers"]["disk"]["objects"] == 4
        assert allocated(tmp_path / "d") <= min(budget // 8, 4 * MiB)
        store.evict(1 << 40, "host")
        plan = store.match(toks)
        got, _ = store.load(plan).result()
        store.release(plan)
        assert all(np.array_equal(np.asarray(g), p) for g, p in zip(got, pages))


def test_the_directory_grows_with_its_objects_and_stays_within_the_budget(
        tmp_path: Path) -> None:
    path = tmp_path / "d"
    with DiskTier(path, 64 * MiB, engine="posix", io_threads=2) as tier:
        assert tier.segment_bytes == segment_bytes_for(64 * MiB) == 4 * MiB
        stored = 0
        for i in range(40):
            d = payload(300_000 + 4096 * i, i)
            tier.put(key(i), d, nbytes=d.size).result()
            stored += tier.charge(d.size)
            on_disk = allocated(path)
            assert on_disk <= 2 * stored + 3 * MiB, (i, on_disk, stored)
        assert stored <= on_disk <= 64 * MiB + 4 * MiB
        assert tier.stats()["grown_bytes"] <= tier.stats()["committed_bytes"]
    with DiskTier(path, 64 * MiB, engine="posix", io_threads=2) as again:   # reopened
        for i in range(40):
            assert np.array_equal(again.get(key(i)), payload(300_000 + 4096 * i, i))
        d = payload(900_000, 99)
        again.put(key(99), d, nbytes=d.size).result()
        assert np.array_equal(again.get(key(99)), d)


def test_segments_are_sized_from_the_budget() -> None:
    assert segment_bytes_for(16 * MiB) == 4 * MiB           # the least
    assert segment_bytes_for(64 * MiB) == 4 * MiB
    assert segment_bytes_for(256 * MiB) == 16 * MiB
    assert segment_bytes_for(3 << 30) == 128 * MiB          # a power of two below 1/16
    assert segment_bytes_for(64 << 30) == 256 * MiB         # the most


def test_an_allocator_grows_its_arenas_as_allocations_need_them() -> None:
    grown: list[tuple[int, int, int]] = []

    def grow(arena: int, limit: int, need: int, size: int) -> int:
        grown.append((arena, limit, need))
        return min(size, max(need, 2 * limit, 64 << 10))

    alloc = SlabAllocator(budget_bytes=4 * MiB, arena_bytes=MiB, slab_bytes=64 << 10,
                          on_grow_arena=grow)
    a = alloc.alloc(100_000)
    assert a is not None and alloc.grown_bytes == a.length < alloc.committed_bytes == MiB
    extents = [alloc.alloc(100_000) for _ in range(8)]
    assert all(e is not None for e in extents) and alloc.arena_count == 1
    assert 9 * a.length <= alloc.grown_bytes <= MiB      # the first arena, grown as needed
    big = alloc.alloc(3 * MiB)                           # a dedicated arena, grown whole
    assert big is not None and alloc.grown_bytes == 4 * MiB

    def refuse(arena: int, limit: int, need: int, size: int) -> int:
        raise DiskFullError("the device is full")

    other = SlabAllocator(budget_bytes=4 * MiB, arena_bytes=MiB, slab_bytes=64 << 10,
                          on_grow_arena=refuse)
    with pytest.raises(DiskFullError):
        other.alloc(100_000)
    assert other.committed_bytes == other.used_bytes == other.grown_bytes == 0
    # rebuilding a reopened tier's state grows the arena under its extents
    again = SlabAllocator(budget_bytes=4 * MiB, arena_bytes=MiB, slab_bytes=64 << 10,
                          on_grow_arena=grow)
    again.reserve(Extent(0, 512 << 10, a.length))
    assert again.grown_bytes >= (512 << 10) + a.length


# -- a full file system ---------------------------------------------------------------
def device_of(room: int) -> tuple[Any, list[int]]:
    """A stand-in for ``posix_fallocate`` on a device with ``room`` bytes for segments."""
    real = disk_tier._preallocate
    sizes: dict[int, int] = {}
    taken: list[int] = [0]

    def preallocate(fd: int, nbytes: int) -> None:
        ino = os.fstat(fd).st_ino
        more = nbytes - sizes.get(ino, os.fstat(fd).st_size)
        if more > 0 and taken[0] + more > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, nbytes)
        if more > 0:
            taken[0] += more
            sizes[ino] = nbytes

    return preallocate, taken


def test_a_full_file_system_costs_what_a_put_needs_not_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26, item 6: with the device full, a put that needed a new segment evicted nearly
    every object of the tier (room-making freed a share of a budget the device could never
    hold: 1/16 of 1 GiB, then more).  Now the tier holds what its grown segments hold while
    the device is full, and the store evicts about what each put needs."""
    preallocate, _ = device_of(6 * MiB)
    monkeypatch.setattr(disk_tier, "_preallocate", preallocate)
    cfg = StoreConfig(block_size=16, host_bytes=512 << 10, disk_path=str(tmp_path / "d"),
                      disk_bytes=1 << 30, disk_segment_bytes=MiB, disk_engine="posix",
                      tier_policy="write-through")
    rng = np.random.default_rng(3)
    prompts = []

    def put_prompt(r: int) -> None:
        toks = np.arange(r * 1000, r * 1000 + 64)
        pages = [rng.integers(0, 256, 60_000, dtype=np.uint8) for _ in range(4)]
        assert store.put_kv(toks, pages) == 4
        store.flush()
        prompts.append((toks, pages))

    with HybridStore(cfg) as store:
        disk = store.tiers["disk"]
        while disk.stats()["committed_bytes"] < 6 * MiB:   # fill the device
            put_prompt(len(prompts))
            assert len(prompts) < 200
        held = disk.stats()["objects"]
        assert held >= 80                                  # ~6 MiB of 60 KB pages
        for _ in range(8):                                 # 2 MiB more than it holds
            put_prompt(len(prompts))
        left = disk.stats()["objects"]
        assert left >= held * 3 // 4, (held, left)         # before: 11 left of 80
        assert disk.stats()["device_full"]
        store.evict(1 << 40, "host")
        hits = 0
        for toks, pages in prompts:
            plan = store.match_pages(toks)
            if len(plan.pages) == 4:
                got, _ = store.load(plan).result()
                assert all(np.array_equal(np.asarray(g), p) for g, p in zip(got, pages))
                hits += 1
            store.release(plan)
        assert hits >= len(prompts) * 2 // 3
        assert len(store.match_pages(prompts[-1][0]).pages) == 4     # the newest stays


def test_a_tier_on_a_full_device_refuses_typed_and_keeps_its_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preallocate, taken = device_of(2 * MiB)
    monkeypatch.setattr(disk_tier, "_preallocate", preallocate)
    path = tmp_path / "d"
    with DiskTier(path, 64 * MiB, engine="posix", io_threads=2) as tier:
        stored = {}
        for i in range(40):
            d = payload(200_000, i)
            try:
                tier.put(key(i), d, nbytes=d.size).result()
            except DiskFullError as e:
                assert isinstance(e, CapacityError) and "full" in str(e)
                break
            stored[i] = d
        assert 5 <= len(stored) < 40 and taken[0] <= 2 * MiB
        assert tier.stats()["device_full"]
        assert tier.capacity_bytes == tier.stats()["grown_bytes"] < 64 * MiB   # what is there
        assert tier.free_bytes < tier.charge(200_000)
        for i, d in stored.items():
            assert np.array_equal(tier.get(key(i)), d)
        tier.delete(key(0))                              # room within the grown segments
        d = payload(200_000, 77)
        tier.put(key(77), d, nbytes=d.size).result()
        assert np.array_equal(tier.get(key(77)), d)
        assert sorted(n for n in os.listdir(path) if n.startswith("seg-")) == [segment_name(0)]


def test_a_reopen_on_a_full_device_keeps_every_object(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Reopening grows each segment over the objects it holds; on a full device that growth
    asked the catalog for slack the device no longer had, and the fault harness's full-device
    rounds lost hundreds of undamaged objects at reopen.  Blocks a file holds already are
    adopted as they are."""
    path = tmp_path / "d"
    data = {i: payload(150_000 + 4096 * i, i) for i in range(30)}
    with DiskTier(path, 64 * MiB, engine="posix", io_threads=2) as tier:
        for i, d in data.items():
            tier.put(key(i), d, nbytes=d.size).result()

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(disk_tier, "_preallocate", full)
    with DiskTier(path, 64 * MiB, engine="posix", io_threads=2) as again:
        assert again.stats()["recovery_dropped"] == 0
        for i, d in data.items():
            assert np.array_equal(again.get(key(i)), d)
