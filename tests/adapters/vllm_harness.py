"""Drive vLLM's own scheduler and worker-side offloading connector on CPU (0.31 to 0.34).

What runs is vLLM's code: a real ``vllm.v1.core.sched.scheduler.Scheduler`` (it
builds the scheduler-role ``OffloadingConnector`` and, through it, the spec's
manager) and a worker-role ``OffloadingConnector`` whose ``register_kv_caches``
builds the spec's worker over CPU tensors standing in for the GPU KV cache.  No
model runs: the loop plays the model runner the way upstream's
``tests/v1/kv_connector/unit/offloading_connector/utils.py`` (``RequestRunner``)
does, returning one sampled token per running request and the worker
connector's outputs (INTERFACES.md §2.7).  The local ``tinyopt`` config keeps
vLLM off the network.

The connector is hybridstore's ``HybridStoreConnector`` (vLLM's
``OffloadingConnector``, handing the spec its ``KVCacheConfig``, which hybrid
models need on 0.32) unless ``connector="OffloadingConnector"`` asks for vLLM's
own; what differs between the releases in the harness itself is
:func:`runner_output`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MODEL_DIR = Path(__file__).with_name("tinyopt")
BLOCK = 16
"""Tokens per GPU block (and per offloaded chunk, ``block_size`` in the extra config)."""

from hybridstore.adapters.vllm.compat import HybridStoreConnector, block_span

init_none_hash(sha256)

_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(req_ids: list[str], sampled: list[list[int]], connector_output: Any
                  ) -> ModelRunnerOutput:
    """A model runner's step output (0.34 dropped ``req_id_to_index``)."""
    kw: dict[str, Any] = {}
    if "req_id_to_index" in _OUTPUT_FIELDS:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             kv_connector_output=connector_output, **kw)


@dataclass
class Run:
    """What one request did: its block table (per group) and the connector's counts."""

    req: Request
    tables: list[tuple[list[int], ...]] = field(default_factory=list)
    steps: int = 0
    hit: int | None = None
    """Tokens computed when first scheduled: vLLM's prefix cache plus the connector's load."""

    def block(self, group: int, index: int) -> int:
        """The first GPU block the request held at logical ``index`` of ``group`` (0: none).

        A Mamba (align) group frees its older blocks as the request advances, so
        the block a load filled is read from the step that allocated it.
        """
        for table in self.tables:
            if len(table[group]) > index and table[group][index]:
                return table[group][index]
        return 0


@dataclass
class Engine:
    """One vLLM engine instance: scheduler + one worker connector over CPU "GPU" tensors.

    Args:
        extra: ``kv_connector_extra_config``.
        hybrid: add that many Mamba groups (``MambaSpec``, ``mamba_cache_mode="align"``).
        num_blocks: GPU blocks per group.
        hash_block: tokens per block hash (``prefix_match_unit``); below ``BLOCK`` with
            a Mamba group, vLLM offloads partial tails (states between chunk ends).
    """

    extra: dict[str, Any]
    hybrid: int = 0
    num_blocks: int = 64
    hash_block: int = BLOCK
    connector: str = "HybridStoreConnector"
    forward_waits: bool = False
    """The step's forward outlasts the copies it started (a real engine's step takes
    milliseconds, the harness's none): they finish before the worker reports."""
    sched: Scheduler = field(init=False)
    worker: OffloadingConnector = field(init=False)
    kv: dict[str, torch.Tensor] = field(init=False)
    groups: list[KVCacheGroupSpec] = field(init=False)

    def __post_init__(self) -> None:
        mc = ModelConfig(model=str(MODEL_DIR), dtype="float16", seed=42, skip_tokenizer_init=True)
        sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                             enable_chunked_prefill=True, is_encoder_decoder=False)
        cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                         enable_prefix_caching=True,
                         **({"mamba_cache_mode": "align"} if self.hybrid else {}),
                         **({"prefix_match_unit": self.hash_block}
                            if self.hash_block != BLOCK else {}))
        cc.kv_cache_layout = "LBNHC"
        own = self.connector == "HybridStoreConnector"
        ktc = KVTransferConfig(kv_connector=self.connector, kv_role="kv_both",
                               kv_connector_extra_config=dict(self.extra),
                               **({"kv_connector_module_path": "hybridstore.adapters.vllm"}
                                  if own else {}))
        self.config = vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
        groups = [KVCacheGroupSpec(["layer0"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16))]
        for g in range(int(self.hybrid)):    # hybrid=2: two Mamba groups (as Qwen3-Next has 3)
            groups.append(KVCacheGroupSpec([f"layer{g + 1}"], MambaSpec(
                block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float16, torch.float32),
                mamba_cache_mode="align")))
        self.groups = groups
        kvc = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        cc.num_gpu_blocks = self.num_blocks
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK)
        self.worker = (HybridStoreConnector if own else OffloadingConnector)(
            vc, KVConnectorRole.WORKER, kvc)
        self.kv = {ln: torch.zeros((self.num_blocks, g.kv_cache_spec.page_size_bytes),
                                   dtype=torch.int8)
                   for g in groups for ln in g.layer_names}
        with set_current_vllm_config(vc):
            self.worker.register_kv_caches(self.kv)

    @property
    def manager(self) -> Any:
        """The spec's manager inside the scheduler-role connector."""
        return self.sched.connector.connector_scheduler.manager

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=gen))

    def zero(self) -> None:
        for t in self.kv.values():
            t.zero_()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {ln: t.clone() for ln, t in self.kv.items()}

    def run(self, rid: str, tokens: list[int], max_steps: int = 200, decode: int = 2) -> Run:
        """Run one request to the end (prefill + ``decode`` tokens), as the model runner would."""
        return self.run_all({rid: tokens}, max_steps, decode)[rid]

    def run_all(self, prompts: dict[str, list[int]], max_steps: int = 200, decode: int = 2
                ) -> dict[str, Run]:
        """Run requests concurrently (all added at once) until every one has finished."""
        sp = SamplingParams(max_tokens=decode)  # the runner "samples" token 7 each step
        sp.update_from_generation_config({}, 50256)
        runs = {}
        for rid, tokens in prompts.items():
            req = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                          pooling_params=None,
                          block_hasher=get_request_block_hasher(self.hash_block, sha256))
            self.sched.add_request(req)
            runs[rid] = Run(req)
        for step in range(max_steps):
            so = self.sched.schedule()
            for rid, n in so.num_scheduled_tokens.items():
                run = runs.get(rid)
                if run is not None and run.hit is None:   # first scheduled: after any load
                    run.hit = run.req.num_computed_tokens - n
            connector_output = self._worker_step(so)
            for rid, run in runs.items():
                if rid in self.sched.requests:
                    run.tables.append(tuple(list(b) for b in
                                            self.sched.kv_cache_manager.get_block_ids(rid)))
                    run.steps = step + 1
            reqs = self.sched.running
            out = runner_output([r.request_id for r in reqs], [[7] for _ in reqs],
                                connector_output)
            self.sched.update_from_output(so, out)
            if not any(rid in self.sched.requests for rid in runs):
                break
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)       # waiting on the manager's put thread or a load
        else:
            raise AssertionError(f"requests {sorted(runs)} did not finish in {max_steps} steps")
        return runs

    def step(self) -> None:
        """One engine step with nothing scheduled (workers report, the manager completes)."""
        so = self.sched.schedule()
        self.sched.update_from_output(so, runner_output([], [], self._worker_step(so)))

    def _worker_step(self, so: Any) -> Any:
        """The worker-role connector's part of one step, as vLLM's model runner drives it
        (``handle_preemptions`` ... ``build_connector_worker_meta``)."""
        md = so.kv_connector_metadata
        cw = self.worker.connector_worker    # the stores it deferred start now, and the loads
        started = ({job[0] for job in cw._unsubmitted_store_jobs} | set(md.load_jobs)
                   | (set(md.jobs_to_flush) & set(md.store_jobs)))
        self.worker.handle_preemptions(md)
        self.worker.bind_connector_metadata(md)
        self.worker.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={},
                                                 slot_mapping={}))
        if self.forward_waits:
            cw.worker.wait(started)
        if so.total_num_scheduled_tokens > 0:
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                 kv_connector_worker_meta=meta)

    def settle(self, busy: Any = None, timeout: float = 30.0) -> None:
        """Step until every store job has been reported and put into the store, as a
        serving engine's next steps would (``busy``: the predicate to wait on;
        default the hybridstore manager's)."""
        busy = busy or (lambda: self.manager.busy)
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            if not busy():
                break
            assert time.monotonic() < deadline, "stores still in flight"
            time.sleep(0.002)
        flush = getattr(self.manager, "flush", None)
        if flush is not None:
            flush()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


# -- tiering (route B): vLLM's TieringOffloadingSpec with a CPU copy worker -------------------
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class CPUCopyWorker(OffloadingWorker):
    """vLLM's CPU-tier worker refuses non-CUDA platforms (``cpu/spec.py:221``); this
    stand-in does its copies with torch on CPU, over the same ``SharedOffloadRegion``
    worker views (``create_next_worker_view``), so the real primary tier's chunks hold
    the bytes its secondary tier reads.  One block per chunk (``blocks_per_chunk=1``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion) -> None:
        self.region = region
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.cpu = [region.create_next_worker_view(t.page_size_bytes) for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.done: list[TransferResult] = []

    def _pairs(self, gpu: Any, chunks: Any):
        # 0.32/0.33 hand a GPULoadStoreSpec, 0.34 DevicePointers: block ids either way
        gpu_spec = block_span(gpu, self.gpu, [refs[0].tensor_idx if refs else -1
                                              for refs in self.refs])
        at = 0
        for g, n in enumerate(gpu_spec.group_sizes):
            blocks = gpu_spec.block_ids[at: at + n].tolist()
            rows = chunks[at: at + n].tolist()
            at += n
            for ref in self.refs[g]:
                yield ref.tensor_idx, blocks, rows

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        for t, blocks, rows in self._pairs(src_spec, dst_spec.block_ids):
            for b, r in zip(blocks, rows):
                self.cpu[t][r].copy_(self.gpu[t][b])
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
                    ) -> bool:
        for t, blocks, rows in self._pairs(dst_spec, src_spec.block_ids):
            for b, r in zip(blocks, rows):
                self.gpu[t][b].copy_(self.cpu[t][r])
        self.done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self.region.cleanup()


class TieringCPUSpec(TieringOffloadingSpec):
    """The real ``TieringOffloadingSpec`` (``TieringOffloadingManager``, CPU primary tier,
    secondary tiers) with :class:`CPUCopyWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        assert self.blocks_per_chunk == 1
        region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks,
                                     rank=0, kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                     cpu_page_size=self.cpu_page_size_per_worker)
        return CPUCopyWorker(kv_caches, region)
