"""A size-class slab allocator over byte offsets inside owner-supplied arenas.

The allocator never touches memory: it hands out :class:`Extent` values
(arena id, byte offset, slot length) and calls ``on_new_arena(arena_id,
nbytes)`` before an arena is first used, so the owner can map memory (host
pool, device tier) or create a segment file (disk tier).

Layout:

* **Size classes.** A payload is rounded up to ``alignment``, then to one of 8
  classes per power of two, so a slot wastes less than 1/8 of itself.
* **Regular arenas** tile the budget: arena ``i`` is ``arena_bytes`` long
  (the last one takes the remainder), is created on demand and released when
  it is empty and its budget is needed elsewhere.  Free space in them is kept
  as coalesced runs, indexed by length for best fit.
* **Slabs.** Slots of at most 1/8 of a slab live in slabs: chunks of
  ``slab_bytes`` (at most 1/8 of the largest regular arena) aligned to their
  size inside their arena, each dedicated to one class, with a free list of
  slots.  A slab whose slots are all free goes back to the free runs, usable
  by any class.
* **Runs.** Larger slots (up to ``arena_bytes``) are runs of exactly their
  size at any aligned offset.
* **Dedicated arenas.** A slot larger than ``arena_bytes`` gets an arena of
  its own (ids from the number of regular arenas upward), released as soon as
  the object is freed (``on_release_arena``).
* **Grown arenas.** With ``on_grow_arena`` an arena starts with none of its
  bytes usable and is grown from its start as allocations need them (the disk
  tier extends a segment file as it fills): a request is served from the grown
  bytes first, then by growing an arena that exists, then by a new arena.  A
  dedicated arena is grown whole when it is made.

Placement is a function of the extent alone (a slab starts at the slab-aligned
offset below a slot; a run or dedicated arena starts at the slot), so
:meth:`SlabAllocator.reserve` can rebuild the state from the live extents of a
reopened disk tier, in any order.

The budget is charged on committed arena bytes (whole arenas, grown or not):
``committed_bytes`` never exceeds ``budget_bytes``.  All methods are thread-safe;
callbacks run under the allocator's lock and must not call back into it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridstore.errors import CapacityError, ConfigError, ObjectTooLargeError

SLAB_BYTES = 1 << 20
"""Default slab size: slots up to 1/8 of it share slabs."""

CLASS_STEPS = 8
"""Size classes per power of two (so internal waste is below 1/CLASS_STEPS)."""

SLABS_PER_ARENA = 64
"""A slab is at most this fraction of the largest arena (and at most ``slab_bytes``).

A slab returns to the free runs only once every slot in it is free, so one live
page keeps a whole slab from larger objects.  With slabs of 1/8 of a small tier
(1 MiB slabs in the 12-25 MiB disk tiers of the engines bench's policy replay: 4 KiB
pages, 196.5 KiB states) the stranded slabs made the tier refuse states and new
slabs at ~85 % fill, and evict in the policy's order from there; at 1/64 the tier
filled to ~94 %, as a file-per-object store does (docs/bench/engines.md).  Tiers of
64 MiB and more keep ``slab_bytes`` (1 MiB)."""


@dataclass(frozen=True, slots=True)
class Extent:
    """Where an object lives.

    Attributes:
        arena: id of the arena (the owner maps it to memory or a file).
        offset: byte offset inside the arena, a multiple of the alignment.
        length: the slot size charged (``slot_size`` of the payload), not the
            payload size.
    """

    arena: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Window:
    """A span of one arena that one slot needs free (:meth:`SlabAllocator.window_at`).

    Attributes:
        arena: the arena's id.
        start: its first byte.
        length: its bytes (the slot's size, or a slab's for slab classes).
        extents: the live extents inside it (to free or to move elsewhere).
    """

    arena: int
    start: int
    length: int
    extents: tuple[Extent, ...]


class _Arena:
    """One arena's free runs (``starts`` sorted; ``runs``: start -> length)."""

    __slots__ = ("id", "size", "limit", "dedicated", "starts", "runs", "ends", "spans")

    def __init__(self, arena_id: int, size: int, dedicated: bool, limit: int) -> None:
        self.id = arena_id
        self.size = size
        self.limit = limit  # bytes usable from its start (grown arenas: up to size)
        self.dedicated = dedicated
        self.starts: list[int] = []
        self.runs: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        self.spans = 0  # slabs and runs carved from this arena


class _Slab:
    """A slab: ``count`` slots of ``slot`` bytes from ``start``; ``free`` lists free indices."""

    __slots__ = ("arena", "start", "slot", "count", "free")

    def __init__(self, arena: int, start: int, slot: int, count: int) -> None:
        self.arena = arena
        self.start = start
        self.slot = slot
        self.count = count
        self.free = list(range(count - 1, -1, -1))  # pop() hands out slot 0 first


def _size_class(units: int) -> int:
    """Round ``units`` up to one of ``CLASS_STEPS`` classes per power of two."""
    if units <= CLASS_STEPS:
        return units
    step = 1 << (units.bit_length() - CLASS_STEPS.bit_length())
    return -(-units // step) * step


class SlabAllocator:
    """Hands out aligned extents inside arenas, never committing more than a budget.

    Args:
        budget_bytes: hard limit on the bytes of all arenas committed at once.
        arena_bytes: size of a regular arena (rounded down to ``alignment``).
        alignment: every offset and slot size is a multiple of it (4096 suits
            ``O_DIRECT``).
        slab_bytes: size of a slab (at most 1/8 of the largest regular arena);
            slots up to 1/8 of a slab share slabs.
        on_new_arena: ``on_new_arena(arena_id, nbytes)``, called before an arena
            is first used; if it raises, the allocation fails and nothing changes.
        on_release_arena: ``on_release_arena(arena_id)``, called after an empty
            arena was dropped (its budget returned).
        on_grow_arena: ``on_grow_arena(arena_id, limit, need, size)`` -> the new limit,
            in ``[need, size]``: make the arena's bytes up to at least ``need`` usable
            (they are ``[0, limit)`` now; ``size`` is the arena's).  Without it every
            arena is usable whole once made.  If it raises, the allocation fails with
            its error and nothing changes.

    Raises:
        ConfigError: a size is not a positive int, or ``arena_bytes`` is below
            ``alignment``.
    """

    def __init__(self, *, budget_bytes: int, arena_bytes: int, alignment: int = 4096,
                 slab_bytes: int = SLAB_BYTES,
                 on_new_arena: Callable[[int, int], None] | None = None,
                 on_release_arena: Callable[[int], None] | None = None,
                 on_grow_arena: Callable[[int, int, int, int], int] | None = None) -> None:
        for name, value in (("alignment", alignment), ("arena_bytes", arena_bytes),
                            ("slab_bytes", slab_bytes)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int of bytes, got {value!r}")
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        if arena_bytes < alignment:
            raise ConfigError(f"arena_bytes ({arena_bytes}) must be at least the alignment "
                              f"({alignment}); use a larger arena")
        self._lock = threading.Lock()
        self._align = alignment
        self._budget = budget_bytes
        self._arena_bytes = arena_bytes // alignment * alignment
        self._max_regular = min(self._arena_bytes, budget_bytes // alignment * alignment)
        # Slabs stay small next to the largest arena (at most 1/SLABS_PER_ARENA of it), so
        # that many classes coexist and a slab that one live slot keeps stranded is a
        # small share of a small tier.
        slab = min(slab_bytes, self._max_regular // SLABS_PER_ARENA)
        self._slab = max(alignment, slab // alignment * alignment)
        self._small_max = self._slab // CLASS_STEPS
        full, rest = divmod(budget_bytes, self._arena_bytes)
        self._n_regular = full + (1 if rest >= alignment else 0)
        self._next_dedicated = self._n_regular
        self._on_new_arena = on_new_arena
        self._on_release_arena = on_release_arena
        self._on_grow_arena = on_grow_arena
        self._grown = 0
        self._arenas: dict[int, _Arena] = {}
        self._creating: set[int] = set()  # regular arenas grow_ahead is creating
        self._empty: dict[int, None] = {}  # regular arenas with no spans
        self._committed = 0
        self._used = 0
        self._live: dict[tuple[int, int], int] = {}  # (arena, offset) -> slot size
        self._slabs: dict[tuple[int, int], _Slab] = {}  # (arena, slab start) -> slab
        self._partial: dict[int, dict[tuple[int, int], _Slab]] = {}  # class -> slabs with room
        self._by_len: dict[int, dict[tuple[int, int], None]] = {}  # run length -> runs
        self._lens: list[int] = []  # sorted keys of _by_len

    # -- sizes ----------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        """The hard limit on committed arena bytes."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Sum of the slot sizes of live extents."""
        return self._used

    @property
    def committed_bytes(self) -> int:
        """Bytes of the arenas that exist now (never above ``budget_bytes``)."""
        return self._committed

    @property
    def grown_bytes(self) -> int:
        """Usable bytes of the arenas that exist now (``committed_bytes`` unless arenas
        are grown as needed: ``on_grow_arena``)."""
        return self._grown

    @property
    def arena_count(self) -> int:
        """Number of arenas that exist now."""
        return len(self._arenas)

    @property
    def alignment(self) -> int:
        """Every offset and slot size is a multiple of this."""
        return self._align

    def arena_sizes(self, grown: bool = False) -> dict[int, int]:
        """``{arena_id: nbytes}`` of the arenas that exist now (``grown``: their usable
        bytes, see ``on_grow_arena``)."""
        with self._lock:
            return {aid: arena.limit if grown else arena.size
                    for aid, arena in self._arenas.items()}

    def slot_size(self, nbytes: int) -> int:
        """The slot size charged for an object of ``nbytes``.

        Raises:
            ObjectTooLargeError: the slot would exceed the whole budget.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        units = max(1, -(-nbytes // self._align))
        size = units * self._align
        if size <= self._max_regular:
            size = min(_size_class(units) * self._align, self._max_regular)
        if size > self._budget:
            raise ObjectTooLargeError(
                f"an object of {nbytes} bytes needs a {size}-byte slot, more than the whole "
                f"budget of {self._budget} bytes; raise the tier's capacity")
        return size

    # -- alloc / free ---------------------------------------------------------------
    def alloc(self, nbytes: int) -> Extent | None:
        """An extent for ``nbytes``, or ``None`` when the budget is exhausted.

        On ``None`` the caller frees something (evicts) and retries.

        Raises:
            ObjectTooLargeError: the object can never fit.
        """
        extents = self.alloc_many(nbytes, 1)
        return None if extents is None else extents[0]

    def alloc_many(self, nbytes: int, n: int) -> list[Extent] | None:
        """``n`` extents for objects of ``nbytes`` each (a run of pages), under one lock:
        all of them, or ``None`` (none allocated) when the budget is exhausted.

        Raises:
            ObjectTooLargeError: the object can never fit.
        """
        size = self.slot_size(nbytes)
        out: list[Extent] = []
        with self._lock:
            try:
                for _ in range(n):
                    extent = self._alloc_one(size)
                    if extent is None:
                        break
                    out.append(extent)
                else:
                    return out
            except BaseException:      # e.g. mapping a new arena failed: give back the run
                for done in reversed(out):
                    self._free(done)
                raise
            for done in reversed(out):  # the budget ran out: none of the run is taken
                self._free(done)
            return None

    def _alloc_one(self, size: int) -> Extent | None:
        """One live extent of slot ``size`` (lock held), or ``None``: the budget is short."""
        if size > self._max_regular:
            extent = self._alloc_dedicated(size)
        elif size <= self._small_max:
            extent = self._alloc_in_slab(size)
        else:
            where = self._take(size, self._align)
            extent = None if where is None else Extent(where[0].id, where[1], size)
        if extent is not None:
            self._live[(extent.arena, extent.offset)] = size
            self._used += size
        return extent

    def alloc_outside(self, window: Window) -> list[Extent] | None:
        """New extents for the live extents of ``window``, one each, of the same slot sizes
        and none of them inside the window: where its objects move so that the window
        frees up (compaction, :meth:`~hybridstore.backends.disk.DiskTier.relocate_window`).

        The window's free runs and the free slots of its slabs are set aside while the
        extents are carved, so every one lands elsewhere; the old extents stay live
        until the caller frees them.

        Returns:
            The new extents, in the order of ``window.extents``; ``None`` (nothing
            allocated) when the room outside the window is short.
        """
        lo, hi = window.start, window.start + window.length
        out: list[Extent] = []
        with self._lock:
            arena = self._arenas.get(window.arena)
            if arena is None:
                return None
            runs = [(start, arena.runs[start]) for start in list(arena.starts)
                    if start < hi and start + arena.runs[start] > lo]
            for start, _ in runs:
                self._remove_run(arena, start)
            slabs = [(slot, key) for slot, partial in self._partial.items() for key in partial
                     if key[0] == window.arena and lo <= key[1] < hi]
            hidden = [(slot, key, self._partial[slot].pop(key)) for slot, key in slabs]
            failure: BaseException | None = None
            try:
                for extent in window.extents:
                    try:
                        got = self._alloc_one(extent.length)
                    except CapacityError:    # a new arena refused (a shared directory's
                        got = None           # budget, committed by other processes)
                    if got is None:
                        break
                    out.append(got)
            except BaseException as e:       # noqa: BLE001 - given back below, then raised
                failure = e
            finally:
                for start, length in runs:
                    self._add_free(arena, start, length)   # it may border grown bytes
                for slot, key, slab in hidden:
                    if slab.free:
                        self._partial.setdefault(slot, {})[key] = slab
            if failure is not None or len(out) < len(window.extents):
                for done in reversed(out):
                    self._free(done)
                if failure is not None:
                    raise failure
                return None
            return out

    def window(self, nbytes: int, movable: Callable[[Extent], bool]) -> list[Extent] | None:
        """:meth:`window_at`'s extents (``None``: no window can be freed)."""
        found = self.window_at(nbytes, movable)
        return None if found is None else list(found.extents)

    def window_at(self, nbytes: int, movable: Callable[[Extent], bool]) -> Window | None:
        """The window to empty so that one object of ``nbytes`` fits, fewest live bytes first.

        For a tier whose free bytes are enough but split (no run of the slot's
        size, or no free slab for a small class): the cheapest window of the
        slot's size (a slab's, for slab classes) in a committed regular arena,
        at its alignment, counted in live slot bytes inside it (a slab counts
        whole: it returns to the free runs only once all its slots are free).
        ``movable(extent)`` says whether an extent may be freed; windows holding
        one it refuses are skipped.

        Returns:
            The window, with the live extents to free or move (none: it is free
            already), or ``None`` when no window can be emptied (or the slot is larger
            than an arena).
        """
        size = self.slot_size(nbytes)
        if size > self._max_regular:
            return None
        length, align = (self._slab, self._slab) if size <= self._small_max else (size, self._align)
        with self._lock:
            live = list(self._live.items())
            slabs = [(slab.arena, slab.start) for slab in self._slabs.values()]
            arenas = {a.id: a.limit for a in self._arenas.values() if not a.dedicated}
        # occupied intervals per arena: (start, end, extents inside)
        occupied: dict[int, dict[int, tuple[int, list[Extent]]]] = {a: {} for a in arenas}
        for arena_id, start in slabs:
            if arena_id in occupied:
                occupied[arena_id][start] = (start + self._slab, [])
        for (arena_id, offset), slot in live:
            spans = occupied.get(arena_id)
            if spans is None:
                continue
            if slot <= self._small_max:
                spans[offset - offset % self._slab][1].append(Extent(arena_id, offset, slot))
            else:
                spans[offset] = (offset + slot, [Extent(arena_id, offset, slot)])
        best: tuple[int, Window] | None = None
        for arena_id, spans in occupied.items():
            found = _cheapest_window(sorted((s, e, x) for s, (e, x) in spans.items()),
                                     arenas[arena_id], length, align, movable)
            if found is not None and (best is None or found[0] < best[0]):
                cost, start, extents = found
                best = cost, Window(arena_id, start, length, tuple(extents))
        return None if best is None else best[1]

    def grow_ahead(self, headroom: int) -> bool:
        """Commit the next regular arena now if the free bytes of the committed arenas are
        below ``headroom`` and the budget allows.

        The owner's ``on_new_arena`` (the disk tier: a segment file and its catalog
        record, a synchronous transaction) runs *without* the allocator's lock, so the
        allocations of other threads go on meanwhile instead of waiting for it inside
        the allocation that found no room.  Its budget is held from the start.

        Returns:
            Whether an arena was added.

        Raises:
            Whatever ``on_new_arena`` raises (nothing is committed then).
        """
        with self._lock:
            if self._committed - self._used >= headroom:
                return False
            left = self._budget - self._committed
            for arena_id in range(self._n_regular):
                size = self._regular_size(arena_id)
                if (arena_id not in self._arenas and arena_id not in self._creating
                        and 0 < size <= left):
                    break
            else:
                return False
            self._creating.add(arena_id)
            self._committed += size
        try:
            if self._on_new_arena is not None:
                self._on_new_arena(arena_id, size)
        except BaseException:
            with self._lock:
                self._creating.discard(arena_id)
                self._committed -= size
            raise
        with self._lock:
            self._creating.discard(arena_id)
            self._install(arena_id, size, False, 0 if self._on_grow_arena else size)
        return True

    def trim(self) -> int:
        """Drop every empty regular arena now (its budget goes back to the owner, e.g. to a
        disk directory that other processes share); returns how many went."""
        with self._lock:
            n = len(self._empty)
            self._release_empty()
            return n

    def free(self, extent: Extent) -> None:
        """Return a live extent.

        Raises:
            ValueError: ``extent`` is not live here (freed twice, or foreign).
        """
        with self._lock:
            self._free(extent)

    def _free(self, extent: Extent) -> None:
        """:meth:`free` with the lock held."""
        key = (extent.arena, extent.offset)
        if self._live.get(key) != extent.length:
            raise ValueError(f"{extent} is not a live extent of this allocator "
                             "(freed twice, or allocated elsewhere)")
        del self._live[key]
        self._used -= extent.length
        arena = self._arenas[extent.arena]
        if arena.dedicated:
            self._drop_arena(arena)
        elif extent.length <= self._small_max:
            self._free_in_slab(arena, extent)
        else:
            self._release(arena, extent.offset, extent.length)

    def reserve(self, extent: Extent) -> None:
        """Mark ``extent`` used where it is (rebuilding state, e.g. on reopen).

        Accepts any extent that ``alloc`` of an allocator with the same
        parameters returned and that does not overlap a live one, in any order.

        Raises:
            ValueError: the extent is malformed or overlaps a live extent.
            CapacityError: committing its arena would exceed the budget (the
                budget is smaller than when the extent was allocated).
        """
        size = extent.length
        if size < 1 or extent.offset % self._align or self.slot_size(size) != size:
            raise ValueError(f"{extent} was not returned by an allocator with these parameters")
        with self._lock:
            if size > self._max_regular:
                self._reserve_dedicated(extent)
            else:
                arena = self._regular_arena(extent.arena)
                if size <= self._small_max:
                    self._reserve_in_slab(arena, extent)
                else:
                    self._carve_at(arena, extent.offset, size)
            self._live[(extent.arena, extent.offset)] = size
            self._used += size

    # -- slabs ----------------------------------------------------------------------
    def _alloc_in_slab(self, size: int) -> Extent | None:
        partial = self._partial.setdefault(size, {})
        if partial:
            slab = next(iter(partial.values()))
        else:
            where = self._take(self._slab, self._slab)
            if where is None:
                return None
            slab = self._new_slab(where[0].id, where[1], size)
        index = slab.free.pop()
        if not slab.free:
            del partial[(slab.arena, slab.start)]
        return Extent(slab.arena, slab.start + index * size, size)

    def _new_slab(self, arena_id: int, start: int, size: int) -> _Slab:
        slab = _Slab(arena_id, start, size, self._slab // size)
        self._slabs[(arena_id, start)] = slab
        self._partial.setdefault(size, {})[(arena_id, start)] = slab
        return slab

    def _free_in_slab(self, arena: _Arena, extent: Extent) -> None:
        start = extent.offset - extent.offset % self._slab
        slab = self._slabs[(arena.id, start)]
        slab.free.append((extent.offset - start) // slab.slot)
        if len(slab.free) == slab.count:
            del self._slabs[(arena.id, start)]
            del self._partial[slab.slot][(arena.id, start)]
            self._release(arena, start, self._slab)
        elif len(slab.free) == 1:
            self._partial.setdefault(slab.slot, {})[(arena.id, start)] = slab

    def _reserve_in_slab(self, arena: _Arena, extent: Extent) -> None:
        start = extent.offset - extent.offset % self._slab
        index, misaligned = divmod(extent.offset - start, extent.length)
        if misaligned or index >= self._slab // extent.length:
            raise ValueError(f"{extent} is not a slot of a slab of its size class")
        slab = self._slabs.get((arena.id, start))
        if slab is None:
            self._carve_at(arena, start, self._slab)
            slab = self._new_slab(arena.id, start, extent.length)
        if slab.slot != extent.length or index not in slab.free:
            raise ValueError(f"{extent} overlaps a live extent")
        slab.free.remove(index)
        if not slab.free:
            del self._partial[slab.slot][(arena.id, start)]

    # -- arenas ---------------------------------------------------------------------
    def _regular_size(self, arena_id: int) -> int:
        left = self._budget - arena_id * self._arena_bytes
        return min(self._arena_bytes, left // self._align * self._align)

    def _commit(self, arena_id: int, size: int, dedicated: bool) -> _Arena:
        if self._on_new_arena is not None:
            self._on_new_arena(arena_id, size)
        limit = size
        if self._on_grow_arena is not None:      # grown as allocations need it; a
            limit = 0                            # dedicated arena's one object needs all
            if dedicated:
                try:
                    limit = self._grow_to(arena_id, 0, size, size)
                except BaseException:
                    if self._on_release_arena is not None:
                        self._on_release_arena(arena_id)
                    raise
        self._committed += size
        return self._install(arena_id, size, dedicated, limit)

    def _install(self, arena_id: int, size: int, dedicated: bool, limit: int) -> _Arena:
        """Record a made arena of ``limit`` usable bytes (its budget is counted already)."""
        arena = _Arena(arena_id, size, dedicated, limit)
        self._arenas[arena_id] = arena
        self._grown += limit
        if not dedicated:
            if limit:
                self._add_run(arena, 0, limit)
            self._empty[arena_id] = None
        return arena

    def _grow_to(self, arena_id: int, limit: int, need: int, size: int) -> int:
        """``on_grow_arena``'s new limit of an arena, checked."""
        assert self._on_grow_arena is not None
        new = self._on_grow_arena(arena_id, limit, need, size)
        if not need <= new <= size or new % self._align:
            raise RuntimeError(f"on_grow_arena grew arena {arena_id} to {new} bytes, not an "
                               f"aligned size in [{need}, {size}]")
        return new

    def _extend(self, arena: _Arena, need: int) -> None:
        """Grow ``arena`` so that its bytes up to ``need`` are usable (free runs)."""
        old = arena.limit
        arena.limit = self._grow_to(arena.id, old, need, arena.size)
        self._grown += arena.limit - old
        self._add_free(arena, old, arena.limit - old)

    def _grow_into(self, length: int, align: int) -> tuple[_Arena, int] | None:
        """Where ``length`` bytes at ``align`` fit once an arena that exists grows (from
        the free run at the end of its grown bytes), growing it; ``None``: none can."""
        if self._on_grow_arena is None:
            return None
        for arena in self._arenas.values():
            if arena.dedicated or arena.limit >= arena.size:
                continue
            tail = arena.ends.get(arena.limit)
            start = -(-(arena.limit if tail is None else tail) // align) * align
            if start + length <= arena.size:
                self._extend(arena, start + length)
                return arena, start
        return None

    def _drop_arena(self, arena: _Arena) -> None:
        if not arena.dedicated:
            if arena.limit:
                self._remove_run(arena, 0)
            del self._empty[arena.id]
        del self._arenas[arena.id]
        self._committed -= arena.size
        self._grown -= arena.limit
        if self._on_release_arena is not None:
            self._on_release_arena(arena.id)

    def _release_empty(self) -> None:
        """Drop every empty regular arena, returning its budget."""
        for arena_id in list(self._empty):
            self._drop_arena(self._arenas[arena_id])

    def _grow(self, need: int) -> bool:
        """Commit a regular arena of at least ``need`` bytes, if the budget allows."""
        if self._commit_regular(need):
            return True
        if not self._empty:
            return False
        self._release_empty()
        return self._commit_regular(need)

    def _commit_regular(self, need: int) -> bool:
        left = self._budget - self._committed
        for arena_id in range(self._n_regular):
            size = self._regular_size(arena_id)
            if (arena_id not in self._arenas and arena_id not in self._creating
                    and need <= size <= left):
                self._commit(arena_id, size, dedicated=False)
                return True
        return False

    def _alloc_dedicated(self, size: int) -> Extent | None:
        if self._budget - self._committed < size:
            self._release_empty()
            if self._budget - self._committed < size:
                return None
        arena_id = self._next_dedicated
        self._commit(arena_id, size, dedicated=True)
        self._next_dedicated += 1
        return Extent(arena_id, 0, size)

    def _reserve_dedicated(self, extent: Extent) -> None:
        if extent.arena < self._n_regular or extent.offset or extent.arena in self._arenas:
            raise ValueError(f"{extent} is not a free dedicated arena of this allocator")
        self._check_budget(extent.length)
        self._commit(extent.arena, extent.length, dedicated=True)
        self._next_dedicated = max(self._next_dedicated, extent.arena + 1)

    def _regular_arena(self, arena_id: int) -> _Arena:
        arena = self._arenas.get(arena_id)
        if arena is not None:
            if arena.dedicated:
                raise ValueError(f"arena {arena_id} is a dedicated arena in use")
            return arena
        if not 0 <= arena_id < self._n_regular:
            raise ValueError(f"arena {arena_id} is not a regular arena of this allocator")
        size = self._regular_size(arena_id)
        self._check_budget(size)
        return self._commit(arena_id, size, dedicated=False)

    def _check_budget(self, size: int) -> None:
        if self._committed + size > self._budget:
            raise CapacityError(
                f"reserving an arena of {size} bytes would commit {self._committed + size} "
                f"bytes, over the budget of {self._budget}; reopen with the budget the "
                "extents were allocated under")

    # -- free runs ------------------------------------------------------------------
    def _take(self, length: int, align: int) -> tuple[_Arena, int] | None:
        """Carve ``length`` bytes at an ``align``-aligned offset (best fit), growing if needed."""
        try:
            found = self._find_run(length, align) or self._grow_into(length, align)
            if found is None and self._grow(length):
                found = self._find_run(length, align) or self._grow_into(length, align)
        except BaseException:
            self._release_empty()   # the owner refused room: its empty arenas go back too
            raise
        if found is None:
            return None
        arena, start = found
        self._carve_at(arena, start, length)
        return arena, start

    def _find_run(self, length: int, align: int) -> tuple[_Arena, int] | None:
        for i in range(bisect.bisect_left(self._lens, length), len(self._lens)):
            run_len = self._lens[i]
            for arena_id, run_start in self._by_len[run_len]:
                start = -(-run_start // align) * align
                if start + length <= run_start + run_len:
                    return self._arenas[arena_id], start
        return None

    def _carve_at(self, arena: _Arena, start: int, length: int) -> None:
        """Mark ``[start, start + length)`` of ``arena`` used; it must lie in one free run
        (of its grown bytes: a reserved extent past them grows the arena first)."""
        if start + length > arena.limit and self._on_grow_arena is not None \
                and start + length <= arena.size:
            self._extend(arena, start + length)
        i = bisect.bisect_right(arena.starts, start) - 1
        run_start = arena.starts[i] if i >= 0 else -1
        run_len = arena.runs.get(run_start, 0)
        if run_start < 0 or start + length > run_start + run_len:
            raise ValueError(f"bytes [{start}, {start + length}) of arena {arena.id} are not free")
        self._remove_run(arena, run_start)
        if start > run_start:
            self._add_run(arena, run_start, start - run_start)
        if start + length < run_start + run_len:
            self._add_run(arena, start + length, run_start + run_len - start - length)
        arena.spans += 1
        self._empty.pop(arena.id, None)

    def _release(self, arena: _Arena, start: int, length: int) -> None:
        """Return ``[start, start + length)`` of a span to the free runs."""
        self._add_free(arena, start, length)
        arena.spans -= 1
        if not arena.spans:
            self._empty[arena.id] = None

    def _add_free(self, arena: _Arena, start: int, length: int) -> None:
        """Add ``[start, start + length)`` to the free runs, coalescing neighbours."""
        prev = arena.ends.get(start)
        if prev is not None:
            self._remove_run(arena, prev)
            length += start - prev
            start = prev
        if start + length in arena.runs:
            length += self._remove_run(arena, start + length)
        self._add_run(arena, start, length)

    def _add_run(self, arena: _Arena, start: int, length: int) -> None:
        arena.runs[start] = length
        arena.ends[start + length] = start
        bisect.insort(arena.starts, start)
        runs = self._by_len.get(length)
        if runs is None:
            runs = self._by_len[length] = {}
            bisect.insort(self._lens, length)
        runs[(arena.id, start)] = None

    def _remove_run(self, arena: _Arena, start: int) -> int:
        length = arena.runs.pop(start)
        del arena.ends[start + length]
        del arena.starts[bisect.bisect_left(arena.starts, start)]
        runs = self._by_len[length]
        del runs[(arena.id, start)]
        if not runs:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]
        return length


class SlabBudget:
    """Capacity of a tier whose space a :class:`SlabAllocator` (``self._alloc``) carves.

    Mixed in before :class:`~hybridstore.backends.base.Tier`: the budget, the
    slot bytes in use, and the slot an object of ``nbytes`` is charged.
    """

    _alloc: SlabAllocator

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Slot bytes of live (and held-but-dropped) objects."""
        return self._alloc.used_bytes

    def charge(self, nbytes: int) -> int:
        return self._alloc.slot_size(nbytes)


def _cheapest_window(spans: list[tuple[int, int, list[Extent]]], size: int, length: int,
                     align: int, movable: Callable[[Extent], bool]
                     ) -> tuple[int, int, list[Extent]] | None:
    """:meth:`SlabAllocator.window_at` in one arena of ``size`` bytes: ``spans`` are its
    occupied intervals ``(start, end, live extents)``, sorted and disjoint.  A sliding
    window over the aligned starts next to each interval (and 0): ``O(k log k)``."""
    cost = [sum(x.length for x in ext) for _, _, ext in spans]
    blocked = [not all(movable(x) for x in ext) for _, _, ext in spans]
    csum, bsum = [0], [0]
    for c, b in zip(cost, blocked):
        csum.append(csum[-1] + c)
        bsum.append(bsum[-1] + b)
    starts = [s for s, _, _ in spans]
    ends = [e for _, e, _ in spans]
    cands = {0}
    for s, e, _ in spans:
        cands.add(s - s % align)
        cands.add(-(-e // align) * align)
    best: tuple[int, int, int, int] | None = None  # (cost, first span, last span + 1, start)
    for w in sorted(cands):
        if w + length > size:
            break
        i = bisect.bisect_right(ends, w)            # first span ending after w
        j = bisect.bisect_left(starts, w + length)  # spans from i to j overlap the window
        if bsum[j] - bsum[i]:
            continue
        c = csum[j] - csum[i]
        if best is None or c < best[0]:
            best = (c, i, j, w)
            if not c:
                break
    if best is None:
        return None
    return best[0], best[3], [x for _, _, ext in spans[best[1]:best[2]] for x in ext]
