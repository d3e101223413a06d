"""Property tests of :class:`SlabAllocator`: no overlaps, hard budget, exact accounting."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.errors import CapacityError, ConfigError, ObjectTooLargeError

# (budget, arena, alignment, slab): small numbers so a few ops reach every path.
CONFIGS = [
    (10_000, 2048, 16, 1024),   # tail arena, slabs, runs and dedicated arenas
    (8192, 8192, 64, 8192),     # one arena
    (100, 4096, 16, 4096),      # budget below one arena
    (65536, 4096, 512, 1024),   # many arenas
]


def _overlaps(extents: list[Extent]) -> bool:
    spans = sorted((e.arena, e.offset, e.offset + e.length) for e in extents)
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences, with rebuilds through ``reserve`` in random order."""

    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config: tuple[int, int, int, int]) -> None:
        self.params = dict(zip(("budget_bytes", "arena_bytes", "alignment", "slab_bytes"), config))
        self.live: list[Extent] = []
        self.alloc = self._new()

    def _new(self) -> SlabAllocator:
        self.mapped: dict[int, int] = {}

        def on_new(arena: int, nbytes: int) -> None:
            assert arena not in self.mapped
            self.mapped[arena] = nbytes

        return SlabAllocator(**self.params, on_new_arena=on_new,
                             on_release_arena=lambda arena: self.mapped.pop(arena))

    @rule(nbytes=st.one_of(st.integers(0, 100), st.integers(0, 12_000)))
    def alloc_one(self, nbytes: int) -> None:
        try:
            size = self.alloc.slot_size(nbytes)
        except ObjectTooLargeError:
            assert -(-max(nbytes, 1) // self.params["alignment"]) * self.params["alignment"] \
                > self.params["budget_bytes"] // self.params["alignment"] * self.params["alignment"]
            return
        assert nbytes <= size < max(nbytes, 1) * 1.125 + self.params["alignment"]
        extent = self.alloc.alloc(nbytes)
        if extent is None:
            assert self.live, "an empty allocator must satisfy any slot within the budget"
            return
        assert extent.length == size
        self.live.append(extent)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        extent = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.alloc.free(extent)
        with pytest.raises(ValueError):
            self.alloc.free(extent)

    @rule(seed=st.integers(0, 2**16))
    def rebuild(self, seed: int) -> None:
        order = list(self.live)
        random.Random(seed).shuffle(order)
        self.alloc = self._new()
        for extent in order:
            self.alloc.reserve(extent)
        if order:
            with pytest.raises(ValueError):
                self.alloc.reserve(order[0])

    @precondition(lambda self: self.live)
    @rule()
    def free_all_then_fill(self) -> None:
        for extent in self.live:
            self.alloc.free(extent)
        self.live.clear()
        align = self.params["alignment"]
        biggest = self.alloc.alloc(self.params["budget_bytes"] // align * align)
        assert biggest is not None and biggest.length <= self.params["budget_bytes"]
        self.alloc.free(biggest)

    @invariant()
    def consistent(self) -> None:
        alloc = self.alloc
        assert not _overlaps(self.live)
        assert alloc.used_bytes == sum(e.length for e in self.live)
        assert alloc.committed_bytes == sum(alloc.arena_sizes().values())
        assert alloc.committed_bytes <= alloc.budget_bytes
        assert alloc.arena_sizes() == self.mapped
        sizes = alloc.arena_sizes()
        for e in self.live:
            assert e.offset % alloc.alignment == 0 and e.length % alloc.alignment == 0
            assert e.offset + e.length <= sizes[e.arena]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_size_classes_waste_less_than_an_eighth() -> None:
    alloc = SlabAllocator(budget_bytes=1 << 40, arena_bytes=1 << 30)
    for nbytes in [1, 4095, 4096, 4097, 65536, (1 << 20) + 3, 50 << 20, (1 << 30) - 1]:
        size = alloc.slot_size(nbytes)
        assert size % 4096 == 0 and nbytes <= size
        assert size - nbytes < max(4096, size / 8)
    assert alloc.slot_size((1 << 30) + 1) == (1 << 30) + 4096  # dedicated arena: aligned only


def test_same_size_objects_pack_densely() -> None:
    alloc = SlabAllocator(budget_bytes=64 << 20, arena_bytes=16 << 20)
    extents = [alloc.alloc(48 << 10) for _ in range(1000)]
    assert all(extents) and alloc.used_bytes == 1000 * (48 << 10)
    assert alloc.committed_bytes <= 64 << 20


def test_dedicated_arena_released_on_free() -> None:
    released: list[int] = []
    alloc = SlabAllocator(budget_bytes=10 << 20, arena_bytes=4 << 20,
                          on_release_arena=released.append)
    extent = alloc.alloc(5 << 20)
    assert extent is not None and extent.offset == 0 and alloc.arena_count == 1
    alloc.free(extent)
    assert released == [extent.arena] and alloc.committed_bytes == 0


def test_empty_arenas_give_budget_to_a_large_object() -> None:
    alloc = SlabAllocator(budget_bytes=8 << 20, arena_bytes=2 << 20)
    small = [alloc.alloc(1 << 20) for _ in range(8)]
    assert all(small) and alloc.alloc(3 << 20) is None
    for extent in small:
        alloc.free(extent)  # type: ignore[arg-type]
    assert alloc.alloc(3 << 20) is not None


def test_failed_arena_callback_changes_nothing() -> None:
    def refuse(arena: int, nbytes: int) -> None:
        raise OSError("no memory")

    alloc = SlabAllocator(budget_bytes=1 << 20, arena_bytes=1 << 20, on_new_arena=refuse)
    with pytest.raises(OSError):
        alloc.alloc(100)
    assert alloc.committed_bytes == 0 and alloc.used_bytes == 0 and alloc.arena_count == 0


def test_errors() -> None:
    with pytest.raises(ConfigError):
        SlabAllocator(budget_bytes=1 << 20, arena_bytes=100, alignment=4096)
    alloc = SlabAllocator(budget_bytes=1 << 20, arena_bytes=1 << 20)
    with pytest.raises(ObjectTooLargeError, match="capacity"):
        alloc.slot_size((1 << 20) + 1)
    with pytest.raises(ValueError):
        alloc.reserve(Extent(0, 100, 4096))
    quarter = 256 << 10
    small = SlabAllocator(budget_bytes=1 << 20, arena_bytes=quarter)
    for arena in range(4):
        small.reserve(Extent(arena, 0, quarter))
    with pytest.raises(CapacityError, match="budget"):
        small.reserve(Extent(4, 0, 2 * quarter))


def test_grow_ahead_creates_the_next_arena_without_holding_allocations_up() -> None:
    import threading

    MiB = 1 << 20
    started, release = threading.Event(), threading.Event()
    created: list[int] = []

    def on_new(arena: int, n: int) -> None:
        if arena == 1:                   # the arena grown ahead: slow, like a new segment
            started.set()
            assert release.wait(5)
        created.append(arena)

    alloc = SlabAllocator(budget_bytes=3 * MiB, arena_bytes=MiB, on_new_arena=on_new)
    first = alloc.alloc_many(256 << 10, 3)          # arena 0, 3/4 full
    assert first is not None and created == [0]
    assert not alloc.grow_ahead(128 << 10)          # 256 KiB free: enough headroom
    t = threading.Thread(target=alloc.grow_ahead, args=(512 << 10,))
    t.start()
    assert started.wait(5)
    # while arena 1 is being created, allocations go on (and do not take arena 1)
    more = alloc.alloc_many(256 << 10, 1)
    assert more is not None and more[0].arena == 0
    big = alloc.alloc(MiB)                          # needs a fresh arena: arena 2, not 1
    assert big is not None and big.arena == 2
    release.set()
    t.join()
    assert created == [0, 2, 1] and alloc.committed_bytes == 3 * MiB
    x = alloc.alloc(256 << 10)
    assert x is not None and x.arena == 1           # the arena grown ahead serves now
    assert not alloc.grow_ahead(10 * MiB)           # the budget is all committed


def test_grow_ahead_failure_commits_nothing() -> None:
    MiB = 1 << 20

    def on_new(arena: int, n: int) -> None:
        if arena == 1:
            raise OSError("no room for the file")

    alloc = SlabAllocator(budget_bytes=2 * MiB, arena_bytes=MiB, on_new_arena=on_new)
    assert alloc.alloc(MiB) is not None
    with pytest.raises(OSError):
        alloc.grow_ahead(MiB)
    assert alloc.committed_bytes == MiB and alloc.arena_count == 1
