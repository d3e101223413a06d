"""Tests of hybridstore.index.keys: native/twin agreement, known answers, chaining."""

from __future__ import annotations

import array
import hashlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridstore import _native
from hybridstore.errors import ConfigError, InvalidTokensError
from hybridstore.index import keys as K
from hybridstore.objects import HASH_BYTES
from tests.twins import REQUIRE_NATIVE, extension, needs_native, running

REPO_SRC = Path(__file__).resolve().parents[2] / "src"

needs_hashing = needs_native("hashing")


# --------------------------------------------------------------------------
# a literal, scalar transcription of the specification (slow; small inputs)

M64 = (1 << 64) - 1
P3, P4 = 0x165667B19E3779F9, 0x85EBCA77C2B2AE63
PRIME = (1 << 61) - 1
SECRET = bytes(range(32))
KEY = K.HashKey(SECRET, 1000)


def ref_lanes(secret: bytes, n: int) -> list[tuple[int, int]]:
    """(ra[i], rb[i]) straight from the specification's SHAKE-256 stream."""
    stream = hashlib.shake_256(b"hybridstore-v2 lanes" + secret).digest(16 * n)
    out = []
    for i in range(n):
        ra = int.from_bytes(stream[16 * i:16 * i + 8], "little") & PRIME
        rb = int.from_bytes(stream[16 * i + 8:16 * i + 16], "little") & PRIME
        out.append((ra % PRIME, rb % PRIME))
    return out


LANES = ref_lanes(SECRET, 1000)


def ref_mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def ref_rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def ref_finalize(plo: int, phi: int, a: int, b: int, n: int) -> tuple[int, int]:
    c = ref_mix64(plo ^ ref_rotl(phi, 29) ^ ((n * P3) & M64))
    return ref_mix64(a ^ c), ref_mix64((b + c + phi + P4) & M64)


def ref_sums(toks: list[int]) -> tuple[int, int]:
    a = sum(t * LANES[i][0] for i, t in enumerate(toks)) % PRIME
    b = sum(t * LANES[i][1] for i, t in enumerate(toks)) % PRIME
    return a, b


def ref_block_hash(parent: tuple[int, int], toks: list[int]) -> tuple[int, int]:
    return ref_finalize(parent[0], parent[1], *ref_sums(toks), len(toks))


def ref_id_hash(parent: tuple[int, int], block_id: int, ntok: int) -> tuple[int, int]:
    return ref_finalize(parent[0], parent[1], *ref_sums([block_id & 0xFFFFFFFF, block_id >> 32]),
                        ntok + (1 << 40))


def pair(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def ref_chain_tokens(toks: list[int], bs: int, parent: bytes) -> list[tuple[int, int]]:
    out, p = [], pair(parent)
    for s in range(0, len(toks), bs):
        p = ref_block_hash(p, toks[s:s + bs])
        out.append(p)
    return out


def ref_prefix_keys(toks: list[int], parent: bytes) -> list[tuple[int, int]]:
    return [ref_block_hash(pair(parent), toks[:j + 1]) for j in range(len(toks))]


def ref_chain_ids(ids: list[int], bs: int, last: int | None, parent: bytes) -> list[tuple[int, int]]:
    out, p = [], pair(parent)
    for k, i in enumerate(ids):
        p = ref_id_hash(p, i, last if (k == len(ids) - 1 and last is not None) else bs)
        out.append(p)
    return out


def rows(arr: np.ndarray) -> list[tuple[int, int]]:
    return [(int(lo), int(hi)) for lo, hi in arr]


# --------------------------------------------------------------------------
# backends


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Run under the twin ("python") or one native kernel ("native:<kernel>")."""
    if name == "python":
        with running("hashing", native=False):
            yield
        return
    hashing = extension("hashing")
    previous = hashing.set_kernel(name.split(":", 1)[1])
    try:
        with running("hashing", native=True):
            assert _native.hashing is hashing
            yield
    finally:
        hashing.set_kernel(previous)


def backend_names() -> list[str]:
    names = ["python"]
    if _native.available()["hashing"]:
        hashing = extension("hashing")
        names += [f"native:{k}" for k in hashing.available_kernels()]
    elif REQUIRE_NATIVE:
        names.append("native:missing")   # fails in backend(): the extension is required
    return names


BACKENDS = backend_names()


def results_per_backend(fn: Callable[[], np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name in BACKENDS:
        with backend(name):
            out[name] = fn()
    return out


def assert_all_equal(results: dict[str, np.ndarray]) -> None:
    twin = results["python"]
    assert twin.dtype == np.uint64 and twin.ndim == 2 and twin.shape[1] == 2
    for name, got in results.items():
        assert got.dtype == np.uint64, name
        assert got.shape == twin.shape, name
        assert got.flags.c_contiguous, name
        np.testing.assert_array_equal(got, twin, err_msg=f"{name} differs from the twin")


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=1200)
parents = st.binary(min_size=16, max_size=16)
block_sizes = st.integers(1, 300)


# --------------------------------------------------------------------------
# native vs twin


@needs_hashing
def test_native_module_is_selected_by_default() -> None:
    assert _native.available()["hashing"]
    with _native.use_twins(False):
        assert _native.hashing is extension("hashing")


@needs_hashing
@settings(max_examples=150, deadline=None)
@given(toks=token_lists, bs=block_sizes, parent=parents)
def test_native_matches_twin_chain_tokens(toks: list[int], bs: int, parent: bytes) -> None:
    t = np.array(toks, dtype=np.uint32)
    assert_all_equal(results_per_backend(lambda: K.chain_hash_tokens(t, bs, parent, KEY)))


@needs_hashing
@settings(max_examples=150, deadline=None)
@given(toks=token_lists, parent=parents)
def test_native_matches_twin_prefix_keys(toks: list[int], parent: bytes) -> None:
    t = np.array(toks, dtype=np.uint32)
    assert_all_equal(results_per_backend(lambda: K.block_prefix_keys(t, parent, KEY)))


@needs_hashing
@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 2**64 - 1), max_size=300), bs=block_sizes,
       last=st.one_of(st.none(), st.integers(1, 300)), parent=parents)
def test_native_matches_twin_chain_ids(ids: list[int], bs: int, last: int | None,
                                       parent: bytes) -> None:
    last = None if last is None else min(last, bs)
    assert_all_equal(results_per_backend(
        lambda: K.chain_hash_ids(ids, parent, last, block_size=bs, key=KEY)))


@needs_hashing
def test_native_matches_twin_large_input() -> None:
    rng = np.random.default_rng(7)
    t = rng.integers(0, 2**32, 70_001, dtype=np.uint64).astype(np.uint32)
    root = KEY.root("large")
    for bs in (1, 7, 16, 64, 257):
        assert_all_equal(results_per_backend(lambda: K.chain_hash_tokens(t, bs, root, KEY)))
    big = K.HashKey(SECRET, 5000)
    assert_all_equal(results_per_backend(lambda: K.block_prefix_keys(t[:5000], root, big)))


def test_the_largest_block_of_the_largest_ids_sums_exactly() -> None:
    """65536 tokens of 2**32 - 1: the partial sums are at their bound (no overflow)."""
    n = K.HashKey.MAX_POSITIONS
    key = K.HashKey(SECRET, n)
    lanes = ref_lanes(SECRET, n)
    t = np.full(n, 2**32 - 1, np.uint32)
    root = key.root("max")
    a = (2**32 - 1) * sum(ra for ra, _ in lanes) % PRIME
    b = (2**32 - 1) * sum(rb for _, rb in lanes) % PRIME
    want = ref_finalize(*pair(root), a, b, n)
    for name, got in results_per_backend(lambda: K.chain_hash_tokens(t, n, root, key)).items():
        assert rows(got) == [want], name
    for name, got in results_per_backend(lambda: K.block_prefix_keys(t, root, key)).items():
        assert rows(got[-1:]) == [want], name


@needs_hashing
def test_native_accepts_integer_buffers_of_the_right_itemsize() -> None:
    hashing = extension("hashing")
    plo, phi = K.bytes_to_key(KEY.root("buf"))
    tab = KEY.table
    u32 = np.arange(50, dtype=np.uint32)
    want = hashing.chain_tokens(u32, 8, plo, phi, tab)
    assert isinstance(want, bytearray) and len(want) == 7 * 16
    assert hashing.chain_tokens(u32.view(np.int32), 8, plo, phi, tab) == want
    assert hashing.chain_tokens(array.array("I", range(50)), 8, plo, phi, tab) == want
    assert hashing.chain_tokens(memoryview(u32), 8, plo, phi, tab) == want
    with pytest.raises(TypeError):
        hashing.chain_tokens(u32.astype(np.float32), 8, plo, phi, tab)
    with pytest.raises(TypeError):
        hashing.chain_tokens(u32.astype(np.uint64), 8, plo, phi, tab)
    with pytest.raises(TypeError):
        hashing.chain_tokens(u32.astype(">u4"), 8, plo, phi, tab)
    with pytest.raises((ValueError, BufferError, TypeError)):
        hashing.chain_tokens(np.arange(100, dtype=np.uint32)[::2], 8, plo, phi, tab)
    with pytest.raises(ValueError):
        hashing.chain_tokens(u32, 0, plo, phi, tab)
    ids = np.arange(5, dtype=np.uint64)
    assert hashing.chain_ids(ids.view(np.int64), 16, -1, plo, phi, tab) == \
        hashing.chain_ids(ids, 16, 16, plo, phi, tab)
    # the lane table: 4 rows of 4-byte ints covering the block size
    with pytest.raises(ValueError):
        hashing.chain_tokens(u32, 8, plo, phi, K.HashKey(SECRET, 4).table)
    with pytest.raises(ValueError):
        hashing.prefix_keys(u32, plo, phi, K.HashKey(SECRET, 40).table)
    with pytest.raises(TypeError):
        hashing.chain_tokens(u32, 8, plo, phi, tab.astype(np.uint64))


@needs_hashing
def test_native_hashing_from_threads_gives_sequential_results() -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
              for _ in range(4)]
    root = KEY.root("threads")
    with running("hashing", native=True):
        want = [K.chain_hash_tokens(a, 16, root, KEY) for a in arrays]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda a: K.chain_hash_tokens(a, 16, root, KEY), arrays))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


# --------------------------------------------------------------------------
# every backend against the literal specification


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(toks=st.lists(st.integers(0, 2**32 - 1), max_size=80), bs=st.integers(1, 20),
       parent=parents)
def test_backends_match_specification(name: str, toks: list[int], bs: int,
                                      parent: bytes) -> None:
    ids = [t * 0x9E3779B97F4A7C15 & M64 for t in toks]
    with backend(name):
        assert rows(K.chain_hash_tokens(toks, bs, parent, KEY)) == ref_chain_tokens(toks, bs, parent)
        assert rows(K.block_prefix_keys(toks, parent, KEY)) == ref_prefix_keys(toks, parent)
        last = (len(toks) % bs) or None
        assert rows(K.chain_hash_ids(ids, parent, last, block_size=bs, key=KEY)) == \
            ref_chain_ids(ids, bs, last, parent)


# --------------------------------------------------------------------------
# known answers (regression guard against silent algorithm changes)

# Computed with the reference transcription above under SECRET (bytes 0..31).
ROOT_EMPTY = "36cf31b41338a1a3620438fcb279ba0a"
ROOT_TENANT_A = "bd487c8898c53acd348e5e3672d892b8"
CHAIN_0_99_B16 = [
    "c7436cc6aac50bae26f7a1fc007e2c2b",
    "680c653907168cfb5a2227843898d7f7",
    "b791e12ec17c965db8b21618db52f732",
    "2d52ea345b9943ee49212dcdbcb69482",
    "1d9023db460670033e4bfe4e881221bd",
    "02e73e656bdbf81085538f1a4ba52231",
    "31ae2c52041ce496f6e58c3874b96a82",  # partial last block (tokens 96..99)
]
PREFIX_123_TENANT_A = [
    "cdfdcc8bbd39293f8870940fd8b14068",
    "6444701aacea4e2d6fd617e36dbdfa0b",
    "184a49c4bc7f3307c231873004e7fab6",
]
IDS_B16_LAST5 = [  # chain_hash_ids([0, 2**64-1, 12345], root(""), 5, block_size=16)
    "cd1ab28307da651fc11b937fcf0e002d",
    "1ef9e1aa6c212343aa23a68bd50fefd1",
    "ed5d6d5c761ea04eeccd45e34b250e85",
]
EXTREME_TOKENS_B3 = [  # chain_hash_tokens([2**32-1, 0, 7, 2**31], 3, root(b"\xff"))
    "b24b1324118a6c35320ec539146db05f",
    "642dca6491210231ca2d650505eb683c",
]


def test_namespace_root_known_answers() -> None:
    assert KEY.root("").hex() == ROOT_EMPTY
    assert KEY.root(b"").hex() == ROOT_EMPTY
    assert KEY.root("tenant-a").hex() == ROOT_TENANT_A
    assert KEY.root("tenant-a") == hashlib.blake2b(
        b"tenant-a", key=SECRET, digest_size=16, person=b"hybridstore-v2").digest()
    assert len(KEY.root("ünïcode")) == HASH_BYTES == 16
    assert K.HashKey(SECRET[::-1], 4).root("tenant-a") != KEY.root("tenant-a")


@pytest.mark.parametrize("name", BACKENDS)
def test_known_answers(name: str) -> None:
    root = KEY.root("")
    with backend(name):
        got = K.keys_to_bytes(K.chain_hash_tokens(list(range(100)), 16, root, KEY))
        assert [b.hex() for b in got] == CHAIN_0_99_B16
        got = K.keys_to_bytes(K.block_prefix_keys([1, 2, 3], KEY.root("tenant-a"), KEY))
        assert [b.hex() for b in got] == PREFIX_123_TENANT_A
        got = K.keys_to_bytes(K.chain_hash_ids([0, 2**64 - 1, 12345], root, 5, block_size=16, key=KEY))
        assert [b.hex() for b in got] == IDS_B16_LAST5
        got = K.keys_to_bytes(K.chain_hash_tokens([2**32 - 1, 0, 7, 2**31], 3,
                                                  KEY.root(b"\xff"), KEY))
        assert [b.hex() for b in got] == EXTREME_TOKENS_B3
    assert [pair(bytes.fromhex(h)) for h in CHAIN_0_99_B16] == \
        ref_chain_tokens(list(range(100)), 16, root)


# --------------------------------------------------------------------------
# consistency between the functions


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(toks=st.lists(st.integers(0, 2**32 - 1), max_size=400), bs=st.integers(1, 70),
       parent=parents)
def test_prefix_keys_agree_with_chain(name: str, toks: list[int], bs: int,
                                      parent: bytes) -> None:
    t = np.array(toks, dtype=np.uint32)
    with backend(name):
        chain = K.chain_hash_tokens(t, bs, parent, KEY)
        assert chain.shape == (-(-len(toks) // bs), 2)
        for k in range(chain.shape[0]):
            before = parent if k == 0 else K.key_to_bytes(chain[k - 1])
            block = t[k * bs:(k + 1) * bs]
            inner = K.block_prefix_keys(block, before, KEY)
            assert inner.shape == (len(block), 2)
            np.testing.assert_array_equal(inner[len(block) - 1], chain[k])
            # every inner offset is the key a partial last block ending there gets
            for j in {0, len(block) // 2, len(block) - 1}:
                end = k * bs + j + 1
                np.testing.assert_array_equal(K.chain_hash_tokens(t[:end], bs, parent, KEY)[-1],
                                              inner[j])
        # a block-aligned split chains: keys(t1 + t2) == keys(t1) ++ keys(t2 | last of t1)
        cut = (len(toks) // bs // 2) * bs
        if 0 < cut < len(toks):
            left = K.chain_hash_tokens(t[:cut], bs, parent, KEY)
            right = K.chain_hash_tokens(t[cut:], bs, K.key_to_bytes(left[-1]), KEY)
            np.testing.assert_array_equal(np.concatenate([left, right]), chain)


@pytest.mark.parametrize("name", BACKENDS)
def test_prefix_keys_beyond_a_block_size(name: str) -> None:
    t = np.arange(1000, dtype=np.uint32)
    root = KEY.root("long")
    with backend(name):
        inner = K.block_prefix_keys(t, root, KEY)
        np.testing.assert_array_equal(inner[-1], K.chain_hash_tokens(t, 1000, root, KEY)[0])
        np.testing.assert_array_equal(inner[299], K.chain_hash_tokens(t[:300], 1000, root, KEY)[0])


# --------------------------------------------------------------------------
# chaining properties


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), bs=st.integers(1, 40))
def test_single_token_change_changes_exactly_the_later_blocks(name: str, data: st.DataObject,
                                                              bs: int) -> None:
    toks = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
    i = data.draw(st.integers(0, len(toks) - 1))
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != toks[i]))
    changed = list(toks)
    changed[i] = new
    root = KEY.root("chain")
    with backend(name):
        a = K.chain_hash_tokens(toks, bs, root, KEY)
        b = K.chain_hash_tokens(changed, bs, root, KEY)
        first = i // bs
        np.testing.assert_array_equal(a[:first], b[:first])
        assert (a[first:] != b[first:]).all(axis=1).all()


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(prefix=st.lists(st.integers(0, 2**32 - 1), max_size=200),
       tail1=st.lists(st.integers(0, 2**32 - 1), max_size=50),
       tail2=st.lists(st.integers(0, 2**32 - 1), max_size=50), bs=st.integers(1, 32))
def test_equal_prefixes_give_equal_keys(name: str, prefix: list[int], tail1: list[int],
                                        tail2: list[int], bs: int) -> None:
    root = KEY.root("prefix")
    with backend(name):
        a = K.chain_hash_tokens(prefix + tail1, bs, root, KEY)
        b = K.chain_hash_tokens(prefix + tail2, bs, root, KEY)
        full = len(prefix) // bs
        np.testing.assert_array_equal(a[:full], b[:full])
        np.testing.assert_array_equal(a, K.chain_hash_tokens(np.array(prefix + tail1), bs, root, KEY))


@pytest.mark.parametrize("name", BACKENDS)
def test_different_namespaces_and_positions_give_different_keys(name: str) -> None:
    toks = list(range(64))
    with backend(name):
        a = K.chain_hash_tokens(toks, 16, KEY.root("tenant-a"), KEY)
        b = K.chain_hash_tokens(toks, 16, KEY.root("tenant-b"), KEY)
        assert (a != b).all(axis=1).all()
        # same multiset of tokens in another order, and a shorter block, differ
        root = KEY.root("")
        assert not np.array_equal(K.chain_hash_tokens([1, 2], 2, root, KEY),
                                  K.chain_hash_tokens([2, 1], 2, root, KEY))
        assert not np.array_equal(K.chain_hash_tokens([0], 2, root, KEY),
                                  K.chain_hash_tokens([0, 0], 2, root, KEY))
        # an id-chain key never equals the token key of a block of the same size
        ids = K.chain_hash_ids([5], root, block_size=1, key=KEY)
        assert not np.array_equal(ids, K.chain_hash_tokens([5], 1, root, KEY))
        all_keys = K.keys_to_bytes(K.chain_hash_tokens(list(range(5000)), 1, root, KEY))
        assert len(set(all_keys)) == 5000


@pytest.mark.parametrize("name", BACKENDS)
def test_chain_ids_last_tokens(name: str) -> None:
    root = KEY.root("ids")
    with backend(name):
        full = K.chain_hash_ids([1, 2, 3], root, block_size=16, key=KEY)
        np.testing.assert_array_equal(full, K.chain_hash_ids([1, 2, 3], root, 16, block_size=16, key=KEY))
        part = K.chain_hash_ids([1, 2, 3], root, 5, block_size=16, key=KEY)
        np.testing.assert_array_equal(full[:2], part[:2])
        assert (full[2] != part[2]).all()
        np.testing.assert_array_equal(
            K.chain_hash_ids(np.array([1, 2, 3], dtype=np.int64), root, 5, block_size=16, key=KEY), part)
        assert K.chain_hash_ids([], root, block_size=16, key=KEY).shape == (0, 2)


@pytest.mark.parametrize("name", BACKENDS)
def test_empty_inputs(name: str) -> None:
    root = KEY.root("")
    with backend(name):
        for fn in (lambda t: K.chain_hash_tokens(t, 16, root, KEY),
                   lambda t: K.block_prefix_keys(t, root, KEY)):
            for empty in ([], (), np.array([], dtype=np.int64), np.empty(0, dtype=np.uint32)):
                out = fn(empty)
                assert out.shape == (0, 2) and out.dtype == np.uint64


# --------------------------------------------------------------------------
# input handling


def test_as_token_array_fast_path_and_conversions() -> None:
    a = np.arange(10, dtype=np.uint32)
    assert K.as_token_array(a) is a
    for src in (list(range(10)), tuple(range(10)), range(10), np.arange(10, dtype=np.int8),
                np.arange(10, dtype=np.uint16), np.arange(10, dtype=np.int64),
                np.arange(10, dtype=np.uint64), np.arange(10, dtype=">i8"),
                np.arange(20, dtype=np.uint32)[::2] // 2):
        got = K.as_token_array(src)
        assert got.dtype == np.uint32 and got.flags.c_contiguous and got.ndim == 1
        np.testing.assert_array_equal(got, a)
    big = K.as_token_array([2**32 - 1, 2**31, 0])
    assert big.tolist() == [2**32 - 1, 2**31, 0]
    assert K.as_token_array(np.array([2**32 - 1], dtype=np.uint64)).tolist() == [2**32 - 1]


def test_torch_tensors_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    want = K.chain_hash_tokens(list(range(40)), 16, KEY.root(""), KEY)
    for t in (torch.arange(40, dtype=torch.int64), torch.arange(40, dtype=torch.int32),
              torch.arange(80, dtype=torch.int64)[::2] // 2,
              torch.arange(40, dtype=torch.int64).requires_grad_(False)):
        np.testing.assert_array_equal(K.chain_hash_tokens(t, 16, KEY.root(""), KEY), want)
        assert K.as_token_array(t).dtype == np.uint32
    ids = K.chain_hash_ids(torch.tensor([1, 2, 3]), KEY.root(""), block_size=4, key=KEY)
    np.testing.assert_array_equal(ids, K.chain_hash_ids([1, 2, 3], KEY.root(""),
                                                        block_size=4, key=KEY))
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([True]), torch.tensor([-1, 3]),
                torch.tensor([2**32]), torch.zeros(2, 2, dtype=torch.int64)):
        with pytest.raises(InvalidTokensError):
            K.as_token_array(bad)


@pytest.mark.parametrize("bad", [
    [1.0, 2.0],
    [1, 2.5],
    np.array([1.0, 2.0]),
    np.array([1, 2], dtype=np.float32),
    np.array([True, False]),
    [True, False],
    np.zeros((2, 2), dtype=np.int64),
    [[1, 2], [3, 4]],
    np.uint32(5),
    [-1],
    [3, -1],
    np.array([-5, 1], dtype=np.int64),
    np.array([-1], dtype=np.int8),
    [2**32],
    [2**64],
    [-1, 2**63],
    np.array([2**32], dtype=np.uint64),
    np.array([2**40], dtype=np.int64),
    "hello",
    b"abc",
    ["1", "2"],
    [None],
])
def test_bad_tokens_raise(bad: object) -> None:
    with pytest.raises(InvalidTokensError) as info:
        K.as_token_array(bad)
    assert isinstance(info.value, ValueError)
    assert len(str(info.value)) > 20  # says what is wrong and how to fix it
    with pytest.raises(InvalidTokensError):
        K.chain_hash_tokens(bad, 16, KEY.root(""), KEY)
    with pytest.raises(InvalidTokensError):
        K.block_prefix_keys(bad, KEY.root(""), KEY)


@pytest.mark.parametrize("bad", [[-1], np.array([-3], dtype=np.int64), [2**64], [1.5],
                                 np.zeros((1, 2), dtype=np.uint64), [[1]]])
def test_bad_ids_raise(bad: object) -> None:
    with pytest.raises(InvalidTokensError):
        K.chain_hash_ids(bad, KEY.root(""), block_size=16, key=KEY)


def test_bad_parameters_raise() -> None:
    root = KEY.root("")
    for bad_parent in (b"short", b"x" * 17, "0" * 16, None, 12):
        with pytest.raises(InvalidTokensError):
            K.chain_hash_tokens([1, 2], 16, bad_parent, KEY)  # type: ignore[arg-type]
    for bs in (0, -1, 1.5, True, None):
        with pytest.raises(ConfigError):
            K.chain_hash_tokens([1, 2], bs, root, KEY)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            K.chain_hash_ids([1, 2], root, block_size=bs, key=KEY)  # type: ignore[arg-type]
    for last in (0, 17, -1, 2.0):
        with pytest.raises(InvalidTokensError):
            K.chain_hash_ids([1, 2], root, last, block_size=16, key=KEY)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokensError):
        KEY.root(5)  # type: ignore[arg-type]
    # a parent may also be given as bytearray/memoryview or a key row
    keys = K.chain_hash_tokens([1, 2, 3], 2, root, KEY)
    for p in (bytearray(root), memoryview(root), np.frombuffer(root, dtype="<u8").copy()):
        np.testing.assert_array_equal(K.chain_hash_tokens([1, 2, 3], 2, p, KEY), keys)
    # chaining from a key row equals chaining from its bytes
    np.testing.assert_array_equal(K.chain_hash_tokens([4, 5], 2, keys[-1], KEY),
                                  K.chain_hash_tokens([4, 5], 2, K.key_to_bytes(keys[-1]), KEY))


# --------------------------------------------------------------------------
# byte forms and backend switching


def test_key_byte_forms_round_trip() -> None:
    keys = K.chain_hash_tokens(list(range(50)), 8, KEY.root("bytes"), KEY)
    as_bytes = K.keys_to_bytes(keys)
    assert len(as_bytes) == keys.shape[0]
    for row, b in zip(keys, as_bytes):
        assert len(b) == HASH_BYTES
        assert b == K.key_to_bytes(row) == K.key_to_bytes((int(row[0]), int(row[1])))
        assert K.bytes_to_key(b) == (int(row[0]), int(row[1]))
        assert b[:8] == int(row[0]).to_bytes(8, "little")
    assert K.keys_to_bytes(np.empty((0, 2), dtype=np.uint64)) == []
    with pytest.raises(InvalidTokensError):
        K.bytes_to_key(b"123")
    with pytest.raises(InvalidTokensError):
        K.key_to_bytes(np.zeros(3, dtype=np.uint64))
    with pytest.raises(InvalidTokensError):
        K.keys_to_bytes(np.zeros((3, 3), dtype=np.uint64))


def test_use_twins_switches_the_hashing_and_restores_it() -> None:
    """The twin really runs inside use_twins(): the keys come from a numpy chain, not C."""
    calls: list[str] = []
    twin = K._py_chain_tokens

    def spy(*args: object) -> np.ndarray:
        calls.append("twin")
        return twin(*args)

    start = _native.hashing
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "_py_chain_tokens", spy)
        with _native.use_twins():
            assert _native.hashing is None
            K.chain_hash_tokens([1, 2, 3], 2, KEY.root(""), KEY)
            assert calls == ["twin"]
            with _native.use_twins(False):
                assert _native.hashing is (extension("hashing") if _native.available()["hashing"]
                                           else None)
            assert _native.hashing is None
        assert _native.hashing is start
        calls.clear()
        K.chain_hash_tokens([1, 2, 3], 2, KEY.root(""), KEY)
        assert calls == ([] if start is not None else ["twin"])


def test_results_are_writable_native_and_twin() -> None:
    for name in BACKENDS:
        with backend(name):
            out = K.chain_hash_tokens(list(range(10)), 4, KEY.root(""), KEY)
            assert out.flags.writeable and out.dtype == np.uint64 and out.shape == (3, 2)


def test_keys_module_needs_no_torch() -> None:
    # Load only keys.py (+ errors, _native) with torch made unimportable; the
    # package __init__ files are bypassed so the check is about this module.
    code = f"""
import sys, types
sys.modules['torch'] = None  # any `import torch` now raises ImportError
src = {str(REPO_SRC)!r}
for name, path in (('hybridstore', src + '/hybridstore'),
                   ('hybridstore.index', src + '/hybridstore/index')):
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    sys.modules[name] = mod
import hybridstore.index.keys as K
KEY = K.HashKey.generate(2)
K.chain_hash_tokens([1, 2, 3], 2, KEY.root(''), KEY)
K.as_token_array(__import__('numpy').arange(3))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
