"""``HybridStoreTier``: hybridstore as the SSD tier beneath vLLM's own DRAM tier.

::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 68719476736, "block_size": 64,
        "secondary_tiers": [{"type": "HybridStoreTier",
          "module_path": "hybridstore.adapters.vllm", "disk_path": "/nvme/hs",
          "disk_bytes": "1TiB"}]}}'

vLLM's ``TieringOffloadingManager`` (``vllm/v1/kv_offload/tiering/manager.py``)
keeps its pinned CPU primary tier and its GPU<->CPU worker; this tier lives in
the scheduler process only and copies whole primary chunks (``primary_kv_view``
rows: every worker's bytes of one key) to and from a
:class:`~hybridstore.HybridStore` on a thread pool: a store cascades each chunk
vLLM's primary tier completed, a load promotes chunks back into primary slots.

Every chunk is one store page keyed by its offload key alone
(``store.engine_prefix([key], prefix=())``): the tier sees chunks, not requests
in order, and the primary tier decides what is stored and promoted, so the
store here is a durable, checksummed, size-bounded chunk store (eviction by
``policy`` over pages); Mamba states and dependency-aware eviction apply through
:class:`~hybridstore.adapters.vllm.HybridStoreSpec` only.

Stores go straight from vLLM's primary rows to the SSD
(:meth:`~hybridstore.HybridStore.write_kv_many`; ``direct_store``, on by
default): the bytes already sit in vLLM's DRAM tier, so they are not copied into
the store's pinned pool first.  A store job completes once its writes returned
(vLLM may reuse the primary slots then); a chunk is found by :meth:`lookup`
once durable (``fdatasync`` + catalog commit), ``RETRY`` until then.  With
``direct_store: false`` a job copies its chunks into the store's DRAM tier and
the SSD write-through follows in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hybridstore import HybridStore, PrefixKeys, ResumePlan, StoreConfig
from hybridstore.adapters.vllm.compat import offloading_event
from hybridstore.adapters.vllm.settings import parse_locality, store_kwargs
from hybridstore.errors import ConfigError, HybridStoreError
from hybridstore.units import parse_flag

log = logging.getLogger(__name__)

_STORE_KEYS = ("disk_bytes", "host_bytes", "policy", "tier_policy", "disk_engine", "io_threads",
               "io_chunk_bytes", "verify_checksums")
_DIRECT_HOST_BYTES = 64 << 20
"""The store's DRAM tier when stores go straight to the SSD and ``host_bytes`` is not
given: loads read into vLLM's primary rows in place, so it holds next to nothing."""


class HybridStoreTier(SecondaryTierManager):
    """A vLLM secondary tier over one :class:`~hybridstore.HybridStore` (scheduler process).

    Args:
        offloading_spec: vLLM's ``TieringOffloadingSpec``.
        primary_kv_view: the primary tier's chunks, ``(num_chunks, chunk_bytes)``.
        tier_type: the tier's type name.
        backpressure_detector: vLLM's, passed through.
        disk_path: the store's SSD directory (required).
        **store_settings: ``disk_bytes``, ``host_bytes``, ``policy``,
            ``tier_policy``, ``disk_engine``, ``io_threads``, ``io_chunk_bytes``,
            ``verify_checksums`` (:class:`~hybridstore.StoreConfig`), ``namespace``,
            ``threads`` (jobs run in parallel, 4), ``direct_store`` (stores
            written from the primary rows straight to the SSD; default true),
            and vLLM's generic tier keys ``locality`` (``"LOCAL"``/``"REMOTE"``)
            and ``enable_kv_events`` (emit KV cache events when vLLM's
            ``kv_events_config`` enables them; default false, as vLLM's tiers).

    Raises:
        ConfigError: no ``disk_path``, an unknown key or a bad value.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, disk_path: str | None = None,
                 **store_settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not disk_path:
            raise ConfigError("the HybridStoreTier entry of secondary_tiers needs 'disk_path'")
        self._primary = np.asarray(primary_kv_view)      # view[c] of a memoryview cannot slice
        config = offloading_spec.config
        par = config.parallel
        chunk = offloading_spec.tokens_per_block[0] * offloading_spec.blocks_per_chunk
        namespace = "|".join(str(x) for x in (
            "vllm-tier", config.model.name, config.model.dtype, f"ws{par.world_size}",
            f"tp{par.tp_size}", f"pp{par.pp_size}", f"chunk{chunk}",
            f"bytes{self._primary.shape[1]}", store_settings.pop("namespace", "")))
        threads = int(store_settings.pop("threads", 4))
        self._direct = parse_flag(store_settings.pop("direct_store", True), "direct_store")
        # vLLM's generic tier keys (as its own fs tier takes them)
        self.locality = parse_locality(store_settings.pop("locality", None))
        events = parse_flag(store_settings.pop("enable_kv_events", False), "enable_kv_events")
        self._events: list[OffloadingEvent] | None = None
        if events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("HybridStoreTier: enable_kv_events is set but vLLM's KV cache "
                            "events are off (kv_events_config); the tier emits none")
        self._announced: set[OffloadKey] = set()
        kwargs = store_kwargs(store_settings, _STORE_KEYS)
        for key in kwargs:
            del store_settings[key]
        if store_settings:
            raise ConfigError(f"HybridStoreTier does not know {sorted(store_settings)}; it takes "
                              f"disk_path, namespace, threads, direct_store, locality, "
                              f"enable_kv_events and {list(_STORE_KEYS)}")
        if self._direct:
            kwargs.setdefault("host_bytes", _DIRECT_HOST_BYTES)
        self.store = HybridStore(StoreConfig(block_size=chunk, namespace=namespace,
                                             disk_path=str(disk_path), **kwargs))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hybridstore-tier")
        self._mu = threading.Lock()
        self._jobs: dict[int, Future] = {}
        self._finished: list[JobResult] = []
        self._storing: dict[OffloadKey, int] = {}
        # written, not durable yet (indexed once durable): a load waits for it, then reads it
        self._inflight: dict[OffloadKey, Future] = {}
        self._pins: dict[tuple[str, OffloadKey], ResumePlan] = {}
        self._settle_timeout = 60.0

    def _prompt(self, key: OffloadKey) -> PrefixKeys:
        return self.store.engine_prefix([key], prefix=())

    # -- lookup -----------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._mu:
            if key in self._storing:
                return LookupResult.RETRY
            pin = (req_context.req_id, key)
            if pin in self._pins:
                return LookupResult.HIT
        plan = self.store.match_pages(self._prompt(key))
        if len(plan.pages) != 1:
            self.store.release(plan)
            self._emit([key], removed=True)
            return LookupResult.MISS
        with self._mu:
            self._pins[pin] = plan        # held until the promotion reads it
        return LookupResult.HIT

    # -- jobs -------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        with self._mu:
            for key in keys:
                self._storing[key] = self._storing.get(key, 0) + 1
        self._submit(job_metadata, self._store, keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        with self._mu:
            plans = [self._pins.pop((job.req_context.req_id, k), None) for k in job.keys]
        self._submit(job, self._load, plans)

    def _submit(self, job: TransferJob, fn: Any, extra: Any) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                done, nbytes = fn(job, extra)
                result = JobResult(job.job_id, len(done) == len(job.keys), successful_keys=done,
                                   transfer_time=time.perf_counter() - t0, transfer_bytes=nbytes)
            except Exception:
                log.exception("HybridStoreTier: job %d failed", job.job_id)
                result = JobResult(job.job_id, False, successful_keys=[])
            if fn == self._store and result.successful_keys:
                self._emit(result.successful_keys, removed=False, req_context=job.req_context)
            with self._mu:
                self._finished.append(result)
                self._jobs.pop(job.job_id, None)

        with self._mu:
            self._jobs[job.job_id] = self._pool.submit(run)

    def _store(self, job: TransferJob, keys: list[OffloadKey]) -> tuple[list[OffloadKey], int]:
        """A job's chunks straight to the SSD (:meth:`_store_direct`), or in one
        :meth:`~hybridstore.HybridStore.put_kv_many` (one lock hold, one coalesced
        write-through); chunk by chunk only if that fails."""
        chunk = self._primary.shape[1]
        later: list[OffloadKey] = []      # released from _storing once durable
        try:
            prompts = [self._prompt(key) for key in keys]
            pages = [self._primary[c] for c in job.chunk_ids.tolist()]
            if self._direct:
                try:
                    return self._store_direct(keys, prompts, pages, later)
                except HybridStoreError:
                    log.warning("HybridStoreTier: a direct store job failed; storing its chunks "
                                "through the DRAM tier", exc_info=True)
            try:
                return list(keys), self.store.put_kv_many(prompts, pages) * chunk
            except HybridStoreError:
                log.warning("HybridStoreTier: a store job failed as a batch; storing its chunks "
                            "one by one", exc_info=True)
            done, nbytes = [], 0
            for key, prompt, page in zip(keys, prompts, pages):
                try:
                    nbytes += self.store.put_kv(prompt, page) * chunk
                    done.append(key)
                except HybridStoreError:
                    log.exception("HybridStoreTier: cannot store a chunk")
            return done, nbytes
        finally:
            pending = set(later)
            self._stored([k for k in keys if k not in pending])

    def _store_direct(self, keys: list[OffloadKey], prompts: list[PrefixKeys],
                      pages: list[np.ndarray], later: list[OffloadKey]
                      ) -> tuple[list[OffloadKey], int]:
        """:meth:`~hybridstore.HybridStore.write_kv_many` of a job: returns once every
        write returned (the primary rows are free again).  The keys being written go to
        ``later``: they stay ``RETRY`` for :meth:`lookup` until durable (then indexed)."""
        chunk = self._primary.shape[1]
        put = self.store.write_kv_many(prompts, pages)
        done = [keys[i] for i in put.held]
        for i, written, durable in zip(put.new, put.written, put.durable):
            key = keys[i]
            later.append(key)
            with self._mu:
                self._inflight[key] = durable
            durable.add_done_callback(partial(self._durable, key))
            if written.exception() is None:       # waits for the write
                done.append(key)
            else:
                log.warning("HybridStoreTier: cannot store a chunk: %s", written.exception())
        if put.refused:
            log.warning("HybridStoreTier: no room on the SSD for %d chunks", len(put.refused))
        return done, len(done) * chunk

    def _durable(self, key: OffloadKey, fut: Future) -> None:
        """A direct store's chunk is durable (or its write failed): :meth:`_stored`."""
        with self._mu:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
        self._stored([key])

    def _settled(self, key: OffloadKey) -> None:
        """Wait until a direct store of ``key`` in flight is durable and indexed.

        vLLM's tiering manager promotes a chunk once its store job succeeded, without a
        lookup here: the job succeeded when the write returned, so the chunk must be
        readable from then on. Its durability follows within one ``fdatasync`` and
        catalog commit; the load job (already asynchronous) waits for it.
        """
        with self._mu:
            fut = self._inflight.get(key)
        if fut is not None:
            fut.exception(timeout=self._settle_timeout)

    def _stored(self, keys: list[OffloadKey]) -> None:
        """Stores of ``keys`` ended (durable, or failed): lookups answer again."""
        with self._mu:
            for key in keys:
                left = self._storing[key] - 1
                if left:
                    self._storing[key] = left
                else:
                    del self._storing[key]

    def _load(self, job: TransferJob, plans: list[ResumePlan | None]
              ) -> tuple[list[OffloadKey], int]:
        """A job's chunks in one :meth:`~hybridstore.HybridStore.load_rows` on this job
        thread, straight into the primary rows (the disk tier reads neighbours in one I/O
        and the rest in parallel); chunk by chunk only if that fails (a corrupt chunk then
        costs itself only)."""
        keys, chunks = list(job.keys), job.chunk_ids.tolist()
        found: list[tuple[OffloadKey, int, ResumePlan]] = []
        try:
            for i, (key, c) in enumerate(zip(keys, chunks)):
                plan, plans[i] = plans[i], None
                if plan is None:     # promoted without a lookup of ours in this request
                    self._settled(key)
                    plan = self.store.match_pages(self._prompt(key))
                if len(plan.pages) != 1:
                    self.store.release(plan)
                    continue
                found.append((key, c, plan))
            if not found:
                return [], 0
            try:
                self.store.load_rows([p for _, _, p in found], self._primary,
                                     [c for _, c, _ in found])
                return [k for k, _, _ in found], len(found) * self._primary.shape[1]
            except HybridStoreError:
                log.warning("HybridStoreTier: a load job failed as a batch; loading its chunks "
                            "one by one", exc_info=True)
            done = []
            for key, c, plan in found:
                try:
                    self.store.load(plan, into=([self._primary[c]], None)).result()
                    done.append(key)
                except HybridStoreError:
                    log.exception("HybridStoreTier: cannot load a chunk")
            return done, len(done) * self._primary.shape[1]
        finally:
            for _, _, plan in found:
                self.store.release(plan)
            for plan in plans:
                if plan is not None:
                    self.store.release(plan)

    # -- events -----------------------------------------------------------------------------
    def _emit(self, keys: Iterable[OffloadKey], *, removed: bool, req_context: Any = None
              ) -> None:
        """Record a KV cache event: chunks stored (readable from now on), or a chunk
        announced before and found gone (evicted) by a lookup."""
        if self._events is None:
            return
        with self._mu:
            if removed:
                keys = [k for k in keys if k in self._announced]
                self._announced.difference_update(keys)
            else:
                keys = list(keys)
                self._announced.update(keys)
            if keys:
                self._events.append(offloading_event(keys, removed=removed,
                                                     locality=self.locality,
                                                     req_context=req_context))

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The KV cache events since the last call (``enable_kv_events``)."""
        if self._events is None:
            return []
        with self._mu:
            events, self._events = self._events, []
        return events

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._mu:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        """Copies in flight, or stored chunks not durable yet: vLLM keeps polling
        :meth:`get_finished_jobs` while True."""
        with self._mu:
            return bool(self._jobs or self._finished or self._storing)

    def drain_jobs(self) -> None:
        with self._mu:
            futures = list(self._jobs.values())
        for fut in futures:
            fut.exception()

    # -- requests ---------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._mu:
            stale = [pin for pin in self._pins if pin[0] == req_context.req_id]
            plans = [self._pins.pop(pin) for pin in stale]
        for plan in plans:
            self.store.release(plan)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        with self._mu:
            plans, self._pins = list(self._pins.values()), {}
        for plan in plans:
            self.store.release(plan)
        self.store.close()
