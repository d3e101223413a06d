"""Tiers that move bytes: the pinned host pool, the SSD tier, GPU memory, accounting.

Importing this package needs neither CUDA nor kvikio: ``DeviceTier`` lives in
``hybridstore.backends.device`` (imported on demand, needs torch with a GPU).
"""

from __future__ import annotations

from hybridstore.backends.accounting import AccountingTier
from hybridstore.backends.alloc import Extent, SlabAllocator
from hybridstore.backends.base import Tier
from hybridstore.backends.host import HostPool
from hybridstore.objects import ObjectKey, ObjectKind, object_key

# DiskTier: import it from hybridstore.backends.disk (it brings lmdb and the I/O engines).

__all__ = [
    "AccountingTier",
    "Extent",
    "HostPool",
    "ObjectKey",
    "ObjectKind",
    "SlabAllocator",
    "Tier",
    "object_key",
]
