"""``python -m benchmarks calibrate``: the replay's presets against SGLang's own radix cache
(the default) or vLLM's own KV cache manager (``--engine vllm``).

Issue 15, part 1 (first step): the same requests (the sequential discipline: every request
of the trace by trace time, one at a time, the replay's synthesized token ids), the same
budgets (a fraction of the KV footprint; KV pool + Mamba pool of ``--mamba-full-memory-
ratio`` 0.9), through

* SGLang 0.5.23's real ``UnifiedRadixCache`` with FULL + MAMBA components and its real
  pools (``HybridReqToTokenPool`` / ``HybridLinearKVPool`` / ``TokenToKVPoolAllocator``),
  page size 1 without the Mamba extra buffer (SGLang requires page size 1 there: its
  ``MambaComponent``), LRU: per request ``match_prefix``, then KV and a Mamba slot for
  the rest (``evict`` when a pool is short; a prompt longer than the KV pool is not
  stored), then ``insert`` of the prompt with its state at the prompt's end, the matched
  prefix locked meanwhile, as ``checkpoint_into_tree`` does after a prefill: the request's
  KV row is the matched prefix's indices then fresh ones, and the insert itself frees the
  fresh indices of what the tree already held (``prev_prefix_len``);
* or vLLM 0.33's real ``KVCacheManager`` (``HybridKVCacheCoordinator`` over a
  ``FullAttentionSpec`` group and the model's ``MambaSpec`` groups in
  ``mamba_cache_mode="align"``, prefix caching on, one real ``BlockPool`` of
  ``budget x footprint x (1 + mamba_ratio)`` bytes in the model's hybrid blocks) driven
  by its real ``Scheduler``: ``get_computed_blocks``, ``allocate_slots`` per prefill
  chunk, ``free`` when the request finishes (:class:`VLLMPrefixCache`);
* hybridstore's replay with a preset, over one accounting tier split the same way.

It prints, per budget, the engine's token hit rate and each preset's, with the requests
whose hit differs from the engine's by a block or more, as JSON, a table and a PNG.

With ``--sglang-mode extra_buffer`` (SGLang's default strategy ``auto`` resolves to it with
overlap scheduling or pages over one token) the same cache runs with page size 64 and the
Mamba extra buffer, driven as its scheduler drives it (:meth:`SGLangRadixCache.
serve_extra_buffer`): prefill in chunks of ``chunked_prefill_size`` (8192), one state
tracked per chunk by SGLang's own ``_mamba_radix_cache_v2_req_prepare_for_extend`` (the
chunk's last 64-aligned position, or the branch point ``mamba_branching_seqlen`` inside
it), inserted with the KV up to it; the preset that follows it is ``sglang-extra``.

With ``--engine vllm --offload-cpu RATIO`` vLLM's CPU offloading runs too, as
``--kv-offloading-size`` sets it up: the scheduler builds the real ``OffloadingConnector``
(scheduler side) with ``CPUOffloadingSpec``'s ``CPUOffloadingManager`` and its LRU, a CPU
tier of ``RATIO`` x the GPU pool's bytes; the worker side completes every transfer the
step it is scheduled (:meth:`VLLMPrefixCache._worker_output`).  ``--offload-disk`` adds
vLLM's ``TieringOffloadingSpec`` with its ``fs`` tier behind the CPU tier, writing real
files into a temporary directory.  The presets get a host tier of as much
(``ReplayConfig.host_ratio``) and a disk tier without a limit (``disk_ratio``); the
presets that follow them are ``vllm-cpu`` and ``vllm-disk``.

What it does not model of SGLang: decode-time states (every ``mamba_track_interval`` tokens
of output: the sequential discipline has no decode), host and storage tiers, batches of
several requests (one request at a time, as the discipline serves them); of vLLM: decode,
concurrent requests, transfer times (its workers' copies complete at once).
"""

from __future__ import annotations

import json
import math
import time
from array import array
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from hybridstore.adapters.cpu_shims import SGLANG_CACHE_MODULES, import_sglang
from hybridstore.errors import ConfigError
from hybridstore.replay.model_presets import vllm_hybrid_pages
from hybridstore.replay.sim import ReplayConfig, kv_footprint, merged_requests, replay
from hybridstore.replay.systems import VLLM_MAX_BATCHED_TOKENS
from hybridstore.replay.tokens import session_tokens
from hybridstore.replay.trace import Trace

DEFAULT_PRESETS = ("sglang-hicache", "vllm-marconi", "histate")


SGLANG_MODES = ("no_buffer", "extra_buffer")
SGLANG_PAGE = {"no_buffer": 1, "extra_buffer": 64}   # extra_buffer: SGLang's default page 64
SGLANG_CHUNK = 8192        # chunked_prefill_size on an H100 / H200 (arg_groups/memory_hook.py)
SGLANG_TRACKING_SLOTS = 3  # extra_buffer: a request's working state + 2 ping-pong track slots


class SGLangRadixCache:
    """SGLang's ``UnifiedRadixCache`` (FULL + MAMBA, LRU) over real pools on CPU.

    Args:
        kv_tokens: the KV pool, in tokens.
        mamba_slots: the Mamba pool, in states.
        tree_core: SGLang's tree core backend, ``"rust"`` (its default) or ``"python"``
            (the reference implementation; the same decisions, slower, inspectable).
        mode: ``"no_buffer"`` (page 1, one state at each prompt's end) or
            ``"extra_buffer"`` (``--mamba-radix-cache-strategy extra_buffer``, what ``auto``
            resolves to with overlap scheduling or pages over 1: page 64, states where the
            scheduler tracks them, :meth:`serve_extra_buffer`).
        chunk: ``chunked_prefill_size`` (extra_buffer: one tracked state per chunk).
    """

    def __init__(self, kv_tokens: int, mamba_slots: int, tree_core: str | None = None,
                 mode: str = "no_buffer", chunk: int = SGLANG_CHUNK) -> None:
        import torch

        if mode not in SGLANG_MODES:
            raise ValueError(f"mode must be one of {SGLANG_MODES}, got {mode!r}")
        self.mode, self.page = mode, SGLANG_PAGE[mode]
        extra = mode == "extra_buffer"
        self.chunk = chunk // self.page * self.page
        kv_tokens = kv_tokens // self.page * self.page
        m = import_sglang(SGLANG_CACHE_MODULES + ("sglang.srt.mem_cache.allocator.paged",
                                                  "sglang.srt.managers.schedule_batch"))
        sa_mod = m["sglang.srt.server_args"]
        self._bpc = m["sglang.srt.mem_cache.base_prefix_cache"]
        self._radix = m["sglang.srt.mem_cache.radix_cache"]
        comp = m["sglang.srt.mem_cache.unified_cache.components.base"].ComponentType
        pools = m["sglang.srt.mem_cache.memory_pool"]
        mamba = m["sglang.srt.configs.mamba_utils"]
        self._parallel = m["sglang.srt.runtime_context"].get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self._parallel.__enter__()
        sa = sa_mod.ServerArgs(model_path="dummy", page_size=self.page,
                               mamba_radix_cache_strategy=mode)
        sa._mamba_cache_chunk_size = 64       # no model config to read it from here
        sa_mod.set_global_server_args_for_scheduler(sa)
        with m["sglang.srt.environ"].envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
            # the smallest real shapes: the calibration counts slots, not bytes
            shape = mamba.Mamba2StateShape.create(tp_world_size=1, intermediate_size=8,
                                                  n_groups=1, num_heads=1, head_dim=8,
                                                  state_size=4, conv_kernel=2)
            cparams = mamba.Mamba2CacheParams(shape=shape, layers=[0])
        rtp = pools.HybridReqToTokenPool(
            size=2, mamba_size=mamba_slots, mamba_spec_state_size=1, max_context_len=8,
            device="cpu", enable_memory_saver=False, cache_params=cparams, mamba_layer_ids=[0],
            enable_mamba_extra_buffer=extra, speculative_num_draft_tokens=1)
        kv = pools.HybridLinearKVPool(
            size=kv_tokens, dtype=torch.bfloat16, page_size=self.page, head_num=1, head_dim=1,
            full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False,
            mamba_pool=rtp.mamba_pool)
        if extra:
            self.kv = m["sglang.srt.mem_cache.allocator.paged"].PagedTokenToKVPoolAllocator(
                size=kv_tokens, page_size=self.page, dtype=torch.bfloat16, device="cpu",
                kvcache=kv, need_sort=False)
        else:
            self.kv = m["sglang.srt.mem_cache.allocator"].TokenToKVPoolAllocator(
                size=kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
        self.mamba = rtp.mamba_allocator
        params = m["sglang.srt.mem_cache.cache_init_params"].CacheInitParams(
            req_to_token_pool=rtp, token_to_kv_pool_allocator=self.kv, page_size=self.page,
            disable=False, tree_components=(comp.FULL, comp.MAMBA),
            enable_mamba_extra_buffer=extra,
            kv_event_lora_names=m["sglang.srt.mem_cache.events"].KvEventLoraNames(),
            eviction_policy="lru", tree_core_backend=tree_core)
        self.cache = m["sglang.srt.mem_cache.unified_radix_cache"].UnifiedRadixCache(params=params)
        self.kv_tokens = kv_tokens
        self.skipped = 0
        # the scheduler's tracking rule, called on a batch of one request (tracked())
        self._prepare_for_extend = m["sglang.srt.managers.schedule_batch"].ScheduleBatch \
            ._mamba_radix_cache_v2_req_prepare_for_extend
        self._batch = SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace()),
            tree_cache=SimpleNamespace(page_size=self.page), req_to_token_pool=rtp)

    def serve(self, tokens: np.ndarray) -> int:
        """One prefill: the hit (tokens with KV and a state at their end), then the insert."""
        import torch

        if self.mode == "extra_buffer":
            return self.serve_extra_buffer(tokens)
        key = self._radix.RadixKey(array("q", tokens.astype(np.int64).tolist()))
        match = self.cache.match_prefix(self._bpc.MatchPrefixParams(key=key))
        hit = int(match.device_prefix_len)
        new = len(tokens) - hit
        lock = self.cache.lock(match.last_device_node)
        try:
            if new > self.kv_tokens:
                self.skipped += 1
                return hit
            if self.kv.available_size() < new:
                self.cache.evict(self._bpc.EvictParams(num_tokens=new - self.kv.available_size()))
            if self.mamba.available_size() < 1:
                self.cache.evict(self._bpc.EvictParams(mamba_num=1))
            idx = self.kv.alloc(new)
            slot = self.mamba.alloc(1) if idx is not None else None
            if idx is None or slot is None:
                if idx is not None:
                    self.kv.free(idx)
                self.skipped += 1
                return hit
            # What checkpoint_into_tree does after the prefill: the request's KV row is the
            # matched prefix's indices then the new ones; the insert frees, itself, the new
            # indices of [hit, prefix_len) that the tree already held (prev_prefix_len = the
            # protected prefix), so nothing is freed here but an unused Mamba slot.
            prefix = self.cache.path_device_indices(match.last_device_node)[:hit]
            value = torch.cat([prefix.to(idx.dtype), idx])
            got = self.cache.insert(self._bpc.InsertParams(key=key, value=value, mamba_value=slot,
                                                           prev_prefix_len=hit))
            if got.mamba_exist:
                self.mamba.free(slot)
            return hit
        finally:
            self.cache.unlock(lock)

    def tracked(self, start: int, end: int, branch: int | None) -> int | None:
        """Where the scheduler tracks a state for the prefill chunk ``[start, end)``: SGLang's
        own ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` on a request
        with that chunk (``mamba_last_track_seqlen``; ``None``: nothing tracked).

        That rule: ONE state per chunk, at ``start + (end - start) // 64 * 64`` (none when
        the chunk is under 64 tokens), or instead at the branch point
        ``mamba_branching_seqlen`` (the KV match floored to 64 where it runs past the state
        match) when ``start < branch < end`` on the chunk's grid.  A prefill-only request
        tracks nothing more (the state every ``mamba_track_interval`` tokens of decode is
        not modeled: the sequential replay has no decode).
        """
        NS = SimpleNamespace
        req = NS(prefix_len=start, extend_end=end, extend_len=end - start,
                 mamba_branching_seqlen=branch,
                 kv=NS(mamba_next_track_idx=0, mamba_last_track_idx=1,
                       mamba_last_track_seqlen=None))
        entry = self._prepare_for_extend(self._batch, req)
        return int(req.kv.mamba_last_track_seqlen) if entry.track_mask else None

    def serve_extra_buffer(self, tokens: np.ndarray) -> int:
        """One prefill with the Mamba extra buffer, as the scheduler drives the cache.

        ``match_prefix`` (the hit: the deepest node with KV and a state; its
        ``mamba_branching_seqlen``); the matched node locked; the request's Mamba slots (a
        working state and two ping-pong track slots, overlap scheduling on: ``evict`` when
        the pool is short); then per chunk of ``chunk`` tokens: KV for the chunk (paged,
        ``evict`` when short), and where the chunk tracked a state
        (:meth:`tracked_positions`) an ``insert`` of ``[0, t)`` with that state
        (``checkpoint_into_tree``: ``prev_prefix_len`` = the protected prefix, the insert
        frees the duplicates; before the last chunk the ping-pong slot is donated and a
        new one allocated, and the lock moves to the inserted node).  At the end the KV
        past the last inserted state is freed (``release_kv_cache``: the key stops at the
        state, ``effective_cache_len``), and the request's other slots with it.
        """
        import torch

        P = self.page
        n = len(tokens)
        key = self._radix.RadixKey(array("q", tokens.astype(np.int64).tolist()))
        match = self.cache.match_prefix(self._bpc.MatchPrefixParams(key=key))
        hit = int(match.device_prefix_len)
        branch = match.mamba_branching_seqlen
        lock = self.cache.lock(match.last_device_node)
        try:
            pages = -(-(n - hit) // P) * P
            if pages > self.kv_tokens or self.mamba.size < SGLANG_TRACKING_SLOTS:
                self.skipped += 1
                return hit
            short = SGLANG_TRACKING_SLOTS - self.mamba.available_size()
            if short > 0:
                self.cache.evict(self._bpc.EvictParams(mamba_num=short))
            slots = self.mamba.alloc(SGLANG_TRACKING_SLOTS)
            if slots is None:
                self.skipped += 1
                return hit
            held = list(slots.split(1))           # working state, ping, pong
            row = self.cache.path_device_indices(match.last_device_node)[:hit].to(torch.int64)
            protected = hit
            s = hit
            while s < n:
                e = min(s + self.chunk, n)
                need = -(-(e - s) // P) * P
                if self.kv.available_size() < need:
                    self.cache.evict(self._bpc.EvictParams(
                        num_tokens=need - self.kv.available_size()))
                idx = self.kv.alloc(need)
                if idx is None:                   # everything left is locked: give up here
                    break
                row = torch.cat([row, idx[:e - s].to(torch.int64)])
                t = self.tracked(s, e, branch)
                if t is not None:
                    last = e == n
                    state = held.pop()
                    got = self.cache.insert(self._bpc.InsertParams(
                        key=key[:t], value=row[:t].clone(), mamba_value=state,
                        prev_prefix_len=protected))
                    if got.mamba_exist:
                        self.mamba.free(state)
                    node = got.last_device_node
                    tree = self.cache.path_device_indices(node)
                    row[protected:len(tree)] = tree[protected:].to(torch.int64)
                    protected = len(tree)
                    self.cache.unlock(lock)
                    lock = self.cache.lock(node)
                    if not last:                  # donate_mamba_ping_pong_slot: a new slot
                        if self.mamba.available_size() < 1:
                            self.cache.evict(self._bpc.EvictParams(mamba_num=1))
                        new = self.mamba.alloc(1)
                        if new is not None:
                            held.append(new)
                s = e
            if len(row) > protected:              # release_kv_cache: past the last state
                self.kv.free(row[protected:])
            for slot in held:
                self.mamba.free(slot)
            return hit
        finally:
            self.cache.unlock(lock)


def sglang_run(trace: Trace, cfg: ReplayConfig, mode: str = "no_buffer",
               chunk: int = SGLANG_CHUNK) -> tuple[list[int], int]:
    """Per-request hits of SGLang's own cache, in the sequential discipline's order, and the
    number of requests it could not hold (a prompt longer than its KV pool); ``mode``:
    :class:`SGLangRadixCache`'s."""
    assert cfg.budget is not None
    model = cfg.full_model()
    footprint = kv_footprint(trace, cfg, model)
    cache = SGLangRadixCache(max(SGLANG_PAGE[mode],
                                 int(cfg.budget * footprint / model.kv_bytes_per_token)),
                             max(1, int(cfg.budget * footprint * cfg.mamba_ratio
                                        / model.checkpoint_bytes)), mode=mode, chunk=chunk)
    order = merged_requests(trace)
    if cfg.max_requests is not None:
        order = order[:cfg.max_requests]
    tokens = {s.id: session_tokens(s) for s in trace.sessions}
    return [cache.serve(next(tokens[r.session])) for r in order], cache.skipped


def sglang_hits(trace: Trace, cfg: ReplayConfig, mode: str = "no_buffer") -> list[int]:
    """Per-request hits of SGLang's own cache (:func:`sglang_run`)."""
    return sglang_run(trace, cfg, mode)[0]


_TINY_CONFIG = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
                "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                "vocab_size": 50272, "max_position_embeddings": 1 << 22,
                "word_embed_proj_dim": 64, "do_layer_norm_before": True,
                "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}


class VLLMPrefixCache:
    """vLLM 0.33's ``KVCacheManager`` (a ``HybridKVCacheCoordinator`` over one
    ``FullAttentionSpec`` group and ``mamba_groups`` ``MambaSpec`` groups in
    ``mamba_cache_mode="align"``, prefix caching on, one real ``BlockPool``) driven by its
    real ``Scheduler`` on CPU, one request at a time.

    The scheduler does what it does in a server: ``get_computed_blocks`` (the hit),
    ``allocate_slots`` per prefill chunk (``max_num_batched_tokens``, clipped by
    ``_mamba_block_aligned_split`` so that chunks end on block boundaries and at the
    prompt's last block boundary), and ``free`` when the request finishes after its one
    output token (the prompt's full blocks stay cached, in the free queue).  No model
    runs: the driver hands back a sampled token per finished prefill.

    Args:
        num_blocks: the pool (one block id = one page in every layer of a group).
        block_tokens: tokens per block (attention and Mamba, align mode).
        mamba_groups: Mamba groups; a state takes one block in each.
        max_num_batched_tokens: the scheduler's token budget per step (the prefill chunk).
    """

    def __init__(self, num_blocks: int, block_tokens: int, mamba_groups: int = 1,
                 max_num_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS,
                 cpu_chunks: int | None = None, disk_dir: str | None = None) -> None:
        import tempfile

        import torch
        from vllm import SamplingParams
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self._Request, self._Output, self._Status = Request, ModelRunnerOutput, RequestStatus
        max_len = 1 << 22
        self._dir = tempfile.TemporaryDirectory()   # a local model config: no hub access
        with open(f"{self._dir.name}/config.json", "w") as fh:
            json.dump(_TINY_CONFIG, fh)
        mc = ModelConfig(model=self._dir.name, dtype="float16", seed=0, skip_tokenizer_init=True,
                         max_model_len=max_len)
        sc = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_len, enable_chunked_prefill=True,
                             is_encoder_decoder=False)
        cc = CacheConfig(block_size=block_tokens, enable_prefix_caching=True,
                         mamba_cache_mode="align")
        cc.num_gpu_blocks = num_blocks
        # Page bytes do not matter to the manager (it counts block ids); the Mamba page is
        # padded to the attention page as vLLM pads it.
        fa = FullAttentionSpec(block_size=block_tokens, num_kv_heads=1,
                               head_size=1 if disk_dir else 8, dtype=torch.float16)
        ktc = None
        if cpu_chunks is not None:
            # --kv-offloading-size N --kv-offloading-backend native: the OffloadingConnector
            # with CPUOffloadingSpec, cpu_bytes_to_use = N GiB, everything else default
            # (one GPU block per chunk, offload_prompt_only, LRU).  One CPU chunk holds one
            # block of one group (worker_kv_bytes_per_block: a block id's bytes, the groups
            # overlaying one allocation); here a block id's bytes are the tiny pages', so
            # cpu_bytes_to_use is chosen to give exactly ``cpu_chunks`` chunks.
            from vllm.config import KVTransferConfig
            from vllm.utils.math_utils import round_up
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

            chunk = round_up(fa.page_size_bytes * (1 + mamba_groups),
                             CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
            extra: dict[str, Any] = {"cpu_bytes_to_use": max(1, cpu_chunks) * chunk}
            if disk_dir is not None:
                # vLLM's disk tier: TieringOffloadingSpec (the same CPU tier as primary)
                # with its file-system secondary tier, polled once per step
                extra.update(spec_name="TieringOffloadingSpec", tier_poll_interval_s=0,
                             secondary_tiers=[{"type": "fs", "root_dir": disk_dir,
                                               "n_read_threads": 2, "n_write_threads": 2}])
            ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                   kv_connector_extra_config=extra)
        vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                        device_config=DeviceConfig("cpu"), kv_transfer_config=ktc)
        groups = [KVCacheGroupSpec(["attn"], fa)]
        for g in range(mamba_groups):
            groups.append(KVCacheGroupSpec([f"mamba{g}"], MambaSpec(
                block_size=block_tokens, shapes=((4, 8),), dtypes=(torch.float16,),
                mamba_cache_mode="align", page_size_padded=fa.page_size_bytes)))
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=block_tokens)
        self.manager = self.sched.kv_cache_manager
        self.offload = None
        if cpu_chunks is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )
            from vllm.v1.outputs import KVConnectorOutput

            self._WorkerMeta, self._ConnectorOutput = OffloadingWorkerMetadata, KVConnectorOutput
            self._connector = self.sched.connector.connector_scheduler
            self.offload = self._connector.manager
            primary = getattr(self.offload, "primary_tier", self.offload)
            assert primary._num_chunks == max(1, cpu_chunks), primary._num_chunks
        self.cpu_hits: list[int] = []
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.sched.hash_block_size, sha256)
        self._params = SamplingParams(max_tokens=1)
        self._params.update_from_generation_config({}, 2)
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.skipped = 0
        self._n = 0

    def _worker_output(self, out: Any) -> Any:
        """The worker side of a step, with every transfer done at once: each load and store
        job the connector scheduled is reported complete (and a load's request as received),
        as the worker-role connector reports them (``get_finished``,
        ``build_connector_worker_meta``); ``None`` without the connector."""
        if self.offload is None:
            return None
        md = out.kv_connector_metadata
        done: dict[int, int] = {}
        recv: set[str] = set()
        if md is not None:
            for jid, job in md.load_jobs.items():
                done[jid] = 1
                recv.add(job.req_id)
            done.update((jid, 1) for jid in md.store_jobs)
        return self._ConnectorOutput(finished_sending=set(), finished_recving=recv,
                                     kv_connector_worker_meta=self._WorkerMeta(
                                         completed_jobs=done))

    def _idle_step(self) -> None:
        """Steps with nothing to run: the connector builds the finished request's last store
        jobs and tells its manager the request finished (the LRU commits its recency); with
        a disk tier, until its writes have landed (the next request comes after them)."""
        deadline = time.monotonic() + 60
        while True:
            out = self.sched.schedule()
            self.sched.update_from_output(out, self._Output(
                req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None,
                kv_connector_output=self._worker_output(out)))
            if not self.offload.has_pending_work() or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _deferred(self, rid: str) -> bool:
        """The connector deferred the request's lookup (a disk-tier lookup or promotion is
        under way): it is scheduled once they complete."""
        if self.offload is None:
            return False
        st = self._connector._req_status.get(rid)
        return st is not None and (st.deferred_lookup_start_time is not None
                                   or self.offload.has_pending_work())

    def serve(self, tokens: np.ndarray) -> int:
        """One request (prefill and its one output token): its hit, in tokens (with the
        offloading connector: the GPU hit plus what it loads from the CPU tier, that part
        appended to :attr:`cpu_hits`)."""
        self._n += 1
        rid = str(self._n)
        req = self._Request(request_id=rid, prompt_token_ids=tokens.tolist(),
                            sampling_params=self._params, pooling_params=None,
                            block_hasher=self._hasher)
        local = hit = self.manager.get_computed_blocks(req)[1]    # the GPU prefix hit
        self.sched.add_request(req)
        first = True
        waited = 0
        deadline = time.monotonic() + 60
        while self.sched.requests:
            out = self.sched.schedule()
            kco = self._worker_output(out)
            n = out.num_scheduled_tokens.get(rid, 0)
            loading = req.status == self._Status.WAITING_FOR_REMOTE_KVS and waited < 2
            if n == 0 and first and (loading or (self._deferred(rid)
                                                 and time.monotonic() < deadline)):
                # its CPU hit is loading (done at once: the next step runs it), or a
                # disk-tier lookup / promotion into the CPU tier is under way
                waited += loading
                self.sched.update_from_output(out, self._Output(
                    req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                    prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kco))
                if not loading:
                    time.sleep(0.001)
                continue
            if n == 0:     # more blocks than the pool has: vLLM cannot run it
                self.sched.finish_requests(rid, self._Status.FINISHED_ABORTED)
                if self.offload is not None:
                    self._idle_step()
                self.skipped += 1
                self.cpu_hits.append(0)
                return hit
            if first:
                hit, first = req.num_computed_tokens - n, False
            done = req.num_computed_tokens >= req.num_prompt_tokens
            self.sched.update_from_output(out, self._Output(
                req_ids=[rid], req_id_to_index={rid: 0},
                sampled_token_ids=[[7] if done else []], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kco))
        if self.offload is not None:
            self._idle_step()
        self.cpu_hits.append(max(0, hit - local))
        return hit


def vllm_cache(trace: Trace, cfg: ReplayConfig,
               max_num_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS,
               disk_dir: str | None = None) -> VLLMPrefixCache:
    """vLLM's own cache sized for ``cfg``: its GPU pool gets the one-budget presets' bytes,
    ``budget x footprint x (1 + mamba_ratio)``, in blocks of the model's hybrid page layout
    (:func:`~hybridstore.replay.model_presets.vllm_hybrid_pages`); with ``cfg.host_ratio``
    the offloading connector's CPU tier gets ``host_ratio`` times those bytes
    (``--kv-offloading-size``), in chunks of one block; with ``disk_dir`` as the primary
    of vLLM's ``TieringOffloadingSpec`` with its ``fs`` tier writing there."""
    assert cfg.budget is not None
    model = cfg.full_model()
    pages = vllm_hybrid_pages(model)
    total = cfg.budget * kv_footprint(trace, cfg, model) * (1 + cfg.mamba_ratio)
    cpu = None if not cfg.host_ratio else int(cfg.host_ratio * total // pages.block_bytes)
    return VLLMPrefixCache(max(1, int(total // pages.block_bytes)), pages.block_tokens,
                           pages.mamba_groups, max_num_batched_tokens, cpu_chunks=cpu,
                           disk_dir=disk_dir)


def vllm_run(trace: Trace, cfg: ReplayConfig,
             max_num_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS) -> tuple[list[int], int]:
    """Per-request hits of vLLM's own prefix cache (with ``cfg.host_ratio``: and of its CPU
    offloading tier, :func:`vllm_cache`), in the sequential discipline's order, and the
    number of requests it could not run (more blocks than its pool)."""
    cache = vllm_cache(trace, cfg, max_num_batched_tokens)
    order = merged_requests(trace)
    if cfg.max_requests is not None:
        order = order[:cfg.max_requests]
    tokens = {s.id: session_tokens(s) for s in trace.sessions}
    return [cache.serve(next(tokens[r.session])) for r in order], cache.skipped


ENGINES = {"sglang": ("sglang_radix_cache", "SGLang UnifiedRadixCache"),
           "vllm": ("vllm_prefix_cache", "vLLM KVCacheManager")}
"""Engines whose own cache the presets are calibrated against: the row key of its hit rate
and its label."""

DEFAULT_VLLM_PRESETS = ("vllm-marconi",)


DEFAULT_VLLM_CPU_PRESETS = ("vllm-cpu", "vllm-marconi")
DEFAULT_VLLM_DISK_PRESETS = ("vllm-disk", "vllm-cpu")
"""With ``--offload-cpu``: the preset that follows vLLM's CPU offloading, and the GPU-only
one for contrast."""


def engine_run(engine: str, trace: Trace, cfg: ReplayConfig,
               sglang_mode: str = "no_buffer") -> tuple[list[int], int, list[int] | None]:
    """Per-request hits of ``engine``'s own cache, the requests it could not hold
    (``sglang_mode``: SGLang's Mamba strategy, :class:`SGLangRadixCache`), and with vLLM's
    CPU offloading (``cfg.host_ratio``) the part of each hit its CPU tier restored."""
    if engine == "sglang":
        return (*sglang_run(trace, cfg, sglang_mode), None)
    if engine == "vllm":
        import tempfile

        order = merged_requests(trace)
        if cfg.max_requests is not None:
            order = order[:cfg.max_requests]
        tokens = {s.id: session_tokens(s) for s in trace.sessions}
        with tempfile.TemporaryDirectory(prefix="calibrate-fs-") as tmp:
            cache = vllm_cache(trace, cfg, disk_dir=tmp if cfg.disk_ratio else None)
            hits = [cache.serve(next(tokens[r.session])) for r in order]
            if cache.offload is not None:
                cache.offload.shutdown()
        return hits, cache.skipped, (cache.cpu_hits if cache.offload is not None else None)
    raise ConfigError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")


def calibrate(trace: Trace, budgets: Sequence[float], presets: Sequence[str] = DEFAULT_PRESETS,
              *, max_requests: int | None = None, mamba_ratio: float = 0.9,
              pools: str = "preset", engine: str = "sglang",
              sglang_mode: str = "no_buffer", host_ratio: float | None = None,
              disk: bool = False) -> dict[str, Any]:
    """Token hit rates of an engine's own cache and of each preset at each budget (sequential).

    Each row has the hit rates (``sglang_radix_cache`` or ``vllm_prefix_cache``, and one
    per preset), and per preset ``diverging``: the requests whose hit differs from the
    engine's by a block or more, and ``refused``: requests the engine or the preset could
    not hold (longer than the KV pool).  With ``host_ratio`` (vLLM only) the engine runs
    its CPU offloading connector with a CPU tier of ``host_ratio`` x the GPU pool, the
    presets a host tier of as much (``ReplayConfig.host_ratio``), and each row also has
    ``cpu_hit_rate``: the tokens of vLLM's hits its CPU tier restored, per input token.
    With ``disk`` as well, vLLM's CPU tier is the primary of its ``TieringOffloadingSpec``
    with the ``fs`` tier (no capacity: it never evicts) in a temporary directory, and the
    presets get a disk tier without a limit (``ReplayConfig.disk_ratio = inf``).
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    if disk and host_ratio is None:
        raise ConfigError("disk (--offload-disk) needs host_ratio (--offload-cpu): vLLM's "
                          "fs tier sits behind its CPU tier")
    if host_ratio is not None and engine != "vllm":
        raise ConfigError("host_ratio (--offload-cpu) drives vLLM's offloading connector: "
                          "use it with engine='vllm'")
    col = ENGINES[engine][0]
    rows = []
    for budget in budgets:
        cfg = ReplayConfig(discipline="sequential", budget=budget, max_requests=max_requests,
                           mamba_ratio=mamba_ratio, pools=pools, host_ratio=host_ratio,
                           disk_ratio=math.inf if disk else None)
        t0 = time.perf_counter()
        hits, skipped, cpu = engine_run(engine, trace, cfg, sglang_mode)
        runs = replay(trace, list(presets), cfg, progress=False)
        inp = sum(r.input_tokens for r in next(iter(runs.values())).results)
        row: dict[str, Any] = {"budget": budget, col: sum(hits) / inp}
        if cpu is not None:
            row["cpu_hit_rate"] = sum(cpu) / inp
        diverging: dict[str, int] = {}
        refused: dict[str, int] = {col: skipped}
        for name, run in runs.items():
            row[name] = run.summary()["token_hit_rate"]
            diverging[name] = sum(abs(r.hit_tokens - h) >= trace.block_size
                                  for r, h in zip(run.results, hits))
            refused[name] = run.refused
        row["diverging"], row["refused"] = diverging, refused
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return {"trace": trace.name, "requests": max_requests or trace.n_requests,
            "discipline": "sequential", "mamba_ratio": mamba_ratio, "pools": pools,
            "engine": engine, "sglang_mode": sglang_mode, "host_ratio": host_ratio,
            "disk": disk, "rows": rows}


def _rate_columns(doc: dict[str, Any]) -> list[str]:
    row = doc["rows"][0]
    return [k for k, v in row.items() if isinstance(v, float) and k not in ("budget", "seconds")]


def print_calibration(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = _rate_columns(doc)
    engine = ENGINES[doc.get("engine", "sglang")][1].split()[0]
    table = Table(title=f"token hit rate, {doc['trace']} ({doc['requests']} requests, "
                        f"sequential, pools {doc.get('pools', 'preset')}"
                        + (f", SGLang {doc.get('sglang_mode', 'no_buffer')}" if engine == "SGLang" else "")
                        + (f", CPU offloading {doc['host_ratio']:g}x the GPU pool"
                           if doc.get("host_ratio") else "")
                        + (" + vLLM's fs tier" if doc.get("disk") else "")
                        + f"; in brackets: requests whose hit differs from {engine}'s by a block "
                        "or more)")
    table.add_column("budget")
    for c in cols:
        table.add_column(c, justify="right")
    for row in doc["rows"]:
        cells = [f"{row[c]:.3f}" + (f" ({row['diverging'][c]})" if c in row.get("diverging", {})
                                    else "") for c in cols]
        table.add_row(f"{row['budget']:.0%}", *cells)
    Console(width=max(100, 24 * (len(cols) + 1))).print(table)


def plot_calibration(doc: dict[str, Any], path: str) -> None:
    """Token hit rate against budget: the engine's own cache and every preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [100 * r["budget"] for r in doc["rows"]]
    col, label = ENGINES[doc.get("engine", "sglang")]
    if doc.get("host_ratio"):
        label += (f" + CPU offloading {doc['host_ratio']:g}x"
                  + (" + fs tier" if doc.get("disk") else ""))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for c in _rate_columns(doc):
        own = c == col
        if c == "cpu_hit_rate":     # the part of vLLM's hits its CPU tier restored
            ax.plot(budgets, [r[c] for r in doc["rows"]], marker=".", color="gray",
                    linestyle=":", label="vLLM: of which restored from its CPU tier")
            continue
        ax.plot(budgets, [r[c] for r in doc["rows"]], marker="o",
                label=f"{label} (its own code)" if own else c,
                color="black" if own else None, linewidth=2.5 if own else 1.5,
                linestyle="--" if own else "-", zorder=3 if own else 2)
    ax.set_xlabel("budget (% of the KV footprint; + Mamba pool x mamba_ratio)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{doc['trace']}: {doc['requests']} requests, sequential, "
                 f"pools {doc.get('pools', 'preset')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_calibration(*, trace_spec: str | None, budgets: Sequence[float],
                    presets: Sequence[str], max_requests: int | None,
                    json_path: str | None, plot_path: str | None = None,
                    pools: str = "preset", engine: str = "sglang",
                    sglang_mode: str = "no_buffer",
                    host_ratio: float | None = None, disk: bool = False) -> dict[str, Any]:
    from hybridstore.replay.loaders import load
    from hybridstore.replay.samples import weka_sample

    doc = calibrate(load(trace_spec or str(weka_sample())), budgets, presets,
                    max_requests=max_requests, pools=pools, engine=engine,
                    sglang_mode=sglang_mode, host_ratio=host_ratio, disk=disk)
    print_calibration(doc)
    print(json.dumps(doc, indent=2))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(doc, fh, indent=2)
    if plot_path:
        plot_calibration(doc, plot_path)
    return doc
