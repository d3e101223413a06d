"""FlashStates cost-aware eviction and admission of hybrid states.

A hybrid state is a checkpoint plus the KV pages only it needs
(:class:`~hybridstore.policy.units.HybridUnit`); it is kept or evicted as one
unit.  Its *price* is the prefill time it saves per byte its eviction frees:
resuming at ``p`` instead of at the nearest retained checkpoint before it,
``p_-``, skips prefilling ``[p_-, p)``, which a per-model
:class:`~hybridstore.policy.units.PrefillCost` prices (a per-token term plus an
attention term growing with context).  Nothing is tuned per workload.

Recency: a state's value halves every ``half_life`` logical ticks since it was
last put or resumed from, so states no request resumed from for a while fall
behind and the newest checkpoint of each session (where its next turn
resumes) is typically kept longest.  Eviction goes lowest value first.

Admission uses the same price: when the tier is short of memory, a new
checkpoint is kept only if it is worth more than the cheapest cached one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import HybridIndex
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.policy.base import AdmissionPolicy
from hybridstore.policy.units import HybridUnit, PrefillCost, UnitEviction, units_of

DEFAULT_PREFILL = PrefillCost(per_token=5e-5, per_context_token=1e-9)
"""Prefill seconds per token and per token of context (a ~9B hybrid on one H100: about
20K tokens/s at short context; the attention term doubles the per-token time by ~50K)."""


@dataclass(frozen=True, slots=True)
class _Pass:
    now: int
    half_life: float


class FlashStatesEviction(UnitEviction):
    """Hybrid-state units ranked by prefill time saved per byte freed, decayed by idleness.

    Args:
        cost: the model's prefill cost in seconds.
        half_life: logical ticks after which an idle state's value halves;
            ``None``: a quarter of the number of objects the tier holds (every
            put advances the clock, so a quarter of a turnover of the tier; on
            the bundled WEKA sample shorter and longer both cost hit rate).
    """

    name = "flashstates"

    def __init__(self, *, cost: PrefillCost = DEFAULT_PREFILL, half_life: float | None = None) -> None:
        if half_life is not None and half_life <= 0:
            raise ConfigError(f"half_life must be positive, got {half_life}")
        self.cost = cost
        self.half_life = half_life

    def prepare(self, index: HybridIndex, tier: str, pages: dict[str, np.ndarray],
                units: list[HybridUnit], kind: ObjectKind | None = None) -> _Pass:
        held = len(pages["ids"]) + sum(u.held for u in units)
        return _Pass(now=index.now(), half_life=self.half_life or max(held / 4, 1.0))

    def price(self, position: int, before: int, nbytes: int) -> float:
        """Prefill seconds saved per byte by a state at ``position`` over one at ``before``."""
        return self.cost.between(before, position) / max(nbytes, 1)

    def score(self, index: HybridIndex, unit: HybridUnit, ctx: _Pass) -> float:
        ck = unit.ck
        before = ck.parent.position if ck.parent is not None else 0
        idle = max(ctx.now - ck.atime, 0)
        return self.price(ck.position, before, unit.nbytes) * 0.5 ** (idle / ctx.half_life)

    def cheapest(self, index: HybridIndex, tier: str) -> float | None:
        """Value of the cheapest unit whose checkpoint ``tier`` holds (``None``: none cached)."""
        found = self.cheapest_with_half_life(index, tier)
        return None if found is None else found[0]

    def cheapest_with_half_life(self, index: HybridIndex, tier: str) -> tuple[float, float] | None:
        """:meth:`cheapest` and the half-life it decays with."""
        pages = index.page_table(tier)
        units = [u for u in units_of(index, tier) if u.held]
        if not units:
            return None
        ctx = self.prepare(index, tier, pages, units)
        return min(self.score(index, u, ctx) for u in units), ctx.half_life


class FlashStatesAdmission(AdmissionPolicy):
    """Admit a checkpoint when memory is short only if it beats the cheapest cached one.

    The store tells the policy how much room the landing tier has: pass
    ``free_bytes`` (a callable returning the bytes a new checkpoint may still
    take there without eviction) or call :meth:`bind`.  Unbound, the policy
    cannot tell that memory is short and admits everything.

    The new checkpoint's price is :class:`FlashStatesEviction`'s: given the
    ``prompt`` it is marginal over the nearest retained checkpoint on the
    prompt's path, and its bytes include the held pages no retained
    checkpoint needs yet (they stay only if it does).  Without the prompt the
    whole prefix ``[0, position)`` is priced over ``nbytes``.

    The cheapest cached value is recomputed every ``refresh_ticks`` index
    operations; in between it only decays (every value halves per half-life,
    so the cheapest stays the cheapest), which errs towards admitting.

    Args:
        free_bytes: room left for a checkpoint in the landing tier.
        tier: the tier new checkpoints land in (``None``: the fastest tier
            that holds checkpoints).
        eviction: the pricing (a :class:`FlashStatesEviction`; its defaults
            when omitted).
        refresh_ticks: index operations between two scans of the cached states.
    """

    name = "flashstates"

    def __init__(self, *, free_bytes: Callable[[], int] | None = None, tier: str | None = None,
                 eviction: FlashStatesEviction | None = None, refresh_ticks: int = 256) -> None:
        if tier is not None and tier not in TIER_BITS:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {list(TIER_BITS)}")
        self.free_bytes = free_bytes
        self.tier = tier
        self.eviction = eviction or FlashStatesEviction()
        self.refresh_ticks = refresh_ticks
        self._floor: tuple[int, int, float | None, float] | None = None  # index id, made, value, half-life

    def bind(self, *, free_bytes: Callable[[], int], tier: str | None = None) -> None:
        """Give the policy the landing tier's room (the store calls this once it knows its tiers)."""
        self.free_bytes = free_bytes
        if tier is not None:
            self.tier = tier

    def admit(self, index: HybridIndex, position: int, nbytes: int, *,
              prompt: PrefixKeys | None = None) -> bool:
        if self.free_bytes is None or self.free_bytes() >= nbytes:
            return True
        floor = self.cheapest(index)
        if floor is None:
            return True
        before, extra = (0, 0) if prompt is None else self.context(index, prompt, position)
        return self.eviction.price(position, before, nbytes + extra) > floor

    def cheapest(self, index: HybridIndex) -> float | None:
        """Value of the cheapest cached state now (``None``: the tier holds none)."""
        now = index.now()
        cached = self._floor
        if cached is None or cached[0] != id(index) or now - cached[1] > self.refresh_ticks:
            tier = self.tier or _landing_tier(index)
            found = None if tier is None else self.eviction.cheapest_with_half_life(index, tier)
            value, half_life = found if found is not None else (None, 1.0)
            self._floor = cached = (id(index), now, value, half_life)
        _, made, value, half_life = cached
        return None if value is None else value * 0.5 ** ((now - made) / half_life)

    def context(self, index: HybridIndex, prompt: PrefixKeys, position: int) -> tuple[int, int]:
        """Nearest retained checkpoint position before ``position`` on the prompt, and the
        bytes of the held pages up to ``position`` that no retained checkpoint needs."""
        before = 0
        for ck in index.checkpoints():
            if before < ck.position < position and ck.tiers and prompt.key_at(ck.position) == ck.key:
                before = ck.position
        B = index.block_size
        extra = 0
        for k in range(before // B, min(-(-position // B), prompt.nblocks)):
            nid = index.find_node(prompt.block_key(k))
            if nid >= 0:
                info = index.page_info(nid)
                if info["tiers"] and info["deps"] == 0:
                    extra += info["nbytes"]
        return before, extra


def _landing_tier(index: HybridIndex) -> str | None:
    """The fastest tier that holds any checkpoint."""
    mask = 0
    for ck in index.checkpoints():
        mask |= ck.tiers
    return next((name for name, bit in TIER_BITS.items() if mask & bit), None)


__all__ = ["DEFAULT_PREFILL", "FlashStatesAdmission", "FlashStatesEviction"]
