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
``write_mode="write-through"`` every object is also written to the disk tier
in the background (it becomes visible there once durable), with
``"write-back"`` only when DRAM evicts it.  All public methods are
thread-safe: index and policy work happens under one lock, byte copies and
disk I/O outside it, protected by pins and host-slot references.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridstore.backends.base import ObjectKind, Tier, object_key
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
from hybridstore.index.trie import TIER_BITS, Checkpoint, HybridIndex, ResumePlan
from hybridstore.layout import Layout, copy_out
from hybridstore.policy import admission_policy, eviction_policy
from hybridstore.policy.base import PlacementPolicy, Victim
from hybridstore.policy.placement import RequestEnd

log = logging.getLogger(__name__)

TIER_ORDER = ("device", "host", "disk")
"""Fastest first: a load reads each object from the first tier that holds it."""

_LAYOUT_INFO = {ObjectKind.PAGE: "layout.page", ObjectKind.STATE: "layout.state"}


class HybridStore:
    """Prefix cache of a hybrid model across GPU memory, pinned DRAM and SSD.

    Args:
        config: the store's configuration (``StoreConfig()`` when omitted).
        tiers: tiers to use instead of the ones ``config`` describes, by name
            (``"device"``, ``"host"``, ``"disk"``); the simulator passes
            accounting-only tiers here.
        placement: where :meth:`checkpoint_positions` asks the engine to
            capture states (request end and anchors by default).

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
                 placement: PlacementPolicy | None = None) -> None:
        self.config = cfg = config or StoreConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._eviction = eviction_policy(cfg.policy)
        self._admission = admission_policy(cfg.checkpoint_policy)
        self._placement = placement or RequestEnd()
        self._root = K.namespace_root(cfg.namespace)
        self.index = HybridIndex(cfg.block_size, self._root)
        self.tiers: dict[str, Tier] = dict(tiers) if tiers is not None else self._open_tiers(cfg)
        for name in self.tiers:
            if name not in TIER_BITS:
                raise UnknownTierError(f"unknown tier {name!r}; tiers are {list(TIER_BITS)}")
        self._layouts: dict[ObjectKind, Layout] = {}
        self._pending: dict[bytes, Future] = {}
        self._completed: deque[tuple[bytes, Future]] = deque()
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hybridstore-load")
        self._counters = {"matches": 0, "hit_tokens": 0, "query_tokens": 0, "loads": 0,
                          "evictions": 0, "corrupt": 0}
        self._loaded_bytes = {name: 0 for name in self.tiers}
        if "disk" in self.tiers:
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
            raw = disk.get_info(_LAYOUT_INFO[kind])  # type: ignore[attr-defined]
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
        if prompt.length == 0:
            raise MisalignedPageError("put_kv got an empty prefix; pass the tokens up to the page's end")
        last = prompt.nblocks - 1
        first = last - len(batch) + 1
        if first < 0:
            raise MisalignedPageError(
                f"{len(batch)} pages do not fit in {prompt.length} tokens of {self.config.block_size}-token "
                "blocks; pass the tokens up to the end of the last page")
        with self._lock:
            self._check_open()
            self._drain()
            layout = self._layout(ObjectKind.PAGE, batch[0], "page")
            for page in batch[1:]:
                layout.check(page, "page")
            stored = 0
            for block, page in zip(range(first, last + 1), batch):
                key16 = prompt.block_key(block)
                okey = object_key(ObjectKind.PAGE, key16)
                nid = self.index.find_node(key16)
                if nid >= 0 and self.index.page_info(nid)["tiers"]:
                    self.index.add_page(prompt, block, self._holder(nid), layout.nbytes)
                    continue
                meta = M.encode_page(block, prompt.block_end(block) - block * self.config.block_size,
                                     prompt.key_before(block))
                self._write_host(okey, layout, page, meta)
                self.index.add_page(prompt, block, "host", layout.nbytes)
                self._after_host_write(okey, meta, layout.nbytes)
                stored += 1
            return stored

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
        return self.put_kv(self.prefix(prompt.tokens[:end]) if prompt.tokens is not None
                           else self._truncate_ids(prompt, end), page)

    def _truncate_ids(self, prompt: PrefixKeys, end: int) -> PrefixKeys:
        n = end // self.config.block_size
        return PrefixKeys(block_size=prompt.block_size, length=end, root=prompt.root,
                          keys=prompt.keys[:n], tokens=None)

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
            True when the checkpoint was stored (False: the admission policy
            declined it).
        """
        prompt = self.prefix(tokens)
        p = prompt.length if position is None else position
        if not 0 < p <= prompt.length:
            raise InvalidTokensError(f"position {p} must be in 1..{prompt.length} (the prompt's length)")
        key16 = prompt.key_at(p)
        if key16 is None:
            raise InvalidTokensError(
                f"position {p} is inside a block of a prompt given as block ids; pass token ids")
        with self._lock:
            self._check_open()
            self._drain()
            layout = self._layout(ObjectKind.STATE, state, "state")
            existing = self.index.checkpoint(key16)
            if existing is not None and existing.tiers:
                self.index.add_checkpoint(prompt, p, self._holder_ck(existing), layout.nbytes)
                return True
            if not self._admission.admit(self.index, p, layout.nbytes):
                return False
            okey = object_key(ObjectKind.STATE, key16)
            self._write_host(okey, layout, state, b"")
            ck = self.index.add_checkpoint(prompt, p, "host", layout.nbytes)
            self._after_host_write(okey, self._state_meta(ck), layout.nbytes)
            return True

    def _state_meta(self, ck: Checkpoint) -> bytes:
        base_key = self.index.root_key if ck.base == 0 else self.index.node_key(ck.base)
        return M.encode_state(ck.position, base_key, self.index.cover_keys(ck))

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
            if disk is not None and hasattr(disk, "put_info"):
                disk.put_info(_LAYOUT_INFO[kind], layout.to_json())
            self._layouts[kind] = layout
        else:
            layout.check(value, what)
        return layout

    def _write_host(self, okey: bytes, layout: Layout, value: Any, meta: bytes) -> None:
        host = self.tiers["host"]
        self._make_room("host", host.charge(layout.nbytes))
        if isinstance(host, HostPool):
            slot = self._retry("host", layout.nbytes, lambda: host.reserve_slot(okey, layout.nbytes, meta))
            try:
                layout.pack_into(value, slot)
            except BaseException:
                host.abort(okey)
                raise
            host.commit(okey)
        else:
            buf = np.empty(layout.nbytes, np.uint8) if host.stores_bytes else None
            if buf is not None:
                layout.pack_into(value, buf)
            self._retry("host", layout.nbytes,
                        lambda: host.put(okey, buf, nbytes=layout.nbytes, meta=meta)).result()

    def _after_host_write(self, okey: bytes, meta: bytes, nbytes: int) -> None:
        """Write-through: start the disk write of an object now in the host pool."""
        disk = self.tiers.get("disk")
        if disk is None or self.config.write_mode != "write-through":
            return
        self._make_room("disk", disk.charge(nbytes))
        self._start_disk_write(okey, meta, nbytes)

    def _start_disk_write(self, okey: bytes, meta: bytes, nbytes: int) -> Future:
        host, disk = self.tiers["host"], self.tiers["disk"]
        if isinstance(host, HostPool):
            host.acquire(okey)
            data = host.view(okey)
        else:
            data = host.get(okey) if host.stores_bytes else None
        try:
            fut = self._retry("disk", nbytes, lambda: disk.put(okey, data, nbytes=nbytes, meta=meta))
        except BaseException:
            if isinstance(host, HostPool):
                host.release_ref(okey)
            raise
        self._pending[okey] = fut
        fut.add_done_callback(lambda f, k=okey: self._disk_write_done(k, f))
        return fut

    def _disk_write_done(self, okey: bytes, fut: Future) -> None:
        """Runs on the disk tier's thread: only queue the completion (no store lock here,
        so that a caller holding the lock may wait on disk writes)."""
        host = self.tiers["host"]
        if isinstance(host, HostPool):
            host.release_ref(okey)
        self._completed.append((okey, fut))

    def _drain(self) -> None:
        """Apply finished disk writes to the index (under the store lock)."""
        while self._completed:
            okey, fut = self._completed.popleft()
            if self._pending.get(okey) is fut:
                del self._pending[okey]
            if fut.exception() is not None:
                log.warning("disk write of %s failed: %s", okey.hex(), fut.exception())
            elif not self._closed and not self._mark(okey, "disk"):
                # The object was forgotten while its write was in flight.
                self.tiers["disk"].delete(okey)

    def _wait_pending(self) -> None:
        """Wait for every in-flight disk write, then apply them."""
        for fut in list(self._pending.values()):
            try:
                fut.result()
            except Exception:  # reported by _drain
                pass
        self._drain()

    def _mark(self, okey: bytes, tier: str) -> bool:
        """Record that ``tier`` now holds ``okey``; False when the index forgot it."""
        if okey[0] == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            if nid < 0 or not self.index.page_info(nid)["tiers"]:
                return False
            self.index.add_page_tier(nid, tier)
            return True
        ck = self.index.checkpoint(okey[1:])
        if ck is None or not ck.tiers:
            return False
        ck.tiers |= TIER_BITS[tier]
        return True

    def _holder(self, nid: int) -> str:
        tiers = self.index.page_info(nid)["tiers"]
        return next(t for t in TIER_ORDER if tiers & TIER_BITS[t])

    @staticmethod
    def _holder_ck(ck: Checkpoint) -> str:
        return next(t for t in TIER_ORDER if ck.tiers & TIER_BITS[t])

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
            self._counters["matches"] += 1
            self._counters["hit_tokens"] += plan.position
            self._counters["query_tokens"] += prompt.length
            return plan

    def release(self, plan: ResumePlan) -> None:
        """Drop the plan's pins (each plan is released exactly once)."""
        with self._lock:
            self.index.release(plan)

    def load(self, plan: ResumePlan, into: tuple[Sequence[Any], Any] | None = None) -> Future:
        """Restore the plan's pages and checkpoint.

        Args:
            plan: a live plan from :meth:`match`.
            into: optional ``(page_buffers, state_buffers)``: a sequence of at
                least ``len(plan.page_keys)`` page buffers and a state buffer
                (tensor/dict of tensors of the stored layout), host or device.

        Returns:
            A future of ``(pages, state)``: the pages covering
            ``[0, plan.position)`` in order and the checkpoint at
            ``plan.position`` (``([], None)`` for an empty plan).  With
            ``into`` the filled buffers are returned.
        """
        with self._lock:
            self._check_open()
            if not self.index.is_live(plan):
                raise PlanReleasedError(f"plan {plan.plan_id} was released; match again before load")
            if into is not None:
                self._check_into(plan, into)
            jobs = [(object_key(ObjectKind.PAGE, k), ObjectKind.PAGE) for k in plan.page_keys]
            if plan.state_key is not None:
                jobs.append((object_key(ObjectKind.STATE, plan.state_key), ObjectKind.STATE))
            sources = [self._source(okey) for okey, _ in jobs]
            self._counters["loads"] += 1
        return self._io.submit(self._run_load, plan, jobs, sources, into)

    def _check_into(self, plan: ResumePlan, into: tuple[Sequence[Any], Any]) -> None:
        page_bufs, state_buf = into
        if len(page_bufs) < len(plan.page_keys):
            raise LayoutMismatchError(
                f"into has {len(page_bufs)} page buffers; the plan restores {len(plan.page_keys)}")
        if plan.page_keys:
            for buf in page_bufs[: len(plan.page_keys)]:
                self._layouts[ObjectKind.PAGE].targets(buf)
        if plan.state_key is not None:
            self._layouts[ObjectKind.STATE].targets(state_buf)

    def _source(self, okey: bytes) -> str:
        """Pick the fastest tier holding ``okey`` and protect its host slot."""
        for name in TIER_ORDER:
            tier = self.tiers.get(name)
            if tier is not None and tier.contains(okey):
                if isinstance(tier, HostPool):
                    tier.acquire(okey)
                return name
        raise CorruptObjectError(f"object {okey.hex()} of a live plan is in no tier", key=okey)

    def _run_load(self, plan: ResumePlan, jobs: list[tuple[bytes, ObjectKind]],
                  sources: list[str], into: tuple[Sequence[Any], Any] | None) -> tuple[list, Any]:
        host = self.tiers["host"]
        outputs: list[Any] = []
        waits: list[tuple[int, Future]] = []
        bufs: list[np.ndarray | None] = []
        try:
            for i, ((okey, kind), src) in enumerate(zip(jobs, sources)):
                layout = self._layouts[kind]
                tier = self.tiers[src]
                if isinstance(tier, HostPool):
                    bufs.append(tier.view(okey))
                elif tier.stores_bytes:
                    buf = _aligned_empty(layout.nbytes)
                    waits.append((i, tier.get_into(okey, buf)))
                    bufs.append(buf)
                else:
                    bufs.append(None)
                self._loaded_bytes[src] += layout.nbytes
            for i, fut in waits:
                try:
                    fut.result()
                except CorruptObjectError:
                    with self._lock:
                        self._counters["corrupt"] += 1
                        self._forget(jobs[i][0], "disk")
                    raise
            for i, ((okey, kind), buf) in enumerate(zip(jobs, bufs)):
                layout = self._layouts[kind]
                if buf is None:
                    outputs.append(None)
                    continue
                if into is not None:
                    target = into[0][i] if kind == ObjectKind.PAGE else into[1]
                    for spec, dst in layout.targets(target):
                        copy_out(spec, buf, dst)
                    outputs.append(target)
                elif sources[i] == "host":
                    copy = _aligned_empty(layout.nbytes)
                    copy[:] = buf[: layout.nbytes]
                    outputs.append(layout.unpack(copy))
                else:
                    outputs.append(layout.unpack(buf))
        finally:
            for (okey, _), src in zip(jobs, sources):
                if src == "host" and isinstance(host, HostPool):
                    host.release_ref(okey)
        if plan.state_key is None:
            return outputs, None
        return outputs[:-1], outputs[-1]

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

    def _make_room(self, tier: str, need: int) -> None:
        t = self.tiers[tier]
        if need > t.capacity_bytes:
            raise ObjectTooLargeError(
                f"an object of {need} bytes is larger than the whole {tier} tier "
                f"({t.capacity_bytes} bytes); raise its budget")
        if t.free_bytes >= need:
            return
        # Evict a little more than needed so that eviction passes are amortised.
        self._drain()
        target = need - t.free_bytes + t.capacity_bytes // 64
        self._evict(tier, target)
        if t.free_bytes < need and self._pending:
            # Objects whose disk write is still in flight cannot leave DRAM yet.
            self._wait_pending()
            self._evict(tier, need - t.free_bytes + t.capacity_bytes // 64)
        if t.free_bytes < need:
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

    def _evict(self, tier: str, nbytes: int) -> int:
        freed = 0
        for _ in range(8):  # each pass may make more pages reclaimable
            before = freed
            for victim in self._eviction.victims(self.index, tier):
                if freed >= nbytes:
                    return freed
                freed += self._evict_one(victim, tier)
            if freed >= nbytes or freed == before:
                break
        return freed

    def _evict_one(self, victim: Victim, tier: str) -> int:
        bit = TIER_BITS[tier]
        if victim.kind == ObjectKind.PAGE:
            nid = int(victim.ref)
            info = self.index.page_info(nid)
            if info["block"] < 0 or not info["tiers"] & bit or info["pins"]:
                return 0
            okey = object_key(ObjectKind.PAGE, self.index.node_key(nid))
            elsewhere = info["tiers"] & ~bit
            needed = info["deps"] > 0
        else:
            ck = self.index.checkpoint(bytes(victim.ref))
            if ck is None or not ck.tiers & bit or ck.pins:
                return 0
            okey = object_key(ObjectKind.STATE, ck.key)
            elsewhere = ck.tiers & ~bit
            needed = False
        if okey in self._pending:
            return 0
        if not elsewhere:
            if tier == "host" and "disk" in self.tiers and self.config.write_mode == "write-back":
                self._demote(okey)
            elif needed:
                return 0
        freed = self.tiers[tier].charge(self.tiers[tier].nbytes(okey) or 0)
        self._drop(okey, tier)
        self._counters["evictions"] += 1
        return freed

    def _demote(self, okey: bytes) -> None:
        """Write-back: copy a host-only object to disk before DRAM drops it."""
        disk = self.tiers["disk"]
        host = self.tiers["host"]
        nbytes = host.nbytes(okey) or 0
        self._make_room("disk", disk.charge(nbytes))
        if okey[0] == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            info = self.index.page_info(nid)
            meta = M.encode_page(info["block"], info["ntok"], self.index.parent_key(nid))
        else:
            meta = self._state_meta(self.index.checkpoint(okey[1:]))
        self._start_disk_write(okey, meta, nbytes).result()
        self._mark(okey, "disk")

    def _drop(self, okey: bytes, tier: str) -> None:
        self.tiers[tier].delete(okey)
        self._forget(okey, tier)

    def _forget(self, okey: bytes, tier: str) -> None:
        """Record in the index that ``tier`` no longer holds ``okey``."""
        if okey[0] == ObjectKind.PAGE:
            nid = self.index.find_node(okey[1:])
            if nid >= 0:
                self.index.drop_page_tier(nid, tier)
        elif self.index.checkpoint(okey[1:]) is not None:
            self.index.drop_checkpoint_tier(okey[1:], tier)

    # -- engine helpers -------------------------------------------------------------
    def checkpoint_positions(self, *, cached: int, length: int, anchors: Sequence[int] = ()) -> list[int]:
        """Positions of a new segment ``(cached, length]`` where the engine should capture states."""
        return self._placement.positions(cached=cached, length=length, anchors=anchors)

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


def _aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on an ``align`` boundary (O_DIRECT/GDS)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start: start + nbytes]


__all__ = ["HybridStore", "ResumePlan", "TIER_ORDER"]
