"""``HybridStoreSpec``: the ``OffloadingSpec`` vLLM loads by name.

::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "HybridStoreSpec",
        "spec_module_path": "hybridstore.adapters.vllm", "block_size": 64,
        "disk_path": "/nvme/hs", "disk_bytes": "512GiB", "host_bytes": "16GiB"}}'

vLLM's ``OffloadingSpecFactory`` (``vllm/v1/kv_offload/factory.py``) builds the
spec in the scheduler process, which asks it for the manager, and in every
worker process, which asks it for a worker; each side maps the same staging
file (``staging.py``), named after the engine id.
"""

from __future__ import annotations

import os
import time

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from hybridstore import HybridStore
from hybridstore.adapters.vllm.compat import group_windows
from hybridstore.adapters.vllm.manager import HybridStoreManager
from hybridstore.adapters.vllm.settings import GroupPlan, VllmSettings
from hybridstore.adapters.vllm.staging import ALIGN, StagingRegion
from hybridstore.adapters.vllm.worker import HybridStoreWorker


class HybridStoreSpec(OffloadingSpec):
    """hybridstore as vLLM's offloading medium (scheduler: index + tiers, workers: copies).

    Raises:
        ConfigError: no ``disk_path`` in the extra config, or a bad store setting.
        UnsupportedModelError: KV cache groups the adapter cannot map (see
            :class:`~hybridstore.adapters.vllm.settings.GroupPlan`).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.plan = GroupPlan.of(config.groups, self.blocks_per_chunk,
                                 group_windows(config.groups, self.blocks_per_chunk))
        self.settings = VllmSettings.from_config(config, self.plan)
        world = config.parallel.world_size
        per_key = world * self.blocks_per_chunk * config.worker_kv_bytes_per_block
        self.slot_bytes = -(-max(per_key, 1) // ALIGN) * ALIGN
        # one slot per key in flight; at least room for one page + the states, twice
        self.nslots = max(self.settings.staging_bytes // self.slot_bytes,
                          2 * (1 + len(self.plan.state_groups)))
        self._manager: HybridStoreManager | None = None
        self._worker: HybridStoreWorker | None = None

    def _region(self) -> StagingRegion:
        return StagingRegion(self.settings.staging_path, slot_bytes=self.slot_bytes,
                             nslots=self.nslots, world=self.config.parallel.world_size,
                             ngroups=len(self.config.groups))

    def get_manager(self) -> HybridStoreManager:
        if self._manager is None:
            # staging files of engines killed before their shutdown (this engine's
            # workers map theirs later: the manager starts first)
            StagingRegion.reclaim(os.path.dirname(self.settings.staging_path))
            region = self._region()
            try:
                # uses dated by the scheduler's wall clock: predicted returns and the
                # orchestrator's hints (hints.py) count seconds, not index ticks
                store = HybridStore(self.settings.store, clock=time.monotonic)
            except BaseException:
                region.close()
                raise
            self._manager = HybridStoreManager(
                store=store, region=region, plan=self.plan,
                enable_events=(self.kv_events_config.enable_kv_cache_events
                               and self.settings.enable_kv_events),
                load_timeout_s=self.settings.load_timeout_s, locality=self.settings.locality)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HybridStoreWorker:
        if self._worker is None:
            self._worker = HybridStoreWorker(
                kv_caches, region=self._region(), rank=self.config.parallel.rank,
                blocks_per_chunk=self.blocks_per_chunk,
                load_timeout_s=self.settings.load_timeout_s)
        return self._worker
