"""SGLang's storage interface (``HiCacheStorage``): our backend and SGLang's ``HiCacheFile``.

Both are driven exactly as ``HybridCacheController`` drives an L3 backend
(``sglang/srt/managers/cache_controller.py``):

* KV pages, legacy path: ``batch_set(keys, [flat page tensor, ...])`` (what
  ``_generic_page_set`` passes: ``host_pool.get_data_page(i)``, one flat bf16
  tensor per page) and ``batch_get(keys, [flat page tensor, ...])``
  (``_generic_page_get``; the bench preallocates the targets, SGLang allocates
  ``get_dummy_flat_data_page()`` per page), up to ``STORAGE_BATCH_SIZE`` = 128
  pages per call;
* Mamba/GDN states: ``batch_set_v2`` / ``batch_get_v2`` with one
  ``PoolTransfer(PoolName.MAMBA, host_indices=[slot], keys=[page key],
  hit_policy=TRAILING_PAGES)`` per state and ``HiCacheStorageExtraInfo(
  prefix_keys=...)``, from / into a real ``MambaPoolHost``
  (``sglang/srt/mem_cache/pool_host/mamba.py``) built on CPU with the model's
  per-layer shapes;
* ``batch_exists_v2(keys, [PoolTransfer(MAMBA, keys=["__placeholder__"],
  TRAILING_PAGES)])`` for the hit (the prefetch's ``_storage_hit_query``).

SGLang is imported through :mod:`hybridstore.adapters.cpu_shims` (CPU-only
machines); host pools skip ``cudaHostRegister`` (nothing to page-lock without
CUDA) and are not pinned.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from hybridstore.adapters.cpu_shims import import_sglang
from hybridstore.bench.engines.geometry import PAGE_TOKENS

__all__ = ["BUILTIN", "OURS", "STORAGE_BATCH_SIZE", "Sgl", "open_backend", "sgl", "sglang_version"]

OURS = "hybridstore"
BUILTIN = "HiCacheFile"
OURS_MODULE, OURS_CLASS = "hybridstore.adapters.sglang", "HybridStoreHiCache"
STORAGE_BATCH_SIZE = 128
"""``sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE`` (pages per storage call)."""

_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.device_pool_info",
    "sglang.srt.mem_cache.utils",
)


class Sgl:
    """SGLang's storage modules, imported once."""

    def __init__(self) -> None:
        m = import_sglang(_MODULES)
        self.hs: ModuleType = m["sglang.srt.mem_cache.hicache_storage"]
        self.cc: ModuleType = m["sglang.srt.managers.cache_controller"]
        self.pools: ModuleType = m["sglang.srt.mem_cache.memory_pool"]
        self.mha: ModuleType = m["sglang.srt.mem_cache.pool_host.mha"]
        self.mamba: ModuleType = m["sglang.srt.mem_cache.pool_host.mamba"]
        self.info: ModuleType = m["sglang.srt.mem_cache.device_pool_info"]
        self.utils: ModuleType = m["sglang.srt.mem_cache.utils"]
        common = m["sglang.srt.mem_cache.pool_host.common"]
        # host pools page-lock their buffers with cudaHostRegister: nothing to lock on CPU
        common.__dict__["_cuda_host_register"] = lambda *a, **k: None
        common.__dict__["_cuda_host_unregister"] = lambda *a, **k: None
        if self.hs.STORAGE_BATCH_SIZE != STORAGE_BATCH_SIZE:  # pragma: no cover - other SGLang
            raise RuntimeError(f"SGLang's STORAGE_BATCH_SIZE is {self.hs.STORAGE_BATCH_SIZE}")

    # -- keys ------------------------------------------------------------------------
    def page_keys(self, tokens: Any, page_size: int, prior: str | None = None) -> list[str]:
        """SGLang's page keys: ``get_hash_str`` = SHA-256(prior digest || page ids as uint32 LE)."""
        keys = self.utils.get_hash_str(list(map(int, tokens)), prior, page_size=page_size)
        return keys if isinstance(keys, list) else [keys]

    # -- transfers -------------------------------------------------------------------
    def mamba_transfer(self, key: str, slot: int | None) -> Any:
        hs = self.hs
        return hs.PoolTransfer(name=hs.PoolName.MAMBA,
                               host_indices=None if slot is None else torch.tensor([slot]),
                               keys=[key], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)

    def mamba_probe(self) -> Any:
        """The Mamba transfer ``_storage_hit_query`` passes to ``batch_exists_v2``."""
        hs = self.hs
        return hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                               hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)

    def extra(self, prefix_keys: list[str]) -> Any:
        return self.hs.HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys))

    # -- host pools ------------------------------------------------------------------
    def mamba_host(self, layers: int, temporal_shape: tuple[int, ...], conv_shape: tuple[int, ...],
                   slots: int) -> Any:
        """A real ``MambaPoolHost`` (page_first layout) with ``slots`` state slots on CPU.

        Its device side (the ``MambaStateBufferInfo`` it copies from on a GPU) is one
        CPU checkpoint; the host side holds ``slots`` states of
        ``layers x (temporal fp32 + conv bf16)`` bytes each (``size_per_token``).
        """
        temporal = torch.zeros((layers, 1, *temporal_shape), dtype=torch.float32)
        conv = (torch.zeros((layers, 1, *conv_shape), dtype=torch.bfloat16),)
        info = self.info.MambaStateBufferInfo(temporal=temporal, conv=conv)
        pool = self.mamba.MambaPoolHost(info, float(slots), 0, device_capacity=1,
                                        pin_memory=False, layout="page_first")
        return pool

    def kv_host(self, *, layers: int, heads: int, head_dim: int, page_size: int,
                pages: int) -> Any:
        """A real ``MHATokenToKVPoolHost`` (``page_first_direct``) of at least ``pages`` pages.

        Built as SGLang's own unit tests build one
        (``storage/aibrix_kvcache/unit_test.py``): a CPU ``MHATokenToKVPool`` of
        4 pages as the device side, the host ``pages`` pages larger.
        """
        device_tokens = 4 * page_size
        kv = self.pools.MHATokenToKVPool(size=device_tokens, page_size=page_size,
                                         dtype=torch.bfloat16, head_num=heads, head_dim=head_dim,
                                         layer_num=layers, device="cpu", enable_memory_saver=False)
        return self.mha.MHATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info, pages * page_size / kv.size + 1, 0,
            page_size, "page_first_direct", pin_memory=False, device_capacity_tokens=kv.size,
            start_layer=kv.start_layer, end_layer=kv.end_layer,
            write_back_staging=kv.hicache_write_back_staging)

    def page_set(self, backend: Any, host: Any, keys: list[str], host_indices: torch.Tensor,
                 prefix_keys: list[str]) -> bool:
        """SGLang's legacy page store, its own code: ``HiCacheController._generic_page_set``.

        It copies each page out of the host pool (``get_data_page``) and calls
        ``backend.batch_set(keys, pages)``; ``self`` is a stand-in holding what
        the method reads (the host pool, the backend, the page size).
        """
        ctrl = SimpleNamespace(storage_host_pool=host, storage_backend=backend,
                               page_size=host.page_size)
        return bool(self.cc.HiCacheController._generic_page_set(ctrl, keys, host_indices,
                                                                 self.extra(prefix_keys)))

    def page_get(self, backend: Any, host: Any, keys: list[str], host_indices: torch.Tensor,
                 prefix_keys: list[str]) -> int:
        """SGLang's legacy page load, ``HiCacheController._generic_page_get``: pages loaded.

        ``batch_get(keys, [get_dummy_flat_data_page() ...])``, then each page
        into the host pool with ``set_from_flat_data_page``.
        """
        ctrl = SimpleNamespace(storage_host_pool=host, storage_backend=backend,
                               page_size=host.page_size)
        op = self.cc.PrefetchOperation("bench", [])
        return int(self.cc.HiCacheController._generic_page_get(ctrl, op, keys, host_indices,
                                                               self.extra(prefix_keys)))

    def storage_config(self, *, tp: int, model: str, extra: dict[str, Any]) -> Any:
        """``HiCacheStorageConfig`` of rank 0 of ``tp`` (what ``_generate_storage_config`` builds)."""
        return self.hs.HiCacheStorageConfig(
            tp_rank=0, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=model, extra_config=dict(extra))


_SGL: Sgl | None = None


def sgl() -> Sgl:
    """SGLang's storage modules (imported on first use, ~10 s on 2 cores)."""
    global _SGL
    if _SGL is None:
        _SGL = Sgl()
    return _SGL


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - metadata missing
        return None


def ours_class() -> type:
    """``hybridstore.adapters.sglang.HybridStoreHiCache`` (ImportError/AttributeError if absent)."""
    return getattr(importlib.import_module(OURS_MODULE), OURS_CLASS)  # type: ignore[no-any-return]


def ours_extra(path: str, *, disk_bytes: int, host_bytes: int,
               policy: str | None = None) -> dict[str, Any]:
    """Our backend's ``--hicache-storage-backend-extra-config``: DRAM + SSD budgets, policy."""
    extra: dict[str, Any] = {"backend_name": OURS, "module_path": OURS_MODULE,
                             "class_name": OURS_CLASS, "disk_path": path,
                             "disk_bytes": int(disk_bytes), "host_bytes": int(host_bytes),
                             "page_size": PAGE_TOKENS}
    if policy is not None:
        extra["policy"] = policy
    return extra


def builtin_extra(path: str, *, max_size: int | None = None) -> dict[str, Any]:
    """``HiCacheFile``'s extra config: its directory and, for a budget, ``LRUFileEvictor``'s cap."""
    extra: dict[str, Any] = {"file_storage_path": path}
    if max_size is not None:
        extra["max_size"] = int(max_size)
    return extra


def open_backend(name: str, *, tp: int, model: str, extra: dict[str, Any], kv_pool: Any,
                 mamba_pool: Any) -> Any:
    """A backend as ``StorageBackendFactory`` builds it, its host pools registered.

    ``HiCacheFile(storage_config)`` for the built-in (``_create_builtin_backend``
    with ``file``), ``cls(storage_config, {})`` for ours (``_create_dynamic_backend``);
    then, as ``attach_storage_backend`` does: ``register_mem_pool_host(kv host)``,
    ``register_mem_host_pool_v2`` of the KV and the Mamba host pools and
    ``on_host_pools_registered()``.
    """
    s = sgl()
    cfg = s.storage_config(tp=tp, model=model, extra=extra)
    backend = s.hs.HiCacheFile(cfg) if name == BUILTIN else ours_class()(cfg, {})
    backend.register_mem_pool_host(kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, s.hs.PoolName.KV)
    backend.register_mem_host_pool_v2(mamba_pool, s.hs.PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend


def close_backend(backend: Any) -> None:
    """What ``detach_storage_backend`` does: ``close()`` when the backend has one."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


def batches(n: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)
