"""The store: :class:`HybridStore`, the public facade, over its layers.

============================  ===================================================
module                        what it holds
============================  ===================================================
``residency.py``              who holds what: tier masks, bytes per tier and kind
``copies.py``                 copies between tiers (write-through, spill, SSD moves)
``evictor.py``                the safety rules of eviction, applied to a policy's order
``landing.py``                the put path (pages and checkpoints into the fastest tier)
``loader.py``                 the load path (one ``load`` from the tiers holding it)
``facade.py``                 :class:`HybridStore`: the lock, the counters, the public API
============================  ===================================================

Each module imports only those above it in this table (no cycle); none imports
torch (device staging lives in :mod:`hybridstore.backends.transfer`).
"""

from hybridstore.index.trie import ResumePlan
from hybridstore.objects import TIER_ORDER
from hybridstore.store.facade import HybridStore

__all__ = ["HybridStore", "ResumePlan", "TIER_ORDER"]
