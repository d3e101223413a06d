"""Presets: the systems the replay compares, each a combination of the store's policies.

Every preset runs the same index and store; only the policies, tier policy
and the tiers it may use differ.  What each models, and where it simplifies:

==================  ===========================================================
preset              models
==================  ===========================================================
``unlimited``       every block boundary and request end checkpointed, nothing
                    evicted: the reference upper bound of hit rate
``vllm-marconi``    vLLM 0.33 hybrid prefix caching (GPU only, one block pool for
                    KV and states), ``mamba_cache_mode="align"``: states at the
                    end of every 8,192-token prefill chunk, at the branch point
                    (block-floored: where the KV match ran past the deepest
                    state) and at the last block boundary before the prompt's
                    last token, in vLLM's hybrid
                    block (512 tokens for qwen3.5-9b: a page covers a state);
                    its free-queue LRU (``lru-vllm`` with ``running_state``: a
                    request's tail first, states its prefill passed before its
                    KV, KV no state needs first, no slack), which may leave
                    states without their KV; the pool accounted as vLLM's (a state
                    padded to one hybrid block per Mamba group, whole blocks less
                    the null block, room for the blocks a prefill holds while it
                    runs), and a second copy of the KV a prefill recomputes while
                    the pool still holds it (vLLM does not de-duplicate blocks).  Calibrated against vLLM's own
                    KVCacheManager (``python -m benchmarks calibrate --engine
                    vllm``, docs/replay.md)
``vllm-cpu``        vLLM 0.33 with CPU offloading (``--kv-offloading-size``:
                    ``OffloadingConnector``, ``CPUOffloadingSpec``, its LRU): the
                    GPU side as ``vllm-marconi``; the host tier write-through
                    (vLLM offloads every full block of the prompt and every
                    align-mode state the GPU caches), ranked as vLLM's
                    offloading LRU ranks its chunks (``lru-vllm`` with
                    ``offload_tiers``: by the request that last stored or used
                    them, tail first, a state just before the KV block ending
                    at it); a hit is the GPU prefix extended through the host
                    tier to the deepest state, and what it loads or computes
                    is then in the GPU cache (``loads_into_device``).
                    Calibrated against vLLM's own connector and CPU manager
                    (``python -m benchmarks calibrate --engine vllm
                    --offload-cpu 2``, docs/replay.md); the host budget:
                    ``ReplayConfig.host_ratio`` (``--host-ratio``)
``vllm-disk``       ``vllm-cpu`` plus a disk tier behind the host tier (vLLM's
                    ``TieringOffloadingSpec`` with its ``fs`` tier: every chunk
                    the CPU tier stores cascades to it, a CPU miss it holds is
                    promoted back), write-through, ranked as the host tier.
                    vLLM's ``fs`` tier has no capacity and never evicts: give
                    the preset ``disk_ratio = inf`` (``--disk-ratio inf``).
                    Calibrated against vLLM's own tiering manager and ``fs``
                    tier (``python -m benchmarks calibrate --engine vllm
                    --offload-cpu 2 --offload-disk``, docs/replay.md)
``sglang-hicache``  SGLang 0.5.23's ``UnifiedRadixCache`` (FULL + MAMBA, no extra
                    buffer: one state at each prompt's end), its split KV and
                    Mamba pools (static partition; ``mamba_ratio / (1 + ratio)``
                    for states under a budget), its radix LRU (``lru-radix``:
                    least recently used leaf with its state, state LRU for the
                    Mamba pool, no slack); HiCache's host tiers write-through.
                    Calibrated against SGLang's own cache
                    (``python -m benchmarks calibrate``, docs/replay.md)
``sglang-extra``    SGLang 0.5.23 as it runs by default (``auto`` resolves to
                    the Mamba extra buffer, page 64): one state per prefill
                    chunk of 8192 tokens at its last 64-aligned position, or
                    the branch point inside that chunk (``chunk-track``), the
                    radix insert stopping at the last state (no KV past it:
                    ``kv_to_last_state``), split pools, ``lru-radix``; no
                    decode-time states.  Calibrated against SGLang's own cache
                    (``python -m benchmarks calibrate --sglang-mode
                    extra_buffer``): the same hit on every request of the
                    bundled sample at 10/20/50 %
``marconi``         Marconi: checkpoints at turn ends and branch points only;
                    eviction by recency + FLOP efficiency (α = 1)
``flashstates``     FlashStates: exact request-end checkpoints (ASC), hybrid
                    states evicted as units by prefill time saved per byte,
                    cost-aware admission; GPU + DRAM
``semantic``        semantic anchors (seed 003): checkpoints at turn / tool
                    boundaries the trace records, plus the request end;
                    dependency-aware LRU; write-through DRAM + SSD
``histate``         HiState: adaptive interval (eq. 3–6) + terminal state,
                    asymmetric tiering (§3.1), unified eviction (eq. 7)
``hybridstore``     ours, the best composition measured (docs/replay.md): vLLM's
                    align-mode placement as calibrated (a state per prefill chunk,
                    at the last hybrid-block boundary and at aligned branch
                    points) plus states at the resume offsets it learns where
                    they pay (``policy/learned.py``), HiState's eq. 7 eviction
                    (KV room priced by the pages freed under split pools) and
                    asymmetric tiering, plus abandoned-branch demotion (a branch
                    the prompt rewrote, an edited turn's dead end, goes first;
                    ``policy/histate.py``) and, for eq. 7's recency, each
                    trajectory's predicted next use (its median return gap on
                    the replay's clock; ``policy/nextuse.py``); the README default
==================  ===========================================================

Simplifications common to all: the GPU tier is a cache of the given budget
with free restores (the engine's own KV pool), copies between tiers are
instantaneous for capacity purposes, and restore time is modelled from bytes
and bandwidth, not simulated transfer by transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridstore.errors import ConfigError
from hybridstore.policy import admission_policy, eviction_policy, placement_policy
from hybridstore.policy.base import AdmissionPolicy, EvictionPolicy, PlacementPolicy
from hybridstore.policy.flashstates import FlashStatesEviction
from hybridstore.policy.learned import LearnedOffsets
from hybridstore.policy.placement import Compose
from hybridstore.policy.units import PrefillCost
from hybridstore.replay.model_presets import ModelPreset, vllm_hybrid_pages

PlacementFactory = Callable[[ModelPreset, int], PlacementPolicy]

VLLM_MAX_BATCHED_TOKENS = 8192
"""``vllm serve``'s default ``max_num_batched_tokens`` on an H100/H200-class GPU (vLLM
0.33 ``engine/arg_utils.py``): the scheduler's prefill chunk, whose ends keep states."""


def _place(*specs: tuple[str, dict]) -> PlacementFactory:
    """A factory composing registered placements; ``"$B"`` / ``"$Ns"`` / ``"$kv"`` / ``"$state"``
    in params stand for the block size, N_s, KV bytes per token and checkpoint bytes,
    ``"$vB"`` for vLLM's hybrid block (:func:`~hybridstore.replay.model_presets.vllm_hybrid_pages`)."""

    def build(model: ModelPreset, block_size: int) -> PlacementPolicy:
        subst: dict[str, Any] = {"$B": block_size, "$Ns": model.state_tokens(),
                                 "$kv": model.kv_bytes_per_token, "$state": model.checkpoint_bytes}
        if any(v == "$vB" for _, params in specs for v in params.values()):
            subst["$vB"] = vllm_hybrid_pages(model).block_tokens
        parts = [placement_policy(name, **{k: subst.get(v, v) if isinstance(v, str) else v
                                           for k, v in params.items()}) for name, params in specs]
        return parts[0] if len(parts) == 1 else Compose(*parts)

    return build


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """One compared system (see the module table).

    Attributes:
        eviction, admission: registry names (``hybridstore.policy``).
        placement: builds the checkpoint placement for a model and block size.
        params: builds keyword parameters of the eviction and admission
            policies from the model preset (prefill costs, sizes).
        tier_policy: ``policy/tiering.py`` name.
        tiers: the tiers the system uses (budgets come from the replay).
        anchors: the engine tells the placement the trace's semantic anchors.
        branch: the engine tells the placement the branch point (where the
            prompt leaves cached context).
        unlimited: no capacity limit at all.
        kv_to_last_state: the engine keeps a prompt's KV only up to its last
            checkpoint of the segment (SGLang's extra buffer: the radix insert
            stops at the last tracked state, the KV past it is freed).
        loads_into_device: a hit restored from a tier behind the device takes
            device room as the segment the engine computes does (vLLM's
            offloading connector loads it into fresh GPU blocks, cached there
            from then on): the engine's KV allocation counts from the end of
            the device-resident prefix, not from the resume point.
        duplicates: the engine keeps a second copy of the KV it recomputes while its
            cache still holds it (vLLM's block pool does not de-duplicate blocks:
            ``block_pool.py``, ``BlockHashToBlockMap``, "we don't de-duplicate the blocks
            in the cache", so that block tables stay append-only): a request that resumes
            from a state before the end of its cached KV caches those blocks again
            (:func:`~hybridstore.replay.sim.put_duplicates`).  GPU-only presets: vLLM's
            CPU offloading looks its blocks up by hash and stores one copy.
        vllm_blocks: the device tier is accounted as vLLM's one block pool
            (:func:`~hybridstore.replay.model_presets.vllm_hybrid_pages`): a checkpoint
            takes one hybrid block in each Mamba group (qwen3.5-9b's 50 MB state takes 3
            blocks of 17.2 MB: ``platforms/interface.py`` pads the Mamba page to the
            attention page), the budget is whole blocks less the null block
            (``block_pool.py``: block 0 is never allocated), and a prefill's allocation
            also makes room for the blocks vLLM holds only while it runs
            (:meth:`transient_bytes`).
    """

    name: str
    eviction: str
    placement: PlacementFactory
    params: Callable[[ModelPreset], dict[str, dict[str, Any]]] = lambda model: {}
    tier_policy: str = "write-through"
    admission: str = "keep-all"
    tiers: tuple[str, ...] = ("device", "host", "disk")
    anchors: bool = False
    branch: bool = False
    unlimited: bool = False
    kv_to_last_state: bool = False
    loads_into_device: bool = False
    duplicates: bool = False
    vllm_blocks: bool = False

    def __post_init__(self) -> None:
        if self.duplicates and len(self.tiers) > 1:
            raise ConfigError(f"preset {self.name}: duplicates model one GPU block pool; "
                              f"it has the tiers {self.tiers}")

    def state_bytes(self, model: ModelPreset) -> int:
        """Bytes one checkpoint of ``model`` takes in the preset's cache (``vllm_blocks``)."""
        if not self.vllm_blocks:
            return model.checkpoint_bytes
        pages = vllm_hybrid_pages(model)
        return round(pages.mamba_groups * pages.block_bytes)

    def transient_bytes(self, model: ModelPreset) -> int:
        """Bytes the engine holds in the device tier only while it prefills a prompt
        (``vllm_blocks``: vLLM's pool then holds the prompt's partial last block and two
        running states, double-buffered across chunks, ``MambaManager``): room its KV
        allocation makes, which the store never fills (:func:`~hybridstore.replay.sim._serve`)."""
        if not self.vllm_blocks:
            return 0
        pages = vllm_hybrid_pages(model)
        return round((1 + 2 * pages.mamba_groups) * pages.block_bytes)

    def pool_bytes(self, model: ModelPreset, nbytes: int, scale: float = 1.0) -> int:
        """What the device tier may hold of a budget of ``nbytes`` (``vllm_blocks``: whole
        hybrid blocks of ``model`` at full size, divided by ``scale``, less the null block)."""
        if not self.vllm_blocks:
            return nbytes
        block = vllm_hybrid_pages(model).block_bytes / scale
        return int(max(0, int(nbytes // block) - 1) * block)

    def with_eviction(self, **kwargs: Any) -> Preset:
        """This preset with ``kwargs`` over its eviction policy's parameters (e.g.
        ``supersede=0.25``): an experiment against the preset as it is."""
        base = self.params

        def params(model: ModelPreset) -> dict[str, dict[str, Any]]:
            out = base(model)
            return {**out, "eviction": {**out.get("eviction", {}), **kwargs}}

        return replace(self, params=params)

    def policies(self, model: ModelPreset) -> tuple[EvictionPolicy, AdmissionPolicy]:
        """The eviction and admission policy instances for ``model``."""
        params = self.params(model)
        return (eviction_policy(self.eviction, **params.get("eviction", {})),
                admission_policy(self.admission, **params.get("admission", {})))


def _flops(model: ModelPreset) -> PrefillCost:
    """Prefill FLOPs per token and per token of context (Marconi's FLOP efficiency)."""
    return PrefillCost(per_token=2.0 * model.active_params,
                       per_context_token=4.0 * model.attn_layers * model.q_heads * model.head_dim)


def _seconds(model: ModelPreset) -> PrefillCost:
    """Prefill seconds (FlashStates prices states by the prefill time they save)."""
    f = _flops(model)
    return PrefillCost(per_token=f.per_token / model.prefill_flops,
                       per_context_token=f.per_context_token / model.prefill_flops)


def _flashstates(model: ModelPreset) -> dict[str, dict[str, Any]]:
    eviction = FlashStatesEviction(cost=_seconds(model))
    return {"eviction": {"cost": _seconds(model)},
            "admission": {"eviction": eviction, "tier": "device"}}


def _learned(factory: PlacementFactory) -> PlacementFactory:
    """``factory``'s placement plus states at the resume offsets learned online
    (:class:`~hybridstore.policy.learned.LearnedOffsets`, on vLLM's hybrid-block grid,
    priced with the model's ``N_s``)."""

    def build(model: ModelPreset, block_size: int) -> PlacementPolicy:
        return LearnedOffsets(factory(model, block_size), block_size=vllm_hybrid_pages(model).block_tokens,
                              state_tokens=model.state_tokens())

    return build


VLLM_ALIGN = ("block-aligned", {"block_size": "$vB", "chunk": VLLM_MAX_BATCHED_TOKENS,
                                "logits_token": True, "junctions": True})
"""vLLM's align-mode placement as calibrated (docs/replay.md): a state per prefill chunk, at
the last hybrid-block boundary before the logits token and at aligned branch points."""

_VLLM_OFFLOAD_LRU = {"running_state": True, "offload_tiers": ("host", "disk")}
"""vLLM's GPU block pool order on the device, its offloading LRU's behind it."""

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(name="unlimited", eviction="lru", unlimited=True, tiers=("device",),
           placement=_place(("interval", {"interval": "$B"}), ("request-end", {}))),
    Preset(name="vllm-marconi", eviction="lru-vllm", tiers=("device",), branch=True,
           duplicates=True, vllm_blocks=True,
           params=lambda model: {"eviction": {"running_state": True}},
           placement=_place(VLLM_ALIGN)),
    Preset(name="vllm-cpu", eviction="lru-vllm", tiers=("device", "host"), branch=True,
           loads_into_device=True,
           params=lambda model: {"eviction": _VLLM_OFFLOAD_LRU},
           placement=_place(VLLM_ALIGN)),
    Preset(name="vllm-disk", eviction="lru-vllm", tiers=("device", "host", "disk"), branch=True,
           loads_into_device=True,
           params=lambda model: {"eviction": _VLLM_OFFLOAD_LRU},
           placement=_place(VLLM_ALIGN)),
    Preset(name="sglang-hicache", eviction="lru-radix", tier_policy="partition",
           placement=_place(("request-end", {}))),
    Preset(name="sglang-extra", eviction="lru-radix", tier_policy="partition", branch=True,
           kv_to_last_state=True,
           placement=_place(("chunk-track", {"block_size": "$B", "chunk": 8192}))),
    Preset(name="marconi", eviction="marconi", tiers=("device", "host"), tier_policy="write-back",
           branch=True, placement=_place(("marconi", {})),
           params=lambda model: {"eviction": {"flops": _flops(model)}}),
    Preset(name="flashstates", eviction="flashstates", admission="flashstates",
           tiers=("device", "host"), tier_policy="write-back",
           placement=_place(("request-end", {})), params=_flashstates),
    Preset(name="semantic", eviction="lru", anchors=True,
           placement=_place(("anchors", {}), ("request-end", {}))),
    Preset(name="histate", eviction="histate", tier_policy="asymmetric",
           placement=_place(("adaptive", {"state_tokens": "$Ns", "block_size": "$B"})),
           params=lambda model: {"eviction": {"kv_bytes_per_token": model.kv_bytes_per_token}}),
    Preset(name="hybridstore", eviction="hybridstore", tier_policy="asymmetric", branch=True,
           placement=_learned(_place(VLLM_ALIGN)),
           params=lambda model: {"eviction": {"kv_bytes_per_token": model.kv_bytes_per_token}}),
)}


def preset(name: str) -> Preset:
    """The preset called ``name``; ConfigError lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
