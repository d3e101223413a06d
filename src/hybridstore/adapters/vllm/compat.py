"""The one place that knows how vLLM 0.31 to 0.34 differ for the adapter.

Every difference the adapter meets between the releases it supports is answered
here, by what the running vLLM *has* (an attribute, a type), never by reading
version strings or stack frames. A vLLM without the interface the adapter uses
(0.30 and older: :data:`NEEDED`) is refused when this package is imported, with a
:class:`~hybridstore.errors.ConfigError` that names what is missing.

========================  ==========================================  ==========================
what                      0.31 / 0.32                                 0.33 / 0.34
========================  ==========================================  ==========================
a group's window          not in ``OffloadingGroupConfig``: computed  ``OffloadingGroupConfig.
                          from the ``KVCacheConfig`` that             sliding_window_size_in_
                          :class:`HybridStoreConnector` hands over    chunks``
worker job's GPU side     ``GPULoadStoreSpec`` (block ids)            0.33: ``GPULoadStoreSpec``;
                                                                      0.34: ``DevicePointers``
                                                                      (one address per block
                                                                      and layer)
``OffloadingManager.      called                                      0.34: never called
touch``
``OffloadingEvent``       keys, medium, removed, locality             0.34: + ``req_context``
========================  ==========================================  ==========================

On 0.31 and 0.32 an offloading spec sees only ``OffloadingConfig``, which does not say
which KV cache groups are Mamba groups. Models with one KV cache group need
nothing more; hybrid models name this package's connector, a subclass of vLLM's
``OffloadingConnector`` that only passes the ``KVCacheConfig`` vLLM gives every
connector on to the spec::

    --kv-transfer-config '{"kv_connector": "HybridStoreConnector",
      "kv_connector_module_path": "hybridstore.adapters.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "HybridStoreSpec",
        "spec_module_path": "hybridstore.adapters.vllm", "disk_path": "/nvme/hs"}}'

(it works the same on 0.33 and 0.34, where ``OffloadingConnector`` itself is
enough).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridstore.errors import ConfigError, UnsupportedModelError

NEEDED: dict[str, tuple[str, ...]] = {
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector": ("OffloadingConnector",),
    "vllm.v1.kv_cache_interface": ("iter_layer_specs",),
    "vllm.v1.kv_offload.base": (
        "CanonicalKVCaches", "LoadStoreSpec", "Locality", "LookupResult", "Medium",
        "OffloadKey", "OffloadingEvent", "OffloadingManager", "OffloadingSpec",
        "OffloadingWorker", "PrepareStoreOutput", "ReqContext", "RequestOffloadingContext",
        "TransferResult", "ReqContext.get_offload_key_position"),
    "vllm.v1.kv_offload.config": ("OffloadingConfig",),
    "vllm.v1.kv_offload.tiering.base": ("JobResult", "SecondaryTierManager", "TransferJob"),
}
"""What the adapter uses of vLLM, by module: every name it imports, and the methods it
calls that older releases lack (0.30 has no ``ReqContext.get_offload_key_position``, 0.28
no ``iter_layer_specs``)."""


def missing_interface() -> list[str]:
    """The names of :data:`NEEDED` that the running vLLM lacks (empty: supported)."""
    missing = []
    for module, names in NEEDED.items():
        try:
            found: Any = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        for name in names:
            obj = found
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{name}")
    return missing


def check_vllm() -> None:
    """Raise ConfigError unless the running vLLM has what the adapter uses (:data:`NEEDED`)."""
    missing = missing_interface()
    if missing:
        import vllm

        raise ConfigError(f"hybridstore's vLLM adapter supports vLLM 0.31 to 0.34; this vLLM "
                          f"({getattr(vllm, '__version__', 'unknown')}) has no "
                          f"{', '.join(missing)}")


check_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import iter_layer_specs  # noqa: E402
from vllm.v1.kv_offload.base import Medium, OffloadingEvent  # noqa: E402

# The KVCacheConfig of the connector being built in this thread (0.31 and 0.32 need it).
_KV_CACHE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "hybridstore_vllm_kv_cache_config", default=None)


def _window_function() -> Callable[[Any, int], int | None]:
    """vLLM's own ``get_sliding_window_size_in_chunks`` (0.31, 0.32: scheduler, 0.33+: config)."""
    for module in ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
                   "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"):
        fn = getattr(importlib.import_module(module), "get_sliding_window_size_in_chunks", None)
        if fn is not None:
            return fn
    raise UnsupportedModelError(  # pragma: no cover - every supported release has it
        "this vLLM has no get_sliding_window_size_in_chunks; the hybridstore adapter supports "
        "vLLM 0.31 to 0.34")


class HybridStoreConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, handing its ``KVCacheConfig`` to the offloading spec.

    Needed on vLLM 0.31 and 0.32 for hybrid (Mamba / GDN) models only: their
    ``OffloadingConfig`` leaves out which groups are Mamba groups, so the spec
    reads each group's window from the ``KVCacheConfig`` with vLLM's own
    ``get_sliding_window_size_in_chunks``. Behaves as ``OffloadingConnector``
    otherwise.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with specs_see(kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)


@contextlib.contextmanager
def specs_see(kv_cache_config: Any) -> Iterator[None]:
    """Offloading specs built in this block read their groups' windows from
    ``kv_cache_config`` (vLLM's ``KVCacheConfig``) where vLLM (0.31, 0.32) does not say them."""
    token = _KV_CACHE_CONFIG.set(kv_cache_config)
    try:
        yield
    finally:
        _KV_CACHE_CONFIG.reset(token)


def group_windows(groups: Sequence[Any], blocks_per_chunk: int) -> tuple[int | None, ...]:
    """Each offloaded group's window in chunks (``None``: full attention; 1: Mamba).

    Args:
        groups: ``OffloadingConfig.groups``.
        blocks_per_chunk: GPU blocks per offloaded chunk.

    Raises:
        UnsupportedModelError: vLLM 0.31 or 0.32 with several KV cache groups, built by
            vLLM's plain ``OffloadingConnector`` (it does not say which are Mamba
            groups): name :class:`HybridStoreConnector` instead.
    """
    if all(hasattr(g, "sliding_window_size_in_chunks") for g in groups):
        return tuple(g.sliding_window_size_in_chunks for g in groups)
    kv_cache_config = _KV_CACHE_CONFIG.get()
    if kv_cache_config is None:
        if len(groups) == 1:
            return (None,)
        raise UnsupportedModelError(
            f"this vLLM (0.31 or 0.32) does not tell an offloading spec which of the model's "
            f"{len(groups)} KV cache groups are Mamba groups. Name hybridstore's connector: "
            '"kv_connector": "HybridStoreConnector", "kv_connector_module_path": '
            '"hybridstore.adapters.vllm" in --kv-transfer-config (or use vLLM 0.33+).')
    window = _window_function()
    specs = kv_cache_config.kv_cache_groups
    out = []
    for g in groups:
        # as 0.33's build_offloading_config: the group's first layer spec decides
        spec = next(iter(iter_layer_specs(specs[g.group_id].kv_cache_spec)))
        out.append(window(spec, g.tokens_per_block * blocks_per_chunk))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """A worker job's GPU side, as block ids (what ``GPULoadStoreSpec`` says).

    Attributes:
        block_ids: the job's GPU blocks, group-major.
        group_sizes: blocks of each group.
        block_indices: logical index of each group's first block.
    """

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def block_span(gpu: Any, tensors: Sequence[Any], group_tensor: Sequence[int]) -> BlockSpan:
    """A job's GPU side as block ids, from 0.31-0.33's ``GPULoadStoreSpec`` or 0.34's pointers.

    0.34 hands the worker ``DevicePointers``: for each group, for each of its
    layer refs, one address per block, ``base + block_id * row stride``
    (``vllm/v1/kv_offload/pointer_utils.py``); the block ids are read back from
    each group's first ref.

    Args:
        gpu: the ``GPULoadStoreSpec`` or ``DevicePointers`` of a job.
        tensors: the worker's canonical KV tensors.
        group_tensor: per group, the tensor index of its first layer ref
            (``CanonicalKVCaches.group_data_refs[g][0].tensor_idx``).

    Raises:
        ValueError: a pointer that is no block of the group's tensor.
    """
    if not hasattr(gpu, "ptrs"):
        return BlockSpan(np.asarray(gpu.block_ids, dtype=np.int64), tuple(gpu.group_sizes),
                         tuple(gpu.block_indices))
    ptrs = np.asarray(gpu.ptrs, dtype=np.uint64)
    ids, at = [], 0
    for n, nrefs, t_idx in zip(gpu.group_block_counts, gpu.group_data_ref_counts, group_tensor):
        if n == 0:
            continue
        t = tensors[t_idx]
        stride = t.stride(0) * t.element_size()
        rel = ptrs[at: at + n].astype(np.int64) - int(t.data_ptr())
        blocks, rem = np.divmod(rel, stride)
        if rem.any() or (blocks < 0).any() or (blocks >= t.shape[0]).any():
            raise ValueError("a DevicePointers address is not a block of this worker's KV cache")
        ids.append(blocks)
        at += n * nrefs
    block_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    return BlockSpan(block_ids, tuple(gpu.group_block_counts), tuple(gpu.block_indices))


_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(OffloadingEvent))


def offloading_event(keys: Iterable[Any], *, removed: bool, locality: Any = None,
                     req_context: Any = None) -> OffloadingEvent:
    """vLLM's KV cache event for keys stored in (or removed from) hybridstore's storage.

    Args:
        keys: the offload keys.
        removed: False for stored, True for removed.
        locality: vLLM's ``Locality`` of the storage, or None.
        req_context: the request that stored them (0.34 events carry it).
    """
    extra: dict[str, Any] = {"locality": locality}
    if "req_context" in _EVENT_FIELDS and req_context is not None:
        extra["req_context"] = req_context
    return OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=removed, **extra)
