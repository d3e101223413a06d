"""hybridstore as SGLang 0.5.23's HiCache storage backend (L3): :class:`HybridStoreHiCache`.

Launch (``docs/engines/sglang.md`` has the whole story)::

    python -m sglang.launch_server --model-path M --page-size 64 \\
      --enable-hierarchical-cache --hicache-mem-layout page_first_direct \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"hybridstore","module_path":"hybridstore.adapters.sglang",
        "class_name":"HybridStoreHiCache","interface_v1":1,
        "hicache_storage_pass_prefix_keys":true,
        "disk_path":"/nvme/hs","disk_bytes":"512GiB","host_bytes":"16GiB"}'

SGLang keeps the GPU <-> pinned-host copies (its L2); the backend moves pages
between SGLang's host pools and the store.  The calls and the threads they come
from (``managers/cache_controller.py``, ``hybrid_cache/hybrid_cache_controller.py``):

* ``batch_set`` / ``batch_set_v1`` (backup thread): ``put_kv`` / ``put_kv_batch``,
  pages keyed by SGLang's page hashes;
* ``batch_set_v2`` with ``MAMBA`` (backup, before the node's KV pages):
  ``put_state`` at the end of the page the key names;
* ``batch_exists`` / ``batch_exists_v2`` (prefetch and scheduler threads):
  ``present_pages`` / ``restorable``;
* ``batch_get`` / ``batch_get_v1`` (prefetch_io_aux): ``match_pages`` + ``load``;
* ``batch_get_v2`` with ``MAMBA`` (prefetch_io_aux): ``match`` + ``load``;
* ``clear`` / ``close`` / ``get_stats`` (scheduler): drop the rank's store /
  close it / SGLang's ``StorageMetrics``.

Keys: SGLang hands over chained 64-hex SHA-256 page hashes, never token ids.
The store places a page by the hashes of every page before it: SGLang passes
them as ``extra_info.prefix_keys`` when the extra config says
``"hicache_storage_pass_prefix_keys": true``.  Without them the adapter finds
the chain through its index, which knows it only for pages it holds, so a
sequence's first pages cannot be written: those writes are refused (a logged
warning, once, naming the flag).  SGLang's legacy page functions
(``_generic_page_set`` / ``_generic_page_get``) build that ``extra_info`` and
do not pass it on; the adapter reads it from their frame (:func:`_legacy_extra_info`).

Every IO call is best effort: a failure is logged and answered as a miss
(``False`` / ``None`` / 0 hits), never raised into the engine.  All methods are
thread-safe (the store is).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hybridstore import HybridStore, PrefixKeys
from hybridstore.adapters.sglang_config import (
    RankIdentity,
    SGLangSettings,
    store_config,
)
from hybridstore.adapters.sglang_pages import (
    KVPages,
    PageViews,
    layout_tag,
    state_bytes,
)
from hybridstore.errors import ConfigError, UnknownPrefixError
from hybridstore.objects import aligned_empty

__all__ = ["HybridStoreHiCache"]

log = logging.getLogger("hybridstore.adapters.sglang")

T = TypeVar("T")

_LEGACY_CALLERS = ("_generic_page_set", "_generic_page_get")


def _legacy_extra_info() -> HiCacheStorageExtraInfo | None:
    """The ``extra_info`` SGLang's legacy page function built for this call.

    ``HiCacheController._generic_page_set(hash_values, host_indices, extra_info)``
    and ``_generic_page_get(operation, hash_values, host_indices, extra_info)``
    (``managers/cache_controller.py``) receive the prefix keys but call
    ``batch_set(keys, values)`` / ``batch_get(keys, targets)``, whose
    signatures have no place for them.  Looks a few frames up (SGLang's fault
    injector may sit between) for exactly those two functions; ``None`` for
    any other caller.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_name in _LEGACY_CALLERS:
            info = frame.f_locals.get("extra_info")
            return info if isinstance(info, HiCacheStorageExtraInfo) else None
        frame = frame.f_back
    return None


class _Counters:
    """Pages and bandwidth of each store / load call, drained by ``get_stats``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []
        self.totals = {"pages_stored": 0, "pages_loaded": 0, "states_stored": 0,
                       "states_loaded": 0, "refused_writes": 0, "errors": 0}

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self.lock:
            if kind == "backup":
                self.backup_pgs.append(pages)
                self.backup_bandwidth.append(gbps)
            else:
                self.prefetch_pgs.append(pages)
                self.prefetch_bandwidth.append(gbps)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.totals[name] += n


def _check_interface(storage_config: Any) -> None:
    """Raise ConfigError unless the running SGLang has the HiCache storage interface this
    adapter is written against (0.5.23's), judged by what it has, not by its version string.

    SGLang 0.5.22 and older have neither hook below: the store would never open (no
    ``on_host_pools_registered`` call) and SGLang's attach would fail on the missing
    ``is_storage_writer``, with an AttributeError deep in its own code.
    """
    missing = [name for name, present in (
        ("HiCacheStorage.on_host_pools_registered",
         callable(getattr(HiCacheStorage, "on_host_pools_registered", None))),
        ("HiCacheStorageConfig.is_storage_writer", hasattr(storage_config, "is_storage_writer")),
    ) if not present]
    if missing:
        raise ConfigError(f"hybridstore's SGLang adapter needs SGLang 0.5.23's HiCache storage "
                          f"interface; this SGLang has no {' and no '.join(missing)}: "
                          "install sglang==0.5.23")


class HybridStoreHiCache(HiCacheStorage):
    """One hybridstore :class:`~hybridstore.HybridStore` per TP/PP rank behind SGLang's
    HiCache storage interface (legacy, ``interface_v1`` and v2 multi-pool calls).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (rank identity, model
            name, ``extra_config`` with the store settings:
            :mod:`hybridstore.adapters.sglang_config`).
        kwargs: the factory's positional extra dict (unused).

    Raises:
        ConfigError: an unknown extra-config key or a bad value, or an SGLang without
            0.5.23's storage interface (at startup).

    The store opens when SGLang has registered its host pools
    (:meth:`on_host_pools_registered`): its page size and byte layout come from
    them.  Attributes: ``store`` (the :class:`~hybridstore.HybridStore`, ``None``
    before), ``settings``, ``rank``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        _check_interface(storage_config)
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        self.rank = RankIdentity.of(storage_config)
        self.store: HybridStore | None = None
        self.registered_pools: dict[Any, Any] = {}
        self._kv: KVPages | None = None
        self._open_lock = threading.Lock()
        self._closed = False
        self._warned: set[str] = set()
        self._counters = _Counters()
        self._scratch = threading.local()      # per thread: a buffer for state loads
        if self.rank.replicated_kv and self.rank.tp_size > 1:
            log.warning("hybridstore: rank-replicated KV (MLA) with tp_size=%d: only the writer "
                        "rank stores KV and each rank's store is its own, so the other ranks "
                        "miss and SGLang's MIN over ranks gives no L3 hits yet",
                        self.rank.tp_size)

    # -- registration (SGLang's base class keeps the pools) ------------------------------
    def on_host_pools_registered(self) -> None:
        """Open the rank's store now that the page size and layouts are known."""
        self._open()

    def _kv_pool(self) -> Any:
        return self.registered_pools.get(PoolName.KV, getattr(self, "mem_pool_host", None))

    def _state_pool(self) -> Any:
        return self.registered_pools.get(PoolName.MAMBA)

    def _open(self) -> HybridStore:
        with self._open_lock:
            if self.store is not None:
                return self.store
            if self._closed:
                raise RuntimeError("this HybridStoreHiCache was closed")
            pool = self._kv_pool()
            if pool is None:
                raise RuntimeError("no KV host pool registered yet")
            kv = KVPages(pool)
            if self.settings.page_size is not None and self.settings.page_size != kv.page_size:
                raise ConfigError(f"extra config page_size={self.settings.page_size} but SGLang's "
                                 f"host pool has page_size={kv.page_size}; drop the key or match it")
            cfg = store_config(self.settings, self.rank, block_size=kv.page_size,
                               layout=layout_tag(pool, self._state_pool()))
            self._kv = kv
            self.store = HybridStore(cfg)
            log.info("hybridstore: store %s (disk %s, host %d bytes, page %d tokens, KV %s)",
                     cfg.namespace, cfg.disk_path, cfg.host_bytes, kv.page_size, kv.mode)
            return self.store

    # -- keys ---------------------------------------------------------------------------
    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def _prompt(self, store: HybridStore, keys: Sequence[str],
                extra_info: HiCacheStorageExtraInfo | None, *, write: bool) -> PrefixKeys | None:
        """``keys`` placed in their sequence: the given prefix keys, else the index.

        ``None`` when neither knows where ``keys[0]`` is (a write is then refused).
        """
        prefix = extra_info.prefix_keys if extra_info is not None else None
        try:
            return store.engine_prefix(list(keys), prefix=prefix)
        except UnknownPrefixError:
            if write:
                self._counters.add("refused_writes")
                self._warn_once(
                    "prefix", "hybridstore: SGLang did not pass the page hashes before a write "
                    "and the store does not hold its first page, so the write is refused; set "
                    '"hicache_storage_pass_prefix_keys": true in '
                    "--hicache-storage-backend-extra-config")
            return None

    # -- guarded IO ---------------------------------------------------------------------
    def _guard(self, what: str, miss: T, fn: Callable[[HybridStore], T]) -> T:
        """Run ``fn(store)``; any exception is logged and answered with ``miss``."""
        try:
            store = self.store if self.store is not None else self._open()
            return fn(store)
        except Exception as e:  # noqa: BLE001 - an IO call never raises into the engine
            self._counters.add("errors")
            log.warning("hybridstore: %s failed, answered as a miss: %s: %s",
                        what, type(e).__name__, e)
            return miss

    # -- KV pages -----------------------------------------------------------------------
    def _set_pages(self, store: HybridStore, keys: Sequence[str], pages: list[Any] | PageViews,
                   extra_info: HiCacheStorageExtraInfo | None) -> bool:
        """Store ``pages`` (a list of per-page entries, or one page-major batch) under ``keys``."""
        if not keys:
            return True
        if not self.rank.writer:
            return True           # replicated KV: the writer rank stores it
        prompt = self._prompt(store, keys, extra_info, write=True)
        if prompt is None:
            return False
        t0 = time.perf_counter()
        if isinstance(pages, dict):
            store.put_kv_batch(prompt, pages)
        else:
            store.put_kv(prompt, pages)
        kv = self._kv
        assert kv is not None
        self._counters.record("backup", len(keys), len(keys) * kv.nbytes, time.perf_counter() - t0)
        self._counters.add("pages_stored", len(keys))
        return True

    def _get_pages(self, store: HybridStore, keys: Sequence[str],
                   targets: Callable[[int], list[Any] | PageViews],
                   extra_info: HiCacheStorageExtraInfo | None) -> int:
        """Load the leading held run of ``keys`` into ``targets(n)`` (per-page entries or
        one page-major batch); returns n."""
        if not keys:
            return 0
        prompt = self._prompt(store, keys, extra_info, write=False)
        if prompt is None:
            return 0
        first = prompt.nblocks - len(keys)
        t0 = time.perf_counter()
        plan = store.match_pages(prompt, first=first)
        try:
            n = len(plan.pages)
            if n:
                store.load(plan, into=(targets(n), None)).result()
        finally:
            store.release(plan)
        kv = self._kv
        assert kv is not None
        self._counters.record("prefetch", n, n * kv.nbytes, time.perf_counter() - t0)
        self._counters.add("pages_loaded", n)
        return n

    def _count_pages(self, store: HybridStore, keys: Sequence[str],
                     extra_info: HiCacheStorageExtraInfo | None) -> int:
        if not keys:
            return 0
        prompt = self._prompt(store, keys, extra_info, write=False)
        if prompt is None:
            return 0
        return self._held(store, prompt, len(keys))

    @staticmethod
    def _held(store: HybridStore, prompt: PrefixKeys, n: int) -> int:
        """How many of the prompt's last ``n`` pages (a call's keys) lead the held run."""
        return max(0, min(store.present_pages(prompt) - (prompt.nblocks - n), n))

    def _slots(self, host_indices: torch.Tensor, n: int) -> list[int]:
        kv = self._kv
        assert kv is not None
        ps = kv.page_size
        if host_indices.numel() != n * ps:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {ps} tokens")
        return host_indices[::ps][:n].tolist()

    def _set_v1(self, store: HybridStore, keys: Sequence[str], host_indices: torch.Tensor,
                extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        kv = self._kv
        assert kv is not None
        slots = self._slots(host_indices, len(keys))
        batch = kv.run_views(slots)
        pages = batch if batch is not None else [kv.read(s) for s in slots]
        ok = self._set_pages(store, keys, pages, extra_info)
        return [ok] * len(keys)

    def _get_v1(self, store: HybridStore, keys: Sequence[str], host_indices: torch.Tensor,
                extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        kv = self._kv
        assert kv is not None
        slots = self._slots(host_indices, len(keys))
        scratch: list[tuple[int, torch.Tensor]] = []
        batch = kv.run_views(slots)

        def targets(n: int) -> list[Any] | PageViews:
            if batch is not None:
                return batch
            out = []
            for s in slots[:n]:
                views, buf = kv.targets(s)
                if buf is not None:
                    scratch.append((s, buf))
                out.append(views)
            return out

        n = self._get_pages(store, keys, targets, extra_info)
        for s, buf in scratch:
            kv.commit(s, buf)
        return [True] * n + [False] * (len(keys) - n)

    # legacy page calls (flat page tensors)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location], target_sizes)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill SGLang's flat pages (``get_dummy_flat_data_page()``) with the leading run of
        held pages; the rest are ``None``."""
        extra_info = _legacy_extra_info()

        def run(store: HybridStore) -> list[torch.Tensor | None]:
            kv = self._kv
            assert kv is not None
            n = self._get_pages(store, keys, lambda n: [kv.split(t) for t in target_locations[:n]],
                                extra_info)
            return list(target_locations[:n]) + [None] * (len(keys) - n)

        return self._guard("batch_get", [None] * len(keys), run)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages (``get_data_page(flat=True)``) under ``keys``."""
        extra_info = _legacy_extra_info()

        def run(store: HybridStore) -> bool:
            kv = self._kv
            assert kv is not None
            return self._set_pages(store, keys, [kv.split(v) for v in values], extra_info)

        return self._guard("batch_set", False, run)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return self._guard("batch_exists", 0, lambda store: self._count_pages(store, keys, extra_info))

    # zero-copy v1 calls (host slots)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._guard("batch_set_v1", [False] * len(keys),
                           lambda store: self._set_v1(store, keys, host_indices, extra_info))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._guard("batch_get_v1", [False] * len(keys),
                           lambda store: self._get_v1(store, keys, host_indices, extra_info))

    # -- v2: several pools --------------------------------------------------------------
    def _each_state(self, store: HybridStore, t: PoolTransfer,
                    extra_info: HiCacheStorageExtraInfo | None, *, write: bool,
                    one: Callable[[Any, PrefixKeys, int, int], bool]) -> list[bool]:
        """``one(state pool, prompt, host slot, position)`` for each key of a MAMBA transfer
        (the state at the end of that key's page); all misses when the transfer cannot be
        served (no pool, malformed slots, an unplaceable chain)."""
        keys = list(t.keys or [])
        pool = self._state_pool()
        if pool is None or t.host_indices is None or t.host_indices.numel() != len(keys):
            return [False] * len(keys)
        prompt = self._prompt(store, keys, extra_info, write=write)
        if prompt is None:
            return [False] * len(keys)
        B, first = prompt.block_size, prompt.nblocks - len(keys)
        return [bool(one(pool, prompt, int(slot), (first + i + 1) * B))
                for i, slot in enumerate(t.host_indices.tolist())]

    def _set_states(self, store: HybridStore, *, t: PoolTransfer,
                    extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        t0, nbytes = time.perf_counter(), 0

        def one(pool: Any, prompt: PrefixKeys, slot: int, p: int) -> bool:
            nonlocal nbytes
            state = state_bytes(pool, slot)
            ok = store.put_state(prompt, state, position=p)
            nbytes += state.numel() if ok else 0
            return ok

        out = self._each_state(store, t, extra_info, write=True, one=one)
        self._counters.record("backup", sum(out), nbytes, time.perf_counter() - t0)
        self._counters.add("states_stored", sum(out))
        return out

    def _state_scratch(self, store: HybridStore, plan: Any) -> Any:
        """This thread's page-aligned buffer of the stored state layout (kept across
        loads: a 73.7 MiB state costs no allocation and page faults per load)."""
        ck = store.index.checkpoint(plan.state_key)
        total = ck.nbytes if ck is not None else 0
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() != total:
            buf = self._scratch.buf = torch.from_numpy(aligned_empty(total))
        return buf

    def _get_states(self, store: HybridStore, *, t: PoolTransfer,
                    extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        def one(pool: Any, prompt: PrefixKeys, slot: int, p: int) -> bool:
            plan = store.match(prompt, max_position=p)
            try:
                if plan.position != p or plan.state_key is None:
                    return False
                # SGLang already holds the pages (it loads them first): the state only,
                # read in place into this thread's reused buffer (no fresh arena per load)
                scratch = self._state_scratch(store, plan)
                _, state = store.load(plan, into=(None, scratch),
                                      skip_pages=len(plan.pages)).result()
                pool.set_from_flat_data_page(slot, torch.as_tensor(state))
                return True
            finally:
                store.release(plan)

        out = self._each_state(store, t, extra_info, write=False, one=one)
        self._counters.add("states_loaded", sum(out))
        return out

    def _kv_v2(self, store: HybridStore, *, t: PoolTransfer,
               extra_info: HiCacheStorageExtraInfo | None, write: bool) -> list[bool]:
        keys, slots = list(t.keys or []), t.host_indices
        assert slots is not None
        if write:
            return self._set_v1(store, keys, slots, extra_info)
        return self._get_v1(store, keys, slots, extra_info)

    def _io_v2(self, what: str, transfers: list[PoolTransfer],
               extra_info: HiCacheStorageExtraInfo | None, write: bool) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            n = len(t.keys or [])
            if t.name == PoolName.KV and t.host_indices is not None:
                out[t.name] = self._guard(f"{what}(kv)", [False] * n,
                                          partial(self._kv_v2, t=t, extra_info=extra_info, write=write))
            elif t.name == PoolName.MAMBA:
                states = self._set_states if write else self._get_states
                out[t.name] = self._guard(f"{what}(mamba)", [False] * n,
                                          partial(states, t=t, extra_info=extra_info))
            else:
                self._warn_once(f"pool:{t.name}", "hybridstore: pool %s is not supported yet; "
                                "its transfers miss", t.name)
                out[t.name] = [False] * n
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages (``KV``) or states (``MAMBA``: the state at the end
        of the page its key names); other pools answer all ``False``."""
        return self._io_v2("batch_set_v2", transfers, extra_info, True)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Load each transfer's pages or states into its host slots."""
        return self._io_v2("batch_get_v2", transfers, extra_info, False)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The KV hit and every prefix length (in pages of ``keys``) where all pools are
        satisfied: with a ``MAMBA`` transfer, the page ends where the store can resume
        (pages held from position 0 and a state at that end: ``store.restorable``)."""
        return self._guard("batch_exists_v2", PoolTransferResult.empty(),
                           lambda store: self._exists_v2(store, keys, pool_transfers or [], extra_info))

    def _exists_v2(self, store: HybridStore, keys: list[str], transfers: list[PoolTransfer],
                   extra_info: HiCacheStorageExtraInfo | None) -> PoolTransferResult:
        if not keys:
            return PoolTransferResult.empty()
        prompt = self._prompt(store, keys, extra_info, write=False)
        if prompt is None:
            return PoolTransferResult.empty()
        first = prompt.nblocks - len(keys)
        kv_pages = self._held(store, prompt, len(keys))
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in transfers:
            if t.name == PoolName.MAMBA and t.hit_policy == PoolHitPolicy.TRAILING_PAGES \
                    and len(t.keys or [None]) == 1:
                B = prompt.block_size
                ends = {p // B - first for p in store.restorable(prompt) if p % B == 0}
                restorable = [p for p in restorable if p in ends]
                if ends & set(range(1, kv_pages + 1)):
                    hits[t.name] = max(ends & set(range(1, kv_pages + 1)))
            else:
                self._warn_once(f"exists:{t.name}", "hybridstore: pool %s (%s) is not supported "
                                "yet; prefixes that need it miss", t.name, t.hit_policy)
                restorable = []
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    # -- lifecycle ----------------------------------------------------------------------
    def clear(self) -> None:
        """Drop everything this rank stored (its store is closed, its directory removed,
        and an empty store opened in its place)."""
        with self._open_lock:
            store, self.store = self.store, None
        if store is None:
            return
        disk = store.config.disk_path
        store.close()
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
        self._open()
        log.info("hybridstore: cleared the store of rank %s", self.rank.directory)

    def close(self) -> None:
        """Finish in-flight writes and close the store (SGLang calls it on detach)."""
        with self._open_lock:
            store, self.store, self._closed = self.store, None, True
        if store is not None:
            store.close()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each load and store call since
        the last call), what ``UnifiedRadixCache`` logs when storage metrics are on."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        c = self._counters
        with c.lock:
            m = StorageMetrics(prefetch_pgs=c.prefetch_pgs, backup_pgs=c.backup_pgs,
                               prefetch_bandwidth=c.prefetch_bandwidth,
                               backup_bandwidth=c.backup_bandwidth)
            c.prefetch_pgs, c.backup_pgs = [], []
            c.prefetch_bandwidth, c.backup_bandwidth = [], []
        return m

    def store_stats(self) -> dict[str, Any]:
        """The adapter's totals and the store's own ``stats()`` (``{}`` before it opens)."""
        c = self._counters
        with c.lock:
            out: dict[str, Any] = dict(c.totals)
        store = self.store
        if store is not None:
            out["store"] = store.stats()
        return out
