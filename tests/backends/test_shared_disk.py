"""Several processes (and stores) on one disk tier directory: ``DiskTier(shared=True)``.

Two tiers opened in one process take two slots exactly as two processes would (slots
are ``flock``-ed per open file), so most rules are checked in-process; the kills, the
several byte-moving processes and the vLLM-style layout run real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.catalog import Catalog
from hybridstore.backends.disk import CATALOG_DIR, DiskTier
from hybridstore.backends.disk.shared import SLOT_BITS
from hybridstore.errors import CapacityError, CorruptObjectError, DiskPathError
from hybridstore.objects import ObjectKind, object_key
from hybridstore.testing.tiers import TierConformance
from tests.reliability.shared import campaign

MiB = 1 << 20
SRC = Path(__file__).resolve().parents[2] / "src"


def key(i: int) -> bytes:
    return object_key(ObjectKind.PAGE, i.to_bytes(16, "little"))


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def shared_tier(path: Path, capacity: int = 16 * MiB, **kw: object) -> DiskTier:
    return DiskTier(path, capacity, engine="posix", segment_bytes=MiB, io_threads=2,
                    shared=True, **kw)  # type: ignore[arg-type]


def records(path: Path) -> list[tuple[int, int, int]]:
    cat = Catalog(path / CATALOG_DIR)
    try:
        return sorted((r.segment, r.offset, r.offset + r.slot_length) for _, r in cat.items())
    finally:
        cat.close()


def no_overlap(path: Path) -> bool:
    recs = records(path)
    return all(not (a[0] == b[0] and b[1] < a[2]) for a, b in zip(recs, recs[1:]))


class TestSharedConformance(TierConformance):
    """The tier contract holds for a tier in a shared directory."""

    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> DiskTier:
        return DiskTier(tmp_path / "disk", capacity_bytes, engine="posix", segment_bytes=MiB,
                        io_threads=4, shared=True)


def test_each_process_sees_what_the_others_made_durable(tmp_path: Path) -> None:
    with shared_tier(tmp_path) as a, shared_tier(tmp_path) as b:
        assert {a.shared.slot, b.shared.slot} == {0, 1}
        data = {i: payload(10_000 + 4096 * i, i) for i in range(6)}
        for i, d in data.items():
            (a if i % 2 else b).put(key(i), d, nbytes=d.size, meta=b"m%d" % i).result()
        for t in (a, b):
            t.sync()
            assert sorted(k for k, _, _ in t.entries()) == sorted(key(i) for i in data)
            for i, d in data.items():
                assert np.array_equal(t.get(key(i)), d) and t.meta(key(i)) == b"m%d" % i
        # each wrote only into its own segments
        for seg, _, _ in records(tmp_path):
            assert seg >> SLOT_BITS in (a.shared.slot, b.shared.slot)
        # b's changes reach a's store as changes: what a store applies to its index
        a.take_changes()
        b.delete(key(1))                         # a's object, deleted by b
        changes = a.take_changes()
        assert [(op, k) for op, k, _, _ in changes] == [(2, key(1))]
        assert not a.contains(key(1))
        with pytest.raises(KeyError):
            a.get(key(1))


def test_a_deleted_extent_is_not_reused_while_another_process_reads_it(tmp_path: Path) -> None:
    """The reuse rule: a's extent freed by b's delete waits for b's read in flight."""
    with shared_tier(tmp_path, MiB) as a, shared_tier(tmp_path, MiB) as b:
        old = payload(900_000, 1)
        a.put(key(1), old, nbytes=old.size).result()
        b.sync()
        view = b._view
        b.shared.begin_read(view)                # b plans a read of key 1 at this view
        a.delete(key(1))
        a.sync()
        reused_only_after_the_read(a, b, view)
        with pytest.raises(KeyError):
            b.get(key(1))


def reused_only_after_the_read(owner: DiskTier, reader: DiskTier, view: int) -> None:
    """``owner``'s only free room is the extent of a deleted object that ``reader`` has a
    read in flight of, planned at ``view``: it stays quarantined until that read ends."""
    assert owner.stats()["quarantined"] == 1
    new = payload(900_000, 2)
    with pytest.raises(CapacityError):           # the only room is the extent being read
        owner.put(key(2), new, nbytes=new.size)
    reader.shared.end_read(view)
    owner.sync()
    assert owner.stats()["quarantined"] == 0
    owner.put(key(2), new, nbytes=new.size).result()     # now reused
    assert np.array_equal(reader.get(key(2)), new)


@pytest.mark.parametrize("many", [False, True])
def test_an_owner_deleting_what_another_process_just_deleted_still_waits_for_readers(
        tmp_path: Path, many: bool) -> None:
    """b deletes a's object between a's sync and a's own delete of it: a's catalog delete
    finds nothing and logs no change, yet c may still read the extent (planned before b's
    delete), so a must quarantine it, not reuse it at once (the kill campaign's reads
    that failed their checksum)."""
    with shared_tier(tmp_path, MiB) as a, shared_tier(tmp_path, MiB) as b, \
            shared_tier(tmp_path, MiB) as c:
        old = payload(900_000, 1)
        a.put(key(1), old, nbytes=old.size).result()
        c.sync()
        view = c._view
        c.shared.begin_read(view)                # c plans a read of key 1 at this view
        b.sync()
        b.delete(key(1))
        a.sync = lambda: None                    # type: ignore[method-assign]  # b's delete
        freed = a.delete_many([key(1)]) if many else a.delete(key(1))  # lands after a's sync
        del a.sync
        assert freed > 0 and key(1) not in a._objects
        reused_only_after_the_read(a, c, view)


def test_a_delete_is_not_undone_by_an_older_change_applied_after_it(tmp_path: Path) -> None:
    """b puts a new version of a key between a's sync and a's delete of the key: a's
    delete removes b's version from the catalog, and b's older put, applied by a's next
    sync, must not bring it back into a's view (the kill campaign read such a phantom
    again and again, after b's segment had reused its extent)."""
    with shared_tier(tmp_path, 4 * MiB) as a, shared_tier(tmp_path, 4 * MiB) as b:
        v1, v2 = payload(300_000, 1), payload(300_000, 2)
        a.put(key(1), v1, nbytes=v1.size).result()
        b.sync()
        b.put(key(1), v2, nbytes=v2.size).result()      # lands after a's last sync
        a.sync = lambda: None                    # type: ignore[method-assign]
        assert a.delete(key(1)) > 0              # removes b's version from the catalog
        del a.sync
        a.sync()                                 # applies b's put, logged before a's delete
        assert key(1) not in a._objects
        with pytest.raises(KeyError):
            a.get(key(1))
        assert a.stats()["objects"] == 0 and not a._tombstones   # the view passed it
        b.sync()
        with pytest.raises(KeyError):
            b.get(key(1))
        v3 = payload(300_000, 3)
        b.put(key(1), v3, nbytes=v3.size).result()      # a later put shows as usual
        assert np.array_equal(a.get(key(1)), v3)


def test_a_dead_reader_does_not_hold_extents(tmp_path: Path) -> None:
    """A slot whose process died (its lock is free) publishes nothing any more."""
    path = tmp_path
    with shared_tier(path, 2 * MiB) as a:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os, signal
            from hybridstore.backends.disk import DiskTier
            t = DiskTier({str(path)!r}, 2 << 20, engine="posix", segment_bytes=1 << 20,
                         shared=True)
            t.shared.begin_read(1)                   # a read in flight, then killed
            os.kill(os.getpid(), signal.SIGKILL)
        """)], env=dict(os.environ, PYTHONPATH=str(SRC)), capture_output=True, text=True,
            timeout=60, check=False)
        assert proc.returncode == -9, proc.stderr
        old = payload(900_000, 1)
        a.put(key(1), old, nbytes=old.size).result()
        a.delete(key(1))
        a.sync()
        assert a.stats()["quarantined"] == 0
        a.put(key(2), old, nbytes=old.size).result()


def test_the_budget_bounds_the_processes_together(tmp_path: Path) -> None:
    cap = 6 * MiB
    with shared_tier(tmp_path, cap) as a, shared_tier(tmp_path, cap) as b:
        stored = {}
        for i in range(40):
            t = (a, b)[i % 2]
            d = payload(300_000, i)
            try:
                t.put(key(i), d, nbytes=d.size).result()
                stored[i] = d
            except CapacityError:
                pass
        assert 10 <= len(stored) < 40
        segments = Catalog(tmp_path / CATALOG_DIR)
        try:
            assert sum(segments.segments().values()) <= cap
        finally:
            segments.close()
        assert no_overlap(tmp_path)
        # room freed by a delete in the other's segments returns to its owner
        a.sync()
        mine = [i for i in stored if a._objects[key(i)].extent.arena >> SLOT_BITS == a.shared.slot]
        b.delete_many([key(i) for i in mine])
        a.sync()
        d = payload(300_000, 99)
        a.put(key(99), d, nbytes=d.size).result()
        assert np.array_equal(b.get(key(99)), d)


def test_modes_do_not_mix(tmp_path: Path) -> None:
    with shared_tier(tmp_path), pytest.raises(DiskPathError, match="disk_shared"):
        DiskTier(tmp_path, 16 * MiB, engine="posix")
    with DiskTier(tmp_path, 16 * MiB, engine="posix"):
        with pytest.raises(DiskPathError, match="does not share"):
            shared_tier(tmp_path)


def test_a_slot_is_taken_back_with_its_objects(tmp_path: Path) -> None:
    """A process that reopens after another closed takes slot 0 back, and its objects'
    extents with it (they are reserved, not reused)."""
    with shared_tier(tmp_path) as a, shared_tier(tmp_path) as b:
        for i in range(4):
            d = payload(50_000, i)
            (a if i < 2 else b).put(key(i), d, nbytes=d.size).result()
    with shared_tier(tmp_path) as c:
        assert c.shared.slot == 0 and c.stats()["recovered_objects"] == 4
        d = payload(50_000, 7)
        c.put(key(7), d, nbytes=d.size).result()
        for i in range(4):
            assert np.array_equal(c.get(key(i)), payload(50_000, i))
    assert no_overlap(tmp_path)
    with DiskTier(tmp_path, 16 * MiB, engine="posix") as alone:   # an exclusive reopen
        assert alone.stats()["objects"] == 5


def test_a_damaged_read_never_drops_a_newer_version(tmp_path: Path) -> None:
    """A reader whose view is stale must not delete the record another process replaced."""
    with shared_tier(tmp_path) as a, shared_tier(tmp_path) as b:
        d1 = payload(20_000, 1)
        a.put(key(1), d1, nbytes=d1.size).result()
        b.sync()
        stale = b._objects[key(1)]
        d2 = payload(20_000, 2)
        a.put(key(1), d2, nbytes=d2.size).result()
        b._drop(key(1), stale, "a test says so")            # with b's stale view
        assert a.catalog.get(key(1)) is not None
        assert np.array_equal(b.get(key(1)), d2)


# -- stores over one directory ------------------------------------------------------------
def store_cfg(path: Path, **kw: object) -> StoreConfig:
    base: dict[str, object] = dict(block_size=16, host_bytes=MiB, disk_path=str(path),
                                   disk_bytes=64 * MiB, disk_segment_bytes=MiB,
                                   disk_shared=True, disk_engine="posix")
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]


def test_stores_share_prefixes_and_evictions(tmp_path: Path) -> None:
    toks = np.arange(96) + 3
    pages = [np.full((2, 16, 8), i, np.float32) for i in range(6)]
    state = np.arange(128, dtype=np.float32).reshape(4, 32)
    with HybridStore(store_cfg(tmp_path)) as a, HybridStore(store_cfg(tmp_path)) as b:
        a.put_kv(toks, pages)
        a.put_state(toks, state)
        a.flush()
        plan = b.match(toks)
        assert plan.position == 96
        got_pages, got_state = b.load(plan).result()
        b.release(plan)
        assert all(np.array_equal(np.asarray(g), p) for g, p in zip(got_pages, pages))
        assert np.array_equal(np.asarray(got_state), state)
        # b forgets the state on disk; a stops promising it (it is still in a's DRAM, so
        # a still hits; dropped there too, a misses)
        b.tiers["disk"].delete(object_key(ObjectKind.STATE, b.prefix(toks).key_at(96)))
        a.evict(a.tiers["host"].capacity_bytes, "host")
        assert a.match(toks).position == 0
        assert a.stats()["tiers"]["disk"]["objects"] == 6


def test_a_plan_whose_objects_another_process_evicted_fails_typed(tmp_path: Path) -> None:
    toks = np.arange(64) + 3
    pages = [np.full((2, 16, 8), i, np.float32) for i in range(4)]
    with HybridStore(store_cfg(tmp_path)) as a, HybridStore(store_cfg(tmp_path)) as b:
        a.put_kv(toks, pages)
        a.put_state(toks, np.ones((4, 32), np.float32))
        a.flush()
        plan = b.match(toks)
        assert plan.position == 64
        for k, _, _ in list(a.tiers["disk"].entries()):
            a.tiers["disk"].delete(k)
        with pytest.raises(CorruptObjectError):
            b.load(plan).result()
        b.release(plan)
        assert b.match(toks).position == 0


def test_a_full_shared_tier_is_evicted_by_one_process_at_a_time(tmp_path: Path) -> None:
    """Two stores writing past the directory's budget: puts never fail into the caller,
    everything on disk reads back exactly, extents never overlap, the budget holds."""
    cfg = store_cfg(tmp_path, host_bytes=256 << 10, disk_bytes=4 * MiB)
    rng = np.random.default_rng(0)
    with HybridStore(cfg) as a, HybridStore(cfg) as b:
        prompts = []
        for r in range(24):
            toks = rng.integers(0, 50_000, 64)
            pages = [rng.standard_normal((2, 16, 8 * 64)).astype(np.float32) for _ in range(4)]
            (a, b)[r % 2].put_kv(toks, pages)
            prompts.append((toks, pages))
        a.flush()
        b.flush()
        hits = 0
        for toks, pages in prompts:
            for s in (a, b):
                plan = s.match_pages(toks)
                if len(plan.pages):
                    got, _ = s.load(plan).result()
                    hits += 1
                    assert all(np.array_equal(np.asarray(g), p) for g, p in zip(got, pages))
                s.release(plan)
        assert hits > 0
    assert no_overlap(tmp_path)
    cat = Catalog(tmp_path / CATALOG_DIR)
    try:
        assert sum(cat.segments().values()) <= 4 * MiB
    finally:
        cat.close()


def test_vllm_style_layout_one_index_several_byte_movers(tmp_path: Path) -> None:
    """vLLM builds its spec in the scheduler and in every worker: two worker processes
    store the pages of one prompt (each its half) and its state; the scheduler-side store
    matches the whole prefix and loads it bit-exact; after every process exits, a
    restarted scheduler hits it again."""
    path = tmp_path / "d"
    cfg = store_cfg(path)
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from hybridstore import HybridStore, StoreConfig
        part = int(sys.argv[1])
        cfg = StoreConfig(block_size=16, host_bytes=1 << 20, disk_path=sys.argv[2],
                          disk_bytes=64 << 20, disk_segment_bytes=1 << 20, disk_shared=True,
                          disk_engine="posix")
        toks = np.arange(128) + 11
        with HybridStore(cfg) as s:
            lo, hi = (0, 4) if part == 0 else (4, 8)
            s.put_kv(toks[:16 * hi], [np.full((2, 16, 8), b, np.float32) for b in range(lo, hi)])
            if part == 1:
                s.put_state(toks, np.full((4, 32), 5, np.float32))
            s.flush()
        print("ok")
    """)
    with HybridStore(cfg) as index:
        env = dict(os.environ, PYTHONPATH=str(SRC))
        for part in (0, 1):     # in order: the second's pages chain onto the first's
            proc = subprocess.run([sys.executable, "-c", script, str(part), str(path)], env=env,
                                  capture_output=True, text=True, timeout=120, check=False)
            assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
        toks = np.arange(128) + 11
        plan = index.match(toks)
        assert plan.position == 128
        pages, state = index.load(plan).result()
        index.release(plan)
        assert [float(np.asarray(p).flat[0]) for p in pages] == list(range(8))
        assert np.array_equal(np.asarray(state), np.full((4, 32), 5, np.float32))
    with HybridStore(cfg) as again:
        assert again.match(toks).position == 128


def test_processes_killed_at_random_leave_the_others_serving(tmp_path: Path) -> None:
    """Short form of ``python -m tests.reliability.shared``: 3 processes, 8 SIGKILLs."""
    summary = campaign(procs=3, kills=8, seed=5, interval_s=0.35, workdir=str(tmp_path),
                       progress=False)
    assert summary["violations"] == 0, summary["violation_samples"]
    assert not summary["crashed"], summary["crash_samples"]
    assert summary["objects"] > 0 and summary["wrong_bytes"] == 0
    assert summary["overlaps"] == 0 and summary["within_budget"]
    assert summary["dropped_on_reopen"] == 0


def test_a_segment_file_made_again_is_read_anew(tmp_path: Path) -> None:
    """The owner removes an emptied segment file and later makes one of the same id: a
    reader holding a handle of the old file must read the new one (the kill campaign
    found reads failing their checksum there)."""
    with shared_tier(tmp_path, 2 * MiB) as a, shared_tier(tmp_path, 2 * MiB) as b:
        first = payload(900_000, 1)
        a.put(key(1), first, nbytes=first.size).result()
        segment = a._objects[key(1)].extent.arena
        assert np.array_equal(b.get(key(1)), first)    # b opens a's segment file
        a.delete(key(1))
        big = payload(3 * MiB // 2, 2)                   # its own file: the budget takes
        a.put(key(2), big, nbytes=big.size).result()     # the emptied segment's back
        assert not (tmp_path / f"seg-{segment:06d}.dat").exists()
        a.delete(key(2))
        second = payload(900_000, 3)
        a.put(key(3), second, nbytes=second.size).result()
        assert a._objects[key(3)].extent.arena == segment        # the same id, a new file
        assert np.array_equal(b.get(key(3)), second)


_JOINING = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from hybridstore import HybridStore, StoreConfig
    path, me, other = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    segment = int(sys.argv[4]) or None
    cfg = StoreConfig(block_size=16, host_bytes=1 << 20, disk_path=path + "/d",
                      disk_bytes=256 << 20, disk_segment_bytes=segment, disk_shared=True,
                      disk_engine="posix")

    def prompt(who, i):
        toks = np.arange(64) + 1000 * i + 100_000 * who
        return toks, [np.full((2, 16, 8), who * 100 + i + b / 8, np.float32) for b in range(4)]

    def wait_for(name):
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(path, name)):
            assert time.monotonic() < deadline, name
            time.sleep(0.02)

    if me == 1:
        wait_for("open-0")                  # the second process joins the first
    with HybridStore(cfg) as store:
        open(os.path.join(path, f"open-{me}"), "w").close()
        for i in range(20):
            store.put_kv(*prompt(me, i))
        store.flush()
        open(os.path.join(path, f"done-{me}"), "w").close()
        wait_for(f"done-{other}")
        seen = mine = 0
        for i in range(20):
            for who in (me, other):
                toks, pages = prompt(who, i)
                plan = store.match_pages(toks)
                if len(plan.pages) == 4:
                    got, _ = store.load(plan).result()
                    assert all(np.array_equal(np.asarray(g), p) for g, p in zip(got, pages))
                    if who == me:
                        mine += 1
                    else:
                        seen += 1
                store.release(plan)
        open(os.path.join(path, f"checked-{me}"), "w").close()
        wait_for(f"checked-{other}")
    print("seen", seen, "mine", mine)
""")


@pytest.mark.parametrize("segment", [0, 256 * MiB], ids=["from-budget", "256MiB"])
def test_a_process_joining_a_small_shared_budget_keeps_the_others_objects(
        tmp_path: Path, segment: int) -> None:
    """Issue 26, item 6: with 256 MiB segments, a process joining a directory whose
    disk_bytes (256 MiB) is below processes x segment size found the budget committed by the
    first process's one segment, and evicted every object of the first to get one: of 20
    small prompts each, one process saw 20 of the other's and the other 0.  Now segments
    are sized from the budget and a shared directory charges a segment the bytes it grew to,
    so both keep their prompts and each sees all of the other's (also in a directory made
    with 256 MiB segments)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    procs = [subprocess.Popen([sys.executable, "-c", _JOINING, str(tmp_path), str(me),
                               str(1 - me), str(segment)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert [out.split() for out, _ in outs] == [["seen", "20", "mine", "20"]] * 2, outs
    cat = Catalog(tmp_path / "d" / CATALOG_DIR)
    try:
        assert sum(cat.segments().values()) <= 256 * MiB
    finally:
        cat.close()


def test_a_process_whose_room_the_others_hold_says_so(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Making room for a process that holds none of a shared budget evicts the others'
    objects: never silently."""
    with shared_tier(tmp_path, 2 * MiB) as a, shared_tier(tmp_path, 2 * MiB) as b:
        for i in range(2):
            d = payload(900_000, i)
            a.put(key(i), d, nbytes=d.size).result()
        with caplog.at_level("WARNING", logger="hybridstore.backends.disk"), \
                pytest.raises(CapacityError):
            b.put(key(9), payload(9000, 9), nbytes=9000)
        assert "holds none of it" in caplog.text and "raise disk_bytes" in caplog.text
        assert all(np.array_equal(b.get(key(i)), payload(900_000, i)) for i in range(2))
