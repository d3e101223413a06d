"""The worker side: copies between vLLM's KV cache blocks and the staging slots.

``HybridStoreWorker`` runs in every vLLM worker process (one per rank).  It
never touches the store: a store job copies the job's GPU blocks into the
rank's part of the slots the manager allocated (``prepare_store``), a load job
waits until the manager has staged the slots (``prepare_load`` starts the
store's load; the slot flag turns to the job's token), then copies them into
the GPU blocks.  Jobs run in submission order on one thread, as vLLM's CPU
worker runs them on ordered streams (``cpu/gpu_worker.py``).

Block mapping, as vLLM's CPU worker does it (``transfer_async``): a job's
``GPULoadStoreSpec`` lists each group's GPU blocks in order, ``group_sizes``
blocks for group ``g``, the first at logical block ``block_indices[g]``; with
``blocks_per_chunk = b`` a key covers ``b`` logical blocks, so the group's
blocks fill its keys (slots, in the same group-major order) from sub-block
``block_indices[g] % b`` on.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hybridstore.adapters.vllm.compat import BlockSpan, block_span
from hybridstore.adapters.vllm.staging import StagingRegion
from hybridstore.errors import ConfigError

log = logging.getLogger(__name__)


class StagedKeys(LoadStoreSpec):
    """Where a job's keys sit in the staging region (the manager's ``LoadStoreSpec``).

    Attributes:
        slots: one slot per key, in the order vLLM's GPU spec lists the
            groups' blocks (group-major, chunk order inside a group).
        tokens: for a load, the value each slot's flag takes once the manager
            has staged it (``-token``: the store could not read it); ``None``
            for a store.
    """

    def __init__(self, slots: list[int] | np.ndarray, tokens: list[int] | np.ndarray | None = None
                 ) -> None:
        self.slots = np.asarray(slots, dtype=np.int64)
        self.tokens = None if tokens is None else np.asarray(tokens, dtype=np.int64)

    def __repr__(self) -> str:
        kind = "store" if self.tokens is None else "load"
        return f"StagedKeys({kind}, slots={self.slots.tolist()})"


class HybridStoreWorker(OffloadingWorker):
    """Copies one rank's KV blocks to and from the staging slots, asynchronously.

    Args:
        kv_caches: vLLM's canonical KV caches of this worker.
        region: the staging region (mapped in this process).
        rank: this worker's rank (``OffloadingConfig.parallel.rank``).
        blocks_per_chunk: GPU blocks per offloaded chunk.
        load_timeout_s: how long a load waits for the manager to stage its slots.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, *, region: StagingRegion, rank: int,
                 blocks_per_chunk: int, load_timeout_s: float = 120.0) -> None:
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._bpc = blocks_per_chunk
        self._region = region
        self._rank = rank
        self._timeout = load_timeout_s
        # per group: (tensor index, page bytes, offset in the rank's part) of each layer ref
        self._refs: list[list[tuple[int, int, int]]] = []
        group_bytes = []
        for refs in kv_caches.group_data_refs:
            off, items = 0, []
            for ref in refs:
                items.append((ref.tensor_idx, ref.page_size_bytes, off))
                off += blocks_per_chunk * ref.page_size_bytes
            self._refs.append(items)
            group_bytes.append(off)
        if len(group_bytes) != region.ngroups:
            raise ConfigError(f"the worker has {len(group_bytes)} KV cache groups, the staging "
                              f"region {region.ngroups}")
        need = region.world * max(group_bytes, default=0)
        if need > region.slot_bytes:
            raise ConfigError(f"a key needs {need} B of staging for {region.world} workers, a "
                              f"slot has {region.slot_bytes} B: worker_kv_bytes_per_block is "
                              "smaller than this worker's pages")
        self.group_bytes = tuple(group_bytes)
        # each group's first layer tensor: where 0.34's DevicePointers are read back from
        self._group_tensor = [refs[0][0] if refs else -1 for refs in self._refs]
        region.group_bytes[rank, :] = group_bytes
        self._flat = region.slots.reshape(-1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridstore-vllm-worker")
        self._jobs: dict[int, Future] = {}
        self._finished: list[TransferResult] = []
        self._lock = threading.Lock()

    # -- OffloadingWorker ---------------------------------------------------------------
    # The GPU side is vLLM 0.32/0.33's GPULoadStoreSpec or 0.34's DevicePointers (compat.py).
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, StagedKeys), dst_spec
        self._submit(job_id, self._store, self._span(src_spec), dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, StagedKeys), src_spec
        self._submit(job_id, self._load, self._span(dst_spec), src_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            fut = self._jobs.get(job_id)
            if fut is not None:
                fut.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._region.close()

    # -- jobs -----------------------------------------------------------------------------
    def _span(self, gpu: Any) -> BlockSpan:
        return block_span(gpu, self._tensors, self._group_tensor)

    def _submit(self, job_id: int, fn, gpu: BlockSpan, staged: StagedKeys) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                nbytes = fn(gpu, staged)
                ok = True
            except Exception:   # reported to vLLM as a failed job, never raised into it
                log.exception("hybridstore vLLM worker: job %d failed", job_id)
                nbytes, ok = 0, False
            with self._lock:
                self._finished.append(TransferResult(job_id, ok, nbytes,
                                                     time.perf_counter() - t0))
                self._jobs.pop(job_id, None)

        with self._lock:
            self._jobs[job_id] = self._pool.submit(run)

    def _runs(self, gpu: BlockSpan, slots: np.ndarray):
        """Per layer ref: (tensor index, page bytes, GPU block ids, byte offsets in the region)."""
        bpc, rank = self._bpc, self._rank
        slot_bytes = self._region.slot_bytes
        key_at = blk_at = 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if n == 0:
                continue
            skip = first % bpc
            nkeys = -(-(skip + n) // bpc)
            gslots = slots[key_at: key_at + nkeys]
            blocks = gpu.block_ids[blk_at: blk_at + n]
            key_at += nkeys
            blk_at += n
            sub = skip + np.arange(n)
            base = gslots[sub // bpc] * slot_bytes + rank * self.group_bytes[g]
            for t_idx, psz, off in self._refs[g]:
                yield t_idx, psz, blocks, base + off + (sub % bpc) * psz
        if key_at != len(slots) or blk_at != len(gpu.block_ids):
            raise ValueError(f"job of {len(gpu.block_ids)} blocks / {len(slots)} slots maps "
                             f"{blk_at} blocks onto {key_at} keys")

    def _store(self, gpu: BlockSpan, staged: StagedKeys) -> int:
        flat, moved = self._flat, 0
        for t_idx, psz, blocks, offs in list(self._runs(gpu, staged.slots)):
            t = self._tensors[t_idx]
            if t.device.type == "cpu":        # one copy per block, straight into the slot
                host = t.numpy().view(np.uint8)
                for b, o in zip(blocks.tolist(), offs.tolist()):
                    flat[o: o + psz] = host[b, :psz]
            else:                             # one gather on the device, one device-to-host copy
                idx = torch.from_numpy(blocks).to(t.device)
                rows = t.index_select(0, idx)[:, :psz].contiguous().cpu().numpy().view(np.uint8)
                for row, o in zip(rows, offs.tolist()):
                    flat[o: o + psz] = row
            moved += len(blocks) * psz
        return moved

    def _load(self, gpu: BlockSpan, staged: StagedKeys) -> int:
        assert staged.tokens is not None
        self._await(staged)
        flat, moved = self._flat, 0
        for t_idx, psz, blocks, offs in list(self._runs(gpu, staged.slots)):
            t = self._tensors[t_idx]
            if t.device.type == "cpu":
                host = t.numpy().view(np.uint8)
                for b, o in zip(blocks.tolist(), offs.tolist()):
                    host[b, :psz] = flat[o: o + psz]
            else:                             # one host-to-device copy, one scatter
                rows = np.stack([flat[o: o + psz] for o in offs.tolist()]).view(np.int8)
                src = torch.from_numpy(rows).to(t.device)
                idx = torch.from_numpy(blocks).to(t.device)
                if psz == t.shape[1]:
                    t.index_copy_(0, idx, src)
                else:
                    t[idx, :psz] = src
            moved += len(blocks) * psz
        return moved

    def _await(self, staged: StagedKeys) -> None:
        """Wait until the manager staged every slot of a load (bounded)."""
        flags = self._region.flags
        slots, tokens = staged.slots, staged.tokens
        assert tokens is not None
        deadline = time.monotonic() + self._timeout
        pause = 1e-4
        while True:
            got = flags[slots]
            if np.any(got == -tokens):
                raise RuntimeError(f"hybridstore could not read slots {slots[got == -tokens]} "
                                   "(see the scheduler's log)")
            if np.array_equal(got, tokens):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"slots {slots.tolist()} not staged after {self._timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
