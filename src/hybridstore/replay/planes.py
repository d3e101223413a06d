"""The replay's object planes: what the loop's objects are (sizes or bytes).

The replay loop (``replay/sim.py``) is one; what its puts and restores move is
an :class:`ObjectPlane`: :class:`SizedObjects` here (accounting mode: sizes and
modeled times, no bytes) or ``DataObjects`` (``replay/bytes_plane.py``: real
bytes through real tiers).  The loop receives a factory of planes from its
caller (``sim.replay(..., plane_for=...)``), so neither plane module imports
the loop and the loop imports no plane but the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridstore.backends.accounting import AccountingTier
from hybridstore.backends.base import Tier
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import ResumePlan
from hybridstore.store import HybridStore

__all__ = ["ObjectPlane", "SizedObjects", "TierBudget"]


@dataclass(frozen=True, slots=True)
class TierBudget:
    """One tier of a replayed system: its name, budget (scaled) and modeled read bandwidth."""

    name: str
    capacity_bytes: int
    read_gbps: float


class ObjectPlane(Protocol):
    """What the replay's objects are: sizes (:class:`SizedObjects`) or bytes (``DataObjects``)."""

    def open_tiers(self, budgets: Sequence[TierBudget]) -> dict[str, Tier]:
        """The store's tiers."""

    def put_pages(self, store: HybridStore, prompt: PrefixKeys, first_block: int, nbytes: int) -> None:
        """Put the pages of blocks ``first_block..`` of ``prompt``."""

    def put_state(self, store: HybridStore, prompt: PrefixKeys, position: int, nbytes: int) -> None:
        """Put the checkpoint at ``position``."""

    def restore(self, store: HybridStore, plan: ResumePlan) -> float | None:
        """Restore a live plan; the seconds it took (None: nothing is moved)."""

    def finish(self, store: HybridStore) -> dict[str, Any] | None:
        """End-of-run counters (the store is still open)."""

    def close(self) -> None:
        """Release what ``open_tiers`` made outside the store (after the store closed)."""


class SizedObjects:
    """Accounting mode: tiers keep sizes and modeled times, puts carry no bytes."""

    def open_tiers(self, budgets: Sequence[TierBudget]) -> dict[str, Tier]:
        return {b.name: AccountingTier(b.name, b.capacity_bytes, read_gbps=b.read_gbps)
                for b in budgets}

    def put_pages(self, store: HybridStore, prompt: PrefixKeys, first_block: int, nbytes: int) -> None:
        store.put_kv_sized(prompt, nbytes=nbytes, first_block=first_block)

    def put_state(self, store: HybridStore, prompt: PrefixKeys, position: int, nbytes: int) -> None:
        store.put_state_sized(prompt, nbytes=nbytes, position=position)

    def restore(self, store: HybridStore, plan: ResumePlan) -> float | None:
        return None

    def finish(self, store: HybridStore) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass
