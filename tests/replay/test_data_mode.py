"""Data-mode replay: real bytes through the pinned pool and the disk tier, same decisions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.cli import main
from hybridstore.errors import CapacityError, ConfigError, CorruptObjectError
from hybridstore.objects import ObjectKind, object_key
from hybridstore.replay.bytes_plane import DataObjects, data_planes, pattern, patterns
from hybridstore.replay.datatiers import BudgetedPool, WriteBehindDisk
from hybridstore.replay.loaders import load
from hybridstore.replay.planes import TierBudget
from hybridstore.replay.report import summarize
from hybridstore.replay.sim import ReplayConfig, replay

# Six agent sessions (prompts up to ~18K tokens) under budgets that hold a few
# sessions at most: at scale 128 the GPU tier is 2 MiB, DRAM 6 MiB and SSD
# 64 MiB, so DRAM evicts (and spills, or drops what SSD holds) all along and
# many restores read SSD.
TRACE = "synthetic:agent?sessions=6&turns=8&new=2048&mutation=0.2&seed=3"
PRESETS = ["histate", "vllm-disk", "sglang-hicache"]   # spill, write-through, partition


def _cfg(tmp_path, **kw) -> ReplayConfig:
    return ReplayConfig(gpu_gib=0.25, host_gib=0.75, disk_gib=8, scale=128, live_sessions=6,
                        data_dir=str(tmp_path), **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    trace = load(TRACE)
    sized = replay(trace, PRESETS, _cfg(tmp), progress=False)
    data = replay(trace, PRESETS, _cfg(tmp, data=True), plane_for=data_planes(str(tmp)),
                  progress=False)
    return trace, sized, data, tmp


@pytest.mark.parametrize("name", PRESETS)
def test_data_mode_makes_the_decisions_of_accounting_mode(runs, name):
    _, sized, data, _ = runs
    a, b = sized[name], data[name]
    assert len(a.results) == len(b.results) > 0
    for x, y in zip(a.results, b.results):
        assert (x.session, x.index, x.hit_tokens) == (y.session, y.index, y.hit_tokens)
        assert x.restored_bytes == y.restored_bytes
        assert x.ttft_s == y.ttft_s
    sa, sb = a.summary(), b.summary()
    for key in ("token_hit_rate", "evictions", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s"):
        assert sa[key] == sb[key], key
    assert 0 < sb["token_hit_rate"] < 1
    assert sb["evictions"] > 0


@pytest.mark.parametrize("name", PRESETS)
def test_data_mode_restores_real_bytes_from_dram_and_ssd(runs, name):
    trace, _, data, tmp = runs
    doc = summarize(trace, data, _cfg(tmp, data=True))
    d = doc["policies"][name]["data"]
    run = data[name]
    hits = [r for r in run.results if r.hit_tokens]
    # Every hit was loaded and timed; times are positive and summarised.
    assert d["restores"] == len(hits) > 10
    assert all(r.measured_restore_s > 0 for r in hits)
    assert all(r.measured_restore_s is None for r in run.results if not r.hit_tokens)
    for stat in ("p50", "p95", "mean"):
        assert d[f"measured_restore_{stat}_s"] > 0
        assert d[f"modeled_restore_{stat}_s"] > 0
    assert d["measured_restore_p95_s"] >= d["measured_restore_p50_s"]
    assert d["measured_over_modeled"] > 0 and d["gbps"] > 0
    # Bytes came back as they were put (pattern checks), and what was read per tier is
    # what the restore model charged for the same plans.
    assert d["verified_objects"] >= len(hits) and d["verified_bytes"] > 0
    for tier in ("host", "disk"):
        modeled = sum(r.restored_bytes.get(tier, 0) for r in hits) / run.scale
        assert d["bytes_read"][tier] == pytest.approx(modeled, rel=1e-6)
        assert d["bytes_read"][tier] > 0, tier
        assert d["bytes_put"][tier] > 0, tier
    # Objects really were written to and read from segment files on disk.
    disk = d["disk"]
    assert disk["engine"]
    assert disk["segment_files"] > 0 and disk["file_bytes"] > 0
    assert disk["bytes_written"] > 0 and disk["objects"] > 0
    assert disk["bytes_read"] == d["bytes_read"]["disk"]
    assert d["physical_refusals"] == 0
    assert not list(tmp.glob("hybridstore-*"))   # each run's directory is removed


def test_patterns_name_their_object(tmp_path):
    keys = np.array([[1, 2], [3, 4], [1, 5]], dtype=np.uint64)
    rows = patterns(ObjectKind.PAGE, keys, 1001)
    assert rows.shape == (3, 1001)
    for row, key in zip(rows, keys):
        assert np.array_equal(row, pattern(ObjectKind.PAGE, key.astype("<u8").tobytes(), 1001))
    assert not np.array_equal(rows[0], rows[2])
    key = keys[0].astype("<u8").tobytes()
    assert not np.array_equal(pattern(ObjectKind.STATE, key, 1001), rows[0])
    long = pattern(ObjectKind.STATE, key, 3 << 20)   # longer than the base block
    assert not np.array_equal(long[: 1 << 19], long[1 << 19: 2 << 19])


def _small_store(tmp_path):
    objects = DataObjects(str(tmp_path), label="unit")
    tiers = objects.open_tiers([TierBudget("host", 1 << 20, 64.0), TierBudget("disk", 4 << 20, 4.7)])
    store = HybridStore(StoreConfig(block_size=16, tier_policy="write-through"), tiers=tiers)
    return objects, store


def test_a_restore_with_other_bytes_than_were_put_is_caught(tmp_path):
    objects, store = _small_store(tmp_path)
    try:
        with store:
            prompt = store.prefix(np.arange(64, dtype=np.uint32))
            objects.put_pages(store, prompt, 0, 4000)
            objects.put_state(store, prompt, 64, 8000)
            plan = store.match(prompt)
            assert objects.restore(store, plan) > 0    # as put: passes
            store.release(plan)
            # The pool now returns other bytes for the checkpoint.
            pool = store.tiers["host"]
            okey = object_key(ObjectKind.STATE, prompt.key_at(64))
            slot = pool.reserve_slot(okey, 8000)
            slot[:] = 7
            pool.commit(okey)
            plan = store.match(prompt)
            with pytest.raises(CorruptObjectError, match="other bytes than were put"):
                objects.restore(store, plan)
            store.release(plan)
    finally:
        objects.close()
    assert not list(tmp_path.iterdir())


def test_data_tiers_charge_exact_bytes_against_their_budget(tmp_path):
    pool = BudgetedPool("host", 10_000, read_gbps=64.0)
    try:
        assert pool.charge(4001) == 4001
        slot = pool.reserve_slot(b"\x01" * 17, 4001)
        slot[:] = 1
        pool.commit(b"\x01" * 17)
        pool.put(b"\x02" * 17, np.ones(5000, np.uint8), nbytes=5000)
        assert pool.used_bytes == 9001 and pool.free_bytes == 999
        with pytest.raises(CapacityError):           # the budget, not the allocator, says no
            pool.put(b"\x03" * 17, np.ones(1000, np.uint8), nbytes=1000)
        assert pool.delete(b"\x01" * 17) == 4001 and pool.used_bytes == 5000
        assert pool.stats()["physical_capacity_bytes"] > 10_000
    finally:
        pool.close()

    disk = WriteBehindDisk(tmp_path / "d", 40_000, read_gbps=4.7)
    try:
        key = b"\x04" * 17
        data = np.arange(10_000, dtype=np.uint8)
        assert disk.put(key, data, nbytes=10_000).done()     # reported done at once
        data[:] = 0                                          # the caller may reuse its buffer
        assert disk.contains(key) and disk.nbytes(key) == 10_000 and disk.used_bytes == 10_000
        out = np.empty(10_000, np.uint8)
        disk.get_into(key, out).result()                     # waits for the write
        assert np.array_equal(out, np.arange(10_000, dtype=np.uint8))
        with pytest.raises(CapacityError):
            disk.put(b"\x05" * 17, out, nbytes=30_001)
        assert disk.delete(key) == 10_000 and not disk.contains(key) and disk.used_bytes == 0
        disk.apply_deletes()
        assert disk.stats()["objects"] == 0                  # gone from the real tier too
    finally:
        disk.close()


def test_data_mode_refuses_budgets_that_do_not_fit_this_machine():
    trace = load("synthetic:rewind?sessions=1&turns=2&seed=1")
    with pytest.raises(ConfigError, match="raise --scale"):
        replay(trace, ["vllm-cpu"], ReplayConfig(data=True, gpu_gib=4096, host_gib=4096),
               plane_for=data_planes(None), progress=False)
    with pytest.raises(ConfigError, match="scale"):
        ReplayConfig(scale=0.5)


def test_cli_replay_data_writes_measured_restores(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", TRACE, "--data", "--policy", "unlimited,histate", "--gpu-gib", "0.25",
               "--host-gib", "0.75", "--disk-gib", "8", "--live-sessions", "6", "--data-dir",
               str(tmp_path / "dd"), "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["data"] and doc["config"]["scale"] == 128
    assert "data" not in doc["policies"]["unlimited"]        # no budget: accounting only
    d = doc["policies"]["histate"]["data"]
    assert d["restores"] > 0 and d["measured_restore_p50_s"] > 0 and d["bytes_read"]["disk"] > 0
    assert png.stat().st_size > 10_000


def test_data_planes_move_bytes_for_presets_with_a_budget(tmp_path):
    """The caller's choice of planes: bytes where a preset has budgets, sizes for ``unlimited``."""
    from hybridstore.replay.planes import SizedObjects
    from hybridstore.replay.systems import preset

    plane_for = data_planes(str(tmp_path))
    assert isinstance(plane_for(preset("unlimited")), SizedObjects)
    plane = plane_for(preset("histate"))
    assert isinstance(plane, DataObjects)
    plane.close()
