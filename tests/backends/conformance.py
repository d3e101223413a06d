"""The one conformance suite of the tier contract (``backends/base.py``).

Every backend's test module subclasses :class:`TierConformance` and implements
one hook; pytest then runs every test below against that backend::

    from tests.backends.conformance import TierConformance

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

from hybridstore.backends.base import ObjectKey, ObjectKind, Tier, object_key
from hybridstore.errors import CapacityError, ObjectTooLargeError, StoreClosedError

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
