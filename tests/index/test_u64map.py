"""hybridstore.index.u64map: the C U64Map and its dict twin against a dict model."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from hybridstore import _native
from hybridstore.index import u64map
from hybridstore.index.u64map import PyU64Map
from tests.twins import Impl, native_and_twin, running

impl = native_and_twin("u64map", u64map.U64Map)

M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer, as native/src/u64map.c uses it for the home slot."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def keys_with_home(home: int, capacity: int, count: int, start: int = 0) -> list[int]:
    """``count`` keys whose home slot in a table of ``capacity`` slots is ``home``."""
    found: list[int] = []
    k = start
    while len(found) < count:
        if mix64(k) & (capacity - 1) == home:
            found.append(k)
        k += 1
    return found


# Keys that share home slots (at the start and, to wrap around, at the end of
# tables of 8..256 slots), that differ only in high bits, and the extremes.
CLUSTERS = [k for cap in (8, 16, 32, 64, 128, 256)
            for home in (0, cap - 1) for k in keys_with_home(home, cap, 5, start=cap << 20)]
KEY_POOL = sorted({0, 1, 2, M64, M64 - 1, 1 << 63, *(j << 40 for j in range(1, 9)), *CLUSTERS})
KEYS = st.one_of(st.sampled_from(KEY_POOL), st.integers(0, M64))
VALUES = st.integers(0, 2**31 - 1)


def u64(keys) -> np.ndarray:
    return np.array(keys, dtype=np.uint64)


def check_same(m, model: dict[int, int]) -> None:
    assert len(m) == len(model)
    assert sorted(m) == sorted(model)
    assert sorted(m.items()) == sorted(model.items())


# --------------------------------------------------------------------------
# random operation sequences against a dict


class U64MapMachine(RuleBasedStateMachine):
    """Every operation on the map and on a dict model must agree."""

    def __init__(self, impl: Impl) -> None:
        super().__init__()
        self.m = impl()
        self.model: dict[int, int] = {}

    @rule(key=KEYS, value=VALUES)
    def setitem(self, key: int, value: int) -> None:
        self.m[key] = value
        self.model[key] = value

    @rule(key=KEYS)
    def delitem(self, key: int) -> None:
        if key in self.model:
            del self.m[key]
            del self.model[key]
        else:
            with pytest.raises(KeyError):
                del self.m[key]

    @rule(key=KEYS)
    def lookups(self, key: int) -> None:
        assert (key in self.m) == (key in self.model)
        assert self.m.get(key) == self.model.get(key)
        assert self.m.get(key, -7) == self.model.get(key, -7)
        if key in self.model:
            assert self.m[key] == self.model[key]
        else:
            with pytest.raises(KeyError):
                self.m[key]

    @rule(key=KEYS, default=st.booleans())
    def pop(self, key: int, default: bool) -> None:
        if default:
            assert self.m.pop(key, None) == self.model.pop(key, None)
        elif key in self.model:
            assert self.m.pop(key) == self.model.pop(key)
        else:
            with pytest.raises(KeyError):
                self.m.pop(key)

    @rule(pairs=st.lists(st.tuples(KEYS, VALUES), max_size=40),
          dtype=st.sampled_from([np.int32, np.int64, np.uint32, np.uint64]))
    def set_many(self, pairs: list[tuple[int, int]], dtype: type) -> None:
        self.m.set_many(u64([k for k, _ in pairs]), np.array([v for _, v in pairs], dtype))
        self.model.update(pairs)

    @rule(keys=st.lists(KEYS, max_size=40))
    def get_many(self, keys: list[int]) -> None:
        out = np.full(len(keys), 99, dtype=np.int64)
        assert self.m.get_many(u64(keys), out) is None
        assert out.tolist() == [self.model.get(k, -1) for k in keys]

    @rule(data=st.data(), tail=st.lists(KEYS, max_size=5))
    def prefix_many(self, data: st.DataObject, tail: list[int]) -> None:
        present = sorted(self.model)
        head = data.draw(st.lists(st.sampled_from(present), max_size=20)) if present else []
        keys = head + tail
        out = np.full(len(keys), 99, dtype=np.int64)
        k = self.m.prefix_many(u64(keys), out)
        expect = 0
        while expect < len(keys) and keys[expect] in self.model:
            expect += 1
        assert k == expect
        assert out[:k].tolist() == [self.model[key] for key in keys[:k]]
        assert (out[k:] == 99).all()

    @rule(data=st.data(), extra=st.lists(KEYS, max_size=5))
    def delete_many(self, data: st.DataObject, extra: list[int]) -> None:
        present = sorted(self.model)
        keys = (data.draw(st.lists(st.sampled_from(present), max_size=30)) if present else [])
        keys += extra
        removed = sum(self.model.pop(k, None) is not None for k in keys)
        assert self.m.delete_many(u64(keys)) == removed

    @rule()
    def clear(self) -> None:
        self.m.clear()
        self.model.clear()

    @invariant()
    def same_contents(self) -> None:
        check_same(self.m, self.model)


def test_operation_sequences_match_a_dict(impl: Impl) -> None:
    run_state_machine_as_test(
        lambda: U64MapMachine(impl),
        settings=settings(max_examples=150, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))


# --------------------------------------------------------------------------
# deterministic cases


def test_extreme_keys_and_values(impl: Impl) -> None:
    m = impl()
    m[0] = 0
    m[M64] = 2**31 - 1
    assert m[0] == 0 and m[M64] == 2**31 - 1
    assert 0 in m and M64 in m and 1 not in m
    assert m.get(1) is None and m.get(1, "d") == "d"
    m[np.uint64(M64)] = 5  # any __index__ object is a key
    assert m[M64] == 5 and len(m) == 2


@pytest.mark.parametrize("capacity", [8, 16, 256])
@pytest.mark.parametrize("home", ["first", "last"])
def test_backward_shift_keeps_clusters_reachable(impl: Impl, capacity: int, home: str) -> None:
    """Delete from long probe chains (wrapping past the table's end) in every order."""
    rng = np.random.default_rng(capacity)
    h = 0 if home == "first" else capacity - 1
    n = capacity * 7 // 10  # a full table
    cluster = keys_with_home(h, capacity, n // 2) + keys_with_home((h + 1) % capacity, capacity,
                                                                   n - n // 2, start=1 << 32)
    for _ in range(20):
        m = impl(capacity_hint=n)
        model = {}
        for k in rng.permutation(cluster).tolist():
            m[k] = model[k] = len(model)
        for k in rng.permutation(cluster).tolist():
            del m[k]
            del model[k]
            out = np.empty(len(cluster), np.int64)
            m.get_many(u64(cluster), out)
            assert out.tolist() == [model.get(c, -1) for c in cluster]
        assert len(m) == 0


def test_many_deletes_then_lookups(impl: Impl) -> None:
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(0, 2**64, size=20_000, dtype=np.uint64, endpoint=False))
    keys = np.concatenate([keys, u64([j << 40 for j in range(1, 1000)] + [0, M64])])
    keys = np.unique(keys)
    values = rng.integers(0, 2**31, size=keys.size, dtype=np.int64)
    m = impl()
    m.set_many(keys, values)
    model = dict(zip(keys.tolist(), values.tolist()))
    for rounds in range(3):
        gone = rng.choice(keys, size=keys.size // 2, replace=False)
        assert m.delete_many(gone) == sum(model.pop(k, None) is not None for k in gone.tolist())
        out = np.empty(keys.size, np.int64)
        m.get_many(keys, out)
        assert out.tolist() == [model.get(k, -1) for k in keys.tolist()]
        back = rng.choice(keys, size=keys.size // 4, replace=False)
        m.set_many(back, np.full(back.size, rounds, np.int32))
        model.update(dict.fromkeys(back.tolist(), rounds))
        check_same(m, model)


def test_set_many_resizes_and_keeps_the_last_duplicate(impl: Impl) -> None:
    m = impl()
    keys = np.arange(50_000, dtype=np.uint64) << np.uint64(40)  # equal low 40 bits
    keys[-1] = keys[0]
    values = np.arange(keys.size, dtype=np.int32)
    m.set_many(keys, values)
    assert len(m) == keys.size - 1
    assert m[0] == keys.size - 1
    out = np.empty(keys.size, np.int64)
    m.get_many(keys, out)
    assert out[1:-1].tolist() == values[1:-1].tolist()


def test_prefix_many_stops_at_the_first_missing_key(impl: Impl) -> None:
    m = impl()
    m.set_many(u64([5, 6, 7, 9]), np.array([50, 60, 70, 90], np.int64))
    out = np.full(5, -5, np.int64)
    assert m.prefix_many(u64([5, 6, 7, 8, 9]), out) == 3
    assert out.tolist() == [50, 60, 70, -5, -5]
    assert m.prefix_many(u64([]), np.empty(0, np.int64)) == 0
    assert m.prefix_many(u64([9, 5]), out[:2]) == 2
    m.get_many(u64([8, 9]), out[:2])
    assert out[:2].tolist() == [-1, 90]


def test_int64_keys_are_read_bit_for_bit(impl: Impl) -> None:
    m = impl()
    m.set_many(np.array([-1, 3], np.int64), np.array([1, 2], np.int32))
    assert m[M64] == 1 and m[3] == 2
    out = np.empty(2, np.int64)
    m.get_many(np.array([-1, 4], np.int64), out)
    assert out.tolist() == [1, -1]
    assert m.delete_many(np.array([-1], np.int64)) == 1 and M64 not in m


def test_iteration_and_items(impl: Impl) -> None:
    m = impl()
    model = {k: i for i, k in enumerate([0, M64, 7, 1 << 40])}
    for k, v in model.items():
        m[k] = v
    assert sorted(m) == sorted(model)
    assert sorted(m.items()) == sorted(model.items())
    assert all(isinstance(k, int) for k in m)
    assert list(impl()) == [] and impl().items() == []
    it = iter(m)
    next(it)
    m[123] = 1  # a new key: the iteration is void
    with pytest.raises(RuntimeError):
        next(it)
    for k in m:  # overwriting values is fine
        m[k] = 3
    assert set(dict(m.items()).values()) == {3}


def test_clear_and_len(impl: Impl) -> None:
    m = impl(capacity_hint=100)
    m.set_many(np.arange(1000, dtype=np.uint64), np.arange(1000, dtype=np.int64))
    assert len(m) == 1000 and bool(m)
    m.clear()
    assert len(m) == 0 and not m and 5 not in m
    m[5] = 1
    assert m[5] == 1 and len(m) == 1


# --------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("key, error", [(2**64, OverflowError), (-1, OverflowError),
                                        (1.0, TypeError), ("1", TypeError), (None, TypeError)])
def test_bad_keys(impl: Impl, key, error: type) -> None:
    m = impl()
    m[1] = 1
    with pytest.raises(error):
        m[key] = 1
    with pytest.raises(error):
        m[key]
    with pytest.raises(error):
        del m[key]
    with pytest.raises(error):
        key in m  # noqa: B015
    with pytest.raises(error):
        m.get(key)
    with pytest.raises(error):
        m.pop(key, None)
    assert m.items() == [(1, 1)]


@pytest.mark.parametrize("value, error", [(-1, ValueError), (-(2**70), ValueError),
                                          (2**31, OverflowError), (2**70, OverflowError),
                                          (1.5, TypeError), ("3", TypeError)])
def test_bad_values(impl: Impl, value, error: type) -> None:
    m = impl()
    with pytest.raises(error):
        m[1] = value
    assert len(m) == 0


def test_missing_keys(impl: Impl) -> None:
    m = impl()
    m[1] = 10
    with pytest.raises(KeyError):
        m[2]
    with pytest.raises(KeyError):
        del m[2]
    with pytest.raises(KeyError):
        m.pop(2)
    assert m.pop(2, "d") == "d" and m.pop(1) == 10 and len(m) == 0
    with pytest.raises(TypeError):
        m.pop(1, 2, 3)
    with pytest.raises(TypeError):
        m.get()


@pytest.mark.parametrize("values, error", [
    (np.array([1, -1], np.int32), ValueError),
    (np.array([1, -1], np.int64), ValueError),
    (np.array([1, 2**31], np.uint32), OverflowError),
    (np.array([1, 2**31], np.int64), OverflowError),
    (np.array([1, M64], np.uint64), OverflowError),
])
def test_set_many_bad_values_store_nothing(impl: Impl, values: np.ndarray, error: type) -> None:
    m = impl()
    m[7] = 7
    with pytest.raises(error):
        m.set_many(u64([1, 2]), values)
    assert m.items() == [(7, 7)]


KEYS_2 = u64([1, 2])


@pytest.mark.parametrize("keys, error", [
    (np.array([1.0, 2.0]), TypeError),
    (np.array([1, 2], np.int32), TypeError),
    (np.array([1, 2], np.uint32), TypeError),
    (np.array([1, 2], ">u8"), TypeError),
    (np.array([True, False]), TypeError),
    (b"\x00" * 16, TypeError),
    ([1, 2], TypeError),
    (np.zeros((2, 1), np.uint64), ValueError),
    (np.array(5, np.uint64), ValueError),
    (np.zeros(4, np.uint64)[::2], ValueError),
])
def test_bad_key_buffers(impl: Impl, keys, error: type) -> None:
    m = impl()
    out = np.empty(2, np.int64)
    with pytest.raises(error):
        m.get_many(keys, out)
    with pytest.raises(error):
        m.prefix_many(keys, out)
    with pytest.raises(error):
        m.set_many(keys, np.zeros(2, np.int32))
    with pytest.raises(error):
        m.delete_many(keys)
    assert len(m) == 0


@pytest.mark.parametrize("out, error", [
    (np.empty(2, np.uint64), TypeError),
    (np.empty(2, np.int32), TypeError),
    (np.empty(2, np.float64), TypeError),
    (np.empty(3, np.int64), ValueError),
    (np.empty(1, np.int64), ValueError),
    (np.empty((2, 1), np.int64), ValueError),
    (np.empty(4, np.int64)[::2], ValueError),
    (np.frombuffer(bytes(16), np.int64), ValueError),  # read-only
])
def test_bad_out_buffers(impl: Impl, out, error: type) -> None:
    m = impl()
    with pytest.raises(error):
        m.get_many(KEYS_2, out)
    with pytest.raises(error):
        m.prefix_many(KEYS_2, out)


@pytest.mark.parametrize("values, error", [
    (np.zeros(2, np.float64), TypeError),
    (np.zeros(2, np.int16), TypeError),
    (np.zeros(3, np.int32), ValueError),
    (np.zeros(1, np.int64), ValueError),
    (np.zeros((2, 1), np.int32), ValueError),
])
def test_bad_value_buffers(impl: Impl, values, error: type) -> None:
    m = impl()
    with pytest.raises(error):
        m.set_many(KEYS_2, values)
    assert len(m) == 0


@pytest.mark.parametrize("hint, error", [(-1, ValueError), (1.5, TypeError)])
def test_bad_capacity_hint(impl: Impl, hint, error: type) -> None:
    with pytest.raises(error):
        impl(hint)


# --------------------------------------------------------------------------
# memory


def test_sizeof_reports_memory_bytes(impl: Impl) -> None:
    m = impl()
    m.set_many(np.arange(1000, dtype=np.uint64), np.arange(1000, dtype=np.int32))
    assert sys.getsizeof(m) >= m.memory_bytes() > 1000 * 12


def test_native_table_is_compact() -> None:
    with running("u64map", native=True):
        m = u64map.U64Map()
    empty = m.memory_bytes()
    assert sys.getsizeof(m) == empty < 256
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64, size=100_000, dtype=np.uint64, endpoint=False)
    m.set_many(keys, np.zeros(keys.size, np.int32))
    per_entry = m.memory_bytes() / len(m)
    assert 12 / 0.7 <= per_entry <= 2 * 12 / 0.7 + 0.01  # load factor in (0.35, 0.7]
    m.clear()
    assert m.memory_bytes() == empty


def test_native_capacity_hint_presizes() -> None:
    with running("u64map", native=True):
        m = u64map.U64Map(capacity_hint=10_000)
        size = m.memory_bytes()
        assert size > u64map.U64Map().memory_bytes()
    m.set_many(np.arange(10_000, dtype=np.uint64), np.zeros(10_000, np.int32))
    assert m.memory_bytes() == size


def test_the_switch_picks_the_type() -> None:
    """U64Map() makes the C type when it is in use and the twin inside use_twins()."""
    with running("u64map", native=True):
        assert type(u64map.U64Map()).__module__ == "hybridstore._cext.u64map"
        with _native.use_twins():
            m = u64map.U64Map(4)
            assert type(m) is PyU64Map
        assert type(u64map.U64Map()).__module__ == "hybridstore._cext.u64map"
    assert type(m) is PyU64Map                       # a made map keeps its type
