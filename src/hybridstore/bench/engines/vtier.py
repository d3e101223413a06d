"""vLLM's tiering interface (``SecondaryTierManager``): its ``fs`` tier and ``HybridStoreTier``.

Both tiers are built by vLLM's own ``SecondaryTierFactory.create_secondary_tier``
(``vllm/v1/kv_offload/tiering/factory.py``) from a tier dict, as
``TieringOffloadingSpec`` does for ``"secondary_tiers": [...]``, over the same
``primary_kv_view``: a ``memoryview`` of an int8 ``(num_chunks, chunk_bytes)``
array standing for vLLM's pinned CPU primary tier.  The spec is a real
``TieringOffloadingSpec`` built from an ``OffloadingConfig`` (one full-attention
group, ``block_size`` = 64 tokens, rank 0 of TP=1); its manager and GPU worker
are never built.

A store (load) job is ``tier.submit_store(TransferJob(job_id, keys,
chunk_ids, is_promotion=False/True, req_context))``; completion comes back
through ``get_finished_jobs()``, polled here every 0.5 ms as the tiering
manager polls on each scheduler call.  Keys are vLLM's offload keys: a 32-byte
SHA-256 chained block hash + the 4-byte big-endian group index; the request
context records each key's end-token position (``set_offload_key_position``).

vLLM's ``fs`` tier uses its C extension ``vllm.fs_io_C`` when it imports; on
a CPU-only install it does not (it links ``libnvrtc``), and the tier runs its
pure-Python path (``os.write`` / ``os.readv``, O_DIRECT when the file system
takes it).  ``fs_io_c`` in the result says which ran.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from hybridstore.bench import threadcpu
from hybridstore.bench.common import aligned

__all__ = ["BUILTIN", "OURS", "JobsRun", "Tier", "Vllm", "vllm"]

OURS = "hybridstore"
BUILTIN = "fs"
OURS_MODULE, OURS_CLASS = "hybridstore.adapters.vllm", "HybridStoreTier"
_POLL_S = 0.0005


class Vllm:
    """vLLM's tiering modules, imported once."""

    def __init__(self) -> None:
        self.base: ModuleType = importlib.import_module("vllm.v1.kv_offload.base")
        self.config: ModuleType = importlib.import_module("vllm.v1.kv_offload.config")
        self.tbase: ModuleType = importlib.import_module("vllm.v1.kv_offload.tiering.base")
        self.factory: ModuleType = importlib.import_module("vllm.v1.kv_offload.tiering.factory")
        self.spec: ModuleType = importlib.import_module("vllm.v1.kv_offload.tiering.spec")
        self.fsio: ModuleType = importlib.import_module("vllm.v1.kv_offload.tiering.fs.io")

    @property
    def fs_io_c(self) -> bool:
        return bool(getattr(self.fsio, "_HAS_FSIO_C", False))

    @property
    def alignment(self) -> int:
        return int(self.spec.TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT)

    def offloading_spec(self, *, chunk_bytes: int, block_tokens: int, model: str,
                        tiers: list[dict[str, Any]]) -> Any:
        c = self.config
        cfg = c.OffloadingConfig(
            groups=(c.OffloadingGroupConfig(tokens_per_block=block_tokens,
                                            layer_names=("model.layers.3.self_attn",), group_id=0),),
            worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
            extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                          "block_size": block_tokens, "secondary_tiers": tiers},
            engine_id="bench-engines",
            model=c.OffloadingModelConfig(name=model, dtype="bfloat16"),
            cache=c.OffloadingCacheConfig(tokens_per_hash=block_tokens, blocks_per_chunk=1),
            parallel=c.OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False))
        return self.spec.TieringOffloadingSpec(cfg)

    def chain_keys(self, n: int, seed: bytes) -> list[bytes]:
        """``n`` offload keys of one request: chained SHA-256 block hashes + group 0."""
        keys, h = [], hashlib.sha256(seed).digest()
        for i in range(n):
            h = hashlib.sha256(h + i.to_bytes(8, "little")).digest()
            keys.append(self.base.make_offload_key(h, 0))
        return keys

    def req_context(self, req_id: str, keys: list[bytes], block_tokens: int) -> Any:
        ctx = self.base.ReqContext(req_id=req_id)
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * block_tokens)
        return ctx


_VLLM: Vllm | None = None


def vllm() -> Vllm:
    """vLLM's tiering modules (imported on first use, ~13 s on 2 cores)."""
    global _VLLM
    if _VLLM is None:
        _VLLM = Vllm()
    return _VLLM


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - metadata missing
        return None


def tier_dict(name: str, path: str, *, disk_bytes: int, host_bytes: int) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of each tier: vLLM's ``fs``, or ours (DRAM + SSD)."""
    if name == BUILTIN:
        return {"type": "fs", "root_dir": path}
    return {"type": OURS_CLASS, "module_path": OURS_MODULE, "disk_path": path,
            "disk_bytes": int(disk_bytes), "host_bytes": int(host_bytes)}


@dataclass
class Primary:
    """vLLM's primary tier stand-in: ``(num_chunks, chunk_bytes)`` int8, and its memoryview."""

    array: np.ndarray
    view: memoryview

    @classmethod
    def make(cls, num_chunks: int, chunk_bytes: int) -> Primary:
        """Page-aligned, as vLLM's mmap'ed shared region is (its ``fs`` tier writes with O_DIRECT)."""
        arr = aligned(num_chunks * chunk_bytes).view(np.int8).reshape(num_chunks, chunk_bytes)
        return cls(array=arr, view=memoryview(arr))


class JobsRun(NamedTuple):
    """What :meth:`Tier.run_jobs` measured."""

    wall_s: float
    latencies_s: list[float]          # per job, submit to finished, in job order
    ok: list[bool]                    # per job, its JobResult's success
    cpu_s: float                      # process CPU (every thread) meanwhile
    pools_s: dict[str, float] | None  # the same by thread pool (bench/threadcpu.py)


class Tier:
    """One secondary tier and the jobs it has in flight."""

    def __init__(self, name: str, path: str, primary: Primary, spec: Any, disk_bytes: int,
                 host_bytes: int) -> None:
        v = vllm()
        self.name = name
        self.path = path
        self.tier = v.factory.SecondaryTierFactory.create_secondary_tier(
            tier_dict(name, path, disk_bytes=disk_bytes, host_bytes=host_bytes), primary.view, spec)
        self._next_job = 0

    def run_jobs(self, jobs: list[tuple[list[bytes], np.ndarray, Any]], *, load: bool,
                 timeout_s: float = 600.0) -> JobsRun:
        """Submit every job at once, poll until all finished.

        Returns:
            The wall time, each job's time from submit to finished and success, and the
            process CPU meanwhile (``time.process_time``: every thread of the process, the
            tier's I/O threads and this polling loop alike, the same for both tiers), also
            by thread pool where Linux gives per-thread times (``MainThread`` is this loop).
        """
        v = vllm()
        pools = threadcpu.PoolClock()
        pools.start()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        started: dict[int, float] = {}
        for keys, chunks, ctx in jobs:
            jid = self._next_job
            self._next_job += 1
            job = v.tbase.TransferJob(job_id=jid, keys=keys, chunk_ids=chunks, is_promotion=load,
                                      req_context=ctx)
            started[jid] = time.perf_counter()
            (self.tier.submit_load if load else self.tier.submit_store)(job)
        done: dict[int, tuple[float, bool]] = {}
        while len(done) < len(started):
            for r in self._finished():
                done[r.job_id] = (time.perf_counter() - started[r.job_id], bool(r.success))
            if len(done) < len(started):
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"{self.name}: {len(started) - len(done)} jobs unfinished")
                time.sleep(_POLL_S)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        by_pool = pools.stop()
        order = sorted(done)
        return JobsRun(wall, [done[j][0] for j in order], [done[j][1] for j in order], cpu,
                       by_pool)

    def _finished(self) -> Iterable[Any]:
        return list(self.tier.get_finished_jobs())

    def lookup(self, keys: list[bytes], ctx: Any, *, timeout_s: float = 30.0) -> int:
        """Leading keys of one request that are HIT (RETRY is asked again, as the scheduler does)."""
        v = vllm()
        self.tier.on_new_request(ctx)
        hits, t0 = 0, time.perf_counter()
        for k in keys:
            while True:
                r = self.tier.lookup(k, ctx)
                if r != v.base.LookupResult.RETRY:
                    break
                # the scheduler's step end: the fs tier flushes its async lookups here
                self.tier.on_schedule_end(v.base.ScheduleEndContext(new_req_ids=(),
                                                                    preempted_req_ids=()))
                if time.perf_counter() - t0 > timeout_s:
                    return hits
                time.sleep(_POLL_S)
            if r != v.base.LookupResult.HIT:
                break
            hits += 1
        return hits

    def close(self) -> None:
        try:
            self.tier.drain_jobs()
        finally:
            self.tier.shutdown()
