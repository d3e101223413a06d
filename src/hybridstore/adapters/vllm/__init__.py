"""hybridstore as vLLM's KV offloading medium, 0.31 to 0.34 (``docs/engines/vllm.md``).

* :class:`HybridStoreSpec` — an ``OffloadingSpec`` for vLLM's
  ``OffloadingConnector`` (``"spec_name": "HybridStoreSpec", "spec_module_path":
  "hybridstore.adapters.vllm"``): :class:`HybridStoreManager` in the scheduler
  process, :class:`HybridStoreWorker` in each worker process, meeting in a shared
  staging region; the store's disk tier + lmdb catalog make it durable.
* :class:`HybridStoreTier` — a ``SecondaryTierManager`` for vLLM's
  ``TieringOffloadingSpec``: vLLM keeps its own DRAM tier, hybridstore is the SSD
  tier beneath it.
* :class:`HybridStoreConnector` — vLLM's ``OffloadingConnector`` that hands the
  spec its ``KVCacheConfig``: what hybrid models need on vLLM 0.31 and 0.32
  (``compat.py``, where every difference between the releases is answered).

Importing this package imports vLLM.
"""

from hybridstore.adapters.vllm.compat import HybridStoreConnector
from hybridstore.adapters.vllm.manager import HybridStoreManager
from hybridstore.adapters.vllm.settings import GroupPlan, VllmSettings
from hybridstore.adapters.vllm.spec import HybridStoreSpec
from hybridstore.adapters.vllm.staging import StagingRegion
from hybridstore.adapters.vllm.tier import HybridStoreTier
from hybridstore.adapters.vllm.worker import HybridStoreWorker, StagedKeys

__all__ = [
    "GroupPlan",
    "HybridStoreConnector",
    "HybridStoreManager",
    "HybridStoreSpec",
    "HybridStoreTier",
    "HybridStoreWorker",
    "StagedKeys",
    "StagingRegion",
    "VllmSettings",
]
