"""Compaction of the disk tier: a window emptied by moving its objects, nothing lost.

An 8 MiB tier has 128 KiB slabs (1/64 of it): 32 slots of 4 KiB.  Filling it with
pages and deleting every other one leaves half the bytes free in 4 KiB holes, so a
200 KiB object finds no slot.  ``relocate_window`` moves the pages of the cheapest
window into the holes elsewhere; the object then fits, and every page reads back bit
for bit, before and after a reopen.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore.backends.alloc import SlabAllocator
from hybridstore.backends.disk import DiskTier
from hybridstore.errors import CapacityError
from hybridstore.objects import ObjectKind, object_key

PAGE = 4096
BIG = 200 << 10
TIER = 8 << 20
PAGES = 60 * 32           # slabs 0..59 full of pages


def key(i: int, kind: ObjectKind = ObjectKind.PAGE) -> bytes:
    return object_key(kind, i.to_bytes(16, "little"))


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def open_tier(path) -> DiskTier:
    return DiskTier(str(path), TIER, segment_bytes=TIER, engine="posix", io_threads=2)


def fragmented(tier: DiskTier) -> dict[bytes, np.ndarray]:
    """Pages in every slot of slabs 0..59, then every other one deleted; the survivors."""
    pages = {key(i): payload(PAGE, i) for i in range(PAGES)}
    for fut in tier.put_many(list(pages), list(pages.values()), nbytes=PAGE):
        fut.result()
    gone = [k for i, k in enumerate(pages) if i % 2]
    tier.delete_many(gone)
    for k in gone:
        del pages[k]
    # slabs 60..63 hold no page: fill them with one big object each so that only the
    # holes between the survivors are free
    for j in range(2):
        tier.put(key(10_000 + j, ObjectKind.STATE), payload(BIG, 10_000 + j), nbytes=BIG).result()
    return pages


def check(tier: DiskTier, objects: dict[bytes, np.ndarray]) -> None:
    for k, want in objects.items():
        assert np.array_equal(tier.get(k), want), k.hex()


def test_relocation_makes_a_slot_and_loses_nothing(tmp_path):
    with open_tier(tmp_path / "d") as tier:
        pages = fragmented(tier)
        assert tier.free_bytes >= 3 * BIG
        big = payload(BIG, 99)
        with pytest.raises(CapacityError):
            tier.put(key(1, ObjectKind.STATE), big, nbytes=BIG)
        before = len(list(tier.entries()))
        moved = tier.relocate_window(BIG, lambda k: True)
        assert moved is not None and 0 < moved <= 2 * (128 << 10)
        assert tier.stats()["relocated_bytes"] == moved
        assert len(list(tier.entries())) == before      # moved, not deleted
        tier.put(key(1, ObjectKind.STATE), big, nbytes=BIG).result()
        check(tier, pages)
        assert np.array_equal(tier.get(key(1, ObjectKind.STATE)), big)
    with open_tier(tmp_path / "d") as tier:                 # the catalog has the moves
        check(tier, pages)
        assert np.array_equal(tier.get(key(1, ObjectKind.STATE)), big)
        assert len(list(tier.entries())) == len(pages) + 3


def test_relocation_leaves_what_may_not_move(tmp_path):
    with open_tier(tmp_path / "d") as tier:
        pages = fragmented(tier)
        assert tier.relocate_window(BIG, lambda k: False) is None
        assert tier.stats()["relocated"] == 0
        with pytest.raises(CapacityError):
            tier.put(key(1, ObjectKind.STATE), payload(BIG, 99), nbytes=BIG)
        check(tier, pages)


def test_relocation_skips_an_object_being_read(tmp_path):
    with open_tier(tmp_path / "d") as tier:
        pages = fragmented(tier)
        # pin one surviving page in every slab that holds pages: no window is movable
        survivors = sorted(pages, key=lambda k: int.from_bytes(k[1:], "little"))
        with tier._lock:
            extents = [tier._objects[k].extent for k in survivors[::16]]
            for e in extents:
                tier._pins[e] = tier._pins.get(e, 0) + 1
        try:
            assert tier.relocate_window(BIG, lambda k: True) is None
        finally:
            for e in extents:
                tier._unpin(e)
        check(tier, pages)


def test_alloc_outside_keeps_clear_of_the_window():
    a = SlabAllocator(budget_bytes=TIER, arena_bytes=TIER, alignment=PAGE)   # 128 KiB slabs
    live = [a.alloc(PAGE) for _ in range(64 * 32)]
    assert all(e is not None for e in live)
    for e in live[1::2]:
        a.free(e)
    used = a.used_bytes
    window = a.window_at(BIG, lambda e: True)
    assert window is not None and window.extents
    lo, hi = window.start, window.start + window.length
    new = a.alloc_outside(window)
    assert new is not None and len(new) == len(window.extents)
    assert all(not (e.arena == window.arena and lo <= e.offset < hi) for e in new)
    assert a.used_bytes == used + sum(e.length for e in new)
    for e in window.extents:
        a.free(e)
    assert a.alloc(BIG) is not None                # the window is a slot now


def _refuse_a_second_arena(arena: int, nbytes: int) -> None:
    if arena:
        raise CapacityError("the directory's budget is committed by other processes")


@pytest.mark.parametrize("budget, on_new_arena", [(TIER, None), (2 * TIER, _refuse_a_second_arena)],
                         ids=["no-budget-left", "new-arena-refused"])
def test_alloc_outside_changes_nothing_when_short(budget, on_new_arena):
    """No room outside the window for its pages: either the budget allows no second arena,
    or it does but the arena's creation is refused (a shared directory whose budget other
    processes committed meanwhile; short of room, not an error).  The pages carved before
    that go back."""
    a = SlabAllocator(budget_bytes=budget, arena_bytes=TIER, alignment=PAGE,
                      on_new_arena=on_new_arena)
    live = [a.alloc(PAGE) for _ in range(64 * 32)]
    for e in live[:40]:
        a.free(e)                                  # 160 KiB free, slabs 0 and 1 only
    window = a.window_at(BIG, lambda e: True)
    assert window is not None
    used = a.used_bytes
    assert a.alloc_outside(window) is None         # no room outside for its pages
    assert a.used_bytes == used
    assert a.alloc(PAGE) is not None               # the allocator goes on as before


def open_shared(path, capacity: int = TIER) -> DiskTier:
    return DiskTier(str(path), capacity, segment_bytes=TIER, engine="posix", io_threads=2,
                    shared=True)


def test_a_shared_directory_compacts_its_own_segment(tmp_path):
    """Two processes' tiers on one directory: a compacts its segment while b reads a's
    objects; b's read in flight keeps an old extent until it is done (the reuse rule), and
    b sees every moved object at its new place, bit for bit."""
    with open_shared(tmp_path) as a, open_shared(tmp_path) as b:
        pages = fragmented(a)
        b.sync()
        view = b._view
        b.shared.begin_read(view)                  # b has a read in flight planned before
        big = payload(BIG, 99)
        with pytest.raises(CapacityError):
            a.put(key(1, ObjectKind.STATE), big, nbytes=BIG)
        moved = a.relocate_window(BIG, lambda k: True)
        assert moved is not None and moved > 0
        a.sync()
        assert a.stats()["quarantined"] > 0       # the old extents wait for b's read
        b.shared.end_read(view)
        a.sync()
        assert a.stats()["quarantined"] == 0
        a.put(key(1, ObjectKind.STATE), big, nbytes=BIG).result()
        b.sync()
        check(b, pages)
        assert np.array_equal(b.get(key(1, ObjectKind.STATE)), big)


def test_a_shared_move_never_undoes_another_process_change(tmp_path):
    """b puts a new version of one of the window's objects, and deletes another, while a
    moves them: the catalog keeps b's changes (a's moves of those keys do not commit, their
    new slots go back), and the other objects move.  (b is given a budget of its own
    segment beyond a's.)"""
    with open_shared(tmp_path) as a, open_shared(tmp_path, 2 * TIER) as b:
        pages = fragmented(a)
        window, owner = a._window(BIG, lambda k: True, idle=True)
        assert window is not None and len(window.extents) >= 2
        hit, gone = (owner[e][0] for e in window.extents[:2])
        newer = payload(PAGE, 12345)
        read = a.read_many_into

        def racing_read(keys, dst, offsets):      # b acts between a's read and its commit
            fut = read(keys, dst, offsets)
            fut.result()
            b.sync()
            b.put(hit, newer, nbytes=PAGE).result()
            b.delete(gone)
            return fut

        a.read_many_into = racing_read            # type: ignore[method-assign]
        used = a._alloc.used_bytes
        moved = a.relocate_window(BIG, lambda k: True)
        del a.read_many_into
        assert moved is not None and moved > 0
        a.sync()
        assert np.array_equal(a.get(hit), newer) and not a.contains(gone)
        pages[hit] = newer
        del pages[gone]
        check(a, pages)
        b.sync()
        check(b, pages)
        # the two moves that lost went back to the allocator: a holds one object less
        a.sync()
        assert a._alloc.used_bytes <= used
    with DiskTier(str(tmp_path), TIER, segment_bytes=TIER, engine="posix") as alone:
        check(alone, pages)                        # the catalog agrees after a reopen


def test_a_shared_move_whose_commit_fails_leaves_everything_in_place(tmp_path):
    """The catalog refuses the moves' transaction (e.g. a full file system): the objects
    stay where they were, readable, and the slots carved for them go back."""
    from hybridstore.errors import CatalogError

    with open_shared(tmp_path) as a:
        pages = fragmented(a)
        used = a._alloc.used_bytes

        def refuse(*args, **kwargs):
            raise CatalogError("no room for the catalog")

        a._catalog.replace_many = refuse          # type: ignore[method-assign]
        a.relocate_window(BIG, lambda k: True)
        del a._catalog.replace_many
        assert a.stats()["pending_writes"] == 0
        assert a._alloc.used_bytes == used
        check(a, pages)
        with pytest.raises(CapacityError):        # nothing moved: still fragmented
            a.put(key(1, ObjectKind.STATE), payload(BIG, 99), nbytes=BIG)
        assert a.relocate_window(BIG, lambda k: True)   # and it moves when it can
        a.put(key(1, ObjectKind.STATE), payload(BIG, 99), nbytes=BIG).result()
        check(a, pages)
