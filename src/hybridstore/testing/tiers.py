"""The one conformance suite of the tier contract (:mod:`hybridstore.backends.base`).

It ships in the package (as ``zarr.testing.store`` does), so a tier written
elsewhere (a ``remote`` tier in another package) is checked by the same tests.
Every backend's test module subclasses :class:`TierConformance` and implements
one hook; pytest then runs every test below against that backend::

    from hybridstore.testing.tiers import TierConformance

    class TestHostPool(TierConformance):
        def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
            return HostPool(capacity_bytes, arena_bytes=1 << 20, pin=False)

The hook (a stable signature):

``make_tier(self, tmp_path, capacity_bytes) -> Tier``
    Return a new, empty, open tier whose ``capacity_bytes`` is exactly
    ``capacity_bytes``.  ``tmp_path`` is an existing empty directory that the
    tier may own (the disk tier keeps its files there); a test that needs two
    tiers passes a different directory to each.  The suite closes every tier it
    makes.

A subclass may also override ``CAPACITY`` (the budget of the ``tier`` fixture,
8 MiB) and add backend-specific tests next to the inherited ones.  Byte checks
are skipped when the tier's ``stores_bytes`` is False; sizes are checked always.
The batch and paired verbs (``put_many``, ``delete_many``, ``read_many_into``,
``stage_many``/``commit_many``/``abort_many``, ``pin_many``/``unpin_many`` with
``view``/``locate``, ``put_info``/``get_info``) are checked whether the tier
overrides them or inherits the contract's defaults.

Needs ``pytest`` and ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridstore.backends.base import Tier
from hybridstore.errors import CapacityError, ObjectTooLargeError, StoreClosedError
from hybridstore.objects import ObjectKey, ObjectKind, object_key

__all__ = ["SIZES", "TierConformance", "blob", "is_blob", "key_of"]

SIZES = [1, 4095, 4096, 64 << 10, (1 << 20) + 3]


def key_of(i: int, kind: ObjectKind = ObjectKind.PAGE) -> ObjectKey:
    """A distinct key for every ``i``."""
    return object_key(kind, i.to_bytes(16, "little"))


def blob(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes, a function of ``seed``; the first 8 bytes hold the seed.

    So any array read back can be checked on its own (:func:`is_blob`): a torn
    mix of two writes fails.
    """
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    tag = seed.to_bytes(8, "little")[:nbytes]
    data[: len(tag)] = np.frombuffer(tag, dtype=np.uint8)
    return data


def is_blob(data: np.ndarray) -> bool:
    """Whether ``data`` is exactly some ``blob(len(data), seed)``."""
    seed = int.from_bytes(data[:8].tobytes(), "little")
    return bool(np.array_equal(data, blob(len(data), seed)))


class TierConformance:
    """Tests every tier must pass; subclasses implement :meth:`make_tier`."""

    CAPACITY = 8 << 20

    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        """A new, empty, open tier with exactly ``capacity_bytes`` of budget."""
        raise NotImplementedError

    # -- fixtures and helpers -----------------------------------------------------
    @pytest.fixture
    def new_tier(self, tmp_path: Path) -> Iterator:
        """``new_tier(capacity_bytes)``: a fresh tier in its own directory, closed after the test."""
        made: list[Tier] = []

        def new(capacity_bytes: int) -> Tier:
            where = tmp_path / f"tier{len(made)}"
            where.mkdir()
            made.append(self.make_tier(where, capacity_bytes))
            return made[-1]

        yield new
        for tier in made:
            if not tier.closed:
                tier.close()

    @pytest.fixture
    def tier(self, new_tier) -> Tier:  # type: ignore[no-untyped-def]
        tier = new_tier(self.CAPACITY)
        assert tier.capacity_bytes == self.CAPACITY and tier.used_bytes == 0
        return tier

    @staticmethod
    def put(tier: Tier, key: ObjectKey, data: np.ndarray, meta: bytes = b"") -> None:
        """Store ``data`` and wait until it is visible."""
        tier.put(key, data if tier.stores_bytes else None, nbytes=len(data), meta=meta).result()

    @staticmethod
    def check(tier: Tier, key: ObjectKey, data: np.ndarray) -> None:
        """``key`` holds exactly ``data`` (its size, when the tier keeps no bytes)."""
        assert tier.nbytes(key) == len(data)
        out = np.zeros(len(data) + 8, dtype=np.uint8)
        assert tier.get_into(key, out if tier.stores_bytes else None).result() == len(data)
        got = tier.get(key)
        assert got.dtype == np.uint8 and len(got) == len(data)
        if tier.stores_bytes:
            assert np.array_equal(got, data)
            assert np.array_equal(out[: len(data)], data) and not out[len(data):].any()

    # -- objects ------------------------------------------------------------------
    @pytest.mark.parametrize("nbytes", SIZES)
    def test_round_trip(self, tier: Tier, nbytes: int) -> None:
        data = blob(nbytes, nbytes)
        self.put(tier, key_of(1), data, meta=b"m" * 7)
        assert tier.contains(key_of(1)) and not tier.contains(key_of(2))
        assert tier.meta(key_of(1)) == b"m" * 7
        self.check(tier, key_of(1), data)
        assert tier.used_bytes == tier.charge(nbytes) >= nbytes

    # Each subclass runs this with its own tier: differing executors are expected.
    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.differing_executors])
    @given(payload=st.binary(min_size=0, max_size=70_000), meta=st.binary(max_size=64))
    def test_round_trip_random_bytes(self, tier: Tier, payload: bytes, meta: bytes) -> None:
        data = np.frombuffer(payload, dtype=np.uint8).copy()
        self.put(tier, key_of(3), data, meta=meta)
        self.check(tier, key_of(3), data)
        assert tier.meta(key_of(3)) == meta
        assert tier.delete(key_of(3)) >= len(data) and tier.used_bytes == 0

    def test_absent_key(self, tier: Tier) -> None:
        assert not tier.contains(key_of(9))
        assert tier.nbytes(key_of(9)) is None and tier.meta(key_of(9)) is None
        assert tier.delete(key_of(9)) == 0
        with pytest.raises(KeyError):
            tier.get(key_of(9))
        with pytest.raises(KeyError):
            tier.get_into(key_of(9), np.zeros(16, dtype=np.uint8)).result()

    def test_entries(self, tier: Tier) -> None:
        expected = {}
        for i in range(5):
            kind = ObjectKind.STATE if i % 2 else ObjectKind.PAGE
            data = blob(1000 * (i + 1), i)
            self.put(tier, key_of(i, kind), data, meta=bytes([i]) * i)
            expected[key_of(i, kind)] = (len(data), bytes([i]) * i)
        assert {k: (n, m) for k, n, m in tier.entries()} == expected
        assert tier.stats()["used_bytes"] == tier.used_bytes
        assert tier.stats()["capacity_bytes"] == tier.capacity_bytes

    def test_delete_frees(self, tier: Tier) -> None:
        self.put(tier, key_of(1), blob(10_000, 1))
        self.put(tier, key_of(2), blob(300_000, 2))
        before = tier.used_bytes
        assert tier.delete(key_of(2)) == tier.charge(300_000)
        assert tier.used_bytes == before - tier.charge(300_000) == tier.charge(10_000)
        assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes
        assert not tier.contains(key_of(2)) and tier.contains(key_of(1))
        self.check(tier, key_of(1), blob(10_000, 1))

    def test_replace(self, tier: Tier) -> None:
        self.put(tier, key_of(1), blob(50_000, 1), meta=b"old")
        self.put(tier, key_of(1), blob(7_000, 2), meta=b"new")
        assert tier.meta(key_of(1)) == b"new"
        self.check(tier, key_of(1), blob(7_000, 2))
        assert tier.used_bytes == tier.charge(7_000)
        assert [k for k, _, _ in tier.entries()] == [key_of(1)]

    def test_read_seconds_grow_with_size(self, tier: Tier) -> None:
        assert 0 < tier.read_seconds(1 << 20) < tier.read_seconds(2 << 20)

    # -- capacity -----------------------------------------------------------------
    def test_object_larger_than_capacity(self, new_tier) -> None:  # type: ignore[no-untyped-def]
        tier = new_tier(1 << 20)
        with pytest.raises(ObjectTooLargeError, match="capacity"):
            tier.charge((1 << 20) + 1)
        with pytest.raises(ObjectTooLargeError):
            self.put(tier, key_of(1), blob((1 << 20) + 1, 1))
        assert tier.used_bytes == 0 and not tier.contains(key_of(1))

    def test_full_tier_raises_and_changes_nothing(self, new_tier) -> None:  # type: ignore[no-untyped-def]
        tier = new_tier(1 << 20)
        stored = []
        with pytest.raises(CapacityError) as info:
            for i in range(100):
                self.put(tier, key_of(i), blob(64 << 10, i), meta=bytes([i]))
                stored.append(i)
                assert tier.used_bytes <= tier.capacity_bytes
        assert not isinstance(info.value, ObjectTooLargeError)
        assert len(stored) >= 8 and not tier.contains(key_of(len(stored)))
        for i in stored:
            assert tier.meta(key_of(i)) == bytes([i])
            self.check(tier, key_of(i), blob(64 << 10, i))
        assert tier.delete(key_of(0)) > 0  # after eviction the put succeeds
        self.put(tier, key_of(1000), blob(64 << 10, 1000))

    # -- lifecycle ----------------------------------------------------------------
    def test_closed_tier_raises(self, tier: Tier) -> None:
        self.put(tier, key_of(1), blob(100, 1))
        tier.close()
        assert tier.closed
        calls = [lambda: self.put(tier, key_of(2), blob(100, 2)),
                 lambda: tier.get(key_of(1)),
                 lambda: tier.get_into(key_of(1), np.zeros(100, np.uint8)).result(),
                 lambda: tier.contains(key_of(1)), lambda: tier.nbytes(key_of(1)),
                 lambda: tier.meta(key_of(1)), lambda: tier.delete(key_of(1)),
                 lambda: list(tier.entries())]
        for call in calls:
            with pytest.raises(StoreClosedError, match="close"):
                call()

    # -- models and concurrency ---------------------------------------------------
    def test_random_ops_match_a_dict(self, tier: Tier) -> None:
        rng = random.Random(7)
        model: dict[ObjectKey, np.ndarray] = {}
        for step in range(400):
            key = key_of(rng.randrange(24))
            op = rng.random()
            if op < 0.5:
                data = blob(rng.choice([1, 5000, 4096 * 3, 90_000, 700_000]), step)
                try:
                    self.put(tier, key, data)
                except CapacityError:  # full: the old object (if any) must be intact
                    continue
                model[key] = data
            elif op < 0.75:
                assert (tier.delete(key) > 0) == (model.pop(key, None) is not None)
            elif key in model:
                self.check(tier, key, model[key])
            assert tier.used_bytes == sum(tier.charge(len(d)) for d in model.values())
            assert tier.used_bytes <= tier.capacity_bytes
        assert {k: n for k, n, _ in tier.entries()} == {k: len(d) for k, d in model.items()}

    def test_threads_keep_bytes_exact(self, tier: Tier) -> None:
        errors: list[BaseException] = []
        over: list[int] = []

        def worker(t: int) -> None:
            rng = random.Random(t)
            mine: dict[ObjectKey, np.ndarray] = {}
            try:
                for step in range(150):
                    own = key_of(1000 * (t + 1) + rng.randrange(6))
                    shared = key_of(rng.randrange(4))
                    op = rng.random()
                    if op < 0.4:
                        data = blob(rng.choice([4096, 10_000, 65_536, 200_003]),
                                    (t << 20) + step)
                        target = own if rng.random() < 0.7 else shared
                        try:
                            self.put(tier, target, data)
                        except CapacityError:
                            continue
                        if target == own:
                            mine[own] = data
                    elif op < 0.6:
                        tier.delete(own)
                        mine.pop(own, None)
                    elif op < 0.8 and own in mine:
                        self.check(tier, own, mine[own])
                    else:
                        try:
                            got = tier.get(shared)
                        except KeyError:
                            continue
                        assert not tier.stores_bytes or is_blob(got)
                    if tier.used_bytes > tier.capacity_bytes:
                        over.append(tier.used_bytes)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        assert not over
        entries = list(tier.entries())
        assert tier.used_bytes == sum(tier.charge(n) for _, n, _ in entries)
        if tier.stores_bytes:
            assert all(is_blob(tier.get(key)) for key, _, _ in entries)

    # -- batch and paired verbs ---------------------------------------------------
    @staticmethod
    def put_many(tier: Tier, keys: list[ObjectKey], datas: list[np.ndarray],
                 metas: list[bytes] | None = None) -> None:
        """``put_many`` of objects of one size, waited for."""
        futs = tier.put_many(keys, datas if tier.stores_bytes else None, nbytes=len(datas[0]),
                             metas=metas)
        assert len(futs) == len(keys)
        for fut in futs:
            fut.result()

    @pytest.mark.parametrize("nbytes", [4096, 5000, 64 << 10])
    def test_put_many_round_trip(self, tier: Tier, nbytes: int) -> None:
        keys = [key_of(i) for i in range(12)]
        datas = [blob(nbytes, 100 + i) for i in range(12)]
        self.put_many(tier, keys, datas, metas=[bytes([i]) * 3 for i in range(12)])
        for i, (key, data) in enumerate(zip(keys, datas)):
            assert tier.meta(key) == bytes([i]) * 3
            self.check(tier, key, data)
        assert tier.used_bytes == 12 * tier.charge(nbytes)
        # replacing some of them with a run of another size keeps one copy of each key
        self.put_many(tier, keys[:4], [blob(1000, 200 + i) for i in range(4)])
        self.check(tier, keys[0], blob(1000, 200))
        assert tier.used_bytes == 4 * tier.charge(1000) + 8 * tier.charge(nbytes)
        assert {k for k, _, _ in tier.entries()} == set(keys)

    def test_put_many_without_room_keeps_what_was_there(self, new_tier) -> None:  # type: ignore[no-untyped-def]
        tier = new_tier(1 << 20)
        self.put(tier, key_of(0), blob(64 << 10, 0))
        keys = [key_of(i) for i in range(1, 41)]
        with pytest.raises(CapacityError):
            self.put_many(tier, keys, [blob(64 << 10, i) for i in range(1, 41)])
        assert tier.used_bytes <= tier.capacity_bytes
        self.check(tier, key_of(0), blob(64 << 10, 0))
        for key, n, _ in tier.entries():      # what a non-atomic default put is intact
            assert n == 64 << 10
            if tier.stores_bytes:
                assert is_blob(tier.get(key))

    def test_delete_many(self, tier: Tier) -> None:
        keys = [key_of(i) for i in range(6)]
        self.put_many(tier, keys, [blob(5000, i) for i in range(6)])
        freed = tier.delete_many(keys[:3] + [key_of(99)])      # an absent key frees nothing
        assert freed == 3 * tier.charge(5000)
        assert tier.used_bytes == 3 * tier.charge(5000)
        assert [tier.contains(k) for k in keys] == [False] * 3 + [True] * 3
        self.check(tier, keys[4], blob(5000, 4))
        assert tier.delete_many([]) == 0

    @pytest.mark.parametrize("spaced", [True, False])
    def test_read_many_into(self, tier: Tier, spaced: bool) -> None:
        nbytes = 10_000
        keys = [key_of(i) for i in range(8)]
        datas = [blob(nbytes, 300 + i) for i in range(8)]
        self.put_many(tier, keys, datas)
        stride = tier.slot_bytes(nbytes) if spaced else nbytes + 4096
        assert stride >= nbytes
        order = [5, 0, 1, 2, 7, 3]                         # any order, a subset
        dst = np.zeros(len(order) * stride + 64, np.uint8)
        offsets = [j * stride for j in range(len(order))]
        got = tier.read_many_into([keys[i] for i in order], dst, offsets).result()
        assert got == len(order) * nbytes
        if tier.stores_bytes:
            for j, i in enumerate(order):
                assert np.array_equal(dst[offsets[j]:offsets[j] + nbytes], datas[i])
        with pytest.raises(KeyError):
            tier.read_many_into([keys[0], key_of(999)], dst, [0, stride]).result()
        with pytest.raises(ValueError):
            tier.read_many_into([keys[0]], dst, [dst.nbytes - 10]).result()   # past dst

    def test_stage_commit_abort(self, tier: Tier) -> None:
        nbytes = 6000
        keys = [key_of(i) for i in range(5)]
        buffers, which, offsets = tier.stage_many(keys, nbytes)
        assert len(which) == len(offsets) == 5
        for i in range(5):
            slot = buffers[int(which[i])][int(offsets[i]):int(offsets[i]) + nbytes]
            assert slot.flags.writeable and len(slot) == nbytes
            slot[:] = blob(nbytes, 400 + i)
        assert not any(tier.contains(k) for k in keys)       # invisible until committed
        with pytest.raises(ValueError):
            tier.stage_many([keys[0]], nbytes)                # already staged
        with pytest.raises(KeyError):
            tier.commit_many(keys[:2] + [key_of(77)])         # one not staged: none committed
        assert not any(tier.contains(k) for k in keys)
        tier.commit_many(keys[:3])
        tier.abort_many(keys[3:] + [key_of(78)])              # keys not staged are skipped
        for i in range(3):
            self.check(tier, keys[i], blob(nbytes, 400 + i))
        assert not tier.contains(keys[3]) and not tier.contains(keys[4])
        assert tier.used_bytes == 3 * tier.charge(nbytes)
        with pytest.raises(ValueError):
            tier.stage_many([keys[0], keys[0]], nbytes)       # repeated key
        buffers, which, offsets = tier.stage_many(keys[3:], nbytes)   # aborted keys stage again
        tier.abort_many(keys[3:])
        assert tier.used_bytes == 3 * tier.charge(nbytes)
        slot = tier.stage(keys[3], 1234)                      # the single-key forms
        slot[:] = blob(1234, 7)
        assert len(slot) == 1234 and not tier.contains(keys[3])
        tier.commit(keys[3])
        self.check(tier, keys[3], blob(1234, 7))
        tier.stage(keys[4], 1234)
        tier.abort(keys[4])
        assert not tier.contains(keys[4])
        assert tier.used_bytes == 3 * tier.charge(nbytes) + tier.charge(1234)

    def test_pin_view_locate_unpin(self, tier: Tier) -> None:
        nbytes = 7000
        keys = [key_of(i) for i in range(4)]
        datas = [blob(nbytes, 500 + i) for i in range(4)]
        self.put_many(tier, keys, datas)
        tier.pin_many(keys)
        try:
            view = tier.view(keys[1])
            assert len(view) == nbytes and not view.flags.writeable
            buffers, which, offsets = tier.locate(keys)
            assert len(which) == len(offsets) == 4
            located = [buffers[int(which[i])][int(offsets[i]):int(offsets[i]) + nbytes]
                       for i in range(4)]
            if tier.stores_bytes:
                assert np.array_equal(view, datas[1])
                assert all(np.array_equal(loc, d) for loc, d in zip(located, datas))
            tier.delete(keys[2])
            tier.put(keys[3], blob(nbytes, 999) if tier.stores_bytes else None, nbytes=nbytes).result()
            if tier.stores_bytes:
                # pinned bytes stay where locate said, even once deleted or replaced
                assert np.array_equal(located[2], datas[2])
                assert np.array_equal(located[3], datas[3])
        finally:
            tier.unpin_many(keys[:2])
            tier.unpin_many(keys[2:])
        assert not tier.contains(keys[2])
        self.check(tier, keys[3], blob(nbytes, 999))
        if tier.zero_copy:                 # pinning is all or none
            with pytest.raises(KeyError):
                tier.pin_many([keys[0], key_of(404)])
            tier.delete(keys[0])           # nothing was held: the slot is free at once
            assert tier.used_bytes == 2 * tier.charge(nbytes)

    def test_info_blobs(self, tier: Tier) -> None:
        assert tier.get_info("layout.page") is None
        tier.put_info("layout.page", b"pages:f16[2,16]")
        tier.put_info("layout.state", b"x" * 300)
        tier.put_info("layout.page", b"pages:bf16[2,16]")      # replaced
        assert tier.get_info("layout.page") == b"pages:bf16[2,16]"
        assert tier.get_info("layout.state") == b"x" * 300
