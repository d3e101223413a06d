"""The scheduler side: ``HybridStoreManager``, vLLM's ``OffloadingManager`` over a HybridStore.

vLLM's scheduler-role ``OffloadingConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) calls
it under its manager lock, once per key or per batch of keys:

================  ==========================================================================
vLLM call         here
================  ==========================================================================
``lookup``        full-attention chunk ``i``: the page is held (``match_pages`` pins it, so
                  no eviction can race the load); Mamba key at ``p``: ``p`` is a complete
                  resume point (``match(max_position=p)`` lands exactly on ``p``: pages
                  ``[0, p)`` and the state, pinned); a key whose put is still queued:
                  ``HIT_PENDING``; a held key while other loads hold the staging slots:
                  ``RETRY`` (vLLM asks again next step for both)
``prepare_load``  one plan for the load (``match_pages`` or ``match``), ``store.load``
                  into the staging slots; a done-callback marks each slot ready
``complete_load`` release the plan, free the slots
``prepare_store`` slots for all the keys not held yet, or None (vLLM skips the keys it
                  offered and we refused, so never some of them); waits for the slots the
                  put thread is returning (the workers copy GPU blocks there)
``complete_store``  the put thread puts the staged bytes: pages with ``put_kv``, the Mamba
                  blocks of all state groups at ``p`` as one checkpoint ``put_state(.., p)``
``take_events``   stored keys; a key found gone by a later lookup as removed
================  ==========================================================================

Keys: vLLM's offload key is ``block hash + 4-byte group id`` and the manager
never sees tokens.  The page of chunk ``i`` is keyed by its engine key through
``store.engine_prefix``; the Mamba key at ``p`` shares the block hash of the
full-attention chunk ending at ``p`` (both are ``block_hashes[p / tokens_per_hash
- 1]``), so the page chain of a state is found from the state key alone.
``engine_prefix([key], prefix=None)`` resolves a held page's chain from the
index; a run of new pages is chained onto the key of the page before it, which
this request showed us in an earlier ``lookup``/``prepare_store`` (positions from
the public ``ReqContext.get_offload_key_position``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

from hybridstore import HybridStore, PrefixKeys, ResumePlan
from hybridstore.adapters.vllm.compat import offloading_event
from hybridstore.adapters.vllm.hints import RESUME_IN, resume_in
from hybridstore.adapters.vllm.settings import GroupPlan
from hybridstore.adapters.vllm.staging import SlotPool, StagingRegion
from hybridstore.adapters.vllm.worker import StagedKeys
from hybridstore.errors import CapacityError, HybridStoreError, UnknownPrefixError

log = logging.getLogger(__name__)


@dataclass
class _Staged:
    """A key whose bytes the workers copy (or copied) into ``slot``, not yet put."""

    key: OffloadKey
    slot: int
    group: int          # position in OffloadingConfig.groups
    position: int       # end token
    req_id: str
    queued: bool = False
    """Its put is queued on the put thread: the slot comes back without a scheduler step."""


@dataclass
class _Load:
    keys: frozenset[OffloadKey]
    plan: ResumePlan | None
    slots: list[int]


@dataclass
class _Request:
    chain: dict[int, OffloadKey] = field(default_factory=dict)
    """Full-attention keys this request showed us, by chunk index."""
    pins: dict[OffloadKey, ResumePlan] = field(default_factory=dict)
    """Plans pinned by lookup HITs, until the load's own plan replaces them."""
    matched: set[int] = field(default_factory=set)
    """Positions this request resumed at before: vLLM looks a waiting request up at every
    step it tries it, and its load matches once more; only the first is a use
    (``HybridStore.match(again=True)`` for the rest)."""
    finished: bool = False
    resume_in: float | None = None
    """An orchestrator's ``hybridstore.resume_in`` hint (``hints.py``): when the session
    that continues this request comes back (``math.inf``: never)."""
    end: PrefixKeys | None = None
    """The prompt of the deepest state stored for this request: where the next one resumes."""


class HybridStoreManager(OffloadingManager):
    """vLLM's offloading manager (scheduler process) over one :class:`~hybridstore.HybridStore`.

    Args:
        store: the store (block size = the full-attention chunk's tokens).
        region: the staging region shared with the workers.
        plan: which vLLM groups are pages and which are states.
        enable_events: record ``OffloadingEvent`` s for ``take_events``.
        locality: vLLM's ``Locality`` the events carry (``locality`` setting).
        load_timeout_s: how long a load may wait for staging slots.
    """

    def __init__(self, *, store: HybridStore, region: StagingRegion, plan: GroupPlan,
                 enable_events: bool = False, load_timeout_s: float = 120.0,
                 locality: Any = None) -> None:
        self.store = store
        self._region = region
        self._plan = plan
        self._page_tokens = plan.page_tokens
        self._page_gid = plan.group_ids[plan.page_group]
        self._slots = SlotPool(region.nslots)
        # Loads (and the HITs that promise them) never need more than half of the slots,
        # and stores leave that half free, so a load always finds its slots at once.
        self._load_cap = max(region.nslots // 2, 1 + len(plan.state_groups))
        self._mu = threading.RLock()
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridstore-vllm-put")
        self._pending_puts: set[Future] = set()
        self._reqs: dict[str, _Request] = {}
        self._staged: dict[OffloadKey, _Staged] = {}
        self._parts: dict[OffloadKey, dict[int, _Staged]] = {}
        self._deferred: list[tuple[OffloadKey, dict[int, _Staged]]] = []
        self._loads: dict[str, list[_Load]] = {}
        self._tokens = itertools.count(time.time_ns())
        self._events_on = enable_events
        self._locality = locality
        self._events: list[OffloadingEvent] = []
        self._announced: set[OffloadKey] = set()
        self._timeout = load_timeout_s
        self.counters = {"lookups": 0, "hits": 0, "stored_pages": 0, "stored_states": 0,
                         "loaded_keys": 0, "dropped": 0}

    # -- keys -------------------------------------------------------------------------------
    def _where(self, key: OffloadKey, ctx: ReqContext) -> tuple[int, int | None]:
        """(group position, end token) of ``key``; the position is None when unknown."""
        gpos = self._plan.position_of(get_offload_group_idx(key))
        return gpos, ctx.get_offload_key_position(key)

    def _page_key_at(self, key: OffloadKey) -> OffloadKey:
        """The full-attention key of the chunk that ends where ``key`` ends."""
        return make_offload_key(get_offload_block_hash(key), self._page_gid)

    def _block(self, end: int) -> int:
        """The page (block) index of the page ending at token ``end``."""
        return (end - 1) // self._page_tokens

    def _resolve(self, page_key: OffloadKey, end: int) -> PrefixKeys | None:
        """The chain of the stored page ending at ``end`` (a partial page when ``end`` is
        inside a chunk), or None when the store does not know that page."""
        try:
            return self.store.engine_prefix([page_key], prefix=None,
                                            length=end - self._block(end) * self._page_tokens)
        except UnknownPrefixError:     # not a page the store knows
            return None

    def _request(self, ctx: ReqContext) -> _Request:
        req = self._reqs.get(ctx.req_id)
        if req is None:
            req = self._reqs[ctx.req_id] = _Request()
        return req

    def _nbytes(self, gpos: int) -> int:
        """Bytes of one key of group ``gpos`` (every worker's part), from the workers' rows."""
        col = self._region.group_bytes[:, gpos]
        if not col.all() or (col != col[0]).any():
            raise HybridStoreError(
                f"staging region: the workers' bytes for group {gpos} are {col.tolist()} "
                "(0: a worker did not register; differing: ranks with unequal pages, e.g. "
                "pipeline stages, which this adapter does not support)")
        return int(col[0]) * self._region.world

    def _view(self, gpos: int, slot: int) -> np.ndarray:
        return self._region.payload(slot, self._nbytes(gpos))

    # -- lookup -----------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._mu:
            self.counters["lookups"] += 1
            gpos, p = self._where(key, req_context)
            if p is None:
                return LookupResult.MISS
            req = self._request(req_context)
            if key in req.pins:
                return LookupResult.HIT
            if key in self._staged:
                return LookupResult.HIT_PENDING
            i = self._block(p)
            if gpos == self._plan.page_group and p % self._page_tokens == 0:
                req.chain[i] = key
            if len(req.pins) >= self._load_cap:
                return LookupResult.MISS      # a load this big is never staged: recompute
            if gpos == self._plan.page_group:
                prompt = self._resolve(key, p)
                plan = self.store.match_pages(prompt, first=i) if prompt is not None else None
                ok = plan is not None and len(plan.pages) == 1
            else:
                prompt = self._resolve(self._page_key_at(key), p)
                plan = self.store.match(prompt, max_position=p, again=p in req.matched) \
                    if prompt is not None else None
                ok = plan is not None and plan.position == p
                if ok:
                    req.matched.add(p)
            if plan is None or not ok:
                if plan is not None:
                    self.store.release(plan)
                self._forget(key)
                return LookupResult.MISS
            if self._promised() >= self._load_cap:
                # held, but other requests' loads hold the slots: vLLM asks again next
                # step (a MISS would have it recompute what is here)
                self.store.release(plan)
                return LookupResult.RETRY
            req.pins[key] = plan
            self.counters["hits"] += 1
            return LookupResult.HIT

    def _promised(self) -> int:
        """Staging slots that loads hold or that HITs already reported will need."""
        return (sum(len(r.pins) for r in self._reqs.values())
                + sum(len(ld.slots) for loads in self._loads.values() for ld in loads))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return   # the store's recency moves on match/put; GPU prefix hits are vLLM's

    # -- load -------------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> StagedKeys:
        keys = list(keys)
        slots = self._slots.take(len(keys)) or self._slots.take_waiting(len(keys), self._timeout)
        if slots is None:
            raise CapacityError(f"a load of {len(keys)} keys found no free staging slots; raise "
                                "staging_bytes in kv_connector_extra_config")
        token = next(self._tokens)
        flags = self._region.flags
        flags[slots] = 0
        with self._mu:
            req = self._request(req_context)
            try:
                plan = self._start_load(keys, slots, token, req_context, req)
            except Exception:
                log.exception("hybridstore: cannot load %d keys of request %s", len(keys),
                              req_context.req_id)
                plan = None
                flags[slots] = -token
            self._loads.setdefault(req_context.req_id, []).append(
                _Load(frozenset(keys), plan, slots))
            self._unpin(req)
        return StagedKeys(slots, [token] * len(keys))

    def _start_load(self, keys: list[OffloadKey], slots: list[int], token: int,
                    ctx: ReqContext, req: _Request) -> ResumePlan:
        pages: dict[int, int] = {}        # chunk index -> slot
        states: dict[int, int] = {}       # group position -> slot
        end = 0
        for key, slot in zip(keys, slots):
            gpos, p = self._where(key, ctx)
            assert p is not None, key
            if gpos == self._plan.page_group:
                pages[self._block(p)] = slot
            else:
                states[gpos] = slot
            end = max(end, p)
        if states:     # the state at ``end`` names the page chain [0, end)
            last = self._page_key_at(next(k for k in keys
                                          if self._where(k, ctx)[0] != self._plan.page_group))
        else:
            last = max(keys, key=lambda k: self._where(k, ctx)[1] or 0)
        prompt = self._resolve(last, end)
        if prompt is None or prompt.length != end:
            raise HybridStoreError(f"the page ending at {end} is no longer held")
        state_buf = None
        if states:
            plan = self.store.match(prompt, max_position=end, again=end in req.matched)
            if plan.position != end:
                self.store.release(plan)
                raise HybridStoreError(f"no resume point at {end} any more")
            req.matched.add(end)
            state_buf = np.empty(sum(self._nbytes(g) for g in self._plan.state_groups), np.uint8)
        else:
            first = min(pages)
            plan = self.store.match_pages(prompt, first=first)
            if len(plan.pages) != self._block(end) + 1 - first:
                self.store.release(plan)
                raise HybridStoreError(f"pages {first}..{self._block(end)} are no longer all "
                                       "held")
        try:
            n = len(plan.pages)
            offset = plan.first_page if not states else 0
            scratch = None
            bufs = []
            for j in range(offset, offset + n):
                if j in pages:
                    bufs.append(self._view(self._plan.page_group, pages[j]))
                else:        # a page vLLM already has (a GPU prefix hit before a Mamba load)
                    if scratch is None:
                        scratch = np.empty(self._nbytes(self._plan.page_group), np.uint8)
                    bufs.append(scratch)
            # the pages vLLM already has are a leading run: not read at all
            held = (min(pages) - offset) if pages else n
            fut = self.store.load(plan, into=(bufs, state_buf), skip_pages=max(held, 0))
        except BaseException:
            self.store.release(plan)
            raise
        fut.add_done_callback(lambda f: self._staged_load(f, slots, token, states, state_buf))
        self.counters["loaded_keys"] += len(keys)
        return plan

    def _staged_load(self, fut: Future, slots: list[int], token: int, states: dict[int, int],
                     state_buf: np.ndarray | None) -> None:
        """Runs on the store's I/O thread: split the state, then flag the slots ready."""
        flags = self._region.flags
        try:
            fut.result()
            if states:
                assert state_buf is not None
                at = 0
                for gpos in self._plan.state_groups:
                    n = self._nbytes(gpos)
                    self._view(gpos, states[gpos])[:] = state_buf[at: at + n]
                    at += n
            flags[slots] = token
        except Exception:
            log.exception("hybridstore: a load failed; the worker reports it to vLLM")
            flags[slots] = -token

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        done = frozenset(keys)
        with self._mu:
            loads = self._loads.get(req_context.req_id, [])
            for load in [ld for ld in loads if ld.keys <= done]:
                loads.remove(load)
                if load.plan is not None:
                    self.store.release(load.plan)
                self._slots.give(load.slots)
            if not loads:
                self._loads.pop(req_context.req_id, None)
            self._maybe_drop(req_context.req_id)

    # -- store ------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        with self._mu:
            req = self._request(req_context)
            todo: list[tuple[OffloadKey, int, int]] = []
            for key in keys:
                gpos, p = self._where(key, req_context)
                if p is None:
                    continue
                if gpos == self._plan.page_group and p % self._page_tokens == 0:
                    req.chain[self._block(p)] = key
                if key in self._staged or self._held(key, gpos, p):
                    continue
                todo.append((key, gpos, p))
            if not todo:
                return PrepareStoreOutput(keys_to_store=[], store_spec=StagedKeys([]),
                                          evicted_keys=[])
            # vLLM moves past every chunk it offered, accepted or not (_build_store_jobs
            # sets next_stored_chunk_idx to the end of the offer): a key left out here is
            # never offered again.  So all or nothing: None, and vLLM offers them all
            # again next step, while the request runs.
            room = self._region.nslots - self._load_cap
            if len(todo) > room:
                log.warning("hybridstore: request %s offers %d keys at once, the staging "
                            "region stages %d: the rest are not stored; raise staging_bytes",
                            req_context.req_id, len(todo), room)
                todo = todo[:room]
            # what loads may still take (those that hold their slots already count)
            keep = max(self._load_cap - self._promised(), 0)
            slots = self._slots.take(len(todo), keep=keep)
            queued = 0 if slots is not None else sum(s.queued for s in self._staged.values())
        if slots is None and self._slots.free - keep + queued >= len(todo):
            # the put thread returns enough slots without a scheduler step (a finished
            # request's offer is its last one): wait for them, outside the lock it takes
            slots = self._slots.take_waiting(len(todo), self._timeout, keep=keep)
        if slots is None:
            return None          # vLLM offers these chunks again next step
        with self._mu:
            for (key, gpos, p), slot in zip(todo, slots):
                self._staged[key] = _Staged(key, slot, gpos, p, req_context.req_id)
            return PrepareStoreOutput(keys_to_store=[k for k, _, _ in todo],
                                      store_spec=StagedKeys(slots), evicted_keys=[])

    def _held(self, key: OffloadKey, gpos: int, p: int) -> bool:
        prompt = self._resolve(self._page_key_at(key), p)
        if prompt is None:
            return False
        if gpos == self._plan.page_group:
            return self.store.present_pages(prompt) == prompt.nblocks
        return p in self.store.restorable(prompt, max_position=p)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        with self._mu:
            staged = [self._staged[k] for k in keys if k in self._staged]
            if not success:
                for s in staged:
                    self._unstage(s)
                return
            req = self._request(req_context)
            pages = sorted((s for s in staged if s.group == self._plan.page_group),
                           key=lambda s: s.position)
            self._queue(pages)   # every run goes to the put thread (a run it drops too)
            # runs of consecutive chunks, each chained onto the page before it
            run: list[_Staged] = []
            for s in pages:
                if run and (s.position != run[-1].position + self._page_tokens
                            or run[-1].position % self._page_tokens):
                    self._submit(self._put_pages, run, self._before(req, run, req_context))
                    run = []
                run.append(s)
            if run:
                self._submit(self._put_pages, run, self._before(req, run, req_context))
            for s in staged:
                if s.group == self._plan.page_group:
                    continue
                anchor = self._page_key_at(s.key)
                parts = self._parts.setdefault(anchor, {})
                parts[s.group] = s
                if len(parts) == len(self._plan.state_groups):
                    del self._parts[anchor]
                    self._queue(parts.values())
                    self._submit(self._put_state, anchor, parts)

    def _before(self, req: _Request, run: list[_Staged], ctx: ReqContext
                ) -> list[OffloadKey] | OffloadKey | None:
        """What chains ``run``: None (it starts the sequence), the key of the page before
        it, or the whole chain before it (fallback)."""
        i = self._block(run[0].position)
        if i == 0:
            return None
        prev = req.chain.get(i - 1)
        if prev is not None:
            return prev
        # Fallback, private vLLM state: the public calls showed no key before this run (its
        # prefix was a GPU prefix-cache hit, never looked up here).  The scheduler records
        # every key of the request from position 0 in ReqContext._offload_key_positions
        # (offloading/scheduler.py:412 RequestOffloadState.update_offload_keys).
        positions: dict[OffloadKey, int] = getattr(ctx, "_offload_key_positions", {})
        chain: list[OffloadKey | None] = [None] * i
        for key, p in list(positions.items()):
            if (get_offload_group_idx(key) == self._page_gid and p % self._page_tokens == 0
                    and 0 < p // self._page_tokens <= i):
                chain[p // self._page_tokens - 1] = key
        if any(k is None for k in chain):
            return []             # cannot chain: the run is dropped
        return [k for k in chain if k is not None]

    def _submit(self, fn: Any, *args: Any) -> None:
        fut = self._puts.submit(self._guarded, fn, *args)
        self._pending_puts.add(fut)
        fut.add_done_callback(self._pending_puts.discard)

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("hybridstore: a put failed")

    def _put_pages(self, run: list[_Staged], before: list[OffloadKey] | OffloadKey | None
                   ) -> None:
        """Put thread: the pages of one run of chunks, then retry states waiting for them."""
        keys = [s.key for s in run]
        end = run[-1].position      # inside a chunk for a partial tail: a partial last page
        try:
            prompt = None
            if before is None:
                prompt = self.store.engine_prefix(keys, prefix=(), length=end)
            elif isinstance(before, list):
                prompt = (self.store.engine_prefix(keys, prefix=before, length=end)
                          if before else None)
            else:
                first = self._block(run[0].position)
                try:
                    prompt = self.store.engine_prefix(
                        [before, *keys], prefix=None,
                        length=end - (first - 1) * self._page_tokens)
                except UnknownPrefixError:
                    prompt = None     # the page before was evicted meanwhile
            if prompt is None:
                log.info("hybridstore: %d pages of request %s dropped: their prefix is not "
                         "held", len(run), run[0].req_id)
                self.counters["dropped"] += len(run)
            else:
                nbytes = self._nbytes(self._plan.page_group)
                self.store.put_kv(prompt, [self._region.payload(s.slot, nbytes) for s in run])
                self.counters["stored_pages"] += len(run)
                self._announce(keys)
        except (HybridStoreError, OSError):
            log.exception("hybridstore: cannot put %d pages", len(run))
            self.counters["dropped"] += len(run)
        finally:
            with self._mu:
                for s in run:
                    self._unstage(s)
        self._retry_deferred()
        with self._mu:
            self._maybe_drop(run[0].req_id)

    def _put_state(self, anchor: OffloadKey, parts: dict[int, _Staged]) -> bool:
        """Put thread: the state of all state groups at one position (False: its page is not
        held yet, the state waits in the deferred list)."""
        first = next(iter(parts.values()))
        end, req_id = first.position, first.req_id
        prompt = self._resolve(anchor, end)
        if prompt is None:
            with self._mu:
                self._deferred.append((anchor, parts))
                self._queue(parts.values(), False)
            return False
        try:
            state = np.concatenate([self._region.payload(parts[g].slot, self._nbytes(g))
                                    for g in self._plan.state_groups])
            if self.store.put_state(prompt, state, position=prompt.length):
                self.counters["stored_states"] += 1
                self._announce([s.key for s in parts.values()])
                with self._mu:
                    req = self._reqs.get(req_id)
                    if req is not None and (req.end is None or req.end.length < prompt.length):
                        req.end = prompt
        except (HybridStoreError, OSError):
            log.exception("hybridstore: cannot put the state at %d", prompt.length)
            self.counters["dropped"] += 1
        finally:
            with self._mu:
                for s in parts.values():
                    self._unstage(s)
                self._maybe_drop(req_id)
        return True

    def _retry_deferred(self) -> None:
        with self._mu:
            waiting, self._deferred = self._deferred, []
            for _, parts in waiting:
                self._queue(parts.values())
        for anchor, parts in waiting:
            self._put_state(anchor, parts)
        with self._mu:
            for req_id in {s.req_id for _, parts in self._deferred for s in parts.values()}:
                self._maybe_drop(req_id)

    @staticmethod
    def _queue(staged: Iterable[_Staged], queued: bool = True) -> None:
        for s in staged:
            s.queued = queued

    def _unstage(self, s: _Staged) -> None:
        if self._staged.get(s.key) is s:
            del self._staged[s.key]
            self._slots.give([s.slot])

    # -- events -----------------------------------------------------------------------------
    def _announce(self, keys: list[OffloadKey]) -> None:
        if not self._events_on:
            return
        with self._mu:
            self._announced.update(keys)
            self._events.append(offloading_event(keys, removed=False, locality=self._locality))

    def _forget(self, key: OffloadKey) -> None:
        """A key looked up and found gone: announce its removal once."""
        if key in self._announced:
            self._announced.discard(key)
            self._events.append(offloading_event([key], removed=True, locality=self._locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._mu:
            events, self._events = self._events, []
        return events

    # -- requests ---------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        with self._mu:
            self._request(req_context).resume_in = resume_in(
                getattr(req_context, "kv_hints", None))
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._mu:
            req = self._reqs.get(req_context.req_id)
            if req is None:
                return
            req.finished = True
            self._unpin(req)
            self._maybe_drop(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # A HIT's prepare_load comes in the step of its lookup; a request that was not
        # loaded looks up again when the scheduler next tries it.
        with self._mu:
            for req in self._reqs.values():
                self._unpin(req)

    def _unpin(self, req: _Request) -> None:
        for plan in req.pins.values():
            self.store.release(plan)
        req.pins.clear()

    def _maybe_drop(self, req_id: str) -> None:
        """Forget a finished request once nothing of it is in flight; drop its states that
        still wait for pages that will not come."""
        req = self._reqs.get(req_id)
        if req is None or not req.finished or req_id in self._loads:
            return
        if any(s.req_id == req_id for s in self._staged.values()
               if s.group == self._plan.page_group):
            return
        keep = []
        for anchor, parts in self._deferred:
            if any(s.req_id == req_id for s in parts.values()):
                for s in parts.values():
                    self._unstage(s)
                self.counters["dropped"] += 1
            else:
                keep.append((anchor, parts))
        self._deferred = keep
        for anchor, parts in list(self._parts.items()):
            if any(s.req_id == req_id for s in parts.values()):
                del self._parts[anchor]
                for s in parts.values():
                    self._unstage(s)
        if not any(s.req_id == req_id for s in self._staged.values()):
            del self._reqs[req_id]
            if req.end is not None:
                try:    # its session's next turn counts from now (HybridStore.finished)
                    self.store.finished(req.end)
                except HybridStoreError:
                    log.exception("hybridstore: cannot record a finished request")
            if req.resume_in is not None and req.end is not None:
                try:    # every store of the request is done: announce its session's return
                    self.store.expect(req.end, in_s=req.resume_in)
                except HybridStoreError:
                    log.exception("hybridstore: cannot apply a %s hint", RESUME_IN)

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether stores are staged or puts queued (a key is HIT only once put)."""
        with self._mu:
            return bool(self._staged or self._pending_puts)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every staged put has reached the store (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._mu:
                busy = bool(self._pending_puts)
            if not busy:
                self.store.flush()
                return True
            time.sleep(0.002)
        return False

    def reset_cache(self) -> None:
        with self._mu:
            for req in self._reqs.values():
                self._unpin(req)
            for tier in ("host", "disk", "device"):
                if tier in self.store.tiers:
                    self.store.evict(1 << 62, tier=tier)
            self._announced.clear()

    def on_reset_flushed(self) -> None:
        # Jobs flushed by a reset never complete: release what they held.
        self.flush()
        with self._mu:
            for loads in self._loads.values():
                for load in loads:
                    if load.plan is not None:
                        self.store.release(load.plan)
                    self._slots.give(load.slots)
            self._loads.clear()
            for s in list(self._staged.values()):
                self._unstage(s)
            self._parts.clear()
            self._deferred.clear()

    def shutdown(self) -> None:
        self.flush()
        self._puts.shutdown(wait=True)
        with self._mu:
            for req in self._reqs.values():
                self._unpin(req)
            for loads in self._loads.values():
                for load in loads:
                    if load.plan is not None:
                        self.store.release(load.plan)
            self._loads.clear()
        self.store.close()
        self._region.close()
        self._region.unlink()
