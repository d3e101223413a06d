"""SGLang 0.5.23's own HiCache stack on CPU, with a ``dynamic`` storage backend.

:func:`build_engine` builds what SGLang builds for ``--enable-hierarchical-cache
--hicache-storage-backend dynamic``: the real device pools (``ReqToTokenPool`` +
``MHATokenToKVPool``, or for a hybrid model ``HybridReqToTokenPool`` over
``Mamba2CacheParams`` + ``HybridLinearKVPool``), a real ``UnifiedRadixCache``,
and ``cache.init_hicache(ServerArgs(...))`` -- SGLang's assembler, its
``HybridCacheController`` with its backup / prefetch / prefetch-IO threads, and
its ``StorageBackendFactory`` loading the backend class from the extra config.

What cannot run on CPU are the GPU<->host copies (CUDA kernels), so an
:class:`Engine` starts at the host pools: :meth:`Engine.fill` writes random
bytes into host slots, :meth:`Engine.write` is the controller's
``write_storage`` (the call ``UnifiedRadixCache.write_backup_storage`` makes),
:meth:`Engine.prefetch` is ``cache.prefetch_from_storage`` pumped through
``check_hicache_events`` / ``check_prefetch_progress`` as the scheduler does,
and :meth:`Engine.host_bytes` reads back what the prefetch put into the host
pools (found through the radix tree, as a later load-back would).

CPU workarounds (INTERFACES.md §1.8), all here and none in the adapter: the
CPU import shims, ``device="cpu"`` pools, no ``cudaHostRegister`` and no pinned
allocations in the host pools, a TP/PP-size-1 parallel context and the Python
tree core (for ``node_by_id``).
"""

from __future__ import annotations

import json
import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridstore.adapters.cpu_shims import SGLANG_CACHE_MODULES, import_sglang

os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")

MODULES = SGLANG_CACHE_MODULES


class _Sgl:
    """The SGLang modules, imported once (module attribute access by short name)."""

    def __init__(self) -> None:
        m = import_sglang(MODULES)
        self.urc = m["sglang.srt.mem_cache.unified_radix_cache"]
        self.comp = m["sglang.srt.mem_cache.unified_cache.components.base"]
        self.alloc = m["sglang.srt.mem_cache.allocator"]
        self.pools = m["sglang.srt.mem_cache.memory_pool"]
        self.cip = m["sglang.srt.mem_cache.cache_init_params"]
        self.events = m["sglang.srt.mem_cache.events"]
        self.bpc = m["sglang.srt.mem_cache.base_prefix_cache"]
        self.radix = m["sglang.srt.mem_cache.radix_cache"]
        self.utils = m["sglang.srt.mem_cache.utils"]
        self.hs = m["sglang.srt.mem_cache.hicache_storage"]
        self.phc = m["sglang.srt.mem_cache.pool_host.common"]
        self.sa = m["sglang.srt.server_args"]
        self.rc = m["sglang.srt.runtime_context"]
        self.mamba = m["sglang.srt.configs.mamba_utils"]
        self.envs = m["sglang.srt.environ"].envs
        # host pools page-lock with cudaHostRegister: nothing to lock on CPU
        self.phc._cuda_host_register = lambda *a, **k: None
        self.phc._cuda_host_unregister = lambda *a, **k: None
        self._parallel = self.rc.get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self._parallel.__enter__()


_SGL: _Sgl | None = None


def sgl() -> _Sgl:
    """SGLang's modules (imported on first use, ~10 s)."""
    global _SGL
    if _SGL is None:
        _SGL = _Sgl()
    return _SGL


@dataclass
class Written:
    """What one :meth:`Engine.write` stored: tokens, page keys, the bytes of each page and state."""

    tokens: list[int]
    hashes: list[str]
    pages: list[torch.Tensor]           # uint8 bytes of each KV page, in order
    state: torch.Tensor | None          # uint8 bytes of the Mamba state at the end (hybrid)
    completed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """One SGLang ``UnifiedRadixCache`` with HiCache and a dynamic storage backend.

    Attributes:
        cache: the ``UnifiedRadixCache``.
        controller: its ``HybridCacheController``.
        backend: the storage backend object the controller calls (SGLang's fault
            injector when its env variables are set, else the backend itself).
        kv_host, mamba_host: the KV and Mamba host pools (``mamba_host`` None for MHA).
    """

    def __init__(self, cache: Any, page_size: int, mamba: bool) -> None:
        self.cache = cache
        self.page_size = page_size
        self.mamba = mamba
        self.controller = cc = cache.cache_controller
        group = cc.mem_pool_host
        for entry in group.entries:   # get_dummy_flat_data_page() would pin: not on CPU
            entry.host_pool.pin_memory = False
        self.kv_host = group.anchor_entry.host_pool
        self.mamba_host = group.entry_map[sgl().hs.PoolName.MAMBA].host_pool if mamba else None
        self.backend = cc.storage_backend
        self._rid = 0

    # -- host pools -------------------------------------------------------------------
    def fill(self, n_pages: int, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Allocate ``n_pages`` host pages and fill them with random bytes; (slots, page bytes)."""
        kvh, ps = self.kv_host, self.page_size
        slots = kvh.alloc(n_pages * ps)
        assert slots is not None, "host KV pool full"
        pages = []
        for i in range(n_pages):
            idx = int(slots[i * ps])
            like = kvh.get_data_page(idx, flat=True)
            raw = torch.randint(0, 256, (like.numel() * like.element_size(),), dtype=torch.uint8,
                                generator=gen)
            kvh.set_from_flat_data_page(idx, raw.view(like.dtype))
            pages.append(raw)
        return slots, pages

    def fill_state(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One Mamba host slot with random bytes; (slot, bytes)."""
        mh = self.mamba_host
        slot = mh.alloc(1)
        assert slot is not None, "host Mamba pool full"
        like = mh.get_data_page(int(slot[0]))
        raw = torch.randint(0, 256, (like.numel(),), dtype=torch.uint8, generator=gen)
        mh.set_from_flat_data_page(int(slot[0]), raw)
        return slot, raw

    def page_bytes(self, slot: int) -> torch.Tensor:
        page = self.kv_host.get_data_page(slot, flat=True)
        return page.contiguous().view(torch.uint8).clone()

    def state_bytes(self, slot: int) -> torch.Tensor:
        return self.mamba_host.get_data_page(slot).contiguous().view(torch.uint8).clone()

    # -- the controller's storage paths ---------------------------------------------
    def hashes(self, tokens: list[int], last_hash: str | None = None) -> list[str]:
        """SGLang's page keys of ``tokens`` (``get_storage_hash_str``), chained onto ``last_hash``."""
        s = sgl()
        return s.utils.get_storage_hash_str(s.radix.RadixKey(array("q", tokens)), last_hash,
                                            page_size=self.page_size)

    def write(self, tokens: list[int], gen: torch.Generator, *, prefix_keys: list[str] | None = None,
              last_hash: str | None = None, state: bool = True, timeout: float = 20.0) -> Written:
        """Fill host pages for ``tokens`` (and a Mamba state at their end), ``write_storage``
        them as ``write_backup_storage`` does, wait for the backup ack, free the host slots."""
        s = sgl()
        n = len(tokens) // self.page_size
        hashes = self.hashes(tokens, last_hash)
        slots, pages = self.fill(n, gen)
        extra, mslot, sbytes = None, None, None
        if self.mamba and state:
            mslot, sbytes = self.fill_state(gen)
            extra = [s.hs.PoolTransfer(name=s.hs.PoolName.MAMBA, host_indices=mslot,
                                       keys=[hashes[-1]], hit_policy=s.hs.PoolHitPolicy.TRAILING_PAGES)]
        op_id = self.controller.write_storage(slots, tokens, hashes, prefix_keys, extra_pools=extra)
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        assert op.id == op_id
        self.kv_host.free(slots)
        if mslot is not None:
            self.mamba_host.free(mslot)
        return Written(tokens, hashes, pages, sbytes, completed_tokens=op.completed_tokens)

    def prefetch(self, tokens: list[int], timeout: float = 20.0) -> dict[str, Any]:
        """``prefetch_from_storage`` from the root, pumped to completion; then ``match_prefix``.

        Returns ``{"done", "loaded", "host_hit", "mamba_hit", "pages", "state"}``: the host
        bytes of every page the tree now holds on host for ``tokens`` (in order) and of the
        Mamba state at the deepest host node (None when it has none).
        """
        s, cache = sgl(), self.cache
        self._rid += 1
        h = s.bpc.CacheRequestHandle(f"r{self._rid}", 0)
        cache.prefetch_from_storage(h, cache.root_node_handle(), array("q", tokens), None, None)
        t0, done = time.monotonic(), False
        while time.monotonic() - t0 < timeout:
            cache.check_hicache_events()
            if cache.check_prefetch_progress(h):
                done = True
                break
            time.sleep(0.001)
        loaded = cache.pop_prefetch_loaded_tokens(h)
        m = cache.match_prefix(s.bpc.MatchPrefixParams(key=s.radix.RadixKey(array("q", tokens))))
        pages, state = self._host_path(m.last_host_node)
        return {"done": done, "loaded": loaded, "host_hit": int(m.host_hit_length),
                "mamba_hit": int(getattr(m, "mamba_host_hit_length", 0) or 0),
                "pages": pages, "state": state}

    def _host_path(self, node_handle: Any) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        core, ps = self.cache.tree_core, self.page_size
        comp = sgl().comp.ComponentType
        path = [info.node_id for info in core.collect_path_info([node_handle])[0]]
        pages: list[torch.Tensor] = []
        state = None
        for nid in path:
            node = core.node_by_id(nid)
            hv = node.component_data[comp.FULL].host_value
            if hv is None:
                continue
            for i in range(0, len(hv), ps):
                pages.append(self.page_bytes(int(hv[i])))
            if self.mamba:
                mv = node.component_data[comp.MAMBA].host_value
                state = self.state_bytes(int(mv[0])) if mv is not None and len(mv) else None
        return pages, state

    def close(self) -> None:
        """Detach the storage backend (SGLang calls the backend's ``close``) and stop the threads."""
        cc = self.controller
        if cc.enable_storage:
            cc.detach_storage_backend()
        cc.storage_stop_event.set()


def build_engine(extra_config: dict[str, Any], *, mamba: bool = False, page_size: int = 4,
                 layout: str = "page_first_direct", tokens: int = 1024,
                 host_ratio: float = 2.0, kv_heads: int = 2, head_dim: int = 16,
                 kv_layers: int = 2) -> Engine:
    """A real ``UnifiedRadixCache`` + ``HybridCacheController`` loading a dynamic backend.

    Args:
        extra_config: ``--hicache-storage-backend-extra-config`` (``backend_name``,
            ``module_path``, ``class_name`` and the backend's own keys).
        mamba: the hybrid pools (2 full-attention + 2 Mamba2 layers) instead of plain MHA.
        page_size: tokens per page.
        layout: ``--hicache-mem-layout``.
        tokens: device KV pool size in tokens (the host pool is ``host_ratio`` times it).
        kv_heads, head_dim, kv_layers: the KV shard (``kv_layers`` full-attention layers;
            hybrid: as many Mamba2 layers between them).
    """
    s = sgl()
    device = "cpu"
    sa = s.sa.ServerArgs(model_path="dummy", page_size=page_size)
    sa._mamba_cache_chunk_size = 64
    s.sa.set_global_server_args_for_scheduler(sa)
    comp = s.comp.ComponentType
    if mamba:
        full, nonfull = list(range(1, 2 * kv_layers, 2)), list(range(0, 2 * kv_layers, 2))
        with s.envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
            shape = s.mamba.Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1,
                                                    num_heads=2, head_dim=16, state_size=16,
                                                    conv_kernel=4)
            cparams = s.mamba.Mamba2CacheParams(shape=shape, layers=nonfull)
        rtp = s.pools.HybridReqToTokenPool(
            size=8, mamba_size=64, mamba_spec_state_size=8, max_context_len=tokens, device=device,
            enable_memory_saver=False, cache_params=cparams, mamba_layer_ids=nonfull,
            enable_mamba_extra_buffer=True, speculative_num_draft_tokens=3)
        kv = s.pools.HybridLinearKVPool(
            size=tokens, dtype=torch.bfloat16, page_size=page_size, head_num=kv_heads,
            head_dim=head_dim, full_attention_layer_ids=full, device=device, enable_memory_saver=False,
            mamba_pool=rtp.mamba_pool)
        comps = (comp.FULL, comp.MAMBA)
    else:
        rtp = s.pools.ReqToTokenPool(size=8, max_context_len=tokens, device=device,
                                     enable_memory_saver=False)
        kv = s.pools.MHATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16,
                                      head_num=kv_heads, head_dim=head_dim, layer_num=kv_layers,
                                      device=device, enable_memory_saver=False)
        comps = (comp.FULL,)
    alloc = s.alloc.TokenToKVPoolAllocator(size=tokens, dtype=torch.bfloat16, device=device,
                                           kvcache=kv, need_sort=False)
    params = s.cip.CacheInitParams(
        req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size, disable=False,
        tree_components=comps, enable_mamba_extra_buffer=mamba,
        kv_event_lora_names=s.events.KvEventLoraNames(), eviction_policy="lru")
    cache = s.urc.UnifiedRadixCache(params=params)
    sa2 = s.sa.ServerArgs(
        model_path="dummy", page_size=page_size, enable_hierarchical_cache=True,
        hicache_io_backend="direct", hicache_mem_layout=layout, hicache_write_policy="write_through",
        hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra_config),
        hicache_storage_prefetch_policy="wait_complete", hicache_ratio=host_ratio)
    sa2._mamba_cache_chunk_size = 64
    s.sa.set_global_server_args_for_scheduler(sa2)
    cache.init_hicache(sa2, params)
    return Engine(cache, page_size, mamba)
