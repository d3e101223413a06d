"""The load path: one ``store.load(plan)``, from the fastest tier holding each object.

A load is planned under the store lock (:meth:`Loader.prepare`: the buffers are
checked, the source tier of every object chosen and its slots pinned on a
``zero_copy`` tier) and run on the store's I/O thread (:meth:`Loader.run`):
reads from byte tiers go into one aligned arena, a tier's reads at once
(``read_many_into``: the disk tier reads neighbours in one I/O), then a
page-major batch is filled with one gather per layout entry, or each object is
copied out or unpacked.  The pins are dropped when it ends, whatever happens.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np

from hybridstore.backends.gather import gather_rows
from hybridstore.backends.transfer import rows_to_device, synchronize
from hybridstore.errors import (
    BackendIOError,
    CorruptObjectError,
    HybridStoreError,
    LayoutMismatchError,
    PlanReleasedError,
)
from hybridstore.index.trie import ResumePlan
from hybridstore.layout import Layout, Target, copy_out
from hybridstore.objects import (
    ALIGN,
    TIER_BITS,
    KeyBatch,
    ObjectKey,
    ObjectKind,
    aligned_empty,
    key_kind,
    object_key,
)
from hybridstore.store.residency import Residency

Job = tuple[ObjectKey, ObjectKind]
"""One object of a load: its key and kind (the plan's pages in order, then its checkpoint)."""


def is_batch(pages: Any) -> bool:
    """Whether ``into``'s pages are one page-major batch (a tensor/array, or a dict of
    them) rather than a sequence of per-page buffers."""
    return isinstance(pages, Mapping) or hasattr(pages, "shape")


class Loader:
    """Loads of one store.

    Args:
        residency: the store's record of who holds what.
        layouts: the store's page and checkpoint layouts.
        lock: the store lock (taken to forget an object found corrupt).
    """

    def __init__(self, residency: Residency, layouts: dict[ObjectKind, Layout],
                 lock: threading.RLock) -> None:
        self.res = residency
        self.layouts = layouts
        self._lock = lock
        self.loaded_bytes = {name: 0 for name in residency.tiers}
        self.corrupt = 0
        """Objects found corrupt by loads (each is dropped from its tier)."""

    # -- under the store lock ---------------------------------------------------------
    def check_into(self, plan: ResumePlan, into: tuple[Any, Any],
                   skip_pages: int = 0) -> list[list[Target]]:
        """The matched buffers of every object of the plan; raises on a mismatch.

        ``into``'s pages may be ``None`` when every page is skipped (``skip_pages``).

        For a page-major batch the first list holds one :class:`Target` per
        entry of the page layout (``host``: its ``(rows, nbytes)`` byte view).
        """
        page_bufs, state_buf = into
        n = len(plan.pages)
        if page_bufs is None and skip_pages >= n:      # the checkpoint only
            out: list[list[Target]] = [[] for _ in range(n)]
            if plan.state_key is not None:
                out.append(self.layouts[ObjectKind.STATE].targets(state_buf))
            return out
        if is_batch(page_bufs):
            out = [self.layouts[ObjectKind.PAGE].batch_targets(page_bufs, n) if n else []]
            if plan.state_key is not None:
                out.append(self.layouts[ObjectKind.STATE].targets(state_buf))
            return out
        if not isinstance(page_bufs, (list, tuple)):
            raise LayoutMismatchError(
                f"into's pages are a {type(page_bufs).__name__}; pass a list of page buffers "
                "or one page-major batch (a tensor, array or dict of them)")
        if len(page_bufs) < n:
            raise LayoutMismatchError(
                f"into has {len(page_bufs)} page buffers; the plan restores {n}")
        out = [self.layouts[ObjectKind.PAGE].targets(buf) for buf in page_bufs[:n]] if n else []
        if plan.state_key is not None:
            out.append(self.layouts[ObjectKind.STATE].targets(state_buf))
        return out

    def prepare(self, plan: ResumePlan, skip: Sequence[str],
                skip_pages: int = 0) -> tuple[list[Job], list[str | None]]:
        """The objects of ``plan`` and the tier each is read from (``None``: skipped, as
        are its first ``skip_pages`` pages), with their slots pinned on ``zero_copy`` tiers
        until :meth:`release_sources`."""
        page_keys = KeyBatch.of(ObjectKind.PAGE, plan.page_blob).keys()
        jobs: list[Job] = [(okey, ObjectKind.PAGE) for okey in page_keys]
        k = min(skip_pages, len(page_keys))     # pages the engine holds: never pinned or read
        sources = [None] * k + self._page_sources(plan.pages[k:], page_keys[k:], skip)
        if plan.state_key is not None:
            try:
                jobs.append((object_key(ObjectKind.STATE, plan.state_key), ObjectKind.STATE))
                sources.append(self._source(jobs[-1][0], skip))
            except BaseException:
                self.release_sources(jobs, sources)   # the pool slots held for this load
                raise
        return jobs, sources

    def _page_sources(self, pages: np.ndarray, okeys: list[ObjectKey],
                      skip: Sequence[str]) -> list[str | None]:
        """:meth:`_source` of every page (node ids ``pages``, object keys ``okeys``), from the
        index's tier masks at once; the pages read from a ``zero_copy`` tier are pinned with
        one ``pin_many`` per tier."""
        n = len(okeys)
        if not n:
            return []
        res = self.res
        tiers = res.index.page_columns(pages)["tiers"]
        rank = np.full(n, -1, np.int64)
        for r, name in enumerate(res.chain):
            rank[(rank < 0) & ((tiers & TIER_BITS[name]) != 0)] = r
        if (rank < 0).any():      # the index lost a page of a live plan: _source says how
            return [self._source(okey, skip) for okey in okeys]
        names = np.array([None if name in skip else name for name in res.chain], object)
        sources: list[str | None] = names[rank].tolist()
        held: list[str | None] = [None] * n   # what this call holds, released if it fails part-way
        try:
            for r, name in enumerate(res.chain):
                tier = res.tiers[name]
                if name in skip:
                    continue
                here = np.flatnonzero(rank == r).tolist()
                if tier.zero_copy:
                    try:
                        tier.pin_many([okeys[i] for i in here])
                        for i in here:
                            held[i] = name
                        continue
                    except KeyError:  # index and pool disagree: _source finds what is there
                        pass
                for i in here:        # a byte tier: checked one by one (its reads cost more)
                    if not tier.zero_copy and tier.contains(okeys[i]):
                        continue
                    sources[i] = held[i] = self._source(okeys[i], skip)
        except BaseException:
            self.release_sources([(k, ObjectKind.PAGE) for k in okeys], held)
            raise
        return sources

    def _source(self, okey: ObjectKey, skip: Sequence[str] = ()) -> str | None:
        """The fastest tier holding ``okey``, its slot pinned (``None``: that tier is skipped)."""
        for name in self.res.chain:
            tier = self.res.tiers[name]
            if tier.contains(okey):
                if name in skip:
                    return None
                if tier.zero_copy:
                    tier.pin_many([okey])
                return name
        raise CorruptObjectError(f"object {okey.hex()} of a live plan is in no tier", key=okey)

    def release_sources(self, jobs: Sequence[Job], sources: Sequence[str | None]) -> None:
        """Drop the pins :meth:`prepare` took for a load."""
        held: dict[str, list[ObjectKey]] = {}
        for (okey, _), src in zip(jobs, sources):
            if src is not None and self.res.tiers[src].zero_copy:
                held.setdefault(src, []).append(okey)
        for name, keys in held.items():
            self.res.tiers[name].unpin_many(keys)

    # -- on the I/O thread ------------------------------------------------------------
    def _needs_buffer(self, src: str | None, has_into: bool) -> bool:
        """Whether a load needs a buffer of its own for an object read from ``src``."""
        if src is None:
            return False
        tier = self.res.tiers[src]
        if tier.zero_copy:
            return not has_into          # copied out of the slot, never handed out
        return tier.stores_bytes         # read from a byte tier into it

    def run(self, plan: ResumePlan, jobs: list[Job], sources: list[str | None],
            into: tuple[Any, Any] | None, targets: list[list[Target]] | None,
            plans: Sequence[ResumePlan] = ()) -> tuple[Any, Any]:
        """Read, gather and copy out the objects of a prepared load; releases its pins.

        ``plans`` are the plans whose objects are read (``(plan,)`` when empty): a plan
        released before its load ran, its objects evicted, fails the load with
        :class:`~hybridstore.errors.PlanReleasedError` (match again)."""
        plans = plans or (plan,)
        tiers = self.res.tiers
        outputs: list[Any] = []
        bufs: list[np.ndarray | None] = []
        devices: set[Any] = set()          # CUDA devices with copies from pool slots in flight
        # A page-major batch: page i is row i, restored by one gather per entry below.
        batch = into is not None and is_batch(into[0])
        n_batch = len(plan.pages) if batch else 0
        rows: dict[str | None, tuple[list[ObjectKey], list[int]]] = {}   # by tier (None: own reads)
        # One 4 KiB-aligned arena for every object that needs a buffer of its own (reads from
        # a byte tier, or copies out of a pool slot when there is no `into`), instead of one
        # allocation per object: plans run to thousands of pages.
        try:
            own = [self._needs_buffer(src, into is not None) for src in sources]
            # Objects read from a byte tier straight into the caller's host buffer (no arena,
            # no copy out): each is one whole-object buffer of a host array that several may
            # share (vLLM's primary tier: rows of one array), found by _direct_targets.
            direct = _direct_targets(jobs, sources, own, targets, n_batch, self.layouts,
                                     tiers) if into is not None and targets is not None else {}
            for i in direct:
                own[i] = False
            # Spaced like the tier's slots, so that pages written together are read back
            # with one I/O per run of neighbours (the disk tier's read_many_into).
            spacing: dict[tuple[ObjectKind, str], int] = {}   # depends on (kind, tier) only

            slots: dict[tuple[ObjectKind, str], int] = {}

            def slotted(kind: ObjectKind, src: str) -> int:
                size = slots.get((kind, src))
                if size is None:
                    size = slots[(kind, src)] = tiers[src].slot_bytes(self.layouts[kind].nbytes)
                return size

            def spaced(kind: ObjectKind, src: str) -> int:
                size = spacing.get((kind, src))
                if size is None:
                    nbytes = self.layouts[kind].nbytes
                    size = spacing[(kind, src)] = max(-(-nbytes // ALIGN) * ALIGN,
                                                      slotted(kind, src))
                return size

            sizes = [spaced(kind, src) if mine and src is not None else 0
                     for (_, kind), mine, src in zip(jobs, own, sources)]
            arena = aligned_empty(sum(sizes)) if any(own) else np.zeros(0, np.uint8)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            reads: dict[str, list[int]] = {}      # byte tiers: each tier's jobs read at once
            reads_direct: dict[tuple[str, int, int], tuple[np.ndarray, list[int], list[int]]] = {}
            for i, ((okey, kind), src) in enumerate(zip(jobs, sources)):
                layout = self.layouts[kind]
                if src is None:                   # skipped: resident in the engine's tier
                    bufs.append(None)
                    continue
                tier = tiers[src]
                own_buf = arena[offsets[i]: offsets[i] + layout.nbytes] if own[i] else None
                if i < n_batch:                   # gathered from the pool or the arena below
                    keys, at = rows.setdefault(None if own_buf is not None else src, ([], []))
                    keys.append(okey)
                    at.append(i)
                    if own_buf is not None:
                        reads.setdefault(src, []).append(i)
                    bufs.append(None)
                elif tier.zero_copy:
                    try:
                        view = tier.view(okey)
                    except KeyError as e:
                        raise self._left(plans, src, [okey], e) from e
                    if own_buf is not None:       # never hand out a pool slot
                        own_buf[:] = view[: layout.nbytes]
                        view = own_buf
                    bufs.append(view)
                elif own_buf is not None:
                    reads.setdefault(src, []).append(i)
                    bufs.append(own_buf)
                elif i in direct:
                    root, place = direct[i]
                    # objects whose slot spans more than them are read one by one: a read of
                    # neighbours would land the slot padding between their destinations
                    alone = slotted(kind, src) != layout.nbytes
                    group = reads_direct.setdefault((src, id(root), i if alone else -1),
                                                    (root, [], []))
                    group[1].append(i)
                    group[2].append(place)
                    bufs.append(None)
                else:
                    bufs.append(None)
                self.loaded_bytes[src] += layout.nbytes
            calls = [(name, idx, arena, [offsets[i] for i in idx]) for name, idx in reads.items()]
            calls += [(name, idx, root, at)
                      for (name, _, _), (root, idx, at) in reads_direct.items()]
            self._read(calls, jobs, plans)
            if batch and targets is not None and rows:
                try:
                    self.gather_batch(rows, arena, offsets, targets[0], n_batch)
                except KeyError as e:         # a pool slot's key (locate)
                    raise self._left(plans, "", [], e) from e
            for i, ((okey, kind), buf) in enumerate(zip(jobs, bufs)):
                if i < n_batch:
                    continue
                if i in direct:
                    assert into is not None
                    outputs.append(into[0][i] if kind == ObjectKind.PAGE else into[1])  # in place
                    continue
                if buf is None:
                    outputs.append(None)
                    continue
                if into is not None and targets is not None:
                    for target in targets[-1 if batch else i]:
                        copy_out(target, buf)
                        if target.host is None:          # a CUDA buffer: an async H2D copy
                            devices.add(target.buffer.device)
                    outputs.append(into[0][i] if kind == ObjectKind.PAGE else into[1])
                else:
                    outputs.append(self.layouts[kind].unpack(buf))
        finally:
            # an H2D copy from a pinned slot is asynchronous: the slot must outlive it
            synchronize(devices)
            self.release_sources(jobs, sources)
        if into is not None and batch:
            return into[0], (outputs[-1] if plan.state_key is not None else None)
        if plan.state_key is None:
            return outputs, None
        return outputs[:-1], outputs[-1]

    def run_rows(self, jobs: list[Job], sources: list[str | None], rows: np.ndarray,
                 at: Sequence[int], plans: Sequence[ResumePlan]) -> None:
        """Read the pages of a prepared load into rows of the caller's host array, on the
        calling thread (:meth:`~hybridstore.HybridStore.load_rows`); releases its pins.

        ``rows`` is the array's ``(rows, nbytes)`` byte view (``Layout.rows_bytes``) and
        page ``i`` lands in row ``at[i]``.  Each byte tier reads its pages with one
        ``read_many_into`` straight into the rows (neighbours spaced like their slots in
        one I/O); a page in the pinned pool is copied out of its slot.
        """
        tiers = self.res.tiers
        flat = rows.reshape(-1)
        size = rows.shape[1]
        groups: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        # per byte tier: whether a page's slot spans more than the page; such a page is
        # read alone, as a read of its neighbours would land the padding on the next row
        alone: dict[str, bool] = {}
        try:
            for i, ((okey, _), src) in enumerate(zip(jobs, sources)):
                if src is None:
                    continue
                tier = tiers[src]
                if tier.zero_copy:
                    try:
                        view = tier.view(okey)
                    except KeyError as e:
                        raise self._left(plans, src, [okey], e) from e
                    rows[at[i]] = view[:size]
                elif tier.stores_bytes:
                    if src not in alone:
                        alone[src] = tier.slot_bytes(size) != size
                    idx, offsets = groups.setdefault((src, i if alone[src] else -1), ([], []))
                    idx.append(i)
                    offsets.append(at[i] * size)
                self.loaded_bytes[src] += size
            self._read([(src, idx, flat, offsets) for (src, _), (idx, offsets) in groups.items()],
                       jobs, plans)
        finally:
            self.release_sources(jobs, sources)

    def _read(self, calls: list[tuple[str, list[int], np.ndarray, list[int]]], jobs: list[Job],
              plans: Sequence[ResumePlan]) -> None:
        """Run ``calls`` (a byte tier, the jobs it reads, where they land: one
        ``read_many_into`` each) at once and wait for every one: the first error is raised
        once none is still writing into the destinations."""
        tiers = self.res.tiers
        waits: list[tuple[str, list[int], Future]] = []
        error: BaseException | None = None
        for name, idx, dst, at in calls:
            okeys = [jobs[i][0] for i in idx]
            try:
                waits.append((name, idx, tiers[name].read_many_into(okeys, dst, at)))
            except KeyError as e:
                error = self._left(plans, name, okeys, e)
                error.__cause__ = e
                break
        for name, idx, fut in waits:
            try:
                fut.result()
            except (CorruptObjectError, BackendIOError) as e:   # a remote tier drops on both
                self._forget_dropped(name, [jobs[i][0] for i in idx])
                error = error or e
            except BaseException as e:  # noqa: BLE001 - raised below, once all are done
                error = error or e
        if error is not None:
            raise error

    def _left(self, plans: Sequence[ResumePlan], src: str, okeys: list[ObjectKey],
              error: KeyError) -> HybridStoreError:
        """The error of a load whose object ``error.args[0]`` left tier ``src`` before it
        was read: a plan released while its load was queued, the object then evicted
        (:class:`PlanReleasedError`), or, the plans live, evicted by another process
        that shares the tier (:class:`CorruptObjectError`; the objects of ``okeys`` it
        dropped are forgotten)."""
        key = bytes(error.args[0]) if error.args else b""
        with self._lock:
            released = [p for p in plans if not self.res.index.is_live(p)]
        if released:
            return PlanReleasedError(
                f"plan {released[0].plan_id} was released before its load ran, and object "
                f"{key.hex()} of it was evicted meanwhile; release a plan only once its "
                "load's future is done, or match again and load the new plan")
        if okeys:
            self._forget_dropped(src, okeys)
        where = f"the {src} tier" if src else "its tier"
        return CorruptObjectError(f"object {key.hex()} of the plan left {where} before it was "
                                  "read (evicted by another process that shares it); match "
                                  "again", key=key)

    def _forget_dropped(self, src: str, okeys: list[ObjectKey]) -> None:
        """After a read of ``okeys`` from ``src`` failed its checksums, forget in the index
        every object the tier dropped: one I/O may cover several corrupt neighbours, and
        the exception names only the first (a forgotten drop would leave the prefix
        matched but unloadable for good)."""
        tier = self.res.tiers[src]
        with self._lock:
            for okey in okeys:
                if not tier.contains(okey):
                    before = self.res.objects[src]
                    self.res.forget(okey, src, self.layouts[key_kind(okey)].nbytes)
                    self.corrupt += before - self.res.objects[src]

    def gather_batch(self, rows: dict[str | None, tuple[list[ObjectKey], list[int]]],
                     arena: np.ndarray | None, offsets: list[int], targets: list[Target],
                     n: int) -> None:
        """Fill the rows of a page-major batch: one gather per layout entry over every
        page, from the pool's arenas (``rows[tier]``) and the load's own reads
        (``rows[None]``, at ``offsets`` in ``arena``).  A device batch is staged in pinned
        host rows, copied and synchronised (``backends/transfer.py``): nothing is left in
        flight."""
        sources: list[np.ndarray] = []
        which, where, at = [], [], []
        for name, (keys, idx) in rows.items():
            if name is None:
                assert arena is not None
                part = [arena], np.zeros(len(idx), np.int64), np.asarray(
                    [offsets[i] for i in idx], np.int64)
            else:
                part = self.res.tiers[name].locate(keys)
            which.append(part[1] + len(sources))
            sources += part[0]
            where.append(part[2])
            at.append(np.asarray(idx, np.int64))
        w, o, r = np.concatenate(which), np.concatenate(where), np.concatenate(at)
        for target in targets:
            spec = target.spec
            if target.host is not None:
                gather_rows(sources, w, o, r, spec.offset, spec.nbytes, target.host)
                continue
            # A GPU batch: gather into pinned host rows, then one async H2D copy per run
            # of filled rows (rows skipped because the engine holds them stay untouched).
            rows_to_device(target.buffer, n, spec.nbytes,
                           partial(_gather_into, sources, w, o, r, spec.offset, spec.nbytes), r)


def _gather_into(sources: list[np.ndarray], which: np.ndarray, offsets: np.ndarray,
                 rows: np.ndarray, entry_offset: int, nbytes: int, dst: np.ndarray) -> None:
    """:func:`~hybridstore.backends.gather.gather_rows` with the destination last."""
    gather_rows(sources, which, offsets, rows, entry_offset, nbytes, dst)


def _direct_targets(jobs: list[Job], sources: list[str | None], own: list[bool],
                    targets: list[list[Target]], n_batch: int, layouts: dict[ObjectKind, Layout],
                    tiers: Mapping[str, Any]) -> dict[int, tuple[np.ndarray, int]]:
    """The objects of a load that a byte tier can read straight into the caller's buffer.

    An object qualifies when it would be read into a buffer of the load's own
    (``own``), is not a row of a page-major batch, and its one target is a host
    view of the whole object that lies inside a C-contiguous host array; the
    result maps its job to that array (as flat bytes) and the byte offset there.
    Objects whose destinations are spaced like their slots are read with one
    I/O (``read_many_into``) where the slot is exactly the object; the others are
    read alone (:meth:`Loader.run`).
    """
    out: dict[int, tuple[np.ndarray, int]] = {}
    roots: dict[int, np.ndarray] = {}
    for i, ((_, kind), src) in enumerate(zip(jobs, sources)):
        if not own[i] or i < n_batch or src is None or i >= len(targets):
            continue
        layout = layouts[kind]
        found = targets[i]
        if len(found) != 1 or found[0].host is None or found[0].spec.offset != 0 \
                or found[0].spec.nbytes != layout.nbytes:
            continue
        view = found[0].host
        root = view
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous or not root.flags.writeable:
            continue
        flat = roots.get(id(root))
        if flat is None:
            flat = roots[id(root)] = root.reshape(-1).view(np.uint8)
        at = view.__array_interface__["data"][0] - flat.__array_interface__["data"][0]
        if 0 <= at and at + layout.nbytes <= flat.nbytes:
            out[i] = (flat, at)
    return out
