"""Tier placement: which tiers an object is written to, and where it goes when DRAM evicts it.

Every object lands in the pinned DRAM pool first (the engine's offload path:
GPU → pinned host → SSD).  A :class:`TierPolicy` then decides, per object kind:

====================  ==========================================================
field                 meaning
====================  ==========================================================
``write_through``     kinds also written to SSD as they are put (vLLM CPU/disk
                      offloading, SGLang HiCache ``write_through``)
``spill``             kinds whose last DRAM copy is written to SSD when DRAM
                      evicts it, instead of being dropped (write-back)
``historical_to_ssd`` a checkpoint that stops being its trajectory's terminal
                      state moves to SSD and leaves DRAM; the terminal state
                      stays in DRAM (HiState §3.1, asymmetric tiering)
``state_share``       fraction of each tier reserved for checkpoints, the rest
                      for KV (SGLang HiCache's static partition); ``None``
                      shares the whole tier
====================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridstore.errors import ConfigError
from hybridstore.objects import ObjectKind

_BOTH = frozenset({ObjectKind.PAGE, ObjectKind.STATE})


@dataclass(frozen=True, slots=True, kw_only=True)
class TierPolicy:
    """Where objects live across DRAM and SSD (see the module table)."""

    name: str
    write_through: frozenset[ObjectKind] = frozenset()
    spill: frozenset[ObjectKind] = frozenset()
    historical_to_ssd: bool = False
    state_share: float | None = None

    def __post_init__(self) -> None:
        if self.state_share is not None and not 0.0 < self.state_share < 1.0:
            raise ConfigError(f"state_share must be in (0, 1), got {self.state_share}")

    def share(self, kind: ObjectKind) -> float | None:
        """Fraction of a tier this kind may use (``None``: no partition)."""
        if self.state_share is None:
            return None
        return self.state_share if kind == ObjectKind.STATE else 1.0 - self.state_share


TIER_POLICIES: dict[str, TierPolicy] = {
    # vLLM CPU/disk offloading: every object to every tier, LRU per tier.
    "write-through": TierPolicy(name="write-through", write_through=_BOTH),
    # DRAM first; SSD receives what DRAM evicts.
    "write-back": TierPolicy(name="write-back", spill=_BOTH),
    # SGLang HiCache: write-through, about half of each tier for states.
    "partition": TierPolicy(name="partition", write_through=_BOTH, state_share=0.5),
    # HiState §3.1: KV prefers DRAM (colder KV spills to SSD), historical
    # checkpoints go to SSD, the terminal state stays in DRAM.
    "asymmetric": TierPolicy(name="asymmetric", spill=_BOTH, historical_to_ssd=True),
}


def tier_policy(name: str) -> TierPolicy:
    """The tier policy called ``name``; ConfigError lists the known ones."""
    try:
        return TIER_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown tier policy {name!r}; choose one of {sorted(TIER_POLICIES)}") from None
