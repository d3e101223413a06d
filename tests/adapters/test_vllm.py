"""hybridstore as vLLM 0.33's KV offloading medium, driven through vLLM's own code.

Every test runs vLLM's real ``Scheduler`` (scheduler-role ``OffloadingConnector``
-> ``HybridStoreSpec.get_manager``) and a worker-role ``OffloadingConnector``
(``register_kv_caches`` -> ``HybridStoreSpec.get_worker``) over CPU tensors
standing in for the GPU KV cache (``vllm_harness.py``).  "GPU" blocks are filled
with random bytes before request A stores them and zeroed before request B
loads, so equal bytes after B's load can only have come back through
hybridstore: worker -> staging -> store (host pool / disk) -> staging -> worker.

What is asserted:

* full attention, and hybrid (one or two ``MambaSpec`` groups,
  ``mamba_cache_mode="align"``): B (A's prompt + 2 tokens) after
  ``reset_prefix_cache()`` loads A's 4 chunks (and each group's Mamba state at 64,
  one store checkpoint) bit-exact;
* a second engine over the same ``disk_path``, after the first shut down, hits
  what the first stored (read back from the disk tier) and loads it bit-exact;
* a budget of a few pages gives misses, never a failed job (vLLM asserts every
  job's success) nor wrong bytes;
* ``TieringOffloadingSpec`` with ``HybridStoreTier`` as the secondary tier:
  A's chunks cascade into hybridstore; after vLLM's primary tier evicted them,
  B's hit is a promotion from hybridstore, bit-exact;
* models the adapter cannot map get a typed error at init.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from hybridstore.errors import ConfigError, UnsupportedModelError
from tests.adapters.vllm_harness import BLOCK, Engine, Run

CHUNKS = 4
PROMPT = list(range(1, 1 + CHUNKS * BLOCK + 5))   # 4 whole chunks + 5 tokens


def extra(tmp_path, **changes):
    cfg = {"spec_name": "HybridStoreSpec", "spec_module_path": "hybridstore.adapters.vllm",
           "block_size": BLOCK, "disk_path": str(tmp_path / "hs"), "disk_engine": "posix",
           "host_bytes": 1 << 20, "disk_bytes": 64 << 20, "staging_bytes": 256 << 10,
           "staging_dir": str(tmp_path)}
    cfg.update(changes)
    return cfg


def loaded_equal(engine: Engine, snap, a: Run, b: Run, *, chunks: int = CHUNKS,
                 hybrid: int = 0) -> list[bool]:
    """Per loaded object: are B's blocks (after its load) A's blocks (when A stored them)?
    Pages of the attention group (layer0), then each Mamba group's state at the last
    chunk boundary (layer1, layer2, ...)."""
    same = []
    for i in range(chunks):
        same.append(torch.equal(snap["layer0"][a.block(0, i)], engine.kv["layer0"][b.block(0, i)]))
    for g in range(1, 1 + int(hybrid)):
        i = chunks - 1
        ln = f"layer{g}"
        same.append(torch.equal(snap[ln][a.block(g, i)], engine.kv[ln][b.block(g, i)]))
    return same


def store_a(engine: Engine, seed: int, tokens=PROMPT):
    engine.fill_random(seed)
    a = engine.run(f"A{seed}", tokens)
    engine.settle()
    return a, engine.snapshot()


def load_b(engine: Engine, seed: int, tokens=PROMPT) -> Run:
    engine.sched.reset_prefix_cache()
    engine.zero()
    return engine.run(f"B{seed}", tokens + [999, 998])


@pytest.mark.parametrize("hybrid", [0, 1, 2],
                         ids=["full-attention", "hybrid-mamba", "two-mamba-groups"])
def test_store_drop_load_bit_exact(tmp_path, hybrid):
    engine = Engine(extra(tmp_path), hybrid=hybrid)
    try:
        a, snap = store_a(engine, 1)
        store = engine.manager.store
        assert store.stats()["pages"] == CHUNKS
        assert store.stats()["checkpoints"] == (1 if hybrid else 0)   # all groups' states: one
        b = load_b(engine, 1)
        assert all(loaded_equal(engine, snap, a, b, hybrid=hybrid))
        assert engine.manager.counters["loaded_keys"] == CHUNKS + hybrid
        assert b.req.num_computed_tokens >= CHUNKS * BLOCK
        engine.settle()
        engine.sched.reset_prefix_cache(reset_connector=True)   # OffloadingManager.reset_cache
        assert store.stats()["pages"] == 0 and store.stats()["checkpoints"] == 0
    finally:
        engine.shutdown()


def test_restart_hits_what_the_first_engine_stored(tmp_path):
    first = Engine(extra(tmp_path), hybrid=1)
    try:
        a, snap = store_a(first, 2)
    finally:
        first.shutdown()
    second = Engine(extra(tmp_path), hybrid=1)
    try:
        assert second.config.kv_transfer_config.engine_id != first.config.kv_transfer_config.engine_id
        b = load_b(second, 2)
        assert all(loaded_equal(second, snap, a, b, hybrid=1))
        stats = second.manager.store.stats()
        assert stats["loaded_bytes"].get("disk", 0) > 0      # the new host pool was empty
    finally:
        second.shutdown()


def test_small_budget_misses_never_fails(tmp_path):
    # room for about one prompt in DRAM and one on disk (5 objects, 4 KiB of pool each)
    engine = Engine(extra(tmp_path, host_bytes=24 << 10, disk_bytes=24 << 10,
                          tier_policy="write-back"), hybrid=1, num_blocks=128)
    try:
        stored = []
        for seed in range(4):
            tokens = [seed * 1000 + t for t in PROMPT]
            stored.append((tokens, *store_a(engine, 10 + seed, tokens)))
        hits = 0
        for seed, (tokens, a, snap) in reversed(list(enumerate(stored))):  # newest first
            engine.sched.reset_prefix_cache()
            engine.zero()
            before = engine.manager.counters["loaded_keys"]
            b = engine.run(f"B{seed}", tokens + [999, 998])  # vLLM asserts every job succeeded
            n = engine.manager.counters["loaded_keys"] - before
            if n:
                assert n == CHUNKS + 1       # a resume point is whole: 4 pages + the state
                assert all(loaded_equal(engine, snap, a, b, hybrid=1))
            hits += n > 0
            engine.settle()
        assert 0 < hits < 4
    finally:
        engine.shutdown()


def test_small_staging_loads_what_fits(tmp_path):
    # 6 staging slots: a load may take 3, so B loads the first 3 chunks and recomputes one
    engine = Engine(extra(tmp_path, staging_bytes=6 * 4096))
    try:
        assert engine.manager._region.nslots == 6
        a, snap = store_a(engine, 4)
        b = load_b(engine, 4)
        assert engine.manager.counters["loaded_keys"] == 3
        assert all(loaded_equal(engine, snap, a, b, chunks=3))
    finally:
        engine.shutdown()


def test_concurrent_prompts_sent_again_at_once_hit_every_block(tmp_path):
    """Issue 26 §2: two prompts at once through a small staging region (8 slots: stores
    stage 4 keys at a time, loads take at most 4), sent again at once after they finished:
    every block of both is a hit, bit-exact.  vLLM never offers again a chunk the manager
    left out of ``keys_to_store`` (so a store is all or nothing, offered again while the
    request runs), and a held key whose load must wait for another request's slots is a
    RETRY, not a MISS that vLLM would recompute."""
    engine = Engine(extra(tmp_path, staging_bytes=8 * 4096), num_blocks=128, forward_waits=True)
    try:
        assert engine.manager._region.nslots == 8
        prompts = {f"A{j}": [1000 * (j + 1) + t for t in PROMPT] for j in range(2)}
        engine.fill_random(6)
        first = engine.run_all(prompts, decode=4)   # A1 is stored once A0's put is done
        snap = engine.snapshot()
        engine.sched.reset_prefix_cache()
        engine.zero()
        again = engine.run_all({f"B{j}": prompts[f"A{j}"] + [999, 998] for j in range(2)},
                               decode=4)
        assert [again[f"B{j}"].hit for j in range(2)] == [CHUNKS * BLOCK] * 2
        for j in range(2):
            assert all(loaded_equal(engine, snap, first[f"A{j}"], again[f"B{j}"]))
        engine.settle()
    finally:
        engine.shutdown()


def tier_extra(tmp_path, **changes):
    cfg = {"spec_name": "TieringCPUSpec", "spec_module_path": "tests.adapters.vllm_harness",
           "block_size": BLOCK, "cpu_bytes_to_use": 6 * 4096,        # 6 primary chunks
           "secondary_tiers": [{"type": "HybridStoreTier",
                                "module_path": "hybridstore.adapters.vllm",
                                "disk_path": str(tmp_path / "tier"), "disk_engine": "posix",
                                "host_bytes": 1 << 20, "disk_bytes": 64 << 20}]}
    cfg.update(changes)
    return cfg


def test_tiering_cascade_then_promotion(tmp_path):
    from hybridstore.adapters.vllm import HybridStoreTier

    engine = Engine(tier_extra(tmp_path), num_blocks=128)
    try:
        (tier,) = engine.manager.secondary_tiers     # vLLM's TieringOffloadingManager
        assert isinstance(tier, HybridStoreTier)
        busy = tier.has_pending_work
        engine.fill_random(3)
        a = engine.run("A", PROMPT)
        engine.settle(busy)
        snap = engine.snapshot()
        assert tier.store.stats()["pages"] == CHUNKS          # the cascade reached hybridstore
        for k in range(2):   # two other prompts push A out of the 6-chunk primary tier
            engine.run(f"C{k}", [50_000 + 100 * k + t for t in PROMPT])
            engine.settle(busy)
        b = load_b(engine, 3)
        assert all(loaded_equal(engine, snap, a, b))
        assert tier.store.stats()["loads"] > 0                # promoted from hybridstore
    finally:
        engine.shutdown()


def group(tokens: int, layer: str, gid: int, window: int | None = None):
    """vLLM's ``OffloadingGroupConfig`` (0.32's has no window: the spec reads it from the
    ``KVCacheConfig``, see :func:`kv_cache_config`)."""
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    has = "sliding_window_size_in_chunks" in {f.name for f in
                                               dataclasses.fields(OffloadingGroupConfig)}
    return OffloadingGroupConfig(tokens_per_block=tokens, layer_names=(layer,), group_id=gid,
                                 **({"sliding_window_size_in_chunks": window} if has else {}))


def kv_cache_config(windows: list[int | None]):
    """A ``KVCacheConfig`` of full-attention (None) and Mamba (1) groups, 16-token blocks."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    groups = [KVCacheGroupSpec([f"layer{g}"], FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16) if w is None else
        MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,),
                  mamba_cache_mode="align")) for g, w in enumerate(windows)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_unsupported_layouts_fail_at_init(tmp_path):
    from hybridstore.adapters.vllm import GroupPlan
    full, mamba, mamba3 = group(16, "a", 0), group(16, "m", 1, 1), group(16, "m3", 3, 1)
    swa = group(16, "s", 2, 4)
    plan = GroupPlan.of((full, mamba, mamba3), 1, (None, 1, 1))
    assert plan.page_group == 0 and plan.state_groups == (1, 2)
    with pytest.raises(UnsupportedModelError, match="sliding window of 4 chunks"):
        GroupPlan.of((full, swa), 1, (None, 4))
    with pytest.raises(UnsupportedModelError, match="exactly one full-attention"):
        GroupPlan.of((full, group(16, "b", 1)), 1, (None, None))
    with pytest.raises(UnsupportedModelError, match="exactly one full-attention"):
        GroupPlan.of((mamba,), 1, (1,))
    cfg = extra(tmp_path)
    del cfg["disk_path"]
    with pytest.raises(ConfigError, match="disk_path"):
        Engine(cfg)


def test_group_windows_on_every_vllm(tmp_path):
    """0.33+ say each group's window; 0.32 does not, and the windows come from the
    ``KVCacheConfig`` HybridStoreConnector hands over, through vLLM's own function."""
    from hybridstore.adapters.vllm.compat import group_windows, specs_see

    groups = (group(16, "layer0", 0), group(16, "layer1", 1, 1))
    with specs_see(kv_cache_config([None, 1])):
        assert group_windows(groups, 1) == (None, 1)
    if not hasattr(groups[0], "sliding_window_size_in_chunks"):     # vLLM 0.32
        with pytest.raises(UnsupportedModelError, match="HybridStoreConnector"):
            group_windows(groups, 1)
        assert group_windows(groups[:1], 1) == (None,)    # one group: full attention


def test_a_vllm_without_the_interface_is_a_config_error(monkeypatch):
    """0.30 and older lack what the adapter calls (``ReqContext.get_offload_key_position``;
    0.28 also ``iter_layer_specs``): the import says so, naming it. This vLLM has it all."""
    from vllm.v1.kv_offload import base

    from hybridstore.adapters.vllm import compat

    assert compat.missing_interface() == []
    compat.check_vllm()
    monkeypatch.delattr(base.ReqContext, "get_offload_key_position")
    assert compat.missing_interface() == [
        "vllm.v1.kv_offload.base.ReqContext.get_offload_key_position"]
    with pytest.raises(ConfigError, match="0.31 to 0.34.*get_offload_key_position"):
        compat.check_vllm()


def test_unknown_extra_config_keys_are_rejected(tmp_path):
    """A misspelt key must not leave a setting at its default silently (issue 26 §3)."""
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['disk_byte'\]"):
        Engine(extra(tmp_path, disk_byte=1 << 20))
    with pytest.raises(ConfigError, match="locality must be"):
        Engine(extra(tmp_path, locality="MARS"))
    engine = Engine(extra(tmp_path, locality="REMOTE", enable_kv_events=True,
                          offload_prompt_only=True))          # vLLM's keys are fine
    try:
        assert engine.manager._locality.value == "REMOTE"
    finally:
        engine.shutdown()


def direct_config(tmp_path, rank: int, world: int, **changes):
    """An ``OffloadingConfig`` as vLLM's ``build_offloading_config`` makes it: full
    attention (1024 B pages) + Mamba (576 B), 16-token blocks, 8 tokens per hash."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    model = {f.name for f in dataclasses.fields(OffloadingModelConfig)}
    return OffloadingConfig(
        groups=(group(16, "layer0", 0), group(16, "layer1", 1, 1)),
        worker_kv_bytes_per_block=1024 + 576, enable_kv_cache_events=True,
        extra_config=extra(tmp_path, **changes), engine_id=f"direct{world}",
        model=OffloadingModelConfig("tiny", "float16",
                                    **({"max_model_len": 1024} if "max_model_len" in model
                                       else {})),
        cache=OffloadingCacheConfig(tokens_per_hash=8, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank, world, world, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="LBNHC")


def direct_spec(tmp_path, rank: int, world: int, **changes):
    """``HybridStoreSpec`` of :func:`direct_config`, built as HybridStoreConnector builds it."""
    from hybridstore.adapters.vllm import HybridStoreSpec
    from hybridstore.adapters.vllm.compat import specs_see

    with specs_see(kv_cache_config([None, 1])):
        return HybridStoreSpec(direct_config(tmp_path, rank, world, **changes))


def direct_worker(tmp_path, rank: int, world: int, kv):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(0, 1024)], [CanonicalKVCacheRef(1, 576)]])
    worker = direct_spec(tmp_path, rank, world).get_worker(caches)
    worker.test_caches = caches
    return worker


def as_vllm_hands_it(worker, args: tuple) -> tuple:
    """A job's arguments as this vLLM's worker connector passes them: the
    ``GPULoadStoreSpec`` (0.32, 0.33) or the ``DevicePointers`` vLLM 0.34 resolves from it
    against the worker's KV caches (``pointer_utils.resolve_device_pointers``)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:
        return args
    return tuple(resolve_device_pointers(a, worker.test_caches)
                 if isinstance(a, GPULoadStoreSpec) else a for a in args)


class Direct:
    """A manager and ``world`` workers of one HybridStoreSpec, called the way vLLM's
    connector calls them (``offloading/scheduler.py``, ``offloading/worker.py``) without
    the Scheduler: for what the CPU harness cannot make vLLM do (several ranks, partial
    tails, a worker in another process)."""

    def __init__(self, tmp_path, world: int, workers: list | None = None, **changes) -> None:
        gen = torch.Generator().manual_seed(world)
        self.kv = [[torch.randint(-128, 128, (16, n), dtype=torch.int8, generator=gen)
                    for n in (1024, 576)] for _ in range(world)]
        self.saved = [[t.clone() for t in rank] for rank in self.kv]
        self.workers = workers if workers is not None else [
            direct_worker(tmp_path, r, world, self.kv[r]) for r in range(world)]
        self.manager = direct_spec(tmp_path, 0, world, **changes).get_manager()
        self.jobs = 0

    def run(self, submit: str, *args) -> None:
        job, self.jobs = self.jobs, self.jobs + 1
        for w in self.workers:
            own = isinstance(w, RemoteWorker)       # converts in its own process
            assert getattr(w, submit)(job, *(args if own else as_vllm_hands_it(w, args)))
        for w in self.workers:
            w.wait({job})
            assert [r.success for r in w.get_finished()] == [True]

    def store(self, keys, ctx, gpu) -> None:
        out = self.manager.prepare_store(keys, ctx)
        assert out.keys_to_store == keys
        self.run("submit_store", gpu, out.store_spec)
        self.manager.complete_store(keys, ctx)

    def load(self, keys, ctx, gpu) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        assert [self.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * len(keys)
        src = self.manager.prepare_load(keys, ctx)
        self.run("submit_load", src, gpu)
        self.manager.complete_load(keys, ctx)

    def stored_request(self, hints=None) -> tuple[list, object, dict]:
        """Request ``A``: CHUNKS pages and the Mamba state at their end, stored and
        flushed; returns ``(page keys, state key, key positions)``. ``hints``: its
        ``ReqContext.kv_hints``."""
        import os

        from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key

        hashes = [os.urandom(32) for _ in range(CHUNKS)]
        pages = [make_offload_key(h, 0) for h in hashes]
        state = make_offload_key(hashes[-1], 1)
        positions = {**{k: (i + 1) * 16 for i, k in enumerate(pages)}, state: CHUNKS * 16}
        ctx = context("A", positions, hints)
        self.manager.on_new_request(ctx)
        self.store(pages, ctx, GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0],
                                                block_indices=[0, 0]))
        self.store([state], ctx, GPULoadStoreSpec([5], group_sizes=[0, 1], block_indices=[0, 3]))
        self.manager.on_request_finished(ctx)
        assert self.manager.flush()
        return pages, state, positions

    def zero(self) -> None:
        for rank in self.kv:
            for t in rank:
                t.zero_()

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()


def context(req_id: str, positions, hints=None):
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id, kv_hints=hints)
    for key, p in positions.items():
        ctx.set_offload_key_position(key, p)
    return ctx


def test_two_workers_share_one_store_object(tmp_path):
    """Two worker ranks (as with TP=2) and one manager: each rank's shard goes to its part
    of the staging slot, one store object holds both, each rank gets its own bytes back."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult

    d = Direct(tmp_path, world=2)
    try:
        pages, state, positions = d.stored_request()
        stats = d.manager.store.stats()
        assert stats["pages"] == CHUNKS and stats["checkpoints"] == 1
        events = list(d.manager.take_events())
        assert sorted(k for e in events for k in e.keys) == sorted(pages + [state])
        d.zero()
        ctx = context("B", positions)
        d.manager.on_new_request(ctx)
        d.load(pages + [state], ctx,
               GPULoadStoreSpec([7, 6, 8, 9, 10], group_sizes=[4, 1], block_indices=[0, 3]))
        d.manager.on_request_finished(ctx)
        for r in range(2):
            assert torch.equal(d.kv[r][0][[7, 6, 8, 9]], d.saved[r][0][[1, 2, 3, 4]])
            assert torch.equal(d.kv[r][1][10], d.saved[r][1][5])
        assert not torch.equal(d.saved[0][0][1], d.saved[1][0][1])   # the ranks' shards differ
        # chunks 0-1 are GPU prefix-cache hits: vLLM loads chunks 2-3 and the state at 64
        ctx = context("C", positions)
        d.manager.on_new_request(ctx)
        d.load(pages[2:] + [state], ctx,
               GPULoadStoreSpec([11, 12, 13], group_sizes=[2, 1], block_indices=[2, 3]))
        d.manager.on_request_finished(ctx)
        for r in range(2):
            assert torch.equal(d.kv[r][0][[11, 12]], d.saved[r][0][[3, 4]])
            assert torch.equal(d.kv[r][1][13], d.saved[r][1][5])
        # evicted (as under pressure): lookups miss and announce each removal once
        for tier in ("host", "disk"):
            d.manager.store.evict(1 << 40, tier=tier)
        ctx = context("D", positions)
        assert {d.manager.lookup(k, ctx) for k in pages + [state]} == {LookupResult.MISS}
        removed = [k for e in d.manager.take_events() if e.removed for k in e.keys]
        assert sorted(removed) == sorted(pages + [state])
        assert {d.manager.lookup(k, ctx) for k in pages + [state]} == {LookupResult.MISS}
        assert not list(d.manager.take_events())
    finally:
        d.close()


def test_partial_tail(tmp_path):
    """vLLM's partial tail (``supports_partial_tail``: tokens_per_hash 8 < 16-token Mamba
    blocks): ``_build_partial_tail_store_jobs`` stores the attention block and the Mamba
    state at boundary 72 under ``block_hashes[72/8 - 1]`` + group; ``_lookup_partial_tail``
    then loads 4 chunks + the partial block + the state at 72.  In the store: a partial
    page ending at 72 and the checkpoint at 72, beside the one at 64."""
    import os

    from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key

    d = Direct(tmp_path, world=1)
    hashes = [os.urandom(32) for _ in range(CHUNKS)]
    pages = [make_offload_key(h, 0) for h in hashes]
    state64 = make_offload_key(hashes[-1], 1)
    tail = os.urandom(32)
    tail_page, tail_state = make_offload_key(tail, 0), make_offload_key(tail, 1)
    positions = {**{k: (i + 1) * 16 for i, k in enumerate(pages)}, state64: 64,
                 tail_page: 72, tail_state: 72}
    try:
        ctx = context("A", positions)
        d.manager.on_new_request(ctx)
        d.store(pages, ctx, GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0],
                                             block_indices=[0, 0]))
        d.store([state64], ctx, GPULoadStoreSpec([5], group_sizes=[0, 1], block_indices=[0, 3]))
        d.store([tail_page, tail_state], ctx,
                GPULoadStoreSpec([11, 12], group_sizes=[1, 1], block_indices=[4, 4]))
        d.manager.on_request_finished(ctx)
        assert d.manager.flush()
        store = d.manager.store
        prompt = store.engine_prefix([tail_page], prefix=None, length=8)
        assert prompt.length == 72 and store.restorable(prompt) == [64, 72]
        d.zero()
        ctx = context("B", positions)
        d.manager.on_new_request(ctx)
        d.load(pages + [tail_page, tail_state], ctx,
               GPULoadStoreSpec([7, 6, 8, 9, 10, 13], group_sizes=[5, 1], block_indices=[0, 4]))
        d.manager.on_request_finished(ctx)
        assert torch.equal(d.kv[0][0][[7, 6, 8, 9, 10]], d.saved[0][0][[1, 2, 3, 4, 11]])
        assert torch.equal(d.kv[0][1][13], d.saved[0][1][12])
    finally:
        d.close()


def _serve_worker(conn, tmp_path, kv) -> None:
    """A worker process: vLLM's worker-role connector would call these on its worker."""
    worker = direct_worker(tmp_path, 0, 1, kv)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        op, job, args = msg
        getattr(worker, op)(job, *as_vllm_hands_it(worker, args))
        worker.wait({job})
        conn.send([r.success for r in worker.get_finished()])
    worker.shutdown()


class RemoteWorker:
    def __init__(self, conn) -> None:
        self.conn = conn
        self.results: list = []

    def submit_store(self, job, *args) -> bool:
        self.conn.send(("submit_store", job, args))
        return True

    def submit_load(self, job, *args) -> bool:
        self.conn.send(("submit_load", job, args))
        return True

    def wait(self, jobs) -> None:
        from vllm.v1.kv_offload.base import TransferResult

        self.results = [TransferResult(j, ok) for j, ok in zip(jobs, self.conn.recv())]

    def get_finished(self):
        done, self.results = self.results, []
        return done

    def shutdown(self) -> None:
        self.conn.send(None)


def test_worker_in_another_process(tmp_path):
    """The scheduler's manager and a worker in a separate process meet only in the
    staging file (and the store's disk): store, drop, load across the process boundary."""
    import multiprocessing as mp
    import os

    from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key

    kv = [torch.randint(-128, 128, (16, n), dtype=torch.int8).share_memory_() for n in (1024, 576)]
    saved = [t.clone() for t in kv]
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_serve_worker, args=(theirs, tmp_path, kv))
    proc.start()      # before the manager starts its threads
    assert ours.recv() == "ready"
    d = Direct(tmp_path, world=1, workers=[RemoteWorker(ours)])
    hashes = [os.urandom(32) for _ in range(CHUNKS)]
    pages = [make_offload_key(h, 0) for h in hashes]
    state = make_offload_key(hashes[-1], 1)
    positions = {**{k: (i + 1) * 16 for i, k in enumerate(pages)}, state: CHUNKS * 16}
    try:
        ctx = context("A", positions)
        d.store(pages, ctx, GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0],
                                             block_indices=[0, 0]))
        d.store([state], ctx, GPULoadStoreSpec([5], group_sizes=[0, 1], block_indices=[0, 3]))
        d.manager.on_request_finished(ctx)
        assert d.manager.flush()
        for t in kv:
            t.zero_()
        ctx = context("B", positions)
        d.load(pages + [state], ctx,
               GPULoadStoreSpec([7, 6, 8, 9, 10], group_sizes=[4, 1], block_indices=[0, 3]))
        assert torch.equal(kv[0][[7, 6, 8, 9]], saved[0][[1, 2, 3, 4]])
        assert torch.equal(kv[1][10], saved[1][5])
    finally:
        d.close()
        proc.join(30)
    assert proc.exitcode == 0


def test_staging_files_of_killed_engines_are_reclaimed_at_the_next_start(tmp_path):
    """An engine killed before its shutdown leaves its staging file (64-256 MiB of
    /dev/shm by default); the next engine's manager removes it, never a live one's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from hybridstore.adapters.vllm.staging import StagingRegion

    def mapped_by_child(name: str, *, killed: bool) -> subprocess.Popen:
        code = ("import os, signal, sys, time\n"
                "from hybridstore.adapters.vllm.staging import StagingRegion\n"
                f"r = StagingRegion({str(tmp_path / name)!r}, slot_bytes=4096, nslots=8, "
                "world=1, ngroups=1)\n"
                "print('mapped', flush=True)\n"
                + ("os.kill(os.getpid(), signal.SIGKILL)\n" if killed else "time.sleep(120)\n"))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "mapped"
        return proc

    dead = mapped_by_child("hybridstore-vllm-dead.staging", killed=True)
    assert dead.wait(30) == -signal.SIGKILL
    live = mapped_by_child("hybridstore-vllm-live.staging", killed=False)
    unrelated = tmp_path / "other.staging"
    unrelated.write_bytes(b"x")
    try:
        assert (tmp_path / "hybridstore-vllm-dead.staging").exists()
        engine = Engine(extra(tmp_path))
        try:
            names = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".staging")
            own = os.path.basename(engine.manager._region.path)
            assert names == sorted(["hybridstore-vllm-live.staging", own, "other.staging"])
            # a second start reclaims nothing of a running engine
            assert StagingRegion.reclaim(str(tmp_path)) == []
        finally:
            engine.shutdown()
    finally:
        live.kill()
        live.wait(30)
    time.sleep(0.05)
    assert StagingRegion.reclaim(str(tmp_path)) == [str(tmp_path / "hybridstore-vllm-live.staging")]
    assert unrelated.exists()


def test_a_finished_request_is_forgotten_once_its_last_put_is_done(tmp_path):
    """A request whose last put was a state stayed in the manager's table for good (its
    chain of keys too): the state's put now drops it, as a page put does."""
    d = Direct(tmp_path, world=1)
    try:
        d.stored_request()
        assert d.manager._reqs == {}
    finally:
        d.close()


def resume_hint(seconds, version="1"):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="other", action_type="kv.fetch", action_version="1.0",
                     payload={}),                           # another component's: ignored
        KvHintAction(action_id="r", action_type="hybridstore.resume_in",
                     action_version=version, payload={"seconds": seconds})])


@pytest.mark.parametrize("seconds", [None, 30.0])
def test_an_orchestrator_hint_announces_when_the_session_comes_back(tmp_path, seconds):
    """A ``hybridstore.resume_in`` action in the request's ``kv_hints`` (vLLM's
    ``KvHintsEnvelope``): once the request's pages and state are stored, the store expects
    the session back in ``seconds`` on the scheduler's wall clock (``None``: never)."""
    import math
    import time

    d = Direct(tmp_path, world=1, policy="hybridstore")
    try:
        returns = d.manager.store._eviction.returns
        assert returns.clock is time.monotonic
        t0 = time.monotonic()
        d.stored_request(hints=resume_hint(seconds))
        ck = next(iter(d.manager.store.index.checkpoints()))
        due, own = returns.expectation(ck, time.monotonic())
        assert own
        if seconds is None:
            assert due == math.inf
        else:
            assert t0 + seconds <= due <= time.monotonic() + seconds
    finally:
        d.close()


def test_a_finished_request_dates_its_sessions_next_turn(tmp_path):
    """Once a request's stores are done the manager tells the store it finished
    (``HybridStore.finished``): its session's next gap counts from then, on the scheduler's
    wall clock, hint or no hint."""
    import time

    d = Direct(tmp_path, world=1, policy="hybridstore")
    try:
        returns = d.manager.store._eviction.returns
        t0 = time.monotonic()
        d.stored_request()
        ck = next(iter(d.manager.store.index.checkpoints()))
        assert t0 <= returns.since(ck, ck.atime) <= time.monotonic()
        assert t0 <= returns._done[ck.key] <= time.monotonic()
    finally:
        d.close()


@pytest.mark.parametrize("action_version, payload", [
    ("2", {"seconds": 5.0}), ("1", {}), ("1", {"seconds": -1}), ("1", {"seconds": "soon"}),
    ("1", {"seconds": True}), ("1", None)])
def test_a_malformed_resume_hint_is_ignored(tmp_path, action_version, payload, caplog):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from hybridstore.adapters.vllm.hints import resume_in

    env = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="r", action_type="hybridstore.resume_in",
                     action_version=action_version, payload=payload)])
    assert resume_in(env) is None and "ignoring" in caplog.text
    assert resume_in(None) is None and resume_in(resume_hint(2)) == 2.0


def test_a_request_looked_up_again_is_one_use(tmp_path):
    """vLLM looks a waiting request up at every step it tries to schedule it, and matches
    once more when it loads: with ``hybridstore``'s predicted returns each of those was a
    return of the session a step after the last, and its learnt gaps became a step long.
    The manager matches a request's resume point once as a use, the rest ``again``."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ScheduleEndContext

    d = Direct(tmp_path, world=1, policy="hybridstore")
    try:
        store = d.manager.store
        returns = store._eviction.returns
        pages, state, positions = d.stored_request()
        ck = next(iter(store.index.checkpoints()))
        ctx = context("B", positions)
        d.manager.on_new_request(ctx)
        for _ in range(3):        # three steps: looked up, not scheduled (vLLM's RETRY path)
            assert [d.manager.lookup(k, ctx) for k in pages + [state]] == \
                [LookupResult.HIT] * (CHUNKS + 1)
            d.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        d.zero()
        d.load(pages + [state], ctx,
               GPULoadStoreSpec([7, 6, 8, 9, 10], group_sizes=[4, 1], block_indices=[0, 3]))
        d.manager.on_request_finished(ctx)
        assert torch.equal(d.kv[0][1][10], d.saved[0][1][5])      # the state came back
        assert len(returns.gaps(ck)) == 1                         # one return, not five
        assert store.stats()["hit_tokens"] == CHUNKS * 16
    finally:
        d.close()
