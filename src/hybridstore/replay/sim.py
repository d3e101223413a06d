"""Discrete-event replay of agent traces against the real store over accounting tiers.

The model of HiState §4.1: one GPU server with a FIFO prefill queue; at most
``live_sessions`` sessions are live, and when one ends a random waiting session
is admitted.  Each request, when the server takes it:

1. ``plan = store.match(prompt)`` — the real index and policies;
2. restore time = the plan's bytes over the bandwidth of whichever tiers hold
   them (``store.restore_cost``: device 0, DRAM ``X/B_H2D``, SSD
   ``X/B_SSD + X/B_H2D``, HiState eq. 2);
3. recompute time = the model preset's prefill cost of ``[plan.position, len)``;
4. the engine then puts the pages of the recomputed segment and the
   checkpoints the preset's placement asks for (sizes only: accounting tiers).

In data mode (``ReplayConfig.data``, ``replay/bytes_plane.py``) the same loop
runs over real tiers: puts carry bytes, and every hit is also restored with
``store.load(plan)`` and timed.  Only the *objects* differ (the
:class:`~hybridstore.replay.planes.ObjectPlane`: ``SizedObjects`` or
``DataObjects``, ``replay/planes.py``), and the caller chooses them
(:func:`replay`'s ``plane_for``); the loop, the store and its policies are
the same, and the simulated clock advances by the modeled restore in both
modes, so both make the same decisions.  ``ReplayConfig.scale``
divides object sizes and budgets alike (real bytes must fit the machine);
modeled times are reported at full size.

A second discipline, ``ReplayConfig.discipline = "sequential"``, is the one
published simulators (Marconi's) and engine caches are compared in: the requests
of all sessions merged by trace time and served one at a time (no queue), so
TTFT = restore + recompute.  Budgets may be given as a fraction of the trace's
KV footprint (``ReplayConfig.budget``, :func:`kv_footprint`): the cache gets
``budget x footprint x (1 + mamba_ratio)`` bytes, SGLang's KV pool plus its
Mamba pool (``--mamba-full-memory-ratio``, 0.9 by default), and a preset that
partitions its tiers (``sglang-hicache``) splits them as SGLang does (states
``mamba_ratio / (1 + mamba_ratio)``).

TTFT = queueing + restore + recompute.  Rules for time between requests of a
session (closed loop): the next request arrives ``decode + think`` after the
previous one's first token, where decode = output tokens x the model's
per-token decode time and think = the trace's think time.  Output tokens are
not cached at decode time; the next prompt carries them and they count as
new input there (what a trace that records inputs only allows).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from hybridstore.config import StoreConfig
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import ResumePlan
from hybridstore.objects import TIER_BITS, TIER_ORDER, ObjectKind
from hybridstore.policy.tiering import TierPolicy, tier_policy
from hybridstore.replay.model_presets import (
    ModelPreset,
    model_preset,
    vllm_hybrid_pages,
)
from hybridstore.replay.planes import ObjectPlane, SizedObjects, TierBudget
from hybridstore.replay.systems import Preset, preset
from hybridstore.replay.tokens import session_tokens
from hybridstore.replay.trace import Request, Session, Trace
from hybridstore.store import HybridStore

GIB = 1 << 30
_UNLIMITED_BYTES = 1 << 62

POOLS = ("preset", "unified", "split")
"""How a budget is shared by KV and states: as the preset does (``sglang-hicache``
partitions), one pool for both (vLLM), or SGLang's split KV and Mamba pools for every
preset."""

DISCIPLINES = ("server", "sequential")
"""``server``: HiState §4.1's FIFO prefill server with live sessions; ``sequential``: all
requests merged by trace time, one at a time (Marconi's and the engines' discipline)."""

PlaneFactory = Callable[[Preset], ObjectPlane]
"""The objects of one preset's run (a fresh plane per run; the loop closes it)."""


def sized_planes(p: Preset) -> ObjectPlane:
    """Accounting mode's planes: sizes only, for every preset."""
    return SizedObjects()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """Settings of one replay (the defaults are HiState's setup).

    Attributes:
        model: model preset name (``replay/model_presets.py``).
        live_sessions: sessions live at once.
        gpu_gib, host_gib, disk_gib: cache budgets per tier.
        h2d_gbps, ssd_gbps: bandwidths for restore time.
        token_level: synthesize token ids from block ids so the index can
            match inside blocks (FlashStates ASC, anchors); False matches at
            block boundaries only.
        seed: session admission order.
        max_requests: stop after this many requests (None: all).
        scale: divide KV, checkpoint and budget bytes by this factor (ratios,
            hence decisions, are kept; modeled times and restored bytes are
            reported at full size).  Data mode needs it: real bytes must fit
            this machine.
        data: move real bytes through the pinned pool and the disk tier and
            time every restore (``replay/bytes_plane.py``); presets without a
            budget (``unlimited``) stay in accounting mode.  The caller makes
            it so: :func:`replay` runs data mode with the planes of
            ``bytes_plane.data_planes(data_dir)`` as its ``plane_for``.
        data_dir: directory for data mode's disk tier (a temporary one inside
            it per preset, removed after its run); None: the system's temp dir.
        discipline: ``"server"`` or ``"sequential"`` (:data:`DISCIPLINES`).
        budget: the cache budget as a fraction of the trace's KV footprint
            (:func:`kv_footprint`; ``0.1`` = 10 %), replacing the GiB budgets:
            ``budget x footprint x (1 + mamba_ratio)`` bytes in all, in the
            preset's first tier (sequential) or split over its tiers in the
            proportion of ``gpu_gib : host_gib : disk_gib`` (server).
            ``None``: the GiB budgets.
        mamba_ratio: state memory per KV memory (SGLang's
            ``--mamba-full-memory-ratio``, 0.9): sizes the budget's state part,
            and the state share of partitioned presets under ``budget``.
        pools: with ``budget``, how KV and states share it (:data:`POOLS`):
            ``"preset"`` (partitioning presets split, the others share),
            ``"unified"`` (every preset shares one pool), ``"split"`` (every
            preset gets SGLang's split pools: states ``mamba_ratio / (1 +
            mamba_ratio)`` of each tier, strictly).
        host_ratio: with ``budget``, a host tier of ``host_ratio`` times the first tier's
            bytes for presets that have one (vLLM's ``--kv-offloading-size`` as a multiple
            of its GPU pool; ``vllm-cpu``, ``vllm-disk``), the first tier keeping the
            whole ``budget``.  ``None``: the budget goes to the first tier only
            (sequential) or is split in the GiB proportion (server).
        disk_ratio: with ``host_ratio``, a disk tier of ``disk_ratio`` times the first
            tier's bytes for presets that have one (``vllm-disk``); ``math.inf``: no limit
            (vLLM's ``fs`` tier never evicts).  ``None``: no disk tier.
        state_scale: checkpoints ``state_scale`` times the model's own
            (:meth:`~hybridstore.replay.model_presets.ModelPreset.with_state_scale`): how
            much of a gap the states' bytes make (docs/replay.md).
        resume_hints: a what-if of an orchestrator that announces each session's next
            request (:func:`announce_next`, ``HybridStore.expect(..., in_s=)``) when a
            request has been served: its time, off by a factor ``exp(N(0, resume_hints))``
            (0: exact), or ``math.inf`` after a session's last request. ``None``: none.
    """

    model: str = "qwen3.5-9b"
    live_sessions: int = 24
    gpu_gib: float = 45.0
    host_gib: float = 96.0
    disk_gib: float = 150.0
    h2d_gbps: float = 64.0
    ssd_gbps: float = 5.0
    token_level: bool = True
    seed: int = 0
    max_requests: int | None = None
    scale: float = 1.0
    data: bool = False
    data_dir: str | None = None
    discipline: str = "server"
    budget: float | None = None
    mamba_ratio: float = 0.9
    pools: str = "preset"
    host_ratio: float | None = None
    disk_ratio: float | None = None
    state_scale: float = 1.0
    resume_hints: float | None = None

    def __post_init__(self) -> None:
        if self.pools not in POOLS:
            raise ConfigError(f"pools must be one of {POOLS}, got {self.pools!r}")
        if self.discipline not in DISCIPLINES:
            raise ConfigError(f"discipline must be one of {DISCIPLINES}, got {self.discipline!r}")
        if self.budget is not None and not (isinstance(self.budget, (int, float))
                                            and math.isfinite(self.budget) and self.budget > 0):
            raise ConfigError(f"budget is a positive fraction of the KV footprint (0.1 = 10 %), "
                              f"got {self.budget!r}")
        if self.host_ratio is not None and not (math.isfinite(self.host_ratio)
                                                and self.host_ratio >= 0):
            raise ConfigError(f"host_ratio must be >= 0, got {self.host_ratio!r}")
        if self.disk_ratio is not None and not self.disk_ratio >= 0:
            raise ConfigError(f"disk_ratio must be >= 0 (inf: no limit), got {self.disk_ratio!r}")
        if self.disk_ratio is not None and self.host_ratio is None:
            raise ConfigError("disk_ratio sizes a disk tier behind host_ratio's host tier: "
                              "give host_ratio too")
        if not (math.isfinite(self.mamba_ratio) and self.mamba_ratio >= 0):
            raise ConfigError(f"mamba_ratio must be >= 0, got {self.mamba_ratio!r}")
        if self.live_sessions < 1:
            raise ConfigError("live_sessions must be at least 1")
        self.full_model()   # a known model and a valid state scale
        if min(self.gpu_gib, self.host_gib, self.disk_gib) < 0:
            raise ConfigError("tier budgets must be non-negative")
        if not self.scale >= 1:
            raise ConfigError(f"scale must be at least 1, got {self.scale}")
        if self.resume_hints is not None and not (math.isfinite(self.resume_hints)
                                                  and self.resume_hints >= 0):
            raise ConfigError(f"resume_hints is the log-normal error of the announced times "
                              f"(>= 0; 0: exact), got {self.resume_hints!r}")

    def full_model(self) -> ModelPreset:
        """The replayed model at full size: ``model``'s preset, its checkpoints
        ``state_scale`` times its own."""
        return model_preset(self.model).with_state_scale(self.state_scale)


@dataclass(slots=True)
class RequestResult:
    """What one request cost under one policy."""

    session: str
    index: int
    kind: str
    input_tokens: int
    hit_tokens: int
    arrival_s: float
    queue_s: float
    restore_s: float
    recompute_s: float
    restored_bytes: dict[str, int]
    measured_restore_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.restore_s + self.recompute_s


@dataclass(slots=True)
class PolicyRun:
    """All request results of one preset, plus the store's counters.

    ``restore_s`` and ``restored_bytes`` of the results are at full size;
    ``measured_restore_s`` (data mode) moved ``restored_bytes / scale``.
    ``data`` holds data mode's end-of-run counters (``DataObjects.finish``).
    """

    name: str
    results: list[RequestResult] = field(default_factory=list)
    evictions: int = 0
    wall_s: float = 0.0
    lookups: int = 0
    scale: float = 1.0
    data: dict[str, Any] | None = None
    refused: int = 0
    unstored: int = 0
    duplicated_pages: int = 0

    def summary(self) -> dict[str, Any]:
        """The per-policy figures the CLI prints and writes to JSON."""
        res = self.results
        ttft = np.array([r.ttft_s for r in res]) if res else np.zeros(1)
        service = ttft - np.array([r.queue_s for r in res]) if res else np.zeros(1)
        inp = sum(r.input_tokens for r in res)
        hit = sum(r.hit_tokens for r in res)
        restored: dict[str, int] = {}
        for r in res:
            for tier, n in r.restored_bytes.items():
                restored[tier] = restored.get(tier, 0) + n
        return {
            "requests": len(res), "input_tokens": inp, "hit_tokens": hit,
            "recomputed_tokens": inp - hit, "token_hit_rate": hit / inp if inp else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(ttft.mean()),
            # restore + recompute: the TTFT without queueing, which `unlimited` bounds
            "service_p95_s": float(np.percentile(service, 95)),
            "service_p99_s": float(np.percentile(service, 99)),
            "restored_bytes": restored, "evictions": self.evictions,
            "requests_per_s": len(res) / self.wall_s if self.wall_s else 0.0,
            "block_lookups_per_s": self.lookups / self.wall_s if self.wall_s else 0.0,
            "scale": self.scale, "refused_requests": self.refused,
            "unstored_requests": self.unstored,
            "duplicated_pages": self.duplicated_pages,
        }


def merged_requests(trace: Trace) -> list[Request]:
    """Every request of the trace merged by trace time (ties: source order), each session's
    requests kept in their order (a request never precedes its predecessor)."""
    keyed = []
    for k, session in enumerate(trace.sessions):
        at = -math.inf
        for r in session.requests:
            at = max(at, r.arrival_s)
            keyed.append((at, k, r.index, r))
    keyed.sort(key=lambda x: x[:3])
    return [r for *_, r in keyed]


def kv_footprint(trace: Trace, cfg: ReplayConfig, model: ModelPreset) -> int:
    """KV bytes (full size) of the distinct blocks the replay's requests hold: one page
    per distinct chained block id (equal id, equal prefix) and, for a partial last block,
    per distinct (id, length), its id being the block's own or, where the trace gives
    none, the last full block's (it takes a whole page, as the tiers charge it), of the first ``cfg.max_requests`` requests by trace
    time (the server discipline serves a slightly different set when it stops early)."""
    reqs = merged_requests(trace)
    if cfg.max_requests is not None:
        reqs = reqs[:cfg.max_requests]
    B = trace.block_size
    pages: set[tuple[int, int, int]] = set()
    for r in reqs:
        full = r.input_tokens // B
        ids = r.block_ids.tolist()
        pages.update((i, B, 0) for i in ids[:full])
        if r.input_tokens % B:   # the partial last block: its own id, else the one before it
            pages.add((ids[full], r.input_tokens % B, 1) if len(ids) > full else
                      (ids[full - 1] if full else -1, r.input_tokens % B, 2))
    return len(pages) * model.page_bytes(B)


def tier_budgets(p: Preset, cfg: ReplayConfig, scale: float = 1.0,
                 footprint: int | None = None) -> list[TierBudget]:
    """The tiers of preset ``p``: configured budgets divided by ``scale``, HiState's bandwidths.

    With ``cfg.budget`` the bytes come from ``footprint`` (:func:`kv_footprint`) instead:
    ``budget x footprint x (1 + mamba_ratio)`` in all (see :class:`ReplayConfig`).
    """
    budgets = {"device": cfg.gpu_gib, "host": cfg.host_gib, "disk": cfg.disk_gib}
    ssd_path = 1.0 / (1.0 / cfg.ssd_gbps + 1.0 / cfg.h2d_gbps)  # HiState eq. 2, T_SSD
    gbps = {"device": 1e9, "host": cfg.h2d_gbps, "disk": ssd_path}
    caps = {name: budgets[name] * GIB for name in p.tiers}
    if cfg.budget is not None and not p.unlimited:
        if footprint is None:
            raise ConfigError("a budget as a fraction needs the trace's KV footprint")
        total = cfg.budget * footprint * (1.0 + cfg.mamba_ratio)
        names = p.tiers[:1] if cfg.discipline == "sequential" else \
            tuple(n for n in p.tiers if budgets[n] > 0) or p.tiers[:1]
        if cfg.host_ratio is not None:
            names = p.tiers[:1]
        weight = sum(budgets[n] for n in names) or 1.0
        caps = {n: total * ((budgets[n] / weight) if len(names) > 1 else 1.0) for n in names}
        if cfg.host_ratio and "host" in p.tiers and "host" not in caps:
            caps["host"] = cfg.host_ratio * total
        if cfg.disk_ratio and "disk" in p.tiers and "disk" not in caps:
            caps["disk"] = cfg.disk_ratio * total
    out = []
    for name, cap in caps.items():
        nbytes = _UNLIMITED_BYTES if p.unlimited or math.isinf(cap) \
            else min(_UNLIMITED_BYTES, int(cap / scale))
        if name == "device" and not p.unlimited:
            nbytes = p.pool_bytes(cfg.full_model(), nbytes, scale)
        if nbytes > 0:
            out.append(TierBudget(name, nbytes, gbps[name]))
    if not out:
        raise ConfigError(f"preset {p.name} has no tier with a budget")
    return out


def tiering_of(p: Preset, cfg: ReplayConfig) -> TierPolicy:
    """The preset's tier policy; under a budget, KV and states share it as ``cfg.pools`` says
    (split pools give states ``mamba_ratio / (1 + mamba_ratio)`` of each tier)."""
    policy = tier_policy(p.tier_policy)
    if cfg.budget is None or p.unlimited:
        return policy
    split = cfg.pools == "split" or (cfg.pools == "preset" and policy.state_share is not None)
    if split and cfg.mamba_ratio > 0:
        return dataclasses.replace(policy, state_share=cfg.mamba_ratio / (1 + cfg.mamba_ratio))
    return dataclasses.replace(policy, state_share=None)


class SimClock:
    """The replay's simulated time, read by policies that predict returns
    (:meth:`~hybridstore.policy.base.EvictionPolicy.bind_clock`): the trace time of the
    request being served (sequential discipline), or when the server takes it (server)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build_store(p: Preset, cfg: ReplayConfig, model: ModelPreset, block_size: int,
                objects: ObjectPlane | None = None, scale: float = 1.0,
                footprint: int | None = None, hash_secret: bytes | None = None,
                clock: SimClock | None = None) -> HybridStore:
    """A store with the preset's policies over tiers of the configured (scaled) sizes.

    Args:
        p: the preset.
        cfg: budgets and bandwidths.
        model: the model preset, already scaled (:meth:`ModelPreset.scaled`).
        block_size: tokens per page.
        objects: builds the tiers (accounting tiers by default).
        scale: budgets are divided by it.
        footprint: the trace's KV footprint at full size, for ``cfg.budget``.
        hash_secret: the store's ``StoreConfig.hash_secret`` (stores that share objects,
            the nodes of ``replay/fleet.py``, need one); None: a fresh one.
    """
    objects = objects or SizedObjects()
    tiers = objects.open_tiers(tier_budgets(p, cfg, scale, footprint))
    store_cfg = StoreConfig(block_size=block_size, policy=p.eviction, checkpoint_policy=p.admission,
                            tier_policy=p.tier_policy, h2d_gbps=cfg.h2d_gbps, ssd_gbps=cfg.ssd_gbps,
                            hash_secret=hash_secret)
    eviction, admission = p.policies(model)
    return HybridStore(store_cfg, tiers=tiers, placement=p.placement(model, block_size),
                       eviction=eviction, admission=admission, tiering=tiering_of(p, cfg),
                       clock=clock)


class _Sessions:
    """Closed-loop session admission: ``live`` at once, a random waiting one when one ends."""

    def __init__(self, sessions: Sequence[Session], live: int, seed: int) -> None:
        order = list(sessions)
        random.Random(seed).shuffle(order)
        self.waiting = order
        self.live = live

    def admit(self) -> Session | None:
        return self.waiting.pop() if self.waiting else None


def replay_policy(trace: Trace, name: str, cfg: ReplayConfig, *,
                  plane_for: PlaneFactory | None = None, progress: bool = True) -> PolicyRun:
    """Replay ``trace`` under the preset ``name``, with the objects ``plane_for`` gives it
    (sizes only by default; data mode needs the caller's planes, see :func:`replay`)."""
    if plane_for is None:
        if cfg.data:
            raise ConfigError("ReplayConfig(data=True) needs the planes that move the bytes: "
                              "replay(..., plane_for=hybridstore.replay.bytes_plane."
                              "data_planes(cfg.data_dir))")
        plane_for = sized_planes
    p = preset(name)
    full = cfg.full_model()
    model = full.scaled(cfg.scale)
    scale = full.kv_bytes_per_token / model.kv_bytes_per_token  # the factor applied exactly
    footprint = kv_footprint(trace, cfg, full) if cfg.budget is not None else None
    objects = plane_for(p)
    try:
        clock = SimClock()
        store = build_store(p, cfg, model, trace.block_size, objects, scale, footprint, clock=clock)
        loop = _run_sequential if cfg.discipline == "sequential" else _run
        run = loop(trace, p, cfg, model, scale, store, objects, clock, progress=progress)
    finally:
        objects.close()
    return run


@dataclass(slots=True)
class Served:
    """What serving one request cost (full-size times and bytes)."""

    hit_tokens: int
    restore_s: float
    recompute_s: float
    restored_bytes: dict[str, int]
    measured_restore_s: float | None


def kv_pool_pages(store: HybridStore, p: Preset, cfg: ReplayConfig, page_bytes: int) -> int | None:
    """The engine's KV pool in pages: what pages may take of the store's fastest tier (all
    of it, or its page partition under split pools); ``None`` for the unlimited reference."""
    if p.unlimited:
        return None
    tier = store.tiers[_fastest(store)]
    share = tiering_of(p, cfg).share(ObjectKind.PAGE)
    return int((1.0 if share is None else share) * tier.capacity_bytes) // tier.charge(page_bytes)


def _serve(store: HybridStore, objects: ObjectPlane, p: Preset, model: ModelPreset, scale: float,
           prompt: PrefixKeys, req: Request, run: PolicyRun, kv_pool: int | None = None) -> Served:
    """One request, as the engine serves it in either discipline: match, restore, then put
    the pages of the recomputed segment and the checkpoints the placement asks for.

    Under a KV pool (``kv_pool``, in pages; ``None`` for the unlimited reference) the engine
    first allocates fresh KV for the whole segment it computes, ``[plan.position, len)``,
    with the resumed prefix locked (:func:`_allocate`), as SGLang and vLLM do: KV the cache
    held past the resume point is not reused by the prefill, and it may be evicted by that
    allocation like any other.  A prompt whose KV alone exceeds the pool cannot be prefilled
    with its KV resident: an engine refuses it (SGLang aborts a prompt longer than its
    ``max_total_tokens``; vLLM cannot schedule more blocks than its pool holds), so it is
    served from its match and nothing of it is stored (``run.refused`` counts them);
    storing it would flush the whole pool for a prompt that cannot stay.  A put the store
    cannot make room for (everything left pinned or needed: ``CapacityError``) degrades
    the same way: the request is served, the rest of its prompt is not cached
    (``run.unstored`` counts them).
    """
    plan = store.match(prompt)
    run.lookups += prompt.nblocks
    cost = store.restore_cost(plan)
    page_bytes = model.page_bytes(prompt.block_size)
    refused = kv_pool is not None and prompt.nblocks > kv_pool
    last_used = _NO_TIMES
    try:
        measured = objects.restore(store, plan) if plan.position else None
        if kv_pool is not None and not refused:
            start = _device_prefix(store, plan) if p.loads_into_device else plan.position
            _allocate(store, prompt, start, page_bytes, p.transient_bytes(model))
        if p.duplicates and not refused:
            last_used = _cached_past(store, prompt, plan.position)
    finally:
        store.release(plan)
    # The simulated clock runs on the modeled restore, in data mode too.
    restore_s = sum(sec for _, sec in cost.values()) * scale
    recompute_s = model.prefill_seconds(plan.position, req.input_tokens)
    hints = list(req.anchors) if p.anchors else []
    if p.branch and plan.position < plan.kv_tokens < prompt.length:
        hints.append(plan.kv_tokens)
    if refused:
        run.refused += 1
    else:
        try:
            _put_segment(store, objects, prompt, plan.position, hints, page_bytes,
                         p.state_bytes(model), kv_to_last_state=p.kv_to_last_state)
            if p.duplicates:
                run.duplicated_pages += put_duplicates(
                    store, objects, prompt, plan.position, last_used, page_bytes,
                    serial=len(run.results) + 1,
                    block_tokens=vllm_hybrid_pages(model).block_tokens)
            if p.loads_into_device:
                _land_in_device(store, prompt, plan, hints)
        except CapacityError:
            # Everything left in the tier is pinned or needed (e.g. KV whose checkpoints
            # only a lower tier holds): the engine served the request but cannot cache
            # it, as it skips caching a prompt it has no free blocks for.  What landed
            # before the refusal stays; nothing more of this prompt is stored.
            run.unstored += 1
    return Served(plan.position, restore_s, recompute_s,
                   {t: round(n * scale) for t, (n, _) in cost.items()}, measured)


_NO_TIMES = np.zeros(0, np.int64)


def announce_next(store: HybridStore, prompt: PrefixKeys, cfg: ReplayConfig, session: Session,
                  i: int, wait: Callable[[Request], float]) -> None:
    """``cfg.resume_hints``' orchestrator, once request ``i`` of ``session`` was served: it
    tells the store when the session's next request ``nxt`` comes (``wait(nxt)`` seconds
    from the store's clock, times ``exp(N(0, resume_hints))``: the same error for the
    request under every preset), or that none will (its last request)."""
    if cfg.resume_hints is None:
        return
    if i + 1 == len(session.requests):
        store.expect(prompt, in_s=math.inf)
        return
    in_s = wait(session.requests[i + 1])
    if cfg.resume_hints:
        rng = np.random.default_rng([cfg.seed, zlib.crc32(session.id.encode()), i])
        in_s *= math.exp(rng.normal(0.0, cfg.resume_hints))
    store.expect(prompt, in_s=max(in_s, 0.0))


def _cached_past(store: HybridStore, prompt: PrefixKeys, position: int) -> np.ndarray:
    """When each page of the prompt's leading held run from ``position`` on was last used
    (read before the engine's put touches them again; one walk of the prompt)."""
    ids = store.index.known_ids(prompt)[position // prompt.block_size:]
    cols = store.index.page_columns(ids, ("tiers", "atime"))
    missing = np.flatnonzero(cols["tiers"] == 0)
    return cols["atime"][:int(missing[0]) if missing.size else len(ids)]


_DUPLICATE_SALT = 0x9E3779B97F4A7C15
"""Odd 64-bit multiplier of a request's serial: the salt of its second copies' keys."""


def put_duplicates(store: HybridStore, objects: ObjectPlane, prompt: PrefixKeys, position: int,
                   last_used: np.ndarray, page_bytes: int, *, serial: int,
                   block_tokens: int = 1) -> int:
    """vLLM's second copies (``Preset.duplicates``): a prefill resumed at ``position`` while
    the cache held the ``len(last_used)`` pages from there on (:func:`_cached_past`: when
    each was last used) recomputes those full blocks into fresh blocks and caches them next to the copies already
    there (vLLM's block pool does not de-duplicate: two blocks hold the same KV, each
    evicted at its own rank in the free queue, and the KV stays cached while either does).
    vLLM caches whole blocks of ``block_tokens`` (its hybrid block), so the copies end at
    the last such block boundary: the pages past it were a partial block, never cached.

    The store is content-addressed and keeps one copy, so the second one is put as a branch
    of pages that no prompt holds: the prompt's keys from ``position`` on, salted with the
    request's ``serial``.  The store's copy is the one the engine's put has just used; the
    branch ranks as the older copy, last used at ``last_used`` (read before that put;
    :meth:`HybridStore.age_sized`), which is what goes
    first when nothing hits it.  A one-byte marker state at the branch's end keeps its
    pages ranked as cached blocks (KV that no state needs is what vLLM never caches, and
    ``lru-vllm`` offers it first).  Returns the pages stored twice.
    """
    B = prompt.block_size
    first = position // B
    stop = min((first + len(last_used)) * B, prompt.length) // block_tokens * block_tokens // B
    if stop <= first:
        return 0
    keys = prompt.keys[:stop].copy()
    keys[first:] ^= np.array([_DUPLICATE_SALT * serial % 2**64, serial], dtype=np.uint64)
    copy = PrefixKeys(block_size=B, length=stop * B, root=prompt.root, keys=keys, tokens=None,
                      hash_key=prompt.hash_key)
    objects.put_pages(store, copy, first, page_bytes)
    objects.put_state(store, copy, stop * B, 1)
    store.age_sized(copy, first_block=first, last_used=last_used[:stop - first])
    return stop - first


def _fastest(store: HybridStore) -> str:
    """The name of the store's fastest tier (the engine's own cache)."""
    return next(name for name in TIER_ORDER if name in store.tiers)


def _device_prefix(store: HybridStore, plan: ResumePlan) -> int:
    """Tokens of the plan's resume prefix whose pages the fastest tier holds from the start
    (the rest an engine loads into blocks it allocates there: ``Preset.loads_into_device``)."""
    if not plan.position or not len(plan.pages):
        return plan.position
    bit = TIER_BITS[_fastest(store)]
    held = (store.index.page_columns(plan.pages, ("tiers",))["tiers"] & bit) != 0
    miss = np.flatnonzero(~held)
    if not miss.size:
        return plan.position
    return min(plan.position, (plan.first_page + int(miss[0])) * plan.block_size)


def _land_in_device(store: HybridStore, prompt: PrefixKeys, plan: ResumePlan,
                    hints: list[int]) -> None:
    """What the engine now holds in its GPU cache (``Preset.loads_into_device``): every page
    of the prompt and its states at the resume point and at the placement's positions, so
    copies of them held only behind the device (a hit it loaded, or a segment it recomputed
    whose copies a lower tier still held: the store's put only touches those) are copied
    into the device (:meth:`HybridStore.promote`), as vLLM's GPU caches the blocks it loads
    and computes.  Only into a ``device`` tier (the GPU cache; without one, as with
    ``--gpu-gib 0``, nothing is copied), and only from the host tier: vLLM promotes a disk
    hit into its CPU tier before it loads it, an object the host tier has evicted while the
    disk keeps it is rarely recomputed, and in data mode a copy from disk would read bytes
    that no restore charged."""
    if "device" not in store.tiers or "host" not in store.tiers:
        return
    anchors = [a for a in hints if 0 < a <= prompt.length]
    positions = [plan.position, *store.checkpoint_positions(cached=plan.position,
                                                            length=prompt.length, anchors=anchors)]
    store.promote(prompt, positions=positions, tier="device", sources=("host",))


def _allocate(store: HybridStore, prompt: PrefixKeys, cached: int, page_bytes: int,
              transient: int = 0) -> None:
    """The engine's KV allocation for the segment ``[cached, len)`` it is about to compute:
    room for its pages in the fastest tier, the resumed prefix pinned by the caller's plan,
    plus ``transient`` bytes the engine holds only while it computes
    (:meth:`~hybridstore.replay.systems.Preset.transient_bytes`).  Best effort: where
    everything left is pinned or needed, the put makes what room it can."""
    pages = prompt.nblocks - cached // prompt.block_size
    if pages <= 0:
        return
    tier = store.tiers[_fastest(store)]
    try:
        store.make_room(pages * tier.charge(page_bytes) + transient, ObjectKind.PAGE)
    except CapacityError:
        pass


def _result(session: str, req: Request, served: Served, arrival: float,
            queue_s: float) -> RequestResult:
    return RequestResult(session=session, index=req.index, kind=req.tags[0] if req.tags else "",
                         input_tokens=req.input_tokens, hit_tokens=served.hit_tokens,
                         arrival_s=arrival, queue_s=queue_s, restore_s=served.restore_s,
                         recompute_s=served.recompute_s, restored_bytes=served.restored_bytes,
                         measured_restore_s=served.measured_restore_s)


ServeFn = Callable[[Session, int, float], "Served"]
"""Serves request ``i`` of a session when the server takes it (at ``begin``, simulated
seconds): the engine's match, restore and put; returns what it cost."""


def server_loop(trace: Trace, cfg: ReplayConfig, model: ModelPreset, serve: ServeFn,
                results: list[RequestResult], *, desc: str, progress: bool,
                queued: Callable[[Session, int, float], None] | None = None) -> None:
    """The server discipline's events (module docstring): ``cfg.live_sessions`` closed-loop
    sessions, a random waiting one admitted when one ends, one FIFO prefill server; each
    request is served by ``serve`` and the session's next arrives ``decode + think`` after
    its first token.  Shared by the replay (:func:`_run`, the store) and the bound
    (``replay/server_bound.py``, hit counts): the same admission, the same clock.  Each
    result is appended to ``results`` as it is served (the put of the next request reads
    how many there are), in serving order, at most ``cfg.max_requests``.  ``queued`` is
    told, once per request, of every request that has arrived by the time ``begin`` the
    server takes the next one, before that one is served: the engine's waiting queue.
    """
    sessions = _Sessions([s for s in trace.sessions if s.requests], cfg.live_sessions, cfg.seed)
    total = trace.n_requests if cfg.max_requests is None else min(cfg.max_requests, trace.n_requests)
    events: list[tuple[float, int, Session, int]] = []
    seq = 0

    def start(session: Session, at: float) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, session, 0))
        seq += 1

    for _ in range(cfg.live_sessions):
        s = sessions.admit()
        if s is None:
            break
        start(s, max(0.0, s.requests[0].arrival_s))  # the trace's own start offsets
    server_free = 0.0
    told: set[tuple[int, int]] = set()
    with tqdm(total=total, desc=desc, unit="req", disable=not progress, leave=False) as bar:
        while events and len(results) < total:
            arrival, _, session, i = heapq.heappop(events)
            req = session.requests[i]
            begin = max(arrival, server_free)
            if queued is not None:
                told.discard((id(session), i))
                for at, _, waiting, j in events:
                    if at <= begin and (id(waiting), j) not in told:
                        told.add((id(waiting), j))
                        queued(waiting, j, begin)
            served = serve(session, i, begin)
            done = begin + served.restore_s + served.recompute_s
            server_free = done
            results.append(_result(session.id, req, served, arrival, begin - arrival))
            bar.update()
            if i + 1 < len(session.requests):
                nxt = session.requests[i + 1]
                at = done + req.output_tokens * model.decode_s_per_token + nxt.think_s
                heapq.heappush(events, (at, seq, session, i + 1))
                seq += 1
            else:
                s = sessions.admit()
                if s is not None:
                    start(s, done)


def _run(trace: Trace, p: Preset, cfg: ReplayConfig, model: ModelPreset, scale: float,
         store: HybridStore, objects: ObjectPlane, clock: SimClock, *, progress: bool) -> PolicyRun:
    """The server discipline's loop (:func:`server_loop`) over the store; results are at
    full size (the store's bytes and times x ``scale``)."""
    import time

    run = PolicyRun(p.name, scale=scale)
    tokens: dict[str, Iterator[np.ndarray]] = {}
    kv_pool = kv_pool_pages(store, p, cfg, model.page_bytes(trace.block_size))

    waiting: dict[tuple[str, int], PrefixKeys] = {}

    def prompt_of(session: Session, i: int) -> PrefixKeys:
        if i == 0:
            tokens[session.id] = session_tokens(session) if cfg.token_level else iter(())
        return _prompt(store, session.requests[i], tokens[session.id], cfg.token_level)

    def queued(session: Session, i: int, begin: float) -> None:
        prompt = waiting[(session.id, i)] = prompt_of(session, i)
        clock.now = begin
        store.expect(prompt)

    def serve(session: Session, i: int, begin: float) -> Served:
        req = session.requests[i]
        prompt = waiting.pop((session.id, i), None)
        if prompt is None:        # not announced: served as it arrived
            prompt = prompt_of(session, i)
        clock.now = begin
        served = _serve(store, objects, p, model, scale, prompt, req, run, kv_pool)
        if i + 1 == len(session.requests):
            tokens.pop(session.id, None)
        # server_loop's next arrival of the session, from begin: done + decode + think
        busy = served.restore_s + served.recompute_s + req.output_tokens * model.decode_s_per_token
        store.finished(prompt, in_s=busy)     # the session's next gap counts from then
        announce_next(store, prompt, cfg, session, i, lambda nxt: busy + nxt.think_s)
        return served

    t0 = time.perf_counter()
    with store:
        server_loop(trace, cfg, model, serve, run.results, desc=f"replay {p.name}",
                    progress=progress, queued=queued)
        run.evictions = store.stats()["evictions"]
        run.data = objects.finish(store)
    run.wall_s = time.perf_counter() - t0
    return run


def _run_sequential(trace: Trace, p: Preset, cfg: ReplayConfig, model: ModelPreset,
                    scale: float, store: HybridStore, objects: ObjectPlane, clock: SimClock, *,
                    progress: bool) -> PolicyRun:
    """The sequential discipline: every request by trace time, one at a time, no queue."""
    import time

    run = PolicyRun(p.name, scale=scale)
    order = merged_requests(trace)
    if cfg.max_requests is not None:
        order = order[:cfg.max_requests]
    by_id = {s.id: s for s in trace.sessions}
    tokens: dict[str, Iterator[np.ndarray]] = {}
    kv_pool = kv_pool_pages(store, p, cfg, model.page_bytes(trace.block_size))
    t0 = time.perf_counter()
    with store:
        for req in tqdm(order, desc=f"replay {p.name} (sequential)", unit="req",
                        disable=not progress, leave=False):
            session = by_id[req.session]
            if req.session not in tokens:
                tokens[req.session] = session_tokens(session) if cfg.token_level else iter(())
            prompt = _prompt(store, req, tokens[req.session], cfg.token_level)
            clock.now = max(clock.now, req.arrival_s)
            served = _serve(store, objects, p, model, scale, prompt, req, run, kv_pool)
            run.results.append(_result(req.session, req, served, req.arrival_s, 0.0))
            # it ends one decode step per output token on: the trace's next arrival of the
            # session already holds whatever prefill the engine it was recorded on did
            store.finished(prompt, in_s=req.output_tokens * model.decode_s_per_token)
            announce_next(store, prompt, cfg, session, req.index,
                          lambda nxt: nxt.arrival_s - clock.now)
            if req.index + 1 == len(session.requests):
                tokens.pop(req.session, None)
        run.evictions = store.stats()["evictions"]
        run.data = objects.finish(store)
    run.wall_s = time.perf_counter() - t0
    return run


def _prompt(store: HybridStore, req: Request, toks: Iterator[np.ndarray], token_level: bool) -> PrefixKeys:
    if token_level:
        return store.prefix(next(toks))
    return store.prefix_from_block_ids(req.block_ids, length=min(
        req.input_tokens, len(req.block_ids) * req.block_size))


def _put_segment(store: HybridStore, objects: ObjectPlane, prompt: PrefixKeys, cached: int,
                 hints: list[int], page_bytes: int, state_bytes: int, *,
                 kv_to_last_state: bool = False) -> None:
    """What the engine stores after prefilling ``[cached, len)``: pages, then checkpoints.

    ``hints`` are the positions the engine knows (semantic anchors, the
    branch point) for presets whose placement uses them.  ``kv_to_last_state``: only
    the pages up to the last checkpoint of the segment are kept (SGLang's extra-buffer
    insert stops at its last tracked state; the KV past it is freed).
    """
    if prompt.length == 0:
        return
    anchors = [a for a in hints if 0 < a <= prompt.length]
    if not kv_to_last_state:
        objects.put_pages(store, prompt, cached // prompt.block_size, page_bytes)
    positions = [p for p in store.checkpoint_positions(cached=cached, length=prompt.length,
                                                       anchors=anchors)
                 if prompt.key_at(p) is not None]
    if kv_to_last_state and positions:
        keep = positions[-1] // prompt.block_size
        head = PrefixKeys(block_size=prompt.block_size, length=keep * prompt.block_size,
                          root=prompt.root, keys=prompt.keys[:keep],
                          tokens=None if prompt.tokens is None
                          else prompt.tokens[:keep * prompt.block_size],
                          hash_key=prompt.hash_key)
        objects.put_pages(store, head, cached // prompt.block_size, page_bytes)
    for p in positions:
        objects.put_state(store, prompt, p, state_bytes)


def replay(trace: Trace, names: Sequence[str], cfg: ReplayConfig, *,
           plane_for: PlaneFactory | None = None, progress: bool = True) -> dict[str, PolicyRun]:
    """Replay ``trace`` under each preset in ``names`` (same sessions, same order).

    Args:
        trace: the trace.
        names: preset names (``replay/systems.py``).
        cfg: budgets, bandwidths, model, scale.
        plane_for: the objects of each preset's run (``replay/planes.py``);
            default: sizes only (:func:`sized_planes`).  Data mode
            (``cfg.data``) needs the caller's choice of planes, e.g.
            ``bytes_plane.data_planes(cfg.data_dir)``.
        progress: show a progress bar per preset.

    Raises:
        ConfigError: ``cfg.data`` without ``plane_for``.
    """
    return {name: replay_policy(trace, name, cfg, plane_for=plane_for, progress=progress)
            for name in names}
