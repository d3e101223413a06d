"""Policies: eviction ranking, checkpoint admission and placement (pure, no I/O).

==================  ======================================================
eviction            ranking
==================  ======================================================
``lru``             dependency-aware LRU, reclaimable pages first (a request's
                    KV awaiting its checkpoint last)
``lru-vllm``        plain per-object LRU, not dependency-aware (vLLM)
``lru-radix``       SGLang's radix LRU: least recently used leaf, its state with it
``lru-refresh``     ``lru`` whose hits refresh the whole checkpoint chain
``marconi``         recency + alpha * FLOP efficiency (Marconi)
``histate``         HiState eq. 7 over checkpoints and terminal bundles
``flashstates``     prefill time saved per byte freed, decayed by idleness
==================  ======================================================

Admission: ``keep-all``, ``flashstates`` (cost-aware).  Placement:
``request-end``, ``branch-points`` (alias ``marconi``), ``interval``,
``block-aligned``, ``adaptive``, ``anchors``; ``compose`` takes ``parts=[...]``
and ``placement_policy("adaptive+anchors")`` composes registered defaults;
``learned`` adds states at the resume offsets it learns to its ``parts``.
"""

from __future__ import annotations

from typing import Any

from hybridstore.errors import ConfigError
from hybridstore.policy.admission import KeepAll
from hybridstore.policy.anchors import SemanticAnchors
from hybridstore.policy.base import (
    AdmissionPolicy,
    EvictionPolicy,
    PlacementPolicy,
    ResidenceStats,
    Victim,
)
from hybridstore.policy.chunk_track import ChunkTrack
from hybridstore.policy.flashstates import FlashStatesAdmission, FlashStatesEviction
from hybridstore.policy.histate import HiStateEviction, HybridStoreEviction
from hybridstore.policy.intervals import AdaptiveInterval, FixedInterval
from hybridstore.policy.learned import LearnedOffsets
from hybridstore.policy.lru import LRUEviction
from hybridstore.policy.lru_radix import RadixLRUEviction
from hybridstore.policy.lru_refresh import LRURefreshEviction
from hybridstore.policy.lru_vllm import PlainLRUEviction
from hybridstore.policy.marconi import MarconiEviction
from hybridstore.policy.placement import BlockAligned, BranchPoints, Compose, RequestEnd
from hybridstore.policy.units import PrefillCost

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUEviction,
    "lru-vllm": PlainLRUEviction,
    "lru-radix": RadixLRUEviction,
    "lru-refresh": LRURefreshEviction,
    "marconi": MarconiEviction,
    "histate": HiStateEviction,
    "hybridstore": HybridStoreEviction,
    "flashstates": FlashStatesEviction,
}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "keep-all": KeepAll,
    "flashstates": FlashStatesAdmission,
}
PLACEMENT_POLICIES: dict[str, type[PlacementPolicy]] = {
    "request-end": RequestEnd,
    "branch-points": BranchPoints,
    "marconi": BranchPoints,
    "interval": FixedInterval,
    "block-aligned": BlockAligned,
    "chunk-track": ChunkTrack,
    "adaptive": AdaptiveInterval,
    "anchors": SemanticAnchors,
    "compose": Compose,     # placement_policy("compose", parts=[...])
    "learned": LearnedOffsets,   # placement_policy("learned", parts=[...], block_size=..., ...)
}


def _build(registry: dict[str, type], kind: str, name: str, params: dict[str, Any]) -> Any:
    try:
        cls = registry[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for {kind} {name!r}: {exc}") from None


def eviction_policy(name: str, **params: Any) -> EvictionPolicy:
    """The eviction policy called ``name``; ConfigError lists the known ones."""
    return _build(EVICTION_POLICIES, "policy", name, params)


def admission_policy(name: str, **params: Any) -> AdmissionPolicy:
    """The checkpoint admission policy called ``name``."""
    return _build(ADMISSION_POLICIES, "checkpoint_policy", name, params)


def placement_policy(name: str, **params: Any) -> PlacementPolicy:
    """The placement called ``name``; ``"a+b"`` composes placements (then without parameters)."""
    parts = name.split("+")
    if len(parts) == 1:
        return _build(PLACEMENT_POLICIES, "placement", name, params)
    if params:
        raise ConfigError(f"composite placement {name!r} takes no parameters; build the parts "
                          "with placement_policy() and pass them to Compose")
    return Compose(*(_build(PLACEMENT_POLICIES, "placement", part, {}) for part in parts))


__all__ = ["ADMISSION_POLICIES", "AdaptiveInterval", "AdmissionPolicy", "BlockAligned",
           "BranchPoints", "ChunkTrack", "Compose", "EVICTION_POLICIES", "EvictionPolicy",
           "FixedInterval", "FlashStatesAdmission", "FlashStatesEviction", "HiStateEviction",
           "HybridStoreEviction", "KeepAll", "LRUEviction", "LearnedOffsets", "LRURefreshEviction",
           "MarconiEviction", "PLACEMENT_POLICIES", "PlacementPolicy", "PlainLRUEviction",
           "PrefillCost", "RadixLRUEviction", "RequestEnd", "ResidenceStats", "SemanticAnchors",
           "Victim", "admission_policy", "eviction_policy", "placement_policy"]
