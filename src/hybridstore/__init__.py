"""hybridstore: the prefix cache of hybrid (attention + recurrent) LLMs across GPU, DRAM and SSD.

Resuming a prompt at token ``p`` on a hybrid model needs the KV pages of every
token before ``p`` and a recurrent-state checkpoint taken exactly at ``p``.
hybridstore indexes both, keeps them in a pinned-DRAM pool and on SSD (kvikio
GPUDirect Storage or its POSIX compat mode, or an O_DIRECT engine), and
answers ``match(prompt)`` with the deepest complete resume point.

Importing it needs neither a GPU nor an inference engine.
"""

from __future__ import annotations

from hybridstore.config import StoreConfig
from hybridstore.errors import (
    BackendIOError,
    CapacityError,
    CatalogError,
    ConfigError,
    CorruptObjectError,
    DiskPathError,
    HybridStoreError,
    InvalidTokensError,
    LayoutMismatchError,
    MisalignedPageError,
    NamespaceError,
    ObjectTooLargeError,
    PlanReleasedError,
    StoreClosedError,
    UnknownPrefixError,
    UnknownTierError,
    UnsupportedModelError,
)
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import ResumePlan
from hybridstore.store import HybridStore

__version__ = "0.1.0"

__all__ = [
    "BackendIOError",
    "CapacityError",
    "CatalogError",
    "ConfigError",
    "CorruptObjectError",
    "DiskPathError",
    "HybridStore",
    "HybridStoreError",
    "InvalidTokensError",
    "LayoutMismatchError",
    "MisalignedPageError",
    "NamespaceError",
    "ObjectTooLargeError",
    "PlanReleasedError",
    "PrefixKeys",
    "ResumePlan",
    "StoreClosedError",
    "StoreConfig",
    "UnknownPrefixError",
    "UnknownTierError",
    "UnsupportedModelError",
    "__version__",
]
