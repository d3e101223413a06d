"""``HybridStore``: the public facade over index, policies and tiers.

The engine contract (ARCHITECTURE.md):

1. ``plan = store.match(prompt)`` — deepest complete resume point, pinned;
2. ``store.load(plan, into=...)`` — a future; restores the pages and the one
   checkpoint from whichever tier holds them;
3. the engine prefills from ``plan.position``, asks
   ``store.checkpoint_positions(...)`` where to capture states, then calls
   ``put_kv(...)`` for new pages and ``put_state(...)`` for captured states;
4. ``store.release(plan)``.  Eviction and tier moves happen under capacity
   pressure, as the policies rank.

Objects are written into the pinned host pool first; with
``tier_policy="write-through"`` every object is also written to the disk tier
in the background (it becomes visible there once durable), with
``"write-back"`` only when DRAM evicts it (``policy/tiering.py`` has the rest).  All public methods are
thread-safe: index and policy work happens under one lock, byte copies and
disk I/O outside it, protected by pins and host-slot references.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridstore.backends.base import Tier, done_future
from hybridstore.backends.gather import gather_rows, scatter_rows
from hybridstore.backends.host import HostPool
from hybridstore.config import StoreConfig
from hybridstore.errors import (
    CapacityError,
    CorruptObjectError,
    HybridStoreError,
    InvalidTokensError,
    LayoutMismatchError,
    MisalignedPageError,
    ObjectTooLargeError,
    PlanReleasedError,
    StoreClosedError,
    UnknownTierError,
)
from hybridstore.index import keys as K
from hybridstore.index import meta as M
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import Checkpoint, HybridIndex, ResumePlan
from hybridstore.layout import Layout, Target, batch_row, batch_rows, copy_out
from hybridstore.objects import ALIGN, TIER_BITS, TIER_ORDER, KeyBatch, ObjectKey, ObjectKind, aligned_empty, object_key
from hybridstore.policy import admission_policy, eviction_policy
from hybridstore.policy.base import (
    AdmissionPolicy,
    EvictionPolicy,
    PlacementPolicy,
    ResidenceStats,
    Victim,
)
from hybridstore.policy.placement import RequestEnd
from hybridstore.policy.tiering import tier_policy

log = logging.getLogger(__name__)

_DONE: Future = done_future()

REUSE_RANKING_OBJECTS = 512
"""Tiers holding at least this many objects reuse an eviction ranking (see ``_evict``)."""

_LAYOUT_INFO = {ObjectKind.PAGE: "layout.page", ObjectKind.STATE: "layout.state"}


_NO_PAGES = np.zeros(0, np.int64)
_NO_PAGES.flags.writeable = False


_Scatter = Callable[[int, int, tuple[list[np.ndarray], np.ndarray, np.ndarray]], None]
"""``scatter(i0, i1, (arenas, which, offsets))``: pages ``i0..i1-1`` of a put into pool slots."""


def _is_batch(pages: Any) -> bool:
    """Whether ``into``'s pages are one page-major batch (a tensor/array, or a dict of
    them) rather than a sequence of per-page buffers."""
    return isinstance(pages, Mapping) or hasattr(pages, "shape")


class _Victims:
    """A policy's victim order that takes victims back: an eviction that took a run of
    pages and stopped inside it leaves the rest where a reused ranking resumes."""

    __slots__ = ("_it", "_back")

    def __init__(self, victims: Iterator[Victim]) -> None:
        self._it = victims
        self._back: list[Victim] = []

    def __iter__(self) -> _Victims:
        return self

    def __next__(self) -> Victim:
        if self._back:
            return self._back.pop()
        return next(self._it)

    def push_back(self, victims: Sequence[Victim]) -> None:
        """Return ``victims`` (in their order) to the front of the order."""
        self._back.extend(reversed(victims))


class HybridStore:
    """Prefix cache of a hybrid model across GPU memory, pinned DRAM and SSD.

    Args:
        config: the store's configuration (``StoreConfig()`` when omitted).
        tiers: tiers to use instead of the ones ``config`` describes, by name
            (``"device"``, ``"host"``, ``"disk"``); the simulator passes
            accounting-only tiers here.
        placement: where :meth:`checkpoint_positions` asks the engine to
            capture states (request end and anchors by default).
        eviction, admission: policy instances that override ``config.policy``
            and ``config.checkpoint_policy`` (for policies with parameters,
            e.g. a model's prefill cost).

    Example::

        cfg = StoreConfig(block_size=16, host_bytes=256 << 20, disk_path="/nvme/hs")
        with HybridStore(cfg) as store:
            store.put_kv(tokens[:32], pages)        # the two pages of blocks 0 and 1
            store.put_state(tokens[:40], state)     # checkpoint at position 40
            plan = store.match(query)
            pages, state = store.load(plan).result()
            store.release(plan)
    """

    def __init__(self, config: StoreConfig | None = None, *, tiers: dict[str, Tier] | None = None,
                 placement: PlacementPolicy | None = None, eviction: EvictionPolicy | None = None,
                 admission: AdmissionPolicy | None = None) -> None:
        self.config = cfg = config or StoreConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._eviction = eviction or eviction_policy(cfg.policy)
        self._admission = admission or admission_policy(cfg.checkpoint_policy)
        self._placement = placement or RequestEnd()
        self._tiering = tier_policy(cfg.tier_policy)
        self.residence = ResidenceStats()
        self._root = K.namespace_root(cfg.namespace)
        self.index = HybridIndex(cfg.block_size, self._root)
        self.tiers: dict[str, Tier] = dict(tiers) if tiers is not None else self._open_tiers(cfg)
        for name in self.tiers:
            if name not in TIER_BITS:
                raise UnknownTierError(f"unknown tier {name!r}; tiers are {list(TIER_BITS)}")
        self._layouts: dict[ObjectKind, Layout] = {}
        self._chain = [name for name in TIER_ORDER if name in self.tiers]
        self._admission.bind(free_bytes=lambda: self._room(self._chain[0], ObjectKind.STATE),
                             tier=self._chain[0])
        self._pending: dict[tuple[bytes, str], Future] = {}   # (key, target tier) -> copy
        self._inflight: Counter[bytes] = Counter()             # copies in flight per key
        self._completed: deque[tuple[bytes, str, Future]] = deque()
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hybridstore-load")
        self._counters = {"matches": 0, "hit_tokens": 0, "query_tokens": 0, "loads": 0,
                          "evictions": 0, "corrupt": 0}
        self._loaded_bytes = {name: 0 for name in self.tiers}
        self._kind_bytes = {name: dict.fromkeys(ObjectKind, 0) for name in self.tiers}
        self._objects = dict.fromkeys(self.tiers, 0)      # objects held per tier
        self._rankings: dict[tuple[str, ObjectKind | None], tuple[_Victims, int]] = {}
        if "disk" in self.tiers and self.tiers["disk"].durable:
            self._reopen()

    # -- construction ---------------------------------------------------------------
    @staticmethod
    def _open_tiers(cfg: StoreConfig) -> dict[str, Tier]:
        tiers: dict[str, Tier] = {}
        if cfg.device_bytes:
            from hybridstore.backends.device import DeviceTier

            tiers["device"] = DeviceTier(cfg.device_bytes)
        tiers["host"] = HostPool(cfg.host_bytes, pin=cfg.pin_host_memory, h2d_gbps=cfg.h2d_gbps)
        if cfg.disk_path is not None:
            from hybridstore.backends.disk import DiskTier

            try:
                tiers["disk"] = DiskTier(cfg.disk_path, cfg.disk_bytes, engine=cfg.disk_engine,
                                         segment_bytes=cfg.disk_segment_bytes,
                                         io_threads=cfg.io_threads, ssd_gbps=cfg.ssd_gbps,
                                         h2d_gbps=cfg.h2d_gbps,
                                         verify_checksums=cfg.verify_checksums)
            except BaseException:
                tiers["host"].close()
                raise
        return tiers

    def _reopen(self) -> None:
        """Make every object the disk tier kept matchable again (pages first)."""
        disk = self.tiers["disk"]
        for kind in (ObjectKind.PAGE, ObjectKind.STATE):
            raw = disk.get_info(_LAYOUT_INFO[kind])
            if raw is not None:
                self._layouts[kind] = Layout.from_json(raw)
        states = []
        for key, nbytes, meta in disk.entries():
            info = M.decode(meta)
            if isinstance(info, M.PageMeta):
                self.index.restore_page(key[1:], info.block, info.ntok, info.parent_key, "disk", nbytes)
            else:
                states.append((key, nbytes, info))
        for key, nbytes, info in states:
            self.index.restore_checkpoint(key[1:], info.position, info.base_key, info.covers,
                                          "disk", nbytes)

    # -- keys -------------------------------------------------------------------------
    def prefix(self, tokens: Any) -> PrefixKeys:
        """Hash a prompt once; every call below also accepts the result."""
        if isinstance(tokens, PrefixKeys):
            return tokens
        return PrefixKeys.from_tokens(tokens, block_size=self.config.block_size, root=self._root)

    def prefix_from_block_ids(self, block_ids: Sequence[int] | np.ndarray,
                              length: int | None = None) -> PrefixKeys:
        """A prompt given as already-hashed block ids (as traces carry them)."""
        return PrefixKeys.from_block_ids(block_ids, block_size=self.config.block_size,
                                         root=self._root, length=length)

    # -- put ----------------------------------------------------------------------------
    def put_kv(self, tokens: Any, pages: Any) -> int:
        """Store KV pages of the blocks that end at ``len(tokens)``.

        Args:
            tokens: the prompt up to the end of the last page (token ids or a
                :class:`PrefixKeys`).  Its length is a block end, or the end of
                the final partial block.
            pages: one page (a tensor/array or dict of them: the block that
                ends at ``len(tokens)``), or a list of pages for consecutive
                blocks ending there.

        Returns:
            The number of pages newly stored (pages already held are touched).
        """
        prompt = self.prefix(tokens)
        batch = list(pages) if isinstance(pages, (list, tuple)) else [pages]
        first = self._first_block(prompt, len(batch))
        with self._lock:
            self._check_open()
            self._drain()
            layout = self._layout(ObjectKind.PAGE, batch[0], "page")
            for page in batch[1:]:
                layout.check(page, "page")
            return self._put_pages(prompt, first, layout.nbytes,
                                   lambda i, slot: layout.pack_into(batch[i], slot))

    def put_kv_batch(self, tokens: Any, batch: Any, *, count: int | None = None) -> int:
        """Store the KV pages of consecutive blocks ending at ``len(tokens)`` from one
        page-major batch (the layout ``load(plan, into=(batch, state))`` fills).

        New pages land in the pinned pool a run at a time: slots for the run are
        reserved together (the tier's ``stage_many``) and each layout entry
        of the whole run is one scatter of batch rows into them
        (``native/_gather.c``), instead of a Python copy per page.  A GPU batch
        is copied to host one run at a time first.

        Args:
            tokens: the prompt up to the end of the last page (token ids or a
                :class:`PrefixKeys`), as for :meth:`put_kv`.
            batch: one tensor/array, or a dict of them, whose first dimension
                indexes pages: row ``i`` of every entry is the page of block
                ``nblocks - count + i``.  Every entry is contiguous.
            count: pages to store (the batch's first ``count`` rows); defaults
                to all its rows.

        Returns:
            The number of pages newly stored (pages already held are touched).

        Raises:
            LayoutMismatchError: the batch's rows do not have the store's page
                layout, its entries disagree in rows, or one is not contiguous
                (nothing is stored).
            MisalignedPageError: more pages than the prompt has blocks.
        """
        prompt = self.prefix(tokens)
        rows = batch_rows(batch)
        n = rows if count is None else count
        if not 0 < n <= rows:
            raise MisalignedPageError(f"count={count} pages, but the batch has {rows} rows; "
                                      "pass 1 <= count <= rows")
        first = self._first_block(prompt, n)
        with self._lock:
            self._check_open()
            self._drain()
            layout = self._layout(ObjectKind.PAGE, batch_row(batch, 0), "page")
            targets = layout.batch_targets(batch, n)

            def scatter(i0: int, i1: int, slots: tuple[list[np.ndarray], np.ndarray, np.ndarray]) -> None:
                arenas, which, offsets = slots
                for target in targets:
                    src, at = target.host, np.arange(i0, i1, dtype=np.int64)
                    if src is None:        # a GPU batch: this run's rows to host first
                        import torch

                        src = target.buffer[i0:i1].reshape(i1 - i0, -1).view(torch.uint8).cpu().numpy()
                        at = at - i0
                    scatter_rows(arenas, which, offsets, at, target.spec.offset,
                                 target.spec.nbytes, src)

            return self._put_pages(prompt, first, layout.nbytes,
                                   lambda i, slot: layout.pack_into(batch_row(batch, i), slot),
                                   scatter)

    def put_kv_sized(self, tokens: Any, *, nbytes: int, first_block: int = 0) -> int:
        """Record pages by size only (accounting tiers: the trace simulator).

        Args:
            tokens: the prompt (token ids, or :class:`PrefixKeys` from block ids).
            nbytes: bytes of one page.
            first_block: the first block to record; every later block of the
                prompt is recorded too.
        """
        prompt = self.prefix(tokens)
        with self._lock:
            self._check_open()
            self._drain()
            return self._put_pages(prompt, first_block, nbytes, None)

    def _first_block(self, prompt: PrefixKeys, npages: int) -> int:
        if prompt.length == 0:
            raise MisalignedPageError("put_kv got an empty prefix; pass the tokens up to the page's end")
        first = prompt.nblocks - npages
        if first < 0:
            raise MisalignedPageError(
                f"{npages} pages do not fit in {prompt.length} tokens of {self.config.block_size}-token "
                "blocks; pass the tokens up to the end of the last page")
        return first

    def _put_pages(self, prompt: PrefixKeys, first: int, nbytes: int,
                   pack: Callable[[int, np.ndarray], None] | None,
                   scatter: _Scatter | None = None) -> int:
        """Store blocks ``first..`` of ``prompt``: runs of held pages are touched, runs of
        new pages land together (:meth:`_land_pages`).  Returns the pages newly stored.

        ``pack(i, slot)`` writes page ``i`` (block ``first + i``) into one slot;
        ``scatter(i0, i1, slots)``, when given, writes pages ``i0..i1-1`` into the
        pool slots ``slots`` (the tier's ``stage_many``) at once."""
        stop = prompt.nblocks
        pos, stored = first, 0
        held = self.index.held_tiers(prompt, first, stop) != 0
        while pos < stop:
            rest = held[pos - first:]
            change = np.flatnonzero(rest != rest[0])
            end = pos + (int(change[0]) if change.size else stop - pos)
            if rest[0]:
                self.index.add_pages(prompt, pos, end, None, nbytes)
            else:
                evictions = self._counters["evictions"]
                stored += self._land_pages(prompt, pos, end, nbytes, pack, first, scatter)
                if self._counters["evictions"] != evictions and end < stop:
                    # Making room may have evicted pages of the runs still to come.
                    held[end - first:] = self.index.held_tiers(prompt, end, stop) != 0
            pos = end
        return stored

    def _land_pages(self, prompt: PrefixKeys, a: int, b: int, nbytes: int,
                    pack: Callable[[int, np.ndarray], None] | None, first: int,
                    scatter: _Scatter | None = None) -> int:
        """Land the new pages of blocks ``a..b-1`` in the fastest tier and index them.

        Room is made for a run at a time (at most an eighth of the tier, so that
        one eviction pass serves it); an accounting tier records the run in one
        call, the pinned pool takes it in one reservation and one ``scatter``
        when the caller gave one.  Pages landed before a failure are indexed
        before it propagates.
        """
        name = self._chain[0]
        tier = self.tiers[name]
        if pack is None and tier.stores_bytes:
            raise HybridStoreError("sized puts (no bytes) need accounting tiers; pass the tensors")
        charge = tier.charge(nbytes)
        okeys = KeyBatch.of(ObjectKind.PAGE, prompt.keys[a:b].astype("<u8", copy=False).tobytes())
        run = max(1, min(b - a, tier.capacity_bytes // 8 // max(charge, 1)))
        c = a
        while c < b:
            d = min(c + run, b)
            try:
                # The same room check for byte and accounting tiers, so that data mode
                # and the simulator evict alike (docs/replay.md: equal by construction).
                self._make_room(name, charge * (d - c), ObjectKind.PAGE)
            except CapacityError:
                if d - c == 1:
                    raise
                # Only room page by page: evicting may take this run's own
                # earlier pages (reclaimable until their checkpoint lands).
                run = 1
                continue
            landed = 0
            try:
                if scatter is not None and tier.stores_bytes:
                    keys = okeys[c - a:d - a].keys()
                    slots = self._retry(name, nbytes * len(keys),
                                        lambda: tier.stage_many(keys, nbytes))
                    try:
                        scatter(c - first, d - first, slots)
                    except BaseException:
                        tier.abort_many(keys)
                        raise
                    self._commit(name, keys, nbytes)
                    landed = d - c
                    self._kind_bytes[name][ObjectKind.PAGE] += charge * landed
                    self._objects[name] += landed
                elif tier.stores_bytes:
                    for k in range(c, d):
                        self._land(okeys[k - a], ObjectKind.PAGE, nbytes,
                                   lambda slot, i=k - first: pack(i, slot))  # type: ignore[misc]
                        landed += 1
                else:
                    keys = okeys[c - a:d - a]
                    self._retry(name, nbytes * len(keys), lambda: tier.put_many(keys, None, nbytes=nbytes))
                    landed = d - c
                    self._kind_bytes[name][ObjectKind.PAGE] += charge * landed
                    self._objects[name] += landed
            finally:
                if landed:
                    self.index.add_pages(prompt, c, c + landed, name, nbytes)
                    if self._writes_through(ObjectKind.PAGE):
                        B = self.config.block_size
                        metas = [M.encode_page(k, prompt.block_end(k) - k * B, prompt.key_before(k))
                                 for k in range(c, c + landed)]
                        for dst in self._chain[1:]:
                            self._copy_many(okeys[c - a:c - a + landed].keys(), ObjectKind.PAGE,
                                            nbytes, metas, name, dst)
            c = d
        return b - a

    def put_kv_page(self, tokens: Any, page: Any, *, end: int) -> int:
        """Store the page of the block ending at ``end`` of a longer prompt.

        Raises:
            MisalignedPageError: ``end`` is neither a block end nor the
                prompt's length.
        """
        prompt = self.prefix(tokens)
        B = self.config.block_size
        if not 0 < end <= prompt.length or (end % B and end != prompt.length):
            raise MisalignedPageError(
                f"a page must end at a multiple of block_size={B} or at the prompt's end "
                f"({prompt.length}); got end={end}. Round it to a block end.")
        if end == prompt.length:
            return self.put_kv(prompt, page)
        if prompt.tokens is not None:
            return self.put_kv(self.prefix(prompt.tokens[:end]), page)
        return self.put_kv(PrefixKeys(block_size=B, length=end, root=prompt.root,
                                      keys=prompt.keys[: end // B], tokens=None), page)

    def put_state(self, tokens: Any, state: Any, *, position: int | None = None) -> bool:
        """Store the recurrent-state checkpoint taken at ``position``.

        Args:
            tokens: the prompt (token ids or :class:`PrefixKeys`); tokens past
                ``position`` let the store link the checkpoint to the page of
                its block that continues past it.
            state: ``dict[str, tensor]`` (or one tensor) of all recurrent
                layers' states at ``position``.
            position: defaults to ``len(tokens)``; any token position, not
                only block ends.

        Returns:
            True when the checkpoint is held (False: the admission policy
            declined it).
        """
        prompt = self.prefix(tokens)
        p = self._state_position(prompt, position)
        with self._lock:
            self._check_open()
            self._drain()
            layout = self._layout(ObjectKind.STATE, state, "state")
            return self._put_state(prompt, p, layout.nbytes,
                                   lambda slot: layout.pack_into(state, slot))

    def put_state_sized(self, tokens: Any, *, nbytes: int, position: int | None = None) -> bool:
        """Record a checkpoint by size only (accounting tiers: the trace simulator)."""
        prompt = self.prefix(tokens)
        p = self._state_position(prompt, position)
        with self._lock:
            self._check_open()
            self._drain()
            return self._put_state(prompt, p, nbytes, None)

    @staticmethod
    def _state_position(prompt: PrefixKeys, position: int | None) -> int:
        p = prompt.length if position is None else position
        if not 0 < p <= prompt.length:
            raise InvalidTokensError(f"position {p} must be in 1..{prompt.length} (the prompt's length)")
        if prompt.key_at(p) is None:
            raise InvalidTokensError(
                f"position {p} is inside a block of a prompt given as block ids; pass token ids")
        return p

    def _put_state(self, prompt: PrefixKeys, p: int, nbytes: int,
                   pack: Callable[[np.ndarray], None] | None) -> bool:
        key16 = prompt.key_at(p)
        assert key16 is not None
        existing = self.index.checkpoint(key16)
        if existing is not None and existing.tiers:
            self.index.add_checkpoint(prompt, p, self._holder(existing.tiers), nbytes)
            return True
        if not self._admission.admit(self.index, p, nbytes, prompt=prompt):
            return False
        okey = object_key(ObjectKind.STATE, key16)
        self._land(okey, ObjectKind.STATE, nbytes, pack)
        ck = self.index.add_checkpoint(prompt, p, self._chain[0], nbytes)
        if self._writes_through(ObjectKind.STATE):
            self._placed(okey, ObjectKind.STATE, nbytes, self._state_meta(ck))
        if self._tiering.historical_to_ssd and ck.parent is not None:
            self._to_ssd(ck.parent)
        return True

    def _state_meta(self, ck: Checkpoint) -> bytes:
        base_key = self.index.root_key if ck.base == 0 else self.index.node_key(ck.base)
        return M.encode_state(ck.position, base_key, self.index.cover_keys(ck))

    def _to_ssd(self, ck: Checkpoint) -> None:
        """HiState §3.1: a checkpoint that stopped being terminal leaves fast memory for SSD."""
        disk_bit = TIER_BITS["disk"]
        if "disk" not in self.tiers or ck.pins or not ck.tiers & ~disk_bit:
            return
        okey = object_key(ObjectKind.STATE, ck.key)
        if not ck.tiers & disk_bit:
            fut = self._pending.get((okey, "disk")) or self._copy(
                okey, ObjectKind.STATE, ck.nbytes, self._state_meta(ck), self._holder(ck.tiers), "disk")
            try:
                fut.result()
            finally:
                self._drain()
        if self.index.checkpoint(ck.key) is ck and ck.tiers & disk_bit and not self._inflight[okey]:
            for name in self._chain[:-1]:
                if ck.tiers & TIER_BITS[name]:
                    self._drop(okey, name)

    def _layout(self, kind: ObjectKind, value: Any, what: str) -> Layout:
        layout = self._layouts.get(kind)
        if layout is None:
            layout = Layout.of(value)
            for tier in self.tiers.values():
                if tier.stores_bytes and layout.nbytes > tier.capacity_bytes:
                    raise ObjectTooLargeError(
                        f"a {what} of {layout.nbytes} bytes is larger than the {tier.name} tier "
                        f"({tier.capacity_bytes} bytes); raise its budget")
            disk = self.tiers.get("disk")
            if disk is not None and disk.durable:
                disk.put_info(_LAYOUT_INFO[kind], layout.to_json())
            self._layouts[kind] = layout
        else:
            layout.check(value, what)
        return layout

    def _land(self, okey: bytes, kind: ObjectKind, nbytes: int,
              pack: Callable[[np.ndarray], None] | None) -> None:
        """Write a new object into the fastest tier (the pinned DRAM pool in a data-plane store)."""
        name = self._chain[0]
        tier = self.tiers[name]
        if pack is None and tier.stores_bytes:
            raise HybridStoreError("sized puts (no bytes) need accounting tiers; pass the tensors")
        self._make_room(name, tier.charge(nbytes), kind)
        if pack is not None and tier.stores_bytes:
            buffers, which, offsets = self._retry(name, nbytes, lambda: tier.stage_many([okey], nbytes))
            at = int(offsets[0])
            try:
                pack(buffers[int(which[0])][at:at + nbytes])
            except BaseException:
                tier.abort_many([okey])
                raise
            self._commit(name, [okey], nbytes)
        else:
            self._retry(name, nbytes, lambda: tier.put(okey, None, nbytes=nbytes)).result()
        self._kind_bytes[name][kind] += tier.charge(nbytes)
        self._objects[name] += 1

    def _commit(self, name: str, keys: Sequence[ObjectKey], nbytes: int) -> None:
        """Commit objects staged in tier ``name``, evicting more while it reports no room
        (a tier whose staging defers the allocation to the commit); they are given back
        if it never finds room."""
        tier = self.tiers[name]
        try:
            self._retry(name, nbytes * len(keys), lambda: tier.commit_many(keys))
        except BaseException:
            tier.abort_many(keys)
            raise

    def _writes_through(self, kind: ObjectKind) -> bool:
        """Whether a new object of ``kind`` is copied to slower tiers as it lands."""
        return kind in self._tiering.write_through and len(self._chain) > 1

    def _placed(self, okey: bytes, kind: ObjectKind, nbytes: int, meta: bytes) -> None:
        """After a put that :meth:`_writes_through`: copy to every slower tier."""
        for name in self._chain[1:]:
            self._copy(okey, kind, nbytes, meta, self._chain[0], name)

    def _copy(self, okey: bytes, kind: ObjectKind, nbytes: int, meta: bytes, src: str,
              dst: str) -> Future:
        """Start copying an object between tiers; the index learns of the copy once it is done
        (for the disk tier: once durable)."""
        source, target = self.tiers[src], self.tiers[dst]
        self._make_room(dst, target.charge(nbytes), kind)
        if not target.stores_bytes:
            # Accounting tiers (simulation) complete at once: no future bookkeeping.
            self._retry(dst, nbytes, lambda: target.put(okey, None, nbytes=nbytes, meta=meta))
            if not self._mark(okey, dst):
                target.delete(okey)
            return _DONE
        if source.zero_copy:
            source.pin_many([okey])
            data = source.view(okey)
        else:
            data = source.get(okey) if source.stores_bytes else None
        try:
            fut = self._retry(dst, nbytes, lambda: target.put(okey, data, nbytes=nbytes, meta=meta))
        except BaseException:
            if source.zero_copy:
                source.unpin_many([okey])
            raise
        self._track_copy(okey, src, dst, fut)
        if fut.done():
            self._drain()
        return fut

    def _track_copy(self, okey: bytes, src: str, dst: str, fut: Future) -> None:
        """Count a copy in flight until its future completes (then :meth:`_drain` applies it)."""
        self._pending[(okey, dst)] = fut
        self._inflight[okey] += 1
        fut.add_done_callback(lambda f, k=okey, s=src, d=dst: self._copy_done(k, s, d, f))

    def _copy_many(self, okeys: list[bytes], kind: ObjectKind, nbytes: int, metas: list[bytes],
                   src: str, dst: str) -> None:
        """:meth:`_copy` of a run of objects of one size: from a ``zero_copy`` tier (the
        pinned pool) to one that ``coalesces_writes`` (the disk tier) they go as one
        ``put_many`` per chunk of at most an eighth of the target (neighbours in one
        write); otherwise one by one."""
        source, target = self.tiers[src], self.tiers[dst]
        if not (source.zero_copy and target.coalesces_writes):
            for okey, meta in zip(okeys, metas):
                self._copy(okey, kind, nbytes, meta, src, dst)
            return
        charge = target.charge(nbytes)
        step = max(1, target.capacity_bytes // 8 // max(charge, 1))
        for i in range(0, len(okeys), step):
            keys, chunk_metas = okeys[i:i + step], metas[i:i + step]
            self._make_room(dst, charge * len(keys), kind)
            source.pin_many(keys)
            try:
                datas = [source.view(okey) for okey in keys]
                futs = self._retry(dst, nbytes * len(keys), lambda: target.put_many(
                    keys, datas, nbytes=nbytes, metas=chunk_metas))
            except BaseException:
                source.unpin_many(keys)
                raise
            for okey, fut in zip(keys, futs):
                self._track_copy(okey, src, dst, fut)
            if any(fut.done() for fut in futs):
                self._drain()

    def _copy_done(self, okey: bytes, src: str, dst: str, fut: Future) -> None:
        """Runs on the target tier's thread: only queue the completion (no store lock here,
        so that a caller holding the lock may wait on copies)."""
        source = self.tiers[src]
        if source.zero_copy:
            source.unpin_many([okey])
        self._completed.append((okey, dst, fut))

    def _drain(self) -> None:
        """Apply finished copies to the index (under the store lock)."""
        while self._completed:
            okey, dst, fut = self._completed.popleft()
            if self._pending.get((okey, dst)) is fut:
                del self._pending[(okey, dst)]
                self._inflight[okey] -= 1
                if not self._inflight[okey]:
                    del self._inflight[okey]
            if fut.exception() is not None:
                log.warning("copy of %s to %s failed: %s", okey.hex(), dst, fut.exception())
            elif not self._closed and not self._mark(okey, dst):
                # The object was forgotten while its copy was in flight.
                self.tiers[dst].delete(okey)

    def _wait_pending(self) -> None:
        """Wait for every in-flight copy, then apply them."""
        for fut in list(self._pending.values()):
            try:
                fut.result()
            except Exception:  # reported by _drain
                pass
        self._drain()

    def _mark(self, okey: bytes, tier: str) -> bool:
        """Record that ``tier`` now holds ``okey``; False when the index forgot it."""
        kind = ObjectKind(okey[0])
        if kind == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            held = self.index.page_tiers(nid) if nid >= 0 else 0
            if not held:
                return False
            if not held & TIER_BITS[tier]:
                self.index.add_page_tier(nid, tier)
                self._kind_bytes[tier][kind] += self.tiers[tier].charge(self.index.page_info(nid)["nbytes"])
                self._objects[tier] += 1
            return True
        ck = self.index.checkpoint(okey[1:])
        if ck is None or not ck.tiers:
            return False
        if not ck.tiers & TIER_BITS[tier]:
            ck.tiers |= TIER_BITS[tier]
            self._kind_bytes[tier][kind] += self.tiers[tier].charge(ck.nbytes)
            self._objects[tier] += 1
        return True

    @staticmethod
    def _holder(tier_mask: int) -> str:
        return next(t for t in TIER_ORDER if tier_mask & TIER_BITS[t])

    # -- match / load / release ---------------------------------------------------------
    def match(self, tokens: Any, *, max_position: int | None = None) -> ResumePlan:
        """The deepest complete resume point of a prompt; pinned until :meth:`release`.

        Args:
            tokens: token ids, or a :class:`PrefixKeys` (also from block ids).
            max_position: do not resume past this position (engines that
                must compute the last token's logits pass ``len - 1``).
        """
        prompt = self.prefix(tokens)
        with self._lock:
            self._check_open()
            self._drain()
            plan = self.index.match(prompt, max_position)
            if plan.state_key is not None:
                ck = self.index.checkpoint(plan.state_key)
                assert ck is not None
                self._eviction.on_hit(self.index, ck)
            self._counters["matches"] += 1
            self._counters["hit_tokens"] += plan.position
            self._counters["query_tokens"] += prompt.length
            return plan

    def release(self, plan: ResumePlan) -> None:
        """Drop the plan's pins (each plan is released exactly once)."""
        with self._lock:
            self.index.release(plan)

    def restore_cost(self, plan: ResumePlan) -> dict[str, tuple[int, float]]:
        """Bytes and modeled seconds to restore ``plan``, per tier it would read from.

        Each object is read from the fastest tier holding it; a tier's
        ``read_seconds`` models its path into engine memory (HiState eq. 2:
        ``X / B_H2D`` from DRAM, ``X / B_SSD + X / B_H2D`` from SSD).
        """
        with self._lock:
            if not self.index.is_live(plan):
                raise PlanReleasedError(f"plan {plan.plan_id} was released; match again first")
            sizes: dict[str, int] = {}
            if len(plan.pages):
                cols = self.index.page_columns(plan.pages)
                taken = np.zeros(len(plan.pages), bool)
                for name in TIER_ORDER:
                    if name not in self.tiers:
                        continue
                    here = ~taken & ((cols["tiers"] & TIER_BITS[name]) != 0)
                    if here.any():
                        sizes[name] = int(cols["nbytes"][here].sum())
                    taken |= here
            if plan.state_key is not None:
                ck = self.index.checkpoint(plan.state_key)
                assert ck is not None
                name = self._holder(ck.tiers)
                sizes[name] = sizes.get(name, 0) + ck.nbytes
            return {name: (n, self.tiers[name].read_seconds(n)) for name, n in sizes.items()}

    def load(self, plan: ResumePlan, into: tuple[Any, Any] | None = None, *,
             skip_tiers: Sequence[str] = ()) -> Future:
        """Restore the plan's pages and checkpoint.

        Args:
            plan: a live plan from :meth:`match`.
            into: optional ``(pages, state_buffers)``, host or device buffers of
                the stored layout.  ``pages`` is either a list/tuple of at
                least ``len(plan.pages)`` page buffers (tensor or dict of
                tensors each), or one *page-major batch*: a tensor (dict of
                tensors) whose first dimension indexes pages, row ``i`` for
                page ``i`` — restored with one gather per entry from the pinned
                pool (:func:`~hybridstore.backends.gather.gather_rows`)
                instead of a copy per page.
            skip_tiers: objects whose fastest holder is one of these tiers are
                not read (their slot in the result is ``None``, their ``into``
                buffer untouched): an engine passes ``("device",)`` for what is
                already resident in its own GPU memory.

        Returns:
            A future of ``(pages, state)``: the pages covering
            ``[0, plan.position)`` in order and the checkpoint at
            ``plan.position`` (``([], None)`` for an empty plan).  With
            ``into`` the filled buffers are returned (the batch itself for a
            page-major batch).
        """
        with self._lock:
            self._check_open()
            if not self.index.is_live(plan):
                raise PlanReleasedError(f"plan {plan.plan_id} was released; match again before load")
            targets = self._check_into(plan, into) if into is not None else None
            for name in skip_tiers:
                if name not in TIER_BITS:
                    raise UnknownTierError(f"unknown tier {name!r} in skip_tiers; tiers are {list(TIER_BITS)}")
            page_keys = KeyBatch.of(ObjectKind.PAGE, plan.page_blob).keys()
            jobs = [(okey, ObjectKind.PAGE) for okey in page_keys]
            sources = self._page_sources(plan, page_keys, skip_tiers)
            try:
                if plan.state_key is not None:
                    jobs.append((object_key(ObjectKind.STATE, plan.state_key), ObjectKind.STATE))
                    sources.append(self._source(jobs[-1][0], skip_tiers))
                fut = self._io.submit(self._run_load, plan, jobs, sources, into, targets)
            except BaseException:
                self._release_sources(jobs, sources)   # the pool slots held for this load
                raise
            self._counters["loads"] += 1
        return fut

    def _check_into(self, plan: ResumePlan, into: tuple[Any, Any]) -> list[list[Target]]:
        """The matched buffers of every object of the plan; raises on a mismatch.

        For a page-major batch the first list holds one :class:`Target` per
        entry of the page layout (``host``: its ``(rows, nbytes)`` byte view).
        """
        page_bufs, state_buf = into
        n = len(plan.pages)
        if _is_batch(page_bufs):
            out = [self._layouts[ObjectKind.PAGE].batch_targets(page_bufs, n) if n else []]
            if plan.state_key is not None:
                out.append(self._layouts[ObjectKind.STATE].targets(state_buf))
            return out
        if len(page_bufs) < n:
            raise LayoutMismatchError(
                f"into has {len(page_bufs)} page buffers; the plan restores {n}")
        out = [self._layouts[ObjectKind.PAGE].targets(buf) for buf in page_bufs[:n]] if n else []
        if plan.state_key is not None:
            out.append(self._layouts[ObjectKind.STATE].targets(state_buf))
        return out

    def _page_sources(self, plan: ResumePlan, okeys: list[bytes],
                      skip: Sequence[str]) -> list[str | None]:
        """:meth:`_source` of every page of ``plan``, from the index's tier masks at once;
        the pages read from a pool are held with one ``acquire_many`` per pool."""
        n = len(okeys)
        if not n:
            return []
        held = self.index.page_columns(plan.pages)["tiers"]
        rank = np.full(n, -1, np.int64)
        for r, name in enumerate(self._chain):
            rank[(rank < 0) & ((held & TIER_BITS[name]) != 0)] = r
        if (rank < 0).any():      # the index lost a page of a live plan: _source says how
            return [self._source(okey, skip) for okey in okeys]
        names = np.array([None if name in skip else name for name in self._chain], object)
        sources: list[str | None] = names[rank].tolist()
        held = [None] * n           # what this call holds, released if it fails part-way
        try:
            for r, name in enumerate(self._chain):
                tier = self.tiers[name]
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
            self._release_sources([(k, ObjectKind.PAGE) for k in okeys], held)
            raise
        return sources

    def _source(self, okey: bytes, skip: Sequence[str] = ()) -> str | None:
        """The fastest tier holding ``okey``, its pool slot held (``None``: that tier is skipped)."""
        for name in TIER_ORDER:
            tier = self.tiers.get(name)
            if tier is not None and tier.contains(okey):
                if name in skip:
                    return None
                if tier.zero_copy:
                    tier.pin_many([okey])
                return name
        raise CorruptObjectError(f"object {okey.hex()} of a live plan is in no tier", key=okey)

    def _needs_buffer(self, src: str | None, has_into: bool) -> bool:
        """Whether a load needs a buffer of its own for an object read from ``src``."""
        if src is None:
            return False
        tier = self.tiers[src]
        if tier.zero_copy:
            return not has_into          # copied out of the slot, never handed out
        return tier.stores_bytes         # read from a byte tier into it

    def _run_load(self, plan: ResumePlan, jobs: list[tuple[bytes, ObjectKind]],
                  sources: list[str | None], into: tuple[Any, Any] | None,
                  targets: list[list[Target]] | None) -> tuple[list, Any]:
        outputs: list[Any] = []
        waits: list[tuple[int, Future]] = []
        bufs: list[np.ndarray | None] = []
        devices: set[Any] = set()          # CUDA devices with copies from pool slots in flight
        # A page-major batch: page i is row i, restored by one gather per entry below.
        batch = into is not None and _is_batch(into[0])
        n_batch = len(plan.pages) if batch else 0
        rows: dict[str | None, tuple[list[bytes], list[int]]] = {}   # by tier (None: own reads)
        # One 4 KiB-aligned arena for every object that needs a buffer of its own (reads from
        # a byte tier, or copies out of a pool slot when there is no `into`), instead of one
        # allocation per object: plans run to thousands of pages.
        try:
            own = [self._needs_buffer(src, into is not None) for src in sources]
            # Spaced like the disk tier's slots, so that pages written together are read
            # back with one I/O per run of neighbours (DiskTier.read_many_into).
            sizes = [max(-(-self._layouts[kind].nbytes // ALIGN) * ALIGN,
                         self.tiers[src].slot_bytes(self._layouts[kind].nbytes))
                     if mine and src is not None else 0
                     for (_, kind), mine, src in zip(jobs, own, sources)]
            arena = aligned_empty(sum(sizes)) if any(own) else None
            offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            reads: dict[str, list[int]] = {}      # disk tiers: jobs read in coalesced runs
            for i, ((okey, kind), src) in enumerate(zip(jobs, sources)):
                layout = self._layouts[kind]
                if src is None:                   # skipped: resident in the engine's tier
                    bufs.append(None)
                    continue
                tier = self.tiers[src]
                own_buf = arena[offsets[i]: offsets[i] + layout.nbytes] if own[i] else None
                if i < n_batch:                   # gathered from the pool or the arena below
                    keys, at = rows.setdefault(None if own_buf is not None else src, ([], []))
                    keys.append(okey)
                    at.append(i)
                    if own_buf is not None:
                        self._read_own(tier, src, i, okey, own_buf, reads, waits)
                    bufs.append(None)
                elif tier.zero_copy:
                    view = tier.view(okey)
                    if own_buf is not None:       # never hand out a pool slot
                        own_buf[:] = view[: layout.nbytes]
                        view = own_buf
                    bufs.append(view)
                elif own_buf is not None:
                    self._read_own(tier, src, i, okey, own_buf, reads, waits)
                    bufs.append(own_buf)
                else:
                    bufs.append(None)
                self._loaded_bytes[src] += layout.nbytes
            for src, idx in reads.items():
                waits.append((idx[0], self.tiers[src].read_many_into(
                    [jobs[i][0] for i in idx], arena, [offsets[i] for i in idx])))
            for i, fut in waits:
                try:
                    fut.result()
                except CorruptObjectError as e:
                    okey = e.key if e.key is not None else jobs[i][0]
                    with self._lock:
                        self._counters["corrupt"] += 1
                        self._forget(okey, "disk", self._layouts[ObjectKind(okey[0])].nbytes)
                    raise
            if batch and targets is not None and rows:
                self._gather_batch(rows, arena, offsets, targets[0], n_batch)
            for i, ((okey, kind), buf) in enumerate(zip(jobs, bufs)):
                if i < n_batch:
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
                    outputs.append(self._layouts[kind].unpack(buf))
        finally:
            # an H2D copy from a pinned slot is asynchronous: the slot must outlive it
            if devices:
                import torch

                for device in devices:
                    torch.cuda.current_stream(device).synchronize()
            self._release_sources(jobs, sources)
        if batch:
            return into[0], (outputs[-1] if plan.state_key is not None else None)  # type: ignore[index]
        if plan.state_key is None:
            return outputs, None
        return outputs[:-1], outputs[-1]

    @staticmethod
    def _read_own(tier: Tier, src: str, i: int, okey: bytes, own_buf: np.ndarray,
                  reads: dict[str, list[int]], waits: list[tuple[int, Future]]) -> None:
        """Read job ``i`` into its own buffer: the reads of a tier are collected for one
        ``read_many_into`` (the disk tier reads runs of neighbours in one I/O)."""
        reads.setdefault(src, []).append(i)

    def _release_sources(self, jobs: list[tuple[bytes, ObjectKind]],
                         sources: Sequence[str | None]) -> None:
        """Drop the pool-slot holds :meth:`_source` / :meth:`_page_sources` took for a load."""
        held: dict[str, list[bytes]] = {}
        for (okey, _), src in zip(jobs, sources):
            if src is not None and self.tiers[src].zero_copy:
                held.setdefault(src, []).append(okey)
        for name, keys in held.items():
            self.tiers[name].unpin_many(keys)

    def _gather_batch(self, rows: dict[str | None, tuple[list[bytes], list[int]]],
                      arena: np.ndarray | None, offsets: list[int], targets: list[Target],
                      n: int) -> None:
        """Fill the rows of a page-major batch: one gather per layout entry over every
        page, from the pool's arenas (``rows[tier]``) and the load's own reads
        (``rows[None]``, at ``offsets`` in ``arena``).  A device batch is staged in pinned
        host rows, copied and synchronised here: nothing is left in flight."""
        sources: list[np.ndarray] = []
        which, where, at = [], [], []
        for name, (keys, idx) in rows.items():
            if name is None:
                part = [arena], np.zeros(len(idx), np.int64), np.asarray(
                    [offsets[i] for i in idx], np.int64)
            else:
                part = self.tiers[name].locate(keys)
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
            import torch

            cuda = bool(target.buffer.is_cuda)
            staged = torch.empty((n, spec.nbytes), dtype=torch.uint8, pin_memory=cuda)
            gather_rows(sources, w, o, r, spec.offset, spec.nbytes, staged.numpy())
            filled = np.zeros(n + 1, bool)
            filled[r] = True
            edges = np.flatnonzero(np.diff(np.concatenate([[False], filled])))
            flat = target.buffer.view(target.buffer.shape[0], -1).view(torch.uint8)
            for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist()):
                flat[a:b].copy_(staged[a:b], non_blocking=cuda)
            if cuda:   # the staging rows must outlive the copies
                torch.cuda.current_stream(target.buffer.device).synchronize()
    # -- eviction ---------------------------------------------------------------------
    def evict(self, nbytes: int, tier: str = "host") -> int:
        """Free at least ``nbytes`` of ``tier`` if the policy and pins allow.

        Returns:
            Bytes freed (may be less when pinned or needed objects remain).
        """
        with self._lock:
            self._check_open()
            if tier not in self.tiers:
                raise UnknownTierError(f"this store has no {tier!r} tier; it has {list(self.tiers)}")
            self._drain()
            return self._evict(tier, nbytes)

    def _room(self, tier: str, kind: ObjectKind | None) -> int:
        """Bytes ``kind`` may still take in ``tier`` (the tier policy may partition it)."""
        t = self.tiers[tier]
        share = self._tiering.share(kind) if kind is not None else None
        if share is None:
            return t.free_bytes
        return min(t.free_bytes, int(share * t.capacity_bytes) - self._kind_bytes[tier][kind])

    def _make_room(self, tier: str, need: int, kind: ObjectKind | None = None) -> None:
        t = self.tiers[tier]
        if need > t.capacity_bytes:
            raise ObjectTooLargeError(
                f"an object of {need} bytes is larger than the whole {tier} tier "
                f"({t.capacity_bytes} bytes); raise its budget")
        if self._room(tier, kind) >= need:
            return
        # Free a few percent of the tier (or two objects) beyond the need, so that one
        # eviction pass serves many puts: a pass ranks every object of the tier.
        self._drain()
        partition = kind if self._tiering.state_share is not None else None
        share = self._tiering.share(kind) if partition is not None else None
        slack = int((share or 1.0) * t.capacity_bytes) // 32
        self._evict(tier, need - self._room(tier, kind) + slack, partition)
        if self._room(tier, kind) < need and self._pending:
            # Objects whose disk write is still in flight cannot leave DRAM yet.
            self._wait_pending()
            self._evict(tier, need - self._room(tier, kind) + slack, partition)
        if self._room(tier, kind) < need:
            raise CapacityError(
                f"the {tier} tier cannot free {need} bytes: everything left is pinned by live "
                "plans or needed by retained checkpoints; release plans or raise its budget")

    def _retry(self, tier: str, nbytes: int, attempt: Callable[[], Any]) -> Any:
        """Run an allocation, evicting more of ``tier`` while it reports CapacityError.

        Free bytes can be split across size classes, so a tier with enough
        free bytes in total may still refuse a slot: free more and try again.
        """
        t = self.tiers[tier]
        for round_ in range(1, 5):
            try:
                return attempt()
            except ObjectTooLargeError:
                raise
            except CapacityError:
                if round_ == 4:
                    raise
                self._drain()
                if not self._evict(tier, t.charge(nbytes) + round_ * t.capacity_bytes // 16):
                    self._wait_pending()
        raise AssertionError("unreachable")

    def _evict(self, tier: str, nbytes: int, kind: ObjectKind | None = None) -> int:
        """Evict in the policy's order until ``nbytes`` are freed (of ``kind`` only, if given).

        A ranking costs a pass over every object of the tier.  In a tier of at
        least ``REUSE_RANKING_OBJECTS`` objects one ranking serves later
        evictions too, for up to a quarter of the tier's objects in index
        operations; objects used since it was made are skipped (they are no
        longer where it ranked them).  Smaller tiers rank afresh every time.
        Consecutive page victims are taken as one batch (:meth:`_evict_pages`),
        about as many as the bytes still owed need.
        """
        freed = 0
        follow = self._eviction.dependency_aware and kind != ObjectKind.STATE
        for attempt in range(8):  # a fresh ranking may find more (pages made reclaimable)
            before = freed
            victims, made = self._ranking(tier, kind, fresh=attempt > 0)
            for victim in victims:
                if victim.kind == ObjectKind.PAGE:
                    freed += self._evict_page_run(victim, victims, made, tier, nbytes - freed)
                    if freed >= nbytes:
                        return freed
                    continue
                if made >= 0 and self._used_since(victim, made):
                    continue
                exclusive = self._exclusive_pages(victim) if follow else _NO_PAGES
                got = self._evict_one(victim, tier)
                freed += got
                if freed >= nbytes:
                    return freed
                if got and exclusive.size:
                    # The pages only this checkpoint needed are reclaimable now, and a
                    # fresh ranking would offer them first; a reused one has passed them.
                    freed += self._evict_pages(exclusive, tier, nbytes - freed)[0]
                    if freed >= nbytes:
                        return freed
            self._rankings.pop((tier, kind), None)
            if freed == before and attempt:
                break
        return freed

    def _evict_page_run(self, victim: Victim, victims: _Victims, made: int, tier: str,
                        owed: int) -> int:
        """Evict ``victim`` and the page victims right after it, as many as ``owed`` bytes
        need; victims taken but not reached go back to ``victims``.  Returns bytes freed."""
        index = self.index
        want = max(1, min(4096, -(-owed // max(1, self.tiers[tier].charge(
            index.page_nbytes(int(victim.ref)))))))
        run, seen = [victim], {victim.ref}
        for nxt in victims:
            if nxt.kind != ObjectKind.PAGE:
                victims.push_back([nxt])
                break
            if nxt.ref in seen:        # named twice: the second time there is nothing to free
                continue
            seen.add(nxt.ref)
            run.append(nxt)
            if len(run) >= want:
                break
        ids = np.fromiter((v.ref for v in run), np.int64, len(run))
        if made >= 0:
            keep = index.page_columns(ids, ("atime",))["atime"] <= made   # used since: skipped
            ids = ids[keep]
            run = [v for v, k in zip(run, keep.tolist()) if k]
        got, taken = self._evict_pages(ids, tier, owed)
        victims.push_back(run[taken:])
        return got

    def _evict_pages(self, ids: np.ndarray, tier: str, owed: int) -> tuple[int, int]:
        """:meth:`_evict_one` of pages ``ids`` in order, vectorised, until ``owed`` bytes
        are freed.  Returns ``(bytes freed, how many of ids were considered)``.

        The same rules as :meth:`_evict_one`: never a pinned page or one whose copy is
        in flight; the last copy of a page that retained checkpoints need stays under
        a dependency-aware policy.  When the last copy would be spilled to the tier
        below, the pages go one by one through :meth:`_evict_one`.
        """
        if not ids.size:
            return 0, 0
        index, t = self.index, self.tiers[tier]
        bit = TIER_BITS[tier]
        cols = index.page_columns(ids, ("tiers", "deps", "pins", "nbytes"))
        tiers, deps, pins, nbytes = cols["tiers"], cols["deps"], cols["pins"], cols["nbytes"]
        ok = ((tiers & bit) != 0) & (pins == 0)
        last = (tiers & (~bit & 0xFF)) == 0
        if self._spills(ObjectKind.PAGE, tier) and (ok & last).any():
            freed = 0
            for i, nid in enumerate(ids.tolist()):
                freed += self._evict_one(Victim(ObjectKind.PAGE, nid), tier)
                if freed >= owed:
                    return freed, i + 1
            return freed, len(ids)
        if self._eviction.dependency_aware:
            ok &= ~last | (deps == 0)
        cand = np.flatnonzero(ok)
        okeys: Sequence[bytes] | None = None      # built for what is evicted, unless needed here
        if self._inflight:
            okeys = KeyBatch.of(ObjectKind.PAGE, index.page_keys_blob(ids[cand]))
            free_now = np.fromiter((not self._inflight[k] for k in okeys), bool, len(okeys))
            cand, okeys = cand[free_now], [k for k, f in zip(okeys, free_now.tolist()) if f]
        sizes = nbytes[cand]
        if not sizes.size or sizes.min() == sizes.max():      # pages of one size: the usual case
            charges = np.full(sizes.size, t.charge(int(sizes[0])) if sizes.size else 0, np.int64)
        else:
            uniq, inv = np.unique(sizes, return_inverse=True)
            charges = np.array([t.charge(int(n)) for n in uniq], np.int64)[inv]
        cum = np.cumsum(charges)
        n = int(np.searchsorted(cum, owed)) + 1   # the first prefix that frees `owed`
        if n <= len(cand):
            cand, charges = cand[:n], charges[:n]
            considered = int(cand[-1]) + 1
        else:
            considered = len(ids)
        if not len(cand):
            return 0, considered
        sel = ids[cand]
        t.delete_many(okeys[:len(cand)] if okeys is not None
                      else KeyBatch.of(ObjectKind.PAGE, index.page_keys_blob(sel)))
        self._forget_pages(sel, tier, last[cand])
        freed = int(charges.sum())
        self._kind_bytes[tier][ObjectKind.PAGE] -= freed
        self._objects[tier] -= len(sel)
        self._counters["evictions"] += len(sel)
        return freed, considered

    def _forget_pages(self, nids: np.ndarray, tier: str, last: np.ndarray) -> None:
        """The index side of dropping pages ``nids`` from ``tier`` (``last``: it held their
        only copy, so their residence ends)."""
        if last.any():
            ages = self.index.now() - self.index.page_columns(nids[last], ("ctime",))["ctime"]
            self.residence.observe_many(ObjectKind.PAGE, ages)
        self.index.drop_pages_tier(nids, tier)

    def _ranking(self, tier: str, kind: ObjectKind | None, fresh: bool) -> tuple[_Victims, int]:
        """The policy's victim order for ``tier``, reused when the tier is large (see ``_evict``)."""
        n = self._objects[tier]
        if n < REUSE_RANKING_OBJECTS:
            return _Victims(self._victims(tier, kind)), -1
        entry = self._rankings.get((tier, kind))
        if fresh or entry is None or self.index.now() - entry[1] > n // 4:
            entry = (_Victims(self._victims(tier, kind)), self.index.now())
            self._rankings[(tier, kind)] = entry
        return entry

    def _victims(self, tier: str, kind: ObjectKind | None) -> Iterator[Victim]:
        """The policy's order; it may leave out what :meth:`_evict_one` would refuse anyway."""
        keep = self._eviction.dependency_aware and not self._spills(ObjectKind.PAGE, tier)
        return self._eviction.victims(self.index, tier, kind, keep_needed=keep)

    def _exclusive_pages(self, victim: Victim) -> np.ndarray:
        ck = self.index.checkpoint(bytes(victim.ref)) if victim.kind == ObjectKind.STATE else None
        return _NO_PAGES if ck is None else self.index.exclusive_page_ids(ck)

    def _used_since(self, victim: Victim, t: int) -> bool:
        """Whether a checkpoint victim was used after ranking time ``t`` (pages: in a batch)."""
        ck = self.index.checkpoint(bytes(victim.ref))
        return ck is not None and ck.atime > t

    def _evict_one(self, victim: Victim, tier: str) -> int:
        """Evict one object from ``tier`` if the safety rules allow; returns bytes freed.

        Never a pinned object or one whose SSD write is in flight.  The last
        copy of an object is written to SSD first when the tier policy spills
        its kind; otherwise the last copy of a page that retained checkpoints
        need stays (dependency-aware policies evict the checkpoint first).
        """
        bit = TIER_BITS[tier]
        if victim.kind == ObjectKind.PAGE:
            nid = int(victim.ref)
            tiers, deps, pins, nbytes = self.index.page_state(nid)   # a freed node holds no tier
            if not tiers & bit or pins:
                return 0
            okey = object_key(ObjectKind.PAGE, self.index.node_key(nid))
            elsewhere, needed = tiers & ~bit, deps > 0
        else:
            ck = self.index.checkpoint(bytes(victim.ref))
            if ck is None or not ck.tiers & bit or ck.pins:
                return 0
            okey = object_key(ObjectKind.STATE, ck.key)
            elsewhere, needed, nbytes = ck.tiers & ~bit, False, ck.nbytes
        if self._inflight[okey]:
            return 0
        if not elsewhere:
            spilled = False
            if self._spills(victim.kind, tier):
                try:
                    self._spill(okey, victim.kind, nbytes, tier, self._below(tier))  # type: ignore[arg-type]
                    spilled = True
                except CapacityError:
                    # The tier below is full of what it must keep: the object is
                    # dropped instead (a checkpoint always may be; a page only when
                    # nothing needs it or the policy ignores dependencies).
                    pass
            if not spilled and needed and self._eviction.dependency_aware:
                return 0
        freed = self.tiers[tier].charge(nbytes)
        self._drop(okey, tier)
        self._counters["evictions"] += 1
        return freed

    def _spills(self, kind: ObjectKind, tier: str) -> bool:
        """Whether the last copy of a ``kind`` object leaving ``tier`` is written one tier down."""
        return kind in self._tiering.spill and self._below(tier) is not None

    def _below(self, tier: str) -> str | None:
        """The next slower tier of this store, or None."""
        i = self._chain.index(tier)
        return self._chain[i + 1] if i + 1 < len(self._chain) else None

    def _spill(self, okey: bytes, kind: ObjectKind, nbytes: int, src: str, dst: str) -> None:
        """Write-back: copy the last copy of an object one tier down before ``src`` drops it."""
        if kind == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            info = self.index.page_info(nid)
            meta = M.encode_page(info["block"], info["ntok"], self.index.parent_key(nid))
        else:
            ck = self.index.checkpoint(okey[1:])
            assert ck is not None
            meta = self._state_meta(ck)
        self._copy(okey, kind, nbytes, meta, src, dst).result()
        self._drain()

    def _drop(self, okey: bytes, tier: str) -> None:
        t = self.tiers[tier]
        n = t.nbytes(okey)
        t.delete(okey)
        self._forget(okey, tier, n)

    def _forget(self, okey: bytes, tier: str, nbytes: int | None) -> None:
        """Record that ``tier`` no longer holds ``okey`` (of ``nbytes``)."""
        kind = ObjectKind(okey[0])
        bit = TIER_BITS[tier]
        if kind == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            held = self.index.page_tiers(nid) if nid >= 0 else 0
            if not held & bit:
                return
            if held == bit:
                self.residence.observe(kind, self.index.now() - self.index.page_ctime(nid))
            self.index.drop_page_tier(nid, tier)
        else:
            ck = self.index.checkpoint(okey[1:])
            if ck is None or not ck.tiers & bit:
                return
            if ck.tiers == bit:
                self.residence.observe(kind, self.index.now() - ck.created)
            self.index.drop_checkpoint_tier(okey[1:], tier)
        self._kind_bytes[tier][kind] -= self.tiers[tier].charge(nbytes or 0)
        self._objects[tier] -= 1

    # -- engine helpers -------------------------------------------------------------
    def checkpoint_positions(self, *, cached: int, length: int, anchors: Sequence[int] = ()) -> list[int]:
        """Positions of a new segment ``(cached, length]`` where the engine should capture states."""
        with self._lock:
            return self._placement.positions(cached=cached, length=length, anchors=anchors,
                                             stats=self.residence)

    def flush(self) -> None:
        """Wait until every disk write has completed and is recorded in the index."""
        with self._lock:
            self._wait_pending()

    def stats(self) -> dict[str, Any]:
        """Counters of the index, each tier and the store's calls."""
        with self._lock:
            self._drain()
            out: dict[str, Any] = dict(self._counters)
            out["pages"] = self.index.n_pages
            out["checkpoints"] = self.index.n_checkpoints
            out["token_hit_rate"] = (self._counters["hit_tokens"] / self._counters["query_tokens"]
                                     if self._counters["query_tokens"] else 0.0)
            out["loaded_bytes"] = dict(self._loaded_bytes)
            out["tiers"] = {name: tier.stats() for name, tier in self.tiers.items()}
            return out

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight writes, then close every tier.  Idempotent."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
        self._io.shutdown(wait=True)
        for tier in self.tiers.values():
            tier.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this HybridStore was closed; open a new one")

    def __enter__(self) -> HybridStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass


__all__ = ["HybridStore", "ResumePlan", "TIER_ORDER"]
