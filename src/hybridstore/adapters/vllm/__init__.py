"""hybridstore as vLLM 0.33's KV offloading medium (``docs/engines/vllm.md``).

* :class:`HybridStoreSpec` — an ``OffloadingSpec`` for vLLM's
  ``OffloadingConnector`` (``"spec_name": "HybridStoreSpec", "spec_module_path":
  "hybridstore.adapters.vllm"``): :class:`HybridStoreManager` in the scheduler
  process, :class:`HybridStoreWorker` in each worker process, meeting in a shared
  staging region; the store's disk tier + lmdb catalog make it durable.
* :class:`HybridStoreTier` — a ``SecondaryTierManager`` for vLLM's
  ``TieringOffloadingSpec``: vLLM keeps its own DRAM tier, hybridstore is the SSD
  tier beneath it.

Importing this package imports vLLM.
"""

from hybridstore.adapters.vllm.manager import HybridStoreManager
from hybridstore.adapters.vllm.settings import GroupPlan, VllmSettings
from hybridstore.adapters.vllm.spec import HybridStoreSpec
from hybridstore.adapters.vllm.staging import StagingRegion
from hybridstore.adapters.vllm.tier import HybridStoreTier
from hybridstore.adapters.vllm.worker import HybridStoreWorker, StagedKeys

__all__ = [
    "GroupPlan",
    "HybridStoreManager",
    "HybridStoreSpec",
    "HybridStoreTier",
    "HybridStoreWorker",
    "StagedKeys",
    "StagingRegion",
    "VllmSettings",
]
