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

The facade holds the lock and the counters and delegates to the layers of
``store/``: :class:`~hybridstore.store.residency.Residency` (who holds what),
:class:`~hybridstore.store.copies.TierCopies` (copies between tiers),
:class:`~hybridstore.store.evictor.Evictor` (the safety rules of eviction),
:class:`~hybridstore.store.landing.Landing` (puts) and
:class:`~hybridstore.store.loader.Loader` (loads).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, cast

import numpy as np

from hybridstore import _native
from hybridstore.backends.base import Tier
from hybridstore.backends.host import HostPool
from hybridstore.config import StoreConfig
from hybridstore.errors import (
    CapacityError,
    CatalogError,
    InvalidArgumentError,
    InvalidTokensError,
    LayoutMismatchError,
    MisalignedPageError,
    NamespaceError,
    PlanReleasedError,
    StoreClosedError,
    UnknownPrefixError,
    UnknownTierError,
)
from hybridstore.index import keys as hashing
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import Checkpoint, HybridIndex, ResumePlan
from hybridstore.layout import Layout, batch_row, batch_rows
from hybridstore.objects import TIER_BITS, ObjectKey, ObjectKind, object_key
from hybridstore.policy import admission_policy, eviction_policy
from hybridstore.policy.base import (
    AdmissionPolicy,
    EvictionPolicy,
    PlacementPolicy,
    abandoned_branches,
    resume_back,
)
from hybridstore.policy.placement import RequestEnd
from hybridstore.policy.tiering import TierPolicy, tier_policy
from hybridstore.store import args, staged
from hybridstore.store.copies import TierCopies
from hybridstore.store.direct import DirectPut, DirectWrites, page_bytes
from hybridstore.store.evictor import Evictor
from hybridstore.store.landing import LAYOUT_INFO, Landing
from hybridstore.store.loader import Loader
from hybridstore.store.remote import RemoteSync, open_remote
from hybridstore.store.residency import Residency
from hybridstore.store.shared import DiskFollower, adopt_entries

log = logging.getLogger("hybridstore.store")

NAMESPACE_INFO = "namespace"
"""The disk tier's info blob that records the root key of the namespace owning it."""
SECRET_INFO = "hash_secret"
"""The disk tier's info blob that keeps the store's hashing secret (the catalog is 0600)."""


def _pack_one(layout: Layout, page: Any, _i: int, slot: np.ndarray) -> None:
    """``pack(i, slot)`` of a put of one page (:meth:`HybridStore.put_kv_many`)."""
    layout.pack_into(page, slot)


def _page_plans(plans: Sequence[ResumePlan], call: str) -> tuple[list[ResumePlan], int]:
    """``plans`` checked for ``call`` (plans without a checkpoint), and their pages in all."""
    checked = [args.plan(plan) for plan in plans]
    if any(plan.state_key is not None for plan in checked):
        raise InvalidArgumentError(f"{call} restores pages only; load a plan with a "
                                   "checkpoint with load()")
    return checked, sum(len(plan.pages) for plan in checked)


class _PagesOnly:
    """What :meth:`Loader.prepare` and :meth:`Loader.run` read of a plan, for the pages of
    several (``load_many``: prepared as one plan, one pass over the index for all)."""

    __slots__ = ("page_blob", "pages", "state_key")

    def __init__(self, plans: Sequence[ResumePlan]) -> None:
        self.page_blob = b"".join(plan.page_blob for plan in plans)
        self.pages = (np.concatenate([plan.pages for plan in plans]) if len(plans) > 1
                      else plans[0].pages if plans else np.zeros(0, np.int64))
        self.state_key = None


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
        tiering: a tier policy instance that overrides ``config.tier_policy``
            (e.g. a partition with another state share).
        clock: the time requests are served at, in seconds (an engine's wall clock,
            ``time.monotonic``; the replay's simulated time), bound to the eviction policy
            (:meth:`~hybridstore.policy.base.EvictionPolicy.bind_clock`): ``hybridstore``
            dates uses, predicted returns and :meth:`expect`'s ``in_s`` by it. ``None``:
            the policy's own (``hybridstore``'s: the index's ticks).

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
                 admission: AdmissionPolicy | None = None,
                 tiering: TierPolicy | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = cfg = config or StoreConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._eviction = eviction or eviction_policy(cfg.policy)
        if clock is not None:
            self._eviction.bind_clock(clock)
        self._admission = admission or admission_policy(cfg.checkpoint_policy)
        self._placement = placement or RequestEnd()
        self.tiers: dict[str, Tier] = dict(tiers) if tiers is not None else self._open_tiers(cfg)
        for name in self.tiers:
            if name not in TIER_BITS:
                raise UnknownTierError(f"unknown tier {name!r}; tiers are {list(TIER_BITS)}")
        disk = self.tiers["disk"] if "disk" in self.tiers and self.tiers["disk"].durable else None
        shared = getattr(disk, "shared", None)
        opening = shared.evict_lease() if shared is not None else contextlib.nullcontext()
        self._layouts: dict[ObjectKind, Layout] = {}
        try:
            with opening:          # processes opening one shared directory agree on its key
                self._hash_key = self._keying(disk)
                if disk is not None:
                    self._claim(disk, self._hash_key.root(cfg.namespace))
            self._root = self._hash_key.root(cfg.namespace)
            if tiers is None and cfg.remote is not None:    # sealed under the store's key
                remote = open_remote(cfg, self._hash_key.secret, self._root, self._layouts)
                if remote is not None:
                    self.tiers["remote"] = remote
        except BaseException:
            for tier in self.tiers.values():
                tier.close()
            raise
        self.index = HybridIndex(cfg.block_size, self._root)
        self._res = res = Residency(self.index, self.tiers, tiering or tier_policy(cfg.tier_policy),
                                    cfg.block_size)
        self.residence = res.residence
        self._copies = TierCopies(res)
        self._evictor = Evictor(res, self._copies, self._eviction)
        self._landing = Landing(res, self._copies, self._evictor, self._admission, self._layouts)
        self._staging = staged.Staging(self._landing.reserved)
        self._direct = DirectWrites(self._landing, self._staging)
        self._loader = Loader(res, self._layouts, self._lock)
        self._remote = RemoteSync(res, self._layouts, self._copies.pending) \
            if "remote" in self.tiers and self.tiers["remote"].stores_bytes else None
        self._follower = DiskFollower(res, self._layouts, str(cfg.disk_path)) \
            if shared is not None else None
        if self._follower is not None:
            self._evictor.leases["disk"] = self._follower.lease
            self._evictor.waits["disk"] = self._follower.wait_s
        if self._remote is not None:
            self._copies.remote_gate = self._remote.worth_sending
        self._admission.bind(free_bytes=lambda: res.room(res.chain[0], ObjectKind.STATE),
                             tier=res.chain[0])
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hybridstore-load")
        self._counters = {"matches": 0, "hit_tokens": 0, "query_tokens": 0, "loads": 0}
        if disk is not None:
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
            # imports the I/O engines: only when used
            from hybridstore.backends.disk import DiskTier
            from hybridstore.backends.engines import select_engine

            try:
                engine = select_engine(cfg.disk_engine, cfg.io_threads,
                                       chunk_bytes=cfg.io_chunk_bytes,
                                       kvikio_keep=cfg.kvikio_keep)
                tiers["disk"] = DiskTier(cfg.disk_path, cfg.disk_bytes, engine=engine,
                                         segment_bytes=cfg.disk_segment_bytes,
                                         io_threads=cfg.io_threads, ssd_gbps=cfg.ssd_gbps,
                                         h2d_gbps=cfg.h2d_gbps,
                                         verify_checksums=cfg.verify_checksums,
                                         shared=cfg.disk_shared)
            except BaseException:
                tiers["host"].close()
                raise
        return tiers          # the remote tier opens once the store's hash key is known

    def _keying(self, disk: Tier | None) -> hashing.HashKey:
        """The store's hash key: its secret from the config, else the one the disk tier
        keeps (recorded there, 0600, on first use), else a fresh one for this process.

        Raises:
            NamespaceError: ``config.hash_secret`` differs from the secret the disk tier
                was keyed with (its keys would never match).
        """
        given = self.config.hash_secret
        positions = self.config.block_size
        if disk is None:
            return self._new_hash_key()
        recorded = disk.get_info(SECRET_INFO)
        damaged = recorded is not None and not 16 <= len(recorded) <= 64
        if damaged or (recorded is None and disk.get_info(NAMESPACE_INFO)):
            # Keyed by a secret that is gone (a damaged record, or a directory of a
            # version that hashed without one): no key of its objects can be rebuilt.
            log.warning("disk tier %s: the hash secret record is %s; its objects can never "
                        "match again and are dropped", self.config.disk_path,
                        "damaged" if damaged else "missing")
            disk.delete_many([key for key, _, _ in disk.entries()])
            disk.put_info(NAMESPACE_INFO, b"")
            recorded = None
        if recorded is None:
            key = self._new_hash_key()
            disk.put_info(SECRET_INFO, key.secret)
            return key
        if given is not None and given != recorded:
            raise NamespaceError(
                f"the disk tier at {self.config.disk_path!r} was keyed with another hash "
                "secret; open it without hash_secret (it keeps its own) or give this store "
                "its own disk_path")
        return hashing.HashKey(recorded, positions)

    def _new_hash_key(self) -> hashing.HashKey:
        """A key under ``config.hash_secret``, or under a fresh secret when none is given."""
        given, positions = self.config.hash_secret, self.config.block_size
        return hashing.HashKey(given, positions) if given is not None else \
            hashing.HashKey.generate(positions)

    def _claim(self, disk: Tier, root: bytes) -> None:
        """Record this store's namespace in a new disk directory; refuse another's."""
        recorded = disk.get_info(NAMESPACE_INFO)
        if not recorded:
            disk.put_info(NAMESPACE_INFO, root)
        elif recorded != root:
            raise NamespaceError(
                f"the disk tier at {self.config.disk_path!r} belongs to another namespace; "
                "open it with the namespace that created it, or give this one its own disk_path")

    def _reopen(self) -> None:
        """Make every object the disk tier kept matchable again (pages first).

        Damage costs exactly the damaged objects: an entry whose metadata does not
        decode is deleted with a logged reason, and a damaged layout record costs the
        objects of its kind (their bytes cannot be interpreted without it).
        """
        disk = self.tiers["disk"]
        lost: set[ObjectKind] = set()
        for kind in (ObjectKind.PAGE, ObjectKind.STATE):
            raw = disk.get_info(LAYOUT_INFO[kind])
            if raw is not None:
                try:
                    self._layouts[kind] = Layout.from_json(raw)
                except CatalogError as e:
                    log.warning("disk tier %s: the %s layout record is damaged (%s); dropping "
                                "every %s object", self.config.disk_path, kind.name.lower(), e,
                                kind.name.lower())
                    lost.add(kind)
        damaged = adopt_entries(self._res, disk.entries(), lost, str(self.config.disk_path))
        if damaged:
            disk.delete_many([ObjectKey(k) for k in damaged])

    def _refresh(self, prompt: PrefixKeys | None = None) -> None:
        """Before a call reads or lands objects (under the store lock): settle finished
        copies, take in what the processes sharing the disk directory changed, and ask the
        remote tier about ``prompt``."""
        self._copies.drain()
        self._direct.drain()
        if self._follower is not None:
            self._follower.pull()
        if prompt is not None and self._remote is not None:
            self._remote.sync(prompt)

    # -- keys -------------------------------------------------------------------------
    def prefix(self, tokens: Any) -> PrefixKeys:
        """Hash a prompt once; every call below also accepts the result."""
        if isinstance(tokens, PrefixKeys):
            if tokens.root != self._root:
                raise NamespaceError("this prompt was hashed under another namespace's root; "
                                     "build it with this store's prefix() / engine_prefix()")
            return tokens
        return PrefixKeys.from_tokens(tokens, block_size=self.config.block_size, root=self._root,
                                      hash_key=self._hash_key)

    def prefix_from_block_ids(self, block_ids: Sequence[int] | np.ndarray,
                              length: int | None = None) -> PrefixKeys:
        """A prompt given as already-hashed block ids (as traces carry them)."""
        if not args.is_sequence(block_ids):
            raise InvalidTokensError(f"block_ids must be a sequence of ints, got "
                                     f"{type(block_ids).__name__}")
        return PrefixKeys.from_block_ids(block_ids, block_size=self.config.block_size,
                                         root=self._root, hash_key=self._hash_key,
                                         length=args.optional_whole(length, "length"))

    def engine_prefix(self, keys: Sequence[Any], *, prefix: Sequence[Any] | None = (),
                      length: int | None = None) -> PrefixKeys:
        """A sequence given as an engine's chained page hashes instead of token ids.

        SGLang's HiCache hands its storage backend one 64-hex SHA-256 chain hash per
        page; vLLM's offloading connector one block hash (+ group index) per chunk.
        Either names a whole prefix, so pages are keyed by it, and a state by the
        hash of the page it ends (``put_state(prompt, state, position=p)`` at a page
        end ``p``).  The result goes to every call that takes token ids.

        Args:
            keys: the hashes of consecutive pages (``str`` or ``bytes``).
            prefix: the hashes of the pages before ``keys[0]``, from position 0
                (``()``: ``keys[0]`` is the sequence's first page).  ``None``:
                not known; the store finds ``keys[0]`` among the pages it holds
                and takes the chain before it from its index.
            length: tokens in the sequence; defaults to a whole number of pages
                (a shorter length makes the last page partial).

        Raises:
            UnknownPrefixError: ``prefix`` is ``None`` and the store holds no page
                under ``keys[0]`` (nothing can be placed or found for ``keys``).
            InvalidTokensError: a hash is neither ``str`` nor bytes, or ``length``
                does not fit the pages.
        """
        B = self.config.block_size
        keys = args.key_list(keys, "keys")
        length = args.optional_whole(length, "length")
        if prefix is not None:
            return PrefixKeys.from_engine_keys([*args.key_list(prefix, "prefix"), *keys],
                                               block_size=B, root=self._root, length=length)
        if not len(keys):
            raise UnknownPrefixError("engine_prefix(prefix=None) needs at least one key to resolve")
        head = hashing.keys_to_bytes(hashing.engine_keys(keys[:1], self._root))[0]
        with self._lock:
            nid = self.index.find_node(head)
            if nid < 0:
                raise UnknownPrefixError(
                    "the first engine key is not a page this store holds, so its place in the "
                    "sequence is unknown; pass the keys of the pages before it as prefix= "
                    "(SGLang: set hicache_storage_pass_prefix_keys)")
            before = self.index.path_keys(nid)[:-1]
        if length is not None:
            length += len(before) * B
        return PrefixKeys.from_engine_keys(keys, block_size=B, root=self._root, length=length,
                                           before=before)

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
        if not batch:
            raise MisalignedPageError("put_kv got no pages; pass one page or a list of them")
        first = self._landing.first_block(prompt, len(batch))
        with self._lock:
            self._check_open()
            self._refresh()
            layout = self._landing.layout(ObjectKind.PAGE, batch[0], "page", batch[1:])
            return self._landing.put_pages(prompt, first, layout.nbytes,
                                           lambda i, slot: layout.pack_into(batch[i], slot))

    def put_kv_batch(self, tokens: Any, batch: Any, *, count: int | None = None) -> int:
        """Store the KV pages of consecutive blocks ending at ``len(tokens)`` from one
        page-major batch (the layout ``load(plan, into=(batch, state))`` fills).

        New pages land in the pinned pool a run at a time: slots for the run are
        staged together and each layout entry of the whole run is one scatter of
        batch rows into them, instead of a copy per page.  A GPU batch is copied
        to host one run at a time first.

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
        n = rows if count is None else args.whole(count, "count")
        if not 0 < n <= rows:
            raise MisalignedPageError(f"count={count} pages, but the batch has {rows} rows; "
                                      "pass 1 <= count <= rows")
        first = self._landing.first_block(prompt, n)
        with self._lock:
            self._check_open()
            self._refresh()
            layout = self._landing.layout(ObjectKind.PAGE, batch_row(batch, 0), "page")
            scatter = self._landing.batch_scatter(layout.batch_targets(batch, n))
            return self._landing.put_pages(
                prompt, first, layout.nbytes,
                lambda i, slot: layout.pack_into(batch_row(batch, i), slot), scatter)

    def put_kv_many(self, prompts: Sequence[Any], pages: Sequence[Any]) -> int:
        """Store the last page of each of several prompts, in one call.

        For engines that hand the store a batch of unrelated chunks (vLLM's
        tiering manager: one job of chunks keyed by their own hashes): one
        store-lock hold for all, and their write-through to slower tiers as one
        batch (the disk tier lays them side by side and writes neighbours in one
        I/O; a later :meth:`load_many` of them reads them back the same way).
        The bytes are copied into the fastest tier outside the store lock: slots
        are reserved under it, filled without it, committed under it again.

        Args:
            prompts: token ids or :class:`PrefixKeys`, one per page (e.g.
                ``engine_prefix([key], prefix=())`` of a chunk).
            pages: the page that ends each prompt (tensor/array or dict of them).

        Returns:
            The number of pages newly stored (pages already held are touched).
        """
        if len(prompts) != len(pages):
            raise InvalidArgumentError(f"put_kv_many got {len(prompts)} prompts and "
                                       f"{len(pages)} pages; pass one page per prompt")
        if not len(prompts):
            return 0
        keyed = [self.prefix(t) for t in prompts]
        firsts = [self._landing.first_block(p, 1) for p in keyed]
        with self._lock:
            self._check_open()
            self._refresh()
            layout = self._landing.layout(ObjectKind.PAGE, pages[0], "page", pages[1:])
            if not self.tiers[self._res.chain[0]].stores_bytes:
                stored = 0       # accounting tiers: nothing to copy
                for prompt, first, page in zip(keyed, firsts, pages):
                    stored += self._landing.put_pages(prompt, first, layout.nbytes,
                                                      partial(_pack_one, layout, page))
                return stored
            tier = self.tiers[self._res.chain[0]]
            step = max(1, tier.capacity_bytes // 8 // max(1, tier.charge(layout.nbytes)))
        stored = 0
        for lo in range(0, len(keyed), step):      # a bounded share of the tier at a time
            part = keyed[lo:lo + step]
            with self._lock:
                self._check_open()
                new = staged.stage(self._landing, self._staging, part, layout.nbytes)
            try:       # the copies run outside the store lock (several calls copy at once)
                for i, slot in zip(new.index, new.slots):
                    layout.pack_into(pages[lo + i], slot)
            except BaseException:
                with self._lock:
                    staged.abort(self._landing, self._staging, new)
                raise
            with self._lock:
                self._check_open()
                stored += staged.commit(self._landing, self._staging, new, part)
        return stored

    def write_kv_many(self, prompts: Sequence[Any], pages: Sequence[Any], *,
                      tier: str = "disk") -> DirectPut:
        """Store the last page of each of several prompts straight into a slower tier.

        For engines that keep the bytes in DRAM of their own and want the store as the
        tier beneath it (vLLM's ``HybridStoreTier`` under vLLM's CPU primary tier): each
        page is written from the caller's buffer to ``tier`` (neighbouring slots in one
        I/O), without a copy into the pinned pool, which it does not fill.  Pages some
        tier already holds are touched.  The index learns of a page once it is durable
        (``durable``), from the next store call on; the caller's buffer is free once
        ``written`` completes (:mod:`~hybridstore.store.direct`).  :meth:`flush` waits
        for them all.

        Args:
            prompts: token ids or :class:`PrefixKeys`, one per page (e.g.
                ``engine_prefix([key], prefix=())`` of a chunk).
            pages: the page that ends each prompt (tensor/array or dict of them); a
                contiguous host tensor is written from in place.
            tier: the tier written to (a byte tier below the fastest one).

        Returns:
            A :class:`~hybridstore.store.direct.DirectPut`: which pages were held,
            are being written (with their ``written`` and ``durable`` futures) or
            found no room.

        Raises:
            UnknownTierError: the store has no such tier.
            InvalidArgumentError: ``tier`` is the fastest tier (use :meth:`put_kv_many`)
                or keeps no bytes.
            LayoutMismatchError: a page does not have the store's page layout.
        """
        if len(prompts) != len(pages):
            raise InvalidArgumentError(f"write_kv_many got {len(prompts)} prompts and "
                                       f"{len(pages)} pages; pass one page per prompt")
        tier = args.tier_name(tier, list(self.tiers))
        if tier == self._res.chain[0] or not self.tiers[tier].stores_bytes:
            raise InvalidArgumentError(f"write_kv_many writes to a byte tier below the fastest "
                                       f"one; {tier!r} is not (use put_kv_many)")
        if not len(prompts):
            return DirectPut()
        keyed = [self.prefix(t) for t in prompts]
        for p in keyed:
            self._landing.first_block(p, 1)
        with self._lock:
            self._check_open()
            layout = self._landing.layout(ObjectKind.PAGE, pages[0], "page")
        datas = [page_bytes(layout, page) for page in pages]     # views; packed if need be
        with self._lock:
            self._check_open()
            self._refresh()
            return self._direct.submit(keyed, datas, layout.nbytes, tier)

    def put_kv_sized(self, tokens: Any, *, nbytes: int, first_block: int = 0) -> int:
        """Record pages by size only (accounting tiers: the trace simulator).

        Args:
            tokens: the prompt (token ids, or :class:`PrefixKeys` from block ids).
            nbytes: bytes of one page.
            first_block: the first block to record; every later block of the
                prompt is recorded too.
        """
        prompt = self.prefix(tokens)
        nbytes = args.whole(nbytes, "nbytes", low=1)
        first_block = args.whole(first_block, "first_block")
        with self._lock:
            self._check_open()
            self._refresh()
            return self._landing.put_pages(prompt, first_block, nbytes, None)

    def put_kv_page(self, tokens: Any, page: Any, *, end: int) -> int:
        """Store the page of the block ending at ``end`` of a longer prompt.

        Raises:
            MisalignedPageError: ``end`` is neither a block end nor the
                prompt's length.
        """
        prompt = self.prefix(tokens)
        B = self.config.block_size
        end = args.whole(end, "end")
        if not 0 < end <= prompt.length or (end % B and end != prompt.length):
            raise MisalignedPageError(
                f"a page must end at a multiple of block_size={B} or at the prompt's end "
                f"({prompt.length}); got end={end}. Round it to a block end.")
        if end == prompt.length:
            return self.put_kv(prompt, page)
        if prompt.tokens is not None:
            return self.put_kv(self.prefix(prompt.tokens[:end]), page)
        return self.put_kv(PrefixKeys(block_size=B, length=end, root=prompt.root,
                                      keys=prompt.keys[: end // B], tokens=None,
                                      hash_key=prompt.hash_key), page)

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
        p = self._landing.state_position(prompt, args.optional_whole(position, "position"))
        with self._lock:
            self._check_open()
            self._refresh()
            layout = self._landing.layout(ObjectKind.STATE, state, "state")
            return self._landing.put_state(prompt, p, layout.nbytes,
                                           lambda slot: layout.pack_into(state, slot))

    def put_state_sized(self, tokens: Any, *, nbytes: int, position: int | None = None) -> bool:
        """Record a checkpoint by size only (accounting tiers: the trace simulator)."""
        prompt = self.prefix(tokens)
        nbytes = args.whole(nbytes, "nbytes", low=1)
        p = self._landing.state_position(prompt, args.optional_whole(position, "position"))
        with self._lock:
            self._check_open()
            self._refresh()
            return self._landing.put_state(prompt, p, nbytes, None)

    def age_sized(self, tokens: Any, *, first_block: int, last_used: Sequence[int] | np.ndarray) -> None:
        """Rank pages recorded by size as last used at earlier logical times (accounting
        tiers: the trace simulator's second copies of vLLM's blocks, which rank as the older
        copy they stand for; ``replay/sim.py``, ``put_duplicates``).

        Args:
            tokens: the prompt (token ids, or :class:`PrefixKeys` from block ids).
            first_block: the first page to age.
            last_used: one logical time per page from ``first_block`` on (see
                :meth:`~hybridstore.index.trie.HybridIndex.now`); a page already older keeps
                its own.
        """
        prompt = self.prefix(tokens)
        first_block = args.whole(first_block, "first_block")
        with self._lock:
            self._check_open()
            self._refresh()
            self.index.age_pages(prompt, first_block, np.asarray(last_used, np.int64))
            self._evictor.forget_rankings()

    # -- match / load / release ---------------------------------------------------------
    def match(self, tokens: Any, *, max_position: int | None = None,
              again: bool = False) -> ResumePlan:
        """The deepest complete resume point of a prompt; pinned until :meth:`release`.

        Args:
            tokens: token ids, or a :class:`PrefixKeys` (also from block ids).
            max_position: do not resume past this position (engines that
                must compute the last token's logits pass ``len - 1``).
            again: the engine asks again for a request it has matched before (vLLM looks
                a waiting request up at every step it tries to schedule it, and once more
                when it loads): the plan is pinned as usual, but the policies see no new
                use (no return gap learnt, no resume counted, no hit in :meth:`stats`).
        """
        prompt = self.prefix(tokens)
        max_position = args.optional_whole(max_position, "max_position")
        if not isinstance(again, bool):
            raise InvalidArgumentError(f"again must be a bool, got {type(again).__name__}")
        with self._lock:
            self._check_open()
            self._refresh(prompt)
            if again:
                return self.index.match(prompt, max_position)
            self._eviction.on_match(self.index, prompt)
            plan = self.index.match(prompt, max_position)
            if plan.state_key is not None:
                ck = self.index.checkpoint(plan.state_key)
                assert ck is not None
                self._eviction.on_hit(self.index, ck)
                limit = prompt.length if max_position is None else min(max_position, prompt.length)
                continues = prompt.length - plan.kv_tokens >= prompt.block_size
                if self._eviction.demotes_abandoned:
                    self._eviction.on_abandon(self.index, abandoned_branches(
                        ck, limit, plan.kv_tokens, continues=continues))
                horizon = self._placement.resume_horizon
                if horizon:
                    self._placement.on_resume(resume_back(
                        ck, limit, plan.kv_tokens, continues=continues, horizon=horizon))
            self._counters["matches"] += 1
            self._counters["hit_tokens"] += plan.position
            self._counters["query_tokens"] += prompt.length
            return plan

    def expect(self, tokens: Any, *, max_position: int | None = None, in_s: float = 0.0) -> int:
        """A request continuing this prompt is expected ``in_s`` seconds from now: keep what
        it resumes from until then (or, with ``in_s=math.inf``, none is: it may go first).

        ``in_s=0`` (the default): the request waits in the engine's queue. An engine calls
        this for a request it has queued and will not look up until it serves it (the
        replay's server discipline does: ``sim.server_loop``); a session whose next turn is
        delayed by the queue looks overdue, and an order that reads overdue as gone would
        evict exactly the context the queue is about to need. The expectation holds until a
        request resumes there. (vLLM looks a waiting request up whenever it tries to
        schedule it, a use that keeps it as well, and SGLang's HiCache prefetches a request
        when it queues it, so neither adapter calls this.)

        ``in_s > 0``: an orchestrator that knows when the session comes back (an agent
        waiting on a tool call with a known duration, a scheduled turn) says so; the
        expectation holds until a request resumes there or its time has passed, then the
        policy's own prediction takes over. ``in_s=math.inf``: the session is over (an
        agent's task ended, a conversation was closed); its own checkpoints, up to where
        another session shares the prefix, rank as an abandoned branch's until a request
        resumes there after all. This is what the orchestrator KV hints of vLLM, SGLang and
        Dynamo (an estimated resume time, a session's end) carry;
        ``docs/replay.md`` measures what exact and noisy ones are worth.

        The eviction policy weighs it against its own prediction
        (:meth:`~hybridstore.policy.base.EvictionPolicy.on_expect`; ``hybridstore``'s
        :class:`~hybridstore.policy.nextuse.ReturnGaps`). Nothing is pinned or counted as a
        lookup; :meth:`match` when the request is served.

        ``in_s`` counts on the store's ``clock`` (``HybridStore(cfg, clock=time.monotonic)``
        for seconds; the replay binds its simulated time). Without one, ``hybridstore``
        dates uses by the index's ticks, and ``in_s`` counts ticks.

        Args:
            tokens: token ids, or a :class:`PrefixKeys` (also from block ids): the prompt
                the next request continues (a queued request's own prompt).
            max_position: as :meth:`match`'s.
            in_s: time from now until the request comes (>= 0; ``math.inf``: never).

        Returns:
            the position the request would resume at if served now (0: none).
        """
        return self._tell(tokens, max_position, args.seconds(in_s, "in_s"),
                          self._eviction.on_expect)

    def finished(self, tokens: Any, *, max_position: int | None = None, in_s: float = 0.0) -> int:
        """The request that continued this prompt finishes decoding ``in_s`` seconds from now
        (0: it just did).

        An agent's next turn comes a tool call after its last one *ended*, not after it
        arrived: the time between a turn's arrival and its end is the engine's (prefill, then
        one decode step per output token), the rest is the agent's. ``hybridstore`` learns
        each trajectory's return gaps from the end of its last use when told it
        (:meth:`~hybridstore.policy.nextuse.ReturnGaps.finish`), so a turn that decodes a long
        answer is not predicted back as soon as one that decodes a short one. An engine calls
        this when a request finishes (the vLLM adapter does, once the request's stores are
        done); the replay calls it with its model's decode time (docs/replay.md, "Gaps count
        from the end of a turn").
        Nothing is pinned or counted as a lookup.

        Args:
            tokens: token ids, or a :class:`PrefixKeys`: the finished request's prompt.
            max_position: as :meth:`match`'s.
            in_s: time from now until the request's last output token (>= 0, finite).

        Returns:
            the position of the checkpoint the finish was recorded on (0: none held).
        """
        in_s = args.seconds(in_s, "in_s")
        if in_s == float("inf"):
            raise InvalidArgumentError("in_s of a finish must be finite (a request that never "
                                       "finishes is not one)")
        return self._tell(tokens, max_position, in_s, self._eviction.on_finish)

    def _tell(self, tokens: Any, max_position: Any, in_s: float,
              hook: Callable[[HybridIndex, Checkpoint, float], None]) -> int:
        """``hook`` (the policy's ``on_expect`` or ``on_finish``) on the
        checkpoint the prompt would resume from; its position (0: none held)."""
        prompt = self.prefix(tokens)
        max_position = args.optional_whole(max_position, "max_position")
        with self._lock:
            self._check_open()
            ck = self.index.resume_checkpoint(prompt, max_position)
            if ck is None:
                return 0
            hook(self.index, ck, in_s)
            return ck.position

    def match_pages(self, tokens: Any, *, first: int = 0, stop: int | None = None) -> ResumePlan:
        """Pin the held pages of blocks ``[first, stop)`` without a checkpoint.

        For models with no recurrent layers, and for engines that fetch a range
        of pages (SGLang's page calls).  The run ends at the first page no tier
        holds.  :meth:`load` restores the plan's pages (its ``state`` is
        ``None``); :meth:`release` it after.

        Args:
            tokens: token ids or a :class:`PrefixKeys` (e.g. :meth:`engine_prefix`).
            first: the first block to pin (``plan.first_page``).
            stop: one past the last block; defaults to the prompt's last block.
        """
        prompt = self.prefix(tokens)
        first = args.whole(first, "first")
        stop = args.optional_whole(stop, "stop")
        if first < 0 or (stop is not None and stop < first):
            raise InvalidTokensError(f"page range [{first}, {stop}) is negative or reversed; "
                                     "pass 0 <= first <= stop")
        end = prompt.nblocks if stop is None else min(stop, prompt.nblocks)
        with self._lock:
            self._check_open()
            self._refresh(prompt)
            plan = self.index.pin_pages(prompt, first, max(end, first))
            self._counters["matches"] += 1
            return plan

    def present_pages(self, tokens: Any) -> int:
        """How many leading pages of a prompt some tier holds (its KV hit, in pages)."""
        prompt = self.prefix(tokens)
        with self._lock:
            self._check_open()
            self._refresh(prompt)
            return self.index.held_run(prompt)

    def restorable(self, tokens: Any, *, max_position: int | None = None) -> list[int]:
        """Every position where a prompt can resume, ascending; nothing is pinned.

        A position ``p`` is listed when some tier holds every page of ``[0, p)``
        and the checkpoint at ``p`` (what :meth:`match` requires; its answer is the
        last entry).  SGLang's ``restorable_prefix_pages`` is this list in pages.
        """
        prompt = self.prefix(tokens)
        max_position = args.optional_whole(max_position, "max_position")
        with self._lock:
            self._check_open()
            self._refresh(prompt)
            return self.index.restorable(prompt, max_position)

    def release(self, plan: ResumePlan) -> None:
        """Drop the plan's pins (each plan is released exactly once)."""
        plan = args.plan(plan)
        with self._lock:
            self.index.release(plan)

    def restore_cost(self, plan: ResumePlan) -> dict[str, tuple[int, float]]:
        """Bytes and modeled seconds to restore ``plan``, per tier it would read from.

        Each object is read from the fastest tier holding it; a tier's
        ``read_seconds`` models its path into engine memory (HiState eq. 2:
        ``X / B_H2D`` from DRAM, ``X / B_SSD + X / B_H2D`` from SSD).
        """
        plan = args.plan(plan)
        with self._lock:
            if not self.index.is_live(plan):
                raise PlanReleasedError(f"plan {plan.plan_id} was released; match again first")
            sizes: dict[str, int] = {}
            if len(plan.pages):
                cols = self.index.page_columns(plan.pages)
                taken = np.zeros(len(plan.pages), bool)
                for name in self._res.chain:
                    here = ~taken & ((cols["tiers"] & TIER_BITS[name]) != 0)
                    if here.any():
                        sizes[name] = int(cols["nbytes"][here].sum())
                    taken |= here
            if plan.state_key is not None:
                ck = self.index.checkpoint(plan.state_key)
                assert ck is not None
                name = self._res.holder(ck.tiers)
                sizes[name] = sizes.get(name, 0) + ck.nbytes
            return {name: (n, self.tiers[name].read_seconds(n)) for name, n in sizes.items()}

    def _check_live(self, plans: Sequence[ResumePlan]) -> None:
        """Under the lock: PlanReleasedError for a plan released before its load."""
        for plan in plans:
            if not self.index.is_live(plan):
                raise PlanReleasedError(f"plan {plan.plan_id} was released; match again "
                                        "before load")

    def load(self, plan: ResumePlan, into: tuple[Any, Any] | None = None, *,
             skip_tiers: Sequence[str] = (), skip_pages: int = 0) -> Future:
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
                instead of a copy per page; or ``None`` when ``skip_pages``
                skips them all (the checkpoint only).  A host buffer that
                holds one whole object is read into in place from the SSD.
            skip_tiers: objects whose fastest holder is one of these tiers are
                not read (their slot in the result is ``None``, their ``into``
                buffer untouched): an engine passes ``("device",)`` for what is
                already resident in its own GPU memory.
            skip_pages: the plan's first pages not to read, the same way (the
                engine already holds them); ``len(plan.pages)`` restores only the
                checkpoint.  Their pins are kept until :meth:`release`.

        Returns:
            A future of ``(pages, state)``: the pages covering
            ``[0, plan.position)`` in order and the checkpoint at
            ``plan.position`` (``([], None)`` for an empty plan).  With
            ``into`` the filled buffers are returned (the batch itself for a
            page-major batch).
        """
        plan = args.plan(plan)
        skip_tiers = args.tier_names(skip_tiers, "skip_tiers")
        skip_pages = args.whole(skip_pages, "skip_pages", high=len(plan.pages))
        if into is not None and (not isinstance(into, (tuple, list)) or len(into) != 2):
            raise InvalidArgumentError("into must be a (pages, state_buffers) pair; pass None "
                                       "for new arrays")
        with self._lock:
            self._check_open()
            self._check_live((plan,))
            targets = (self._loader.check_into(plan, into, skip_pages) if into is not None
                       else None)
            jobs, sources = self._loader.prepare(plan, skip_tiers, skip_pages)
            try:
                fut = self._io.submit(self._loader.run, plan, jobs, sources, into, targets)
            except BaseException:
                self._loader.release_sources(jobs, sources)   # the pool slots held for this load
                raise
            self._counters["loads"] += 1
        return fut

    def load_many(self, plans: Sequence[ResumePlan], into: Sequence[Any]) -> Future:
        """Restore the pages of several live page plans (:meth:`match_pages`) as one load.

        Every page of every plan is read in one pass: from a byte tier with one
        ``read_many_into`` (the disk tier reads objects that lie side by side,
        e.g. those one :meth:`put_kv_many` wrote, with one I/O of up to 8 MiB and
        runs the rest in parallel), from the pinned pool by copy.

        Args:
            plans: live plans without a checkpoint (``match_pages``).
            into: one page buffer per page of the plans, in order (the plans'
                pages concatenated).

        Returns:
            A future of the filled buffers (a list).  The plans stay pinned until
            :meth:`release`.
        """
        plans, n = _page_plans(plans, "load_many")
        bufs = list(into)
        if len(bufs) != n:
            raise LayoutMismatchError(f"into has {len(bufs)} page buffers; the plans restore {n}")
        with self._lock:
            self._check_open()
            self._check_live(plans)
            merged = cast(ResumePlan, _PagesOnly(plans))
            jobs, sources = self._loader.prepare(merged, (), 0)
            try:
                layout = self._layouts.get(ObjectKind.PAGE)
                if n and layout is None:
                    raise LayoutMismatchError("the store holds no page layout yet")
                targets = [layout.targets(buf) for buf in bufs] if layout is not None else []
                fut = self._io.submit(self._loader.run, merged, jobs, sources, (bufs, None),
                                      targets, plans)
            except BaseException:
                self._loader.release_sources(jobs, sources)
                raise
            self._counters["loads"] += 1
        out: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(f.result()[0])

        fut.add_done_callback(done)
        return out

    def load_rows(self, plans: Sequence[ResumePlan], array: Any, rows: Sequence[int]) -> None:
        """Restore the pages of live page plans into rows of one host array, on this thread.

        For an engine whose host cache is one array of page rows and whose transfers run
        on job threads of its own: vLLM's primary CPU tier (``(num_chunks, chunk_bytes)``)
        under its ``TieringOffloadingManager``, whose secondary tier runs each job on its
        own pool (:class:`~hybridstore.adapters.vllm.HybridStoreTier`).  Page ``i`` of the
        plans (their pages concatenated) lands in row ``rows[i]``: read from the SSD
        straight into the row (the disk tier reads rows spaced like their slots with one
        I/O, :meth:`load_many`'s rule) or copied from the pinned pool.  Against
        :meth:`load_many` the array is checked once for all of its rows instead of a buffer
        per page, and the reads are issued and waited for here, not on the store's load
        threads: the call returns once every row is written.

        Args:
            plans: live plans without a checkpoint (:meth:`match_pages`); they stay pinned
                until :meth:`release`.
            array: a writable, C-contiguous host array (numpy, or a CPU torch tensor) whose
                rows each hold one page of the stored page layout (one tensor: the row's
                dtype and shape are the layout's).
            rows: the row of each page, in ``[0, len(array))``.

        Raises:
            PlanReleasedError: a plan was released.
            LayoutMismatchError: ``rows`` and the plans' pages differ in number, or the
                array's rows do not hold the page layout.
            InvalidArgumentError: a plan has a checkpoint, or a row is out of range.
            CorruptObjectError, BackendIOError: a read failed (the object is dropped, as by
                :meth:`load`); rows of other pages may have been written.
        """
        plans, n = _page_plans(plans, "load_rows")
        with self._lock:
            self._check_open()
            self._check_live(plans)
            if not n:
                return
            layout = self._layouts.get(ObjectKind.PAGE)
            if layout is None:
                raise LayoutMismatchError("the store holds no page layout yet")
            view = layout.rows_bytes(array)
            at = args.indices(rows, "rows", len(view))
            if len(at) != n:
                raise LayoutMismatchError(f"rows has {len(at)} rows; the plans restore {n} pages")
            jobs, sources = self._loader.prepare(cast(ResumePlan, _PagesOnly(plans)), (), 0)
            self._counters["loads"] += 1
        self._loader.run_rows(jobs, sources, view, at, plans)

    # -- eviction ---------------------------------------------------------------------
    def evict(self, nbytes: int, tier: str = "host") -> int:
        """Free at least ``nbytes`` of ``tier`` if the policy and pins allow.

        Returns:
            Bytes freed (may be less when pinned or needed objects remain).
        """
        nbytes = args.whole(nbytes, "nbytes")
        tier = args.tier_name(tier, list(self.tiers))
        with self._lock:
            self._check_open()
            self._refresh()
            return self._evictor.evict(tier, nbytes)

    def make_room(self, nbytes: int, kind: ObjectKind = ObjectKind.PAGE) -> None:
        """Evict from the fastest tier until ``nbytes`` of ``kind`` fit (its partition, if
        the tier policy splits it): an engine's allocation before a prefill, which computes
        its new segment into fresh KV whatever the cache held past the resume point.

        Raises:
            ObjectTooLargeError: ``nbytes`` exceeds the whole tier.
            CapacityError: what is left is pinned by live plans or needed.
        """
        nbytes = args.whole(nbytes, "nbytes")
        with self._lock:
            self._check_open()
            self._copies.drain()
            self._evictor.make_room(self._res.chain[0], nbytes, ObjectKind(kind))

    def promote(self, tokens: Any, *, positions: Sequence[int] = (), tier: str | None = None,
                sources: Sequence[str] | None = None) -> int:
        """Copy into ``tier`` what it lacks of a prompt: the pages of its leading blocks the
        index knows and its checkpoints at ``positions``, each from the fastest of
        ``sources`` that holds it.  What an engine whose own cache is the fastest tier holds
        after it loaded or recomputed the prompt (vLLM caches the blocks it loads from its
        CPU offloading tier in its GPU block pool).  Best effort: a copy that finds ``tier``
        full of pinned or needed objects is skipped.

        Args:
            tokens: the prompt (token ids or :class:`PrefixKeys`).
            positions: checkpoint positions to bring up too (those the index lacks are skipped).
            tier: the tier copied into; ``None``: the fastest.
            sources: tiers copied from, fastest first; ``None``: every other tier.

        Returns:
            Objects copied.
        """
        prompt = self.prefix(tokens)
        positions = args.positions(positions, "positions")
        chain = self._res.chain
        dst = chain[0] if tier is None else args.tier_name(tier, list(self.tiers))
        allowed = set(chain) if sources is None else set(args.tier_names(sources, "sources"))
        srcs = [t for t in chain if t != dst and t in allowed]
        copied = 0
        with self._lock:
            self._check_open()
            self._refresh(prompt)
            bit = TIER_BITS[dst]

            def copy(okey: ObjectKey, kind: ObjectKind, mask: int, nbytes: int) -> None:
                nonlocal copied
                src = next((t for t in srcs if mask & TIER_BITS[t]), None)
                if src is None:
                    return
                try:
                    self._copies.copy(okey, kind, nbytes, b"", src, dst)
                    copied += 1
                except CapacityError:
                    pass

            ids = self.index.known_ids(prompt)
            cols = self.index.page_columns(ids, ("tiers", "nbytes"))
            for k in np.flatnonzero((cols["tiers"] & bit) == 0).tolist():
                copy(object_key(ObjectKind.PAGE, prompt.block_key(k)), ObjectKind.PAGE,
                     int(cols["tiers"][k]), int(cols["nbytes"][k]))
            for pos in positions:
                key = prompt.key_at(pos) if pos else None
                ck = self.index.checkpoint(key) if key is not None else None
                if ck is not None and not ck.tiers & bit:
                    copy(object_key(ObjectKind.STATE, ck.key), ObjectKind.STATE, ck.tiers, ck.nbytes)
        return copied

    # -- engine helpers -------------------------------------------------------------
    def checkpoint_positions(self, *, cached: int, length: int, anchors: Sequence[int] = ()) -> list[int]:
        """Positions of a new segment ``(cached, length]`` where the engine should capture states."""
        cached, length = args.whole(cached, "cached"), args.whole(length, "length")
        anchors = args.positions(anchors, "anchors")
        with self._lock:
            return self._placement.positions(cached=cached, length=length, anchors=anchors,
                                             stats=self.residence)

    def flush(self) -> None:
        """Wait until every disk write has completed and is recorded in the index."""
        with self._lock:
            self._copies.wait_pending()
            self._direct.wait()

    def stats(self) -> dict[str, Any]:
        """Counters of the index, each tier and the store's calls."""
        with self._lock:
            self._refresh()
            out: dict[str, Any] = dict(self._counters)
            out["evictions"] = self._evictor.evictions
            out["relocations"] = self._evictor.relocations
            # the evictor's last resort (Evictor.unblock): pages moved down, states dropped
            out["demotions"] = self._evictor.demotions
            out["dropped_checkpoints"] = self._evictor.dropped_checkpoints
            out["corrupt"] = self._loader.corrupt
            out["skipped_copies"] = self._copies.skipped_copies
            out["direct_write_failures"] = self._direct.failed
            out["pages"] = self.index.n_pages
            out["checkpoints"] = self.index.n_checkpoints
            out["token_hit_rate"] = (self._counters["hit_tokens"] / self._counters["query_tokens"]
                                     if self._counters["query_tokens"] else 0.0)
            out["loaded_bytes"] = dict(self._loader.loaded_bytes)
            out["tiers"] = {name: tier.stats() for name, tier in self.tiers.items()}
            out["native"] = _native.in_use()
            return out

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight writes, then close every tier.  Idempotent."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._copies.closed = True
            self._direct.closed = True
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
