"""hybridstore.backends.keytable: the C KeyTable and its dict twin against a dict model."""

from __future__ import annotations

import gc
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
from hybridstore.backends import keytable
from hybridstore.backends.keytable import PyKeyTable
from tests.twins import Impl, native_and_twin, running

impl = native_and_twin("keytable", keytable.KeyTable)

W = 17  # the store's object keys: a kind byte and a 16-byte hash
M64 = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1

Model = dict[bytes, tuple[int, int, bytes]]


def mix64(x: int) -> int:
    """splitmix64's finalizer, as native/src/keytable.c uses it."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def home(key: bytes, capacity: int) -> int:
    """The home slot of ``key`` in a C table of ``capacity`` slots."""
    first = int.from_bytes(key[:8], "little")
    last = int.from_bytes(key[-8:], "little")
    return mix64(last ^ mix64(first)) & (capacity - 1)


def keys_with_home(h: int, capacity: int, count: int, salt: int) -> list[bytes]:
    """``count`` 17-byte keys whose home slot in a table of ``capacity`` slots is ``h``."""
    found: list[bytes] = []
    i = 0
    while len(found) < count:
        k = bytes([salt]) + i.to_bytes(16, "little")
        if home(k, capacity) == h:
            found.append(k)
        i += 1
    return found


def twins(base: bytes, count: int) -> list[bytes]:
    """Keys that differ from ``base`` only in byte 8, which the C hash ignores (width 17)."""
    return [base[:8] + bytes([j]) + base[9:] for j in range(count)]


_rng = np.random.default_rng(2024)
RANDOM_KEYS = [bytes(r) for r in _rng.integers(0, 256, (24, W), dtype=np.uint8)]
# Keys that share home slots at the start and (to wrap around) the end of
# tables of 8..64 slots, keys that share all their hashed bytes, the extremes.
CLUSTERS = [k for cap in (8, 16, 32, 64) for h in (0, cap - 1)
            for k in keys_with_home(h, cap, 4, salt=cap + h)]
KEY_POOL = sorted({*RANDOM_KEYS, *CLUSTERS, *twins(RANDOM_KEYS[0], 6), *twins(bytes(W), 4),
                   b"\xff" * W})
KEYS = st.sampled_from(KEY_POOL)
COUNTS = st.one_of(st.integers(0, 100), st.sampled_from([4096, 1 << 40, INT64_MAX]))
METAS = st.sampled_from([b"", b"m", b"meta-" * 7, b"\x00"])


def pack(keys: list[bytes], form: str, width: int = W):
    """``keys`` as put_many / delete_many rows of the given form."""
    data = b"".join(keys)
    if form == "uint8":
        return np.frombuffer(data, np.uint8).reshape(len(keys), width).copy()
    if form == "void":
        return np.frombuffer(data, f"V{width}").copy()
    if form == "bytearray":
        return bytearray(data)
    if form == "memoryview":
        return memoryview(data)
    return data


FORMS = st.sampled_from(["uint8", "void", "bytes", "bytearray", "memoryview"])


def model_put_many(model: Model, keys: list[bytes], entry: tuple[int, int, bytes],
                   budget: int) -> tuple[int, int] | None | type[OverflowError]:
    """What put_many must do to ``model`` (changed in place unless rejected)."""
    trial = dict(model)
    added = delta = 0
    for k in keys:
        before = trial.get(k)
        added += before is None and k not in model
        delta += entry[1] - (0 if before is None else before[1])
        trial[k] = entry
        if not -(1 << 63) <= delta <= INT64_MAX:
            return OverflowError
    if delta > budget:
        return None
    model.clear()
    model.update(trial)
    return added, delta


def check_same(t, model: Model) -> None:
    assert len(t) == len(model)
    assert sorted(t.items()) == sorted((k, *e) for k, e in model.items())
    for k, e in model.items():
        assert t.get(k) == e
        assert k in t


# --------------------------------------------------------------------------
# random operation sequences against a dict


class KeyTableMachine(RuleBasedStateMachine):
    """Every operation on the table and on a dict model must agree."""

    def __init__(self, impl: Impl) -> None:
        super().__init__()
        self.t = impl(W)
        self.model: Model = {}

    @rule(data=st.data(), keys=st.lists(KEYS, max_size=40), nbytes=COUNTS, charged=COUNTS,
          meta=METAS, slack=st.one_of(st.none(), st.integers(-2, 2),
                                      st.sampled_from([-(1 << 70), 1 << 70])),
          form=FORMS)
    def put_many(self, data: st.DataObject, keys: list[bytes], nbytes: int, charged: int,
                 meta: bytes, slack: int | None, form: str) -> None:
        present = sorted(self.model)
        if present:  # replace some present keys too, repeated or not
            keys = keys + data.draw(st.lists(st.sampled_from(present), max_size=20))
            keys = data.draw(st.permutations(keys))
        entry = (nbytes, charged, meta)
        # the budget sits right at the expected delta (or far off), so that
        # batches are often rejected by one byte and rolled back
        probe = dict(self.model)
        expect_delta = model_put_many(probe, keys, entry, 1 << 80)
        base = expect_delta[1] if isinstance(expect_delta, tuple) else 0
        budget = (1 << 80) if slack is None else base + slack
        expect = model_put_many(self.model, keys, entry, budget)
        if expect is OverflowError:
            with pytest.raises(OverflowError):
                self.t.put_many(pack(keys, form), nbytes, charged, meta, budget)
        else:
            assert self.t.put_many(pack(keys, form), nbytes, charged, meta, budget) == expect

    @rule(data=st.data(), extra=st.lists(KEYS, max_size=8), form=FORMS)
    def delete_many(self, data: st.DataObject, extra: list[bytes], form: str) -> None:
        present = sorted(self.model)
        keys = data.draw(st.lists(st.sampled_from(present), max_size=30)) if present else []
        keys = data.draw(st.permutations(keys + extra))
        removed = freed = 0
        for k in keys:
            e = self.model.pop(k, None)
            if e is not None:
                removed += 1
                freed += e[1]
        assert self.t.delete_many(pack(keys, form)) == (removed, freed)

    @rule(key=KEYS, nbytes=COUNTS, charged=COUNTS, meta=METAS)
    def set(self, key: bytes, nbytes: int, charged: int, meta: bytes) -> None:
        assert self.t.set(key, nbytes, charged, meta) == self.model.get(key)
        self.model[key] = (nbytes, charged, meta)

    @rule(key=KEYS)
    def pop(self, key: bytes) -> None:
        assert self.t.pop(key) == self.model.pop(key, None)

    @rule(key=KEYS)
    def lookups(self, key: bytes) -> None:
        assert (key in self.t) == (key in self.model)
        assert self.t.get(key) == self.model.get(key)
        assert self.t.get(bytearray(key)) == self.model.get(key)

    @rule()
    def clear(self) -> None:
        self.t.clear()
        self.model.clear()

    @invariant()
    def same_contents(self) -> None:
        check_same(self.t, self.model)


def test_operation_sequences_match_a_dict(impl: Impl) -> None:
    run_state_machine_as_test(
        lambda: KeyTableMachine(impl),
        settings=settings(max_examples=150, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.parametrize("width", [8, 13, 16, 17, 24, 40])
def test_big_batches_grow_roll_back_and_match_a_dict(impl: Impl, width: int) -> None:
    """Batches of up to 3000 rows (fresh, present, repeated) through many resizes."""
    rng = np.random.default_rng(width)
    t = impl(width)
    model: Model = {}
    universe = [bytes(r) for r in rng.integers(0, 256, (30_000, width), dtype=np.uint8)]
    # keys equal in their hashed bytes (the first and last 8), for widths > 16
    if width > 16:
        universe += [universe[0][:8] + bytes([j % 256, j // 256]) * ((width - 16) // 2)
                     + bytes((width - 16) % 2) + universe[0][-8:] for j in range(300)]
        universe = list(dict.fromkeys(universe))
    fresh = peak = 0
    metas = [b"", b"a", b"page-meta"]
    for rounds in range(40):
        n_new = int(rng.integers(0, 2500))
        keys = universe[fresh:fresh + n_new]
        present = list(model)
        if present:
            keys += [present[i] for i in rng.integers(0, len(present), int(rng.integers(0, 500)))]
        keys += [keys[i] for i in rng.integers(0, len(keys), int(rng.integers(0, 50)))] if keys \
            else []
        keys = [keys[i] for i in rng.permutation(len(keys))]
        entry = (int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 20)),
                 metas[rounds % 3])
        probe = dict(model)
        full = model_put_many(probe, keys, entry, 1 << 80)
        assert isinstance(full, tuple)
        budget = full[1] + int(rng.integers(-1, 2))  # rejected a third of the time
        expect = model_put_many(model, keys, entry, budget)
        got = t.put_many(pack(keys, ["uint8", "void", "bytes"][rounds % 3], width), *entry,
                         budget)
        assert got == expect
        if expect is not None:
            fresh += n_new
        if rounds % 4 == 3:  # delete a random half of what is present, plus absent keys
            present = list(model)
            gone = [present[i] for i in rng.permutation(len(present))[:len(present) // 2]]
            gone += universe[fresh:fresh + 20] + gone[:10]
            removed = freed = 0
            for k in gone:
                e = model.pop(k, None)
                if e is not None:
                    removed += 1
                    freed += e[1]
            assert t.delete_many(pack(gone, "uint8", width)) == (removed, freed)
        assert len(t) == len(model)
        peak = max(peak, len(model))
    check_same(t, model)
    assert peak > 5000  # several resizes happened


# --------------------------------------------------------------------------
# deterministic cases


def test_single_key_methods(impl: Impl) -> None:
    t = impl(W)
    assert t.width == W and len(t) == 0 and not t
    k = bytes(range(W))
    assert t.get(k) is None and k not in t and t.pop(k) is None
    assert t.set(k, 10, 16) is None
    assert t.get(k) == (10, 16, b"") and k in t and len(t) == 1
    assert t.set(k, 11, 32, b"m") == (10, 16, b"")
    assert t.set(key=k, nbytes=12, charged=48, meta=b"n") == (11, 32, b"m")
    assert t.items() == [(k, 12, 48, b"n")]
    assert t.pop(k) == (12, 48, b"n") and len(t) == 0 and t.pop(k) is None
    # any contiguous bytes-like key
    for like in (bytearray(k), memoryview(k), np.frombuffer(k, np.uint8), np.frombuffer(k, "V17")):
        t.set(like, 1, 1)
        assert t.get(like) == (1, 1, b"") and like in t and len(t) == 1
        assert t.items() == [(k, 1, 1, b"")] and type(t.items()[0][0]) is bytes
        assert t.pop(like) == (1, 1, b"")


def test_put_many_counts_repeats_once_and_replacements_by_difference(impl: Impl) -> None:
    t = impl(W)
    a, b, c = RANDOM_KEYS[:3]
    assert t.put_many(pack([a, b, a, a], "uint8"), 5, 8, b"x", 16) == (2, 16)
    assert t.get(a) == (5, 8, b"x") and len(t) == 2
    # b is replaced (8 -> 24: +16), c is new (+24), c repeated (+0)
    assert t.put_many(pack([b, c, c], "bytes"), 20, 24, b"", 40) == (1, 40)
    assert t.put_many(pack([b, c], "bytes"), 1, 1, b"", -46) == (0, -46)  # shrinking is < 0
    assert sorted(t.items()) == sorted([(a, 5, 8, b"x"), (b, 1, 1, b""), (c, 1, 1, b"")])
    assert t.put_many(b"", 1, 1, b"", 0) == (0, 0)
    assert t.put_many(np.empty((0, W), np.uint8), 1, 1, b"", -1) is None  # 0 > -1
    assert t.put_many(pack([a], "uint8"), 1, 8, b"", 0) == (0, 0)  # same charge: delta 0


def test_rejected_batches_restore_everything(impl: Impl) -> None:
    t = impl(W, capacity_hint=4)
    keys = RANDOM_KEYS[:6]
    for i, k in enumerate(keys[:3]):
        t.set(k, i, 10 * i, bytes([i]) * i)
    before = sorted(t.items())
    mem = t.memory_bytes()
    # new keys (a resize), replacements and repeats, one byte over budget
    batch = [keys[3], keys[0], keys[4], keys[0], keys[1], keys[5], keys[3], keys[2]]
    expect = model_put_many({k: tuple(e) for k, *e in before}, batch, (7, 100, b"z"), 1 << 80)
    assert isinstance(expect, tuple)
    assert t.put_many(pack(batch, "uint8"), 7, 100, b"z", expect[1] - 1) is None
    assert sorted(t.items()) == before and len(t) == 3
    assert t.memory_bytes() >= mem  # only the capacity may have grown
    assert t.put_many(pack(batch, "uint8"), 7, 100, b"z", -(1 << 100)) is None
    assert sorted(t.items()) == before
    assert t.put_many(pack(batch, "uint8"), 7, 100, b"z", expect[1]) == expect
    assert all(t.get(k) == (7, 100, b"z") for k in keys) and len(t) == 6


def test_delta_overflow_raises_and_changes_nothing(impl: Impl) -> None:
    t = impl(W)
    a, b, c, d = RANDOM_KEYS[:4]
    with pytest.raises(OverflowError):
        t.put_many(pack([a, b, c], "uint8"), 1, 1 << 62, b"", 1 << 100)
    assert len(t) == 0
    with pytest.raises(OverflowError):  # 2 * (2**63 - 1)
        t.put_many(pack([a, b], "uint8"), 1, INT64_MAX, b"m", 1 << 100)
    assert len(t) == 0
    assert t.put_many(pack([a], "uint8"), 1, INT64_MAX, b"m", 1 << 100) == (1, INT64_MAX)
    t.set(b, 1, INT64_MAX)
    # two replacements each -(2**63 - 1): the partial sum leaves int64 going down
    with pytest.raises(OverflowError):
        t.put_many(pack([c, a, b, d], "uint8"), 2, 0, b"", 1 << 100)
    assert sorted(t.items()) == sorted([(a, 1, INT64_MAX, b"m"), (b, 1, INT64_MAX, b"")])
    # a partial sum that overflows and comes back still raises
    t.delete_many(pack([a, b], "bytes"))
    t.set(a, 0, 1 << 62)
    with pytest.raises(OverflowError):
        t.put_many(pack([b, c, a], "uint8"), 0, 1 << 62, b"", 1 << 100)
    assert t.items() == [(a, 0, 1 << 62, b"")]
    # freed bytes are exact beyond int64
    t.set(b, 0, INT64_MAX)
    t.set(c, 0, INT64_MAX)
    assert t.delete_many(pack([a, b, c, d, a], "uint8")) == (3, 2 * INT64_MAX + (1 << 62))


@pytest.mark.parametrize("width", [17, 24])
def test_keys_sharing_hashed_bytes_form_one_reachable_chain(impl: Impl, width: int) -> None:
    """Up to 200 keys with one hash: insert and delete them in every order."""
    rng = np.random.default_rng(width)
    base = bytes(rng.integers(0, 256, width, dtype=np.uint8))
    same = [base[:8] + j.to_bytes(width - 16, "little") + base[-8:] for j in range(200)]
    for _ in range(5):
        t = impl(width)
        order = [same[i] for i in rng.permutation(len(same))]
        assert t.put_many(pack(order, "uint8", width), 1, 2, b"", 1 << 20) == (200, 400)
        model = {k: (1, 2, b"") for k in same}
        for k in [same[i] for i in rng.permutation(len(same))][:150]:
            assert t.pop(k) == model.pop(k)
            assert all(t.get(s) == model.get(s) for s in same[::7])
        check_same(t, model)
        assert t.delete_many(pack(same, "bytes", width)) == (50, 100) and len(t) == 0


@pytest.mark.parametrize("capacity", [8, 16, 64])
@pytest.mark.parametrize("where", ["first", "last"])
def test_backward_shift_keeps_wrapping_clusters_reachable(impl: Impl, capacity: int,
                                                          where: str) -> None:
    rng = np.random.default_rng(capacity)
    h = 0 if where == "first" else capacity - 1
    n = capacity * 7 // 10  # a full table
    cluster = (keys_with_home(h, capacity, n // 2, salt=1)
               + keys_with_home((h + 1) % capacity, capacity, n - n // 2, salt=2))
    for _ in range(10):
        t = impl(W, capacity_hint=n)
        model: Model = {}
        for i, k in enumerate(cluster[j] for j in rng.permutation(n)):
            t.set(k, i, i)
            model[k] = (i, i, b"")
        for k in [cluster[j] for j in rng.permutation(n)]:
            assert t.pop(k) == model.pop(k)
            assert [t.get(c) for c in cluster] == [model.get(c) for c in cluster]
        assert len(t) == 0


def test_rows_forms(impl: Impl) -> None:
    keys = RANDOM_KEYS[:5]
    for form in ("uint8", "void", "bytes", "bytearray", "memoryview"):
        t = impl(W)
        assert t.put_many(pack(keys, form), 3, 4, b"", 100) == (5, 20)
        assert t.delete_many(pack(keys[:2] + keys[:1], form)) == (2, 8)
    t = impl(W)  # other integer views of the same bytes work too
    rows = np.frombuffer(b"".join(RANDOM_KEYS[:8]), np.uint64).copy()  # 136 bytes = 17 uint64
    assert t.put_many(rows, 1, 1, b"", 100) == (8, 8)
    assert sorted(k for k, *_ in t.items()) == sorted(RANDOM_KEYS[:8])


def test_meta_is_plain_bytes(impl: Impl) -> None:
    class Sub(bytes):
        pass

    t = impl(W)
    k = RANDOM_KEYS[0]
    t.set(k, 1, 1, Sub(b"sub"))
    assert t.get(k) == (1, 1, b"sub") and type(t.get(k)[2]) is bytes
    t.put_many(pack([k], "bytes"), 1, 1, Sub(b""), 10)
    assert t.get(k) == (1, 1, b"") and type(t.get(k)[2]) is bytes
    t.put_many(pack([k], "bytes"), 1, 1, Sub(b"x"), 10)
    assert type(t.items()[0][3]) is bytes


def test_clear_memory_and_reuse(impl: Impl) -> None:
    t = impl(W, capacity_hint=10)
    empty = t.memory_bytes()
    assert empty > 0 and sys.getsizeof(t) >= empty
    keys = [bytes(r) for r in np.random.default_rng(5).integers(0, 256, (5000, W), np.uint8)]
    assert t.put_many(pack(keys, "uint8"), 1, 1, b"m", 10**9) == (5000, 5000)
    assert t.memory_bytes() > empty
    t.clear()
    assert len(t) == 0 and t.items() == [] and keys[0] not in t
    assert t.memory_bytes() == empty
    t.set(keys[0], 2, 2)
    assert t.items() == [(keys[0], 2, 2, b"")]


def test_native_memory_is_compact() -> None:
    with running("keytable", native=True):
        t = keytable.KeyTable(W, capacity_hint=2048)
    base = t.memory_bytes()
    assert base < 4096 * 48 + 1024  # 48-byte slots for 17-byte keys
    keys = np.random.default_rng(0).integers(0, 256, (2048, W), np.uint8)
    t.put_many(keys, 1, 1, b"", 10**9)
    assert t.memory_bytes() == base  # the hint was enough


def test_the_switch_picks_the_type() -> None:
    """KeyTable() makes the C type when it is in use and the twin inside use_twins()."""
    with running("keytable", native=True):
        assert type(keytable.KeyTable(W)).__module__ == "hybridstore._cext.keytable"
        with _native.use_twins():
            t = keytable.KeyTable(W)
            assert type(t) is PyKeyTable
        assert type(keytable.KeyTable(W)).__module__ == "hybridstore._cext.keytable"
    assert type(t) is PyKeyTable                     # a made table keeps its type


# --------------------------------------------------------------------------
# references held on metas


def test_meta_references_are_released(impl: Impl) -> None:
    a = bytes(range(40)) + b"a"  # made at run time: not shared with constants
    b = bytes(range(40)) + b"b"
    ra, rb = sys.getrefcount(a), sys.getrefcount(b)
    t = impl(W)
    keys = RANDOM_KEYS[:10]
    t.set(keys[0], 1, 1, a)
    t.put_many(pack(keys[1:6], "uint8"), 1, 1, a, 100)
    if not isinstance(t, PyKeyTable):  # the C type counts its references
        assert sys.getrefcount(a) == ra + 6
    # rejected batch: nothing kept, nothing lost
    assert t.put_many(pack(keys, "uint8"), 1, 5, b, 0) is None
    assert sys.getrefcount(b) == rb
    with pytest.raises(OverflowError):
        t.put_many(pack(keys, "uint8"), 1, INT64_MAX, b, 1 << 100)
    assert sys.getrefcount(b) == rb
    assert t.get(keys[0]) == (1, 1, a)
    # overwrite by set, pop, delete_many
    assert t.set(keys[0], 1, 1, b) == (1, 1, a)
    assert t.pop(keys[0]) == (1, 1, b)
    assert sys.getrefcount(b) == rb
    t.put_many(pack(keys[4:8], "uint8"), 1, 1, b, 100)  # replaces two metas a
    assert t.delete_many(pack(keys[1:3], "uint8")) == (2, 2)
    t.set(keys[3], 1, 1)
    if not isinstance(t, PyKeyTable):  # the C type counts its references
        assert sys.getrefcount(a) == ra and sys.getrefcount(b) == rb + 4
    items = t.items()
    del items
    t.clear()
    assert sys.getrefcount(a) == ra and sys.getrefcount(b) == rb
    t.put_many(pack(keys, "uint8"), 1, 1, a, 100)
    t.set(keys[0], 1, 1, b)
    del t
    gc.collect()
    assert sys.getrefcount(a) == ra and sys.getrefcount(b) == rb


# --------------------------------------------------------------------------
# errors


def test_bad_construction(impl: Impl) -> None:
    for width in (7, 0, -1, 65537, 1 << 70):
        with pytest.raises(ValueError, match="width"):
            impl(width)
    with pytest.raises(ValueError, match="capacity_hint"):
        impl(W, -1)
    with pytest.raises(TypeError):
        impl(17.0)
    with pytest.raises(TypeError):
        impl(W, 1.5)
    with pytest.raises(TypeError):
        impl()
    assert impl(8).width == 8 and impl(np.int64(20), capacity_hint=100).width == 20


def test_bad_keys(impl: Impl) -> None:
    t = impl(W)
    k = RANDOM_KEYS[0]
    t.set(k, 1, 2, b"m")
    before = t.items()
    for bad in (k[:-1], k + b"\x00", b""):
        with pytest.raises(ValueError, match="17 bytes"):
            t.get(bad)
        with pytest.raises(ValueError, match="17 bytes"):
            t.set(bad, 1, 1)
        with pytest.raises(ValueError, match="17 bytes"):
            t.pop(bad)
        assert bad not in t
    for bad in ("x" * W, 5, None, [0] * W):
        for call in (t.get, t.pop, lambda x: t.set(x, 1, 1), lambda x: x in t):
            with pytest.raises(TypeError):
                call(bad)
    strided = np.frombuffer(k * 2, np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        t.get(strided)
    with pytest.raises(ValueError, match="contiguous"):
        strided in t  # noqa: B015
    assert t.items() == before


@pytest.mark.parametrize("nbytes, charged, meta, error", [
    (-1, 1, b"", ValueError),
    (1, -1, b"", ValueError),
    (-(1 << 70), 1, b"", ValueError),
    (1 << 63, 1, b"", OverflowError),
    (1, 1 << 63, b"", OverflowError),
    (1.0, 1, b"", TypeError),
    (1, "1", b"", TypeError),
    (1, 1, "m", TypeError),
    (1, 1, bytearray(b"m"), TypeError),
    (1, 1, None, TypeError),
])
def test_bad_values_change_nothing(impl: Impl, nbytes, charged, meta, error: type) -> None:
    t = impl(W)
    k0, k1 = RANDOM_KEYS[:2]
    t.set(k0, 1, 2, b"m")
    before = t.items()
    with pytest.raises(error):
        t.set(k0, nbytes, charged, meta)
    with pytest.raises(error):
        t.set(k1, nbytes, charged, meta)
    with pytest.raises(error):
        t.put_many(pack([k0, k1], "uint8"), nbytes, charged, meta, 1 << 100)
    assert t.items() == before


def test_bad_rows_and_budget(impl: Impl) -> None:
    t = impl(W)
    k = RANDOM_KEYS[0]
    t.set(k, 1, 2)
    before = t.items()
    for rows, error, match in [
        ([k], TypeError, "bytes-like"),
        (k.hex(), TypeError, "bytes-like"),
        (None, TypeError, "bytes-like"),
        (k + b"\x00", ValueError, "multiple of the key width 17"),
        (np.zeros((2, 16), np.uint8), ValueError, "multiple"),
        (np.zeros((2, 2 * W), np.uint8)[:, :W], ValueError, "contiguous"),
    ]:
        with pytest.raises(error, match=match):
            t.put_many(rows, 1, 1, b"", 100)
        with pytest.raises(error, match=match):
            t.delete_many(rows)
    with pytest.raises(TypeError):
        t.put_many(pack([k], "bytes"), 1, 1, b"", 1.5)
    with pytest.raises(TypeError):
        t.put_many(pack([k], "bytes"), 1, 1, b"")
    assert t.items() == before


def test_a_stepped_key_batch_goes_to_the_accounting_tier():
    from hybridstore.backends.accounting import AccountingTier
    from hybridstore.objects import KeyBatch, ObjectKind

    tier = AccountingTier("host", 1 << 20, read_gbps=10)
    batch = KeyBatch.of(ObjectKind.PAGE, b"".join(i.to_bytes(16, "little") for i in range(10)))
    tier.put_many(batch[::2], nbytes=100)
    assert tier.used_bytes == 500 and tier.contains(batch[4]) and not tier.contains(batch[5])
    assert tier.delete_many(batch[::-1]) == 500 and tier.used_bytes == 0
