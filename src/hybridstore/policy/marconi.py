"""Marconi eviction: recency plus FLOP efficiency (Pan et al. 2025, §4.2).

Marconi scores every cache entry as ``S = recency + alpha * flop_efficiency``,
both min-max normalised over the candidates, and evicts the lowest score.
Its entries are radix-tree nodes holding KV and the recurrent state at the
node's end, evicted together; here they are the equivalent hybrid-state units
(a checkpoint plus the pages only it needs, :mod:`~hybridstore.policy.units`).

FLOP efficiency is the prefill FLOPs a hit on the entry saves per byte it
occupies.  Evicting the entry makes a resume fall back to the nearest retained
checkpoint before it (the parent node), so the FLOPs saved are those of the
prefix segment between the two: ``F(p) - F(p_-)`` with ``F`` the per-model
:class:`~hybridstore.policy.units.PrefillCost` in FLOPs.  Long contexts make
this superlinear in ``p`` (the attention term), which is what lets Marconi
keep the long, expensive prefixes that LRU drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.index.trie import HybridIndex
from hybridstore.objects import ObjectKind
from hybridstore.policy.units import HybridUnit, PrefillCost, UnitEviction

DEFAULT_FLOPS = PrefillCost(per_token=2 * 9e9, per_context_token=4 * 8 * 4096)
"""FLOPs of a ~9B-parameter hybrid with 8 attention layers of width 4096: 2·params per
token, plus 4·d per attention layer per (token, earlier token) pair."""


@dataclass(frozen=True, slots=True)
class _Pass:
    t_lo: float
    t_span: float
    e_lo: float
    e_span: float


class MarconiEviction(UnitEviction):
    """Marconi's utility ``recency + alpha * flop_efficiency`` (both normalised), lowest first.

    Args:
        alpha: weight of FLOP efficiency against recency (Marconi tunes it on
            a bootstrap window; 0 is LRU over hybrid-state units).
        flops: the model's prefill FLOPs.
    """

    name = "marconi"

    def __init__(self, *, alpha: float = 1.0, flops: PrefillCost = DEFAULT_FLOPS) -> None:
        if alpha < 0:
            raise ConfigError(f"alpha must be non-negative, got {alpha}")
        self.alpha = alpha
        self.flops = flops

    def efficiency(self, unit: HybridUnit) -> float:
        """Prefill FLOPs a resume at the unit's checkpoint saves, per byte the unit holds."""
        ck = unit.ck
        before = ck.parent.position if ck.parent is not None else 0
        return self.flops.between(before, ck.position) / max(unit.nbytes, 1)

    def prepare(self, index: HybridIndex, tier: str, pages: dict[str, np.ndarray],
                units: list[HybridUnit], kind: ObjectKind | None = None) -> _Pass:
        if not units:
            return _Pass(0.0, 1.0, 0.0, 1.0)
        t = np.fromiter((u.ck.atime for u in units), dtype=np.float64, count=len(units))
        e = np.fromiter((self.efficiency(u) for u in units), dtype=np.float64, count=len(units))
        return _Pass(float(t.min()), float(t.max() - t.min()) or 1.0,
                     float(e.min()), float(e.max() - e.min()) or 1.0)

    def score(self, index: HybridIndex, unit: HybridUnit, ctx: _Pass) -> float:
        recency = (unit.ck.atime - ctx.t_lo) / ctx.t_span
        eff = (self.efficiency(unit) - ctx.e_lo) / ctx.e_span
        return recency + self.alpha * eff


__all__ = ["DEFAULT_FLOPS", "MarconiEviction"]
