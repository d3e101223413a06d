"""The host pool: the conformance suite plus its zero-copy slots and references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridstore.backends.host import HostPool
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.testing.tiers import TierConformance, blob, key_of


class TestHostPool(TierConformance):
    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> HostPool:
        return HostPool(capacity_bytes, arena_bytes=1 << 20, pin=False)


@pytest.fixture
def pool() -> HostPool:
    with HostPool(4 << 20, arena_bytes=1 << 20, pin=False) as pool:
        yield pool


def test_reserve_commit_is_zero_copy(pool: HostPool) -> None:
    slot = pool.reserve_slot(key_of(1), 5000, b"meta")
    assert slot.flags.writeable and len(slot) == 5000 and slot.ctypes.data % 4096 == 0
    assert not pool.contains(key_of(1)) and pool.used_bytes == pool.charge(5000)
    slot[:] = blob(5000, 1)
    pool.commit(key_of(1))
    view = pool.view(key_of(1))
    assert not view.flags.writeable and np.shares_memory(view, slot)
    assert np.array_equal(view, blob(5000, 1)) and pool.meta(key_of(1)) == b"meta"
    with pytest.raises(KeyError):
        pool.commit(key_of(1))


def test_abort_frees_the_slot(pool: HostPool) -> None:
    pool.reserve_slot(key_of(1), 100_000)
    with pytest.raises(ValueError, match="abort"):
        pool.reserve_slot(key_of(1), 10)
    pool.abort(key_of(1))
    assert pool.used_bytes == 0 and not pool.contains(key_of(1))


def test_acquired_slot_outlives_delete_and_replace(pool: HostPool) -> None:
    pool.put(key_of(1), blob(70_000, 1), nbytes=70_000).result()
    pool.acquire(key_of(1))
    view = pool.view(key_of(1))
    pool.put(key_of(1), blob(70_000, 2), nbytes=70_000).result()  # replaced while held
    assert pool.delete(key_of(1)) == pool.charge(70_000)
    pool.put(key_of(2), blob(70_000, 3), nbytes=70_000).result()
    assert np.array_equal(view, blob(70_000, 1))  # the held slot was not reused
    assert pool.used_bytes == 3 * pool.charge(70_000)
    pool.release_ref(key_of(1))
    assert pool.used_bytes == pool.charge(70_000)
    with pytest.raises(ValueError, match="acquire"):
        pool.release_ref(key_of(1))
    with pytest.raises(KeyError):
        pool.acquire(key_of(1))


def test_replace_in_a_full_pool_keeps_the_old_object() -> None:
    with HostPool(1 << 20, arena_bytes=1 << 20, pin=False) as pool:
        for i in range(16):
            pool.put(key_of(i), blob(64 << 10, i), nbytes=64 << 10).result()
        with pytest.raises(CapacityError, match="evict"):
            pool.put(key_of(0), blob(64 << 10, 99), nbytes=64 << 10)
        assert np.array_equal(pool.get(key_of(0)), blob(64 << 10, 0))
        assert pool.used_bytes == pool.capacity_bytes


def test_torch_tensors_in_and_out(pool: HostPool) -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(1000, dtype=torch.float32)
    pool.put(key_of(1), src, nbytes=4000).result()
    out = torch.empty(1000, dtype=torch.float32)
    assert pool.get_into(key_of(1), out).result() == 4000
    assert torch.equal(out, src)
    with pytest.raises(ValueError, match="contiguous"):
        pool.get_into(key_of(1), torch.empty(2000)[::2])


def test_large_objects_get_their_own_arena(pool: HostPool) -> None:
    pool.put(key_of(1), blob(3 << 20, 1), nbytes=3 << 20).result()
    assert pool.stats()["committed_bytes"] == 3 << 20
    assert np.array_equal(pool.get(key_of(1)), blob(3 << 20, 1))
    pool.delete(key_of(1))
    assert pool.stats()["committed_bytes"] == 0


def test_stats_and_pinning(pool: HostPool) -> None:
    pool.put(key_of(1), blob(10, 1), nbytes=10).result()
    pool.get(key_of(1))
    stats = pool.stats()
    assert (stats["objects"], stats["puts"], stats["gets"]) == (1, 1, 1)
    assert (stats["bytes_in"], stats["bytes_out"]) == (10, 10)
    assert not pool.is_pinned
    assert pool.read_seconds(64 * 10**9) == pytest.approx(1.0)


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        HostPool(1 << 20, h2d_gbps=0)
    with pytest.raises(ConfigError):
        HostPool(1 << 20, arena_bytes=100)


def test_relocation_makes_a_slot_and_keeps_held_objects_in_place() -> None:
    """8 MiB of 4 KiB pages (128 KiB slabs), every other one deleted: a 200 KiB object finds
    no slot until the pages of one window move into the holes; a held page stays put."""
    big = 200 << 10
    with HostPool(8 << 20, arena_bytes=8 << 20, pin=False) as pool:
        n = 2048
        for i in range(n):
            pool.put(key_of(i), blob(4096, i), nbytes=4096)
        for i in range(1, n, 2):
            pool.delete(key_of(i))
        with pytest.raises(CapacityError):
            pool.put(key_of(n), blob(big, n), nbytes=big)
        held = [key_of(i) for i in range(0, n, 128)]     # one page in every 4th slab
        for k in held:
            pool.acquire(k)
        views = {k: pool.view(k) for k in held}
        moved = pool.relocate_window(big, lambda k: True)
        assert moved is not None and moved > 0 and pool.stats()["relocated_bytes"] == moved
        assert pool.relocate_window(big, lambda k: False) in (None, 0)
        pool.put(key_of(n), blob(big, n), nbytes=big)
        for k, v in views.items():
            assert np.shares_memory(v, pool.view(k))   # held: not moved
            pool.release_ref(k)
        for i in range(0, n, 2):
            assert np.array_equal(pool.view(key_of(i)), blob(4096, i))
        assert np.array_equal(pool.view(key_of(n)), blob(big, n))
