"""HybridStoreHiCache driven by SGLang 0.5.23's own HiCache code (``sglang_harness``).

Every engine here is a real ``UnifiedRadixCache`` + ``HybridCacheController`` that loaded
``hybridstore.adapters.sglang.HybridStoreHiCache`` through SGLang's ``dynamic`` storage
backend; bytes are random and compared bit for bit after store -> drop host copy -> load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import threading

import pytest
import torch

if importlib.util.find_spec("sglang") is None:   # not importorskip: sglang/__init__ is skipped
    pytest.skip("SGLang is not installed (pip install --no-deps sglang)", allow_module_level=True)

from hybridstore.adapters.sglang_config import RankIdentity, SGLangSettings
from hybridstore.errors import ConfigError
from tests.adapters.sglang_harness import Engine, Written, build_engine, sgl

PS = 4   # tokens per page


@pytest.fixture(scope="module")
def engine_modules():
    return sgl()   # SGLang's modules, imported once for the whole file


def extra(tmp_path=None, **keys):
    cfg = {"backend_name": "hybridstore", "module_path": "hybridstore.adapters.sglang",
           "class_name": "HybridStoreHiCache", "prefetch_threshold": PS,
           "hicache_storage_pass_prefix_keys": True, "host_bytes": 1 << 22}
    if tmp_path is not None:
        cfg["disk_path"] = str(tmp_path / "hs")
        cfg["disk_bytes"] = 1 << 26
    cfg.update(keys)
    return cfg


def adapter(e: Engine):
    """The HybridStoreHiCache behind the controller (under SGLang's fault injector, if any)."""
    return getattr(e.backend, "_backend", e.backend)


def tokens(gen: torch.Generator, pages: int) -> list[int]:
    return torch.randint(0, 1 << 20, (pages * PS,), generator=gen).tolist()


def assert_hit_exact(r: dict, w: Written, *, full: bool = True) -> int:
    """Every page the prefetch brought to host equals what was written; returns the hit pages."""
    n = r["host_hit"] // PS
    assert len(r["pages"]) == n <= len(w.pages)
    for got, want in zip(r["pages"], w.pages):
        assert torch.equal(got, want)
    if full:
        assert n == len(w.pages)
    return n


@pytest.fixture
def built(engine_modules):
    engines: list[Engine] = []

    def build(cfg, **kw) -> Engine:
        e = build_engine(cfg, page_size=PS, **kw)
        engines.append(e)
        return e

    yield build
    for e in engines:
        e.close()


# -- the round trip through SGLang's own write_storage / prefetch_from_storage ---------------

@pytest.mark.parametrize(("mamba", "layout"), [
    (False, "page_first_direct"), (False, "page_first"), (False, "layer_first"),
    (True, "page_first_direct"), (True, "page_first")])
@pytest.mark.parametrize("v1", [False, True], ids=["legacy", "interface_v1"])
def test_store_drop_load_is_bit_exact(built, tmp_path, mamba, layout, v1):
    e = built(extra(tmp_path, interface_v1=int(v1)), mamba=mamba, layout=layout)
    a = adapter(e)
    assert type(a).__name__ == "HybridStoreHiCache"
    assert a._kv.mode == ("copy" if layout == "layer_first" else "halves")
    assert e.controller.page_set_func.__name__ == ("_page_set_zero_copy" if v1 else "_generic_page_set")
    gen = torch.Generator().manual_seed(7)
    toks = tokens(gen, 6)
    first = e.write(toks[:3 * PS], gen, prefix_keys=[])               # a node of 3 pages ...
    second = e.write(toks[3 * PS:], gen, prefix_keys=first.hashes,      # ... and its child
                     last_hash=first.hashes[-1])
    assert first.completed_tokens == second.completed_tokens == 3 * PS
    r = e.prefetch(toks)
    assert r["done"] and r["loaded"] == 6 * PS
    both = Written(toks, first.hashes + second.hashes, first.pages + second.pages, second.state)
    assert_hit_exact(r, both)
    if mamba:
        assert r["mamba_hit"] == 1 and torch.equal(r["state"], second.state)
    stats = a.store_stats()
    assert stats["pages_stored"] == 6 and stats["pages_loaded"] == 6 and stats["errors"] == 0
    assert stats["states_stored"] == (2 if mamba else 0)


def test_a_second_engine_over_the_same_disk_path_hits_what_the_first_stored(built, tmp_path):
    cfg = extra(tmp_path, interface_v1=1)
    e1 = built(cfg, mamba=True)
    gen = torch.Generator().manual_seed(11)
    toks = tokens(gen, 5)
    w = e1.write(toks, gen, prefix_keys=[])
    assert w.completed_tokens == 5 * PS
    e1.close()                                   # SGLang's detach: the adapter's close()
    e2 = built(cfg, mamba=True)
    assert adapter(e2).store.stats()["pages"] == 5
    r = e2.prefetch(toks)
    assert_hit_exact(r, w)
    assert r["mamba_hit"] == 1 and torch.equal(r["state"], w.state)
    assert adapter(e2).store_stats()["store"]["tiers"]["disk"]["bytes_read"] > 0


@pytest.mark.parametrize(("mamba", "layout"), [(True, "page_first_direct"), (False, "layer_first")])
def test_legacy_and_interface_v1_store_the_same_objects(built, tmp_path, mamba, layout):
    gen = torch.Generator().manual_seed(12)
    toks = tokens(gen, 4)
    e1 = built(extra(tmp_path), mamba=mamba, layout=layout)                 # legacy writes ...
    w = e1.write(toks, gen, prefix_keys=[])
    e1.close()
    e2 = built(extra(tmp_path, interface_v1=1), mamba=mamba, layout=layout)  # ... v1 reads
    r = e2.prefetch(toks)
    assert_hit_exact(r, w)
    if mamba:
        assert torch.equal(r["state"], w.state)


def test_a_small_budget_evicts_into_misses_never_errors_or_wrong_bytes(built):
    # DRAM only, room for about 3 of the 12 sequences (pages + their state)
    e = built(extra(host_bytes=64 << 10, interface_v1=1), mamba=True)
    gen = torch.Generator().manual_seed(13)
    written = []
    for _ in range(12):
        toks = tokens(gen, 4)
        written.append(e.write(toks, gen, prefix_keys=[]))
    hits = 0
    for w in written:
        r = e.prefetch(w.tokens)
        assert r["done"]
        n = assert_hit_exact(r, w, full=False)
        assert n in (0, 4)                       # a Mamba prefix resumes only where its state is
        if n:
            hits += 1
            assert torch.equal(r["state"], w.state)
    a = adapter(e)
    assert 0 < hits < len(written)
    assert a.store.stats()["evictions"] > 0 and a.store_stats()["errors"] == 0


@pytest.mark.parametrize(("policy", "checkpoint_policy", "tier_policy"), [
    ("histate", "keep-all", "asymmetric"), ("hybridstore", "keep-all", "asymmetric"),
    ("flashstates", "flashstates", "write-through"),
    ("marconi", "keep-all", "partition"), ("lru-refresh", "keep-all", "write-back")])
def test_hybridstore_policies_apply_through_sglang(built, tmp_path, policy, checkpoint_policy,
                                                   tier_policy):
    # a DRAM tier for ~3 of 8 prompts over an SSD tier for all: DRAM evicts, SSD serves
    e = built(extra(tmp_path, interface_v1=1, host_bytes=64 << 10, policy=policy,
                    checkpoint_policy=checkpoint_policy, tier_policy=tier_policy), mamba=True)
    gen = torch.Generator().manual_seed(14)
    written = [e.write(tokens(gen, 4), gen, prefix_keys=[]) for _ in range(8)]
    for w in written:
        r = e.prefetch(w.tokens)
        assert_hit_exact(r, w)
        assert torch.equal(r["state"], w.state)
    stats = adapter(e).store.stats()
    assert stats["evictions"] > 0 and stats["tiers"]["disk"]["bytes_read"] > 0


def test_restorable_prefix_pages_are_the_page_ends_with_a_state(built, engine_modules):
    hs = engine_modules.hs
    e = built(extra(interface_v1=1), mamba=True)
    a = adapter(e)
    gen = torch.Generator().manual_seed(17)
    toks = tokens(gen, 8)
    first = e.write(toks[:4 * PS], gen, prefix_keys=[])                 # state at page 4
    second = e.write(toks[4 * PS:], gen, prefix_keys=first.hashes,      # state at page 8
                     last_hash=first.hashes[-1])
    keys = first.hashes + second.hashes
    placeholder = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                                   hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]

    def query(ks, prefix):
        return a.batch_exists_v2(ks, placeholder, hs.HiCacheStorageExtraInfo(prefix_keys=prefix))

    held = [p // PS for p in a.store.restorable(a.store.engine_prefix(keys))]
    assert held == [4, 8]
    res = query(keys, [])
    assert res.restorable_prefix_pages == held and res.kv_hit_pages == 8
    assert res.extra_pool_hit_pages[hs.PoolName.KV] == 8
    # a span that starts after page 2: lengths count from its own first page
    res = query(keys[2:], keys[:2])
    assert res.restorable_prefix_pages == [2, 6] and res.kv_hit_pages == 6
    # a prompt that leaves the stored context after page 6 resumes at page 4 only
    other = e.hashes(toks[:6 * PS] + tokens(gen, 2))
    res = query(other, [])
    assert res.restorable_prefix_pages == [4] and res.kv_hit_pages == 4
    assert a.batch_exists(other, hs.HiCacheStorageExtraInfo(prefix_keys=[])) == 6
    # and SGLang's prefetch takes exactly that: 4 pages and the state at their end
    r = e.prefetch(toks[:6 * PS] + [1, 2, 3, 4] * 2)
    assert r["host_hit"] == 4 * PS and r["mamba_hit"] == 1
    assert_hit_exact(r, first)
    assert torch.equal(r["state"], first.state)
    # without a Mamba pool in the query the KV run is the answer
    res = a.batch_exists_v2(other, None, hs.HiCacheStorageExtraInfo(prefix_keys=[]))
    assert res.kv_hit_pages == 6 and res.restorable_prefix_pages == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("mamba", "v1"), [(False, True), (True, True), (True, False)],
                         ids=["mha-v1", "mamba-v1", "mamba-legacy"])
def test_sglang_fault_injector_leaves_the_engine_consistent(built, monkeypatch, mamba, v1):
    # each backend call fails with p = 0.2 (a Mamba round trip makes 5 calls: 1/3 get through)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    e = built(extra(interface_v1=int(v1)), mamba=mamba)
    assert type(e.backend).__name__ == "HiCacheStorageFailureInjector"
    gen = torch.Generator().manual_seed(19)
    hit_pages = []
    for _ in range(24):
        toks = tokens(gen, 4)
        w = e.write(toks, gen, prefix_keys=[])
        r = e.prefetch(toks, timeout=10)
        n = assert_hit_exact(r, w, full=False)
        if mamba and r["state"] is not None:
            assert n == 4 and torch.equal(r["state"], w.state)
        hit_pages.append(n)
    assert 4 in hit_pages and min(hit_pages) < 4   # both outcomes happened (P(not) < 1e-4)
    assert adapter(e).store_stats()["errors"] == 0


# -- the adapter called from several threads, as the controller's threads do -------------

def _content(key: str, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_concurrent_calls_on_overlapping_chains_are_bit_exact(built, engine_modules):
    hs = engine_modules.hs
    e = built(extra(interface_v1=1), mamba=False, tokens=2048)
    a, kvh = adapter(e), e.kv_host
    gen = torch.Generator().manual_seed(23)
    trunk = tokens(gen, 6)
    chains = [e.hashes(trunk + tokens(gen, 4)) for _ in range(4)]   # 6 shared pages + 4 own
    nbytes = a._kv.nbytes
    slots = [(kvh.alloc(10 * PS), kvh.alloc(10 * PS)) for _ in chains]
    failures: list[str] = []

    def worker(keys: list[str], wslots: torch.Tensor, rslots: torch.Tensor) -> None:
        try:
            for i, k in enumerate(keys):
                kvh.set_from_flat_data_page(int(wslots[i * PS]), _content(k, nbytes).view(torch.bfloat16))
            for _ in range(3):
                for s in range(0, 10, 3):        # batches of 3 pages, each with its prefix
                    info = hs.HiCacheStorageExtraInfo(prefix_keys=keys[:s])
                    ok = a.batch_set_v1(keys[s:s + 3], wslots[s * PS:(s + 3) * PS], info)
                    if not all(ok):
                        failures.append(f"set {s}: {ok}")
                    h = a.batch_exists(keys, hs.HiCacheStorageExtraInfo(prefix_keys=[]))
                    got = a.batch_get_v1(keys[:h], rslots[:h * PS], hs.HiCacheStorageExtraInfo(prefix_keys=[]))
                    if sum(got) != h or h < s + 1:
                        failures.append(f"get {s}: {h} held, {sum(got)} loaded")
                    for i in range(sum(got)):
                        page = kvh.get_data_page(int(rslots[i * PS]), flat=True).view(torch.uint8)
                        if not torch.equal(page, _content(keys[i], nbytes)):
                            failures.append(f"page {i} differs")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k, *s)) for k, s in zip(chains, slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:5]
    assert all(a.batch_exists(k, hs.HiCacheStorageExtraInfo(prefix_keys=[])) == 10 for k in chains)
    assert a.store.stats()["pages"] == 6 + 4 * 4


# -- keys, ranks, pools, lifecycle ---------------------------------------------------------

def test_without_prefix_keys_a_new_sequence_is_refused_with_one_warning(built, caplog):
    e = built(extra(interface_v1=1, hicache_storage_pass_prefix_keys=False), mamba=True)
    gen = torch.Generator().manual_seed(29)
    with caplog.at_level(logging.WARNING, logger="hybridstore.adapters.sglang"):
        for _ in range(2):
            w = e.write(tokens(gen, 3), gen, prefix_keys=None)
            assert w.completed_tokens == 0
    warned = [r for r in caplog.records if "hicache_storage_pass_prefix_keys" in r.getMessage()]
    assert len(warned) == 1
    assert adapter(e).store_stats()["refused_writes"] >= 2
    assert adapter(e).store.stats()["pages"] == 0


def test_reads_without_prefix_keys_resolve_through_the_index(built, engine_modules):
    hs = engine_modules.hs
    e = built(extra(interface_v1=1), mamba=False)
    a = adapter(e)
    gen = torch.Generator().manual_seed(31)
    toks = tokens(gen, 5)
    w = e.write(toks, gen, prefix_keys=[])
    assert a.batch_exists(w.hashes[2:]) == 3                       # no extra_info at all
    assert a.batch_exists(w.hashes[2:], hs.HiCacheStorageExtraInfo()) == 3
    assert a.exists(w.hashes[4]) and not a.exists("00" * 32)
    slots = e.kv_host.alloc(3 * PS)
    assert a.batch_get_v1(w.hashes[2:], slots) == [True] * 3
    for i in range(3):
        assert torch.equal(e.page_bytes(int(slots[i * PS])), w.pages[2 + i])


def test_replicated_kv_non_writer_rank_writes_only_its_states(engine_modules, tmp_path):
    from hybridstore.adapters.sglang import HybridStoreHiCache

    hs = engine_modules.hs
    e = build_engine(extra(interface_v1=1), mamba=True, page_size=PS)
    try:
        src = adapter(e)
        cfg = hs.HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                      attn_cp_size=1, is_mla_model=True, enable_storage_metrics=False,
                                      is_page_first_layout=True, model_name="m",
                                      extra_config={"disk_path": str(tmp_path)})
        assert not cfg.is_storage_writer
        b = HybridStoreHiCache(cfg, {})
        b.register_mem_pool_host(src.mem_pool_host)
        for name, pool in src.registered_pools.items():
            b.register_mem_host_pool_v2(pool, name)
        b.on_host_pools_registered()
        assert b.store.config.disk_path == str(tmp_path / "tp1of2_pp0of1")
        assert "tp1of2" not in b.store.config.namespace     # replicated KV: one namespace
        gen = torch.Generator().manual_seed(37)
        keys = e.hashes(tokens(gen, 2))
        slots, _ = e.fill(2, gen)
        mslot, _ = e.fill_state(gen)
        info = hs.HiCacheStorageExtraInfo(prefix_keys=[])
        assert b.batch_set_v1(keys, slots, info) == [True, True]      # accepted, not stored
        assert b.store.stats()["pages"] == 0
        state = [hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=mslot, keys=keys[-1:],
                                 hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]
        assert b.batch_set_v2(state, hs.HiCacheStorageExtraInfo(prefix_keys=keys[:1])) == {
            hs.PoolName.MAMBA: [True]}
        assert b.store.stats()["checkpoints"] == 1
        back = e.mamba_host.alloc(1)
        state[0].host_indices = back
        assert b.batch_get_v2(state, hs.HiCacheStorageExtraInfo(prefix_keys=keys[:1])) == {
            hs.PoolName.MAMBA: [False]}          # its pages are the writer's: no resume point here
        b.close()
    finally:
        e.close()


def test_unknown_pools_miss_and_clear_drops_the_rank_store(built, tmp_path, engine_modules):
    hs = engine_modules.hs
    e = built(extra(tmp_path, interface_v1=1), mamba=True)
    a = adapter(e)
    gen = torch.Generator().manual_seed(41)
    w = e.write(tokens(gen, 3), gen, prefix_keys=[])
    info = hs.HiCacheStorageExtraInfo(prefix_keys=[])
    swa = hs.PoolTransfer(name=hs.PoolName.SWA, host_indices=torch.arange(PS), keys=w.hashes[:1])
    assert a.batch_get_v2([swa], info) == {hs.PoolName.SWA: [False]}
    assert a.batch_set_v2([swa], info) == {hs.PoolName.SWA: [False]}
    res = a.batch_exists_v2(w.hashes, [swa], info)
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    assert a.batch_exists(w.hashes, info) == 3
    assert e.controller.clear_storage_backend()                     # SGLang's clear path
    assert a.batch_exists(w.hashes, info) == 0 and a.store.stats()["pages"] == 0
    assert e.write(tokens(gen, 2), gen, prefix_keys=[]).completed_tokens == 2 * PS   # still usable


def test_get_stats_feeds_sglangs_storage_metrics_collector(built):
    pytest.importorskip("prometheus_client")
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    e = built(extra(interface_v1=1), mamba=False)
    gen = torch.Generator().manual_seed(43)
    toks = tokens(gen, 3)
    e.write(toks, gen, prefix_keys=[])
    e.prefetch(toks)
    stats = adapter(e).get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert all(b > 0 for b in stats.backup_bandwidth + stats.prefetch_bandwidth)
    StorageMetricsCollector(labels={"model_name": "t"}).log_storage_metrics(stats)
    assert adapter(e).get_stats().backup_pgs == []                  # drained


@pytest.mark.parametrize("bad", [{"disk_pth": "/x"}, {"page_size": 8}], ids=["unknown-key", "page-size"])
def test_a_bad_extra_config_fails_sglangs_attach(engine_modules, bad):
    with pytest.raises(ConfigError):
        build_engine(extra(**bad), page_size=PS)


def test_extra_config_keys_and_rank_identity():
    s = SGLangSettings.from_extra_config({"backend_name": "hybridstore", "interface_v1": 1,
                                          "file_storage_path": "/x", "host_bytes": "2MiB"})
    assert s.disk_path == "/x" and s.host_bytes == 2 << 20
    with pytest.raises(ConfigError, match="unknown hybridstore key"):
        SGLangSettings.from_extra_config({"disk_pth": "/x"})
    with pytest.raises(ConfigError, match="policy"):
        SGLangSettings.from_extra_config({"policy": "nope"})
    with pytest.raises(ConfigError):
        SGLangSettings.from_extra_config({"tier_policy": "nope"})
    r0 = RankIdentity(tp_rank=0, tp_size=2, model_name="Qwen/Qwen3-Next")
    r1 = RankIdentity(tp_rank=1, tp_size=2, model_name="Qwen/Qwen3-Next")
    assert r0.directory == "tp0of2_pp0of1" and r1.directory == "tp1of2_pp0of1"
    assert r0.namespace("", "L") != r1.namespace("", "L")
    assert "Qwen/Qwen3-Next" in r0.namespace("", "L")
    mla = [RankIdentity(tp_rank=i, tp_size=2, replicated_kv=True) for i in (0, 1)]
    assert mla[0].namespace("", "L") == mla[1].namespace("", "L")


def test_an_sglang_without_the_storage_interface_is_a_config_error(engine_modules, tmp_path,
                                                                     monkeypatch):
    """SGLang 0.5.22 and older lack ``is_storage_writer`` and ``on_host_pools_registered``:
    the adapter says so at startup instead of failing inside SGLang's attach."""
    from dataclasses import fields
    from types import SimpleNamespace

    from hybridstore.adapters import sglang as adapter_mod
    from hybridstore.errors import ConfigError

    hs = engine_modules.hs
    cfg = hs.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                  is_page_first_layout=True, model_name="m",
                                  extra_config={"disk_path": str(tmp_path)})
    adapter_mod.HybridStoreHiCache(cfg, {}).close()          # 0.5.23: accepted
    old = SimpleNamespace(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})  # 0.5.22's fields
    with pytest.raises(ConfigError, match="is_storage_writer"):
        adapter_mod.HybridStoreHiCache(old, {})
    monkeypatch.delattr(adapter_mod.HiCacheStorage, "on_host_pools_registered")
    with pytest.raises(ConfigError, match="on_host_pools_registered"):
        adapter_mod.HybridStoreHiCache(cfg, {})
