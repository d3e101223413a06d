"""Chained 128-bit prefix keys of token blocks, keyed by a per-store secret.

Every KV page and recurrent-state snapshot in hybridstore is stored under the
key of the token prefix it ends.  A key is 128 bits, kept as a ``(lo, hi)`` pair
of uint64 (a row of a ``(n, 2)`` uint64 array) or as its 16-byte form: ``lo``
little-endian followed by ``hi`` little-endian.

The hash
--------
A store draws a 32-byte secret ``s`` (kept with its disk tier, mode 0600; see
:class:`HashKey`).  From it come two lanes of multipliers per position ``i`` of
a block, uniform in ``[0, p)`` with ``p = 2**61 - 1``::

    stream = shake_256(b"hybridstore-v2 lanes" + s)
    ra[i]  = le64(stream[16i : 16i+8])    & (2**61 - 1)   (the value p counts as 0)
    rb[i]  = le64(stream[16i+8 : 16i+16]) & (2**61 - 1)

A block of ``n`` token ids ``t[0..n-1]`` (each in ``[0, 2**32)``) hashes to the
two multilinear sums, then a chained finalize (uint64 arithmetic with
wraparound, ``mix64`` = SplitMix64's finalizer)::

    block_hash((plo, phi), t) = finalize(plo, phi, a, b, n)
        a = sum(t[i] * ra[i]) mod p,   b = sum(t[i] * rb[i]) mod p

    finalize(plo, phi, a, b, n):
        c  = mix64(plo ^ rotl(phi, 29) ^ (n * P3))
        return (mix64(a ^ c), mix64(b + c + phi + P4))

    id_hash((plo, phi), id, ntok) = finalize(plo, phi, a, b, ntok + 2**40)
        with the block hash's a, b over the two 32-bit halves [id & (2**32-1), id >> 32]

    namespace_root(ns, s) = blake2b(utf8(ns), key=s, digest_size=16, person=b"hybridstore-v2")
    engine_key(root, e)   = xxh3_128(e, seed=blake2b(root, digest_size=8,
                                                     person=b"hybridstore-eng"))

with ``P3 = 0x165667B19E3779F9`` and ``P4 = 0x85EBCA77C2B2AE63``.

What it guarantees (Carter-Wegman): ``(a, b)`` is the multilinear hash of the
block under independent uniform keys, so two different blocks of the same length
give equal ``(a, b)`` with probability ``p**-2 < 2**-121`` over the secret, and
``finalize`` is injective in ``(a, b)`` for a given parent and length.  The keys
never leave the store and a prompt reveals only whether it hit, so a tenant who
does not know ``s`` can do no better than guess: every try succeeds with about
``2**-121`` times the number of prefixes held.  What it does not guarantee:
anyone who reads the secret (the store's owner, root, a leaked backup) can
build colliding blocks at once by lattice reduction; the sums are linear.  The
hash is a guard against crafted prompts, not a signature.  Timing still shows
whether a prefix is cached: tenants who must not learn that need their own
namespace (their own root) or their own store.

Because ``a`` and ``b`` are sums of per-token terms, the keys at every inner
offset of a block are prefix sums (:func:`block_prefix_keys`): checkpoints
inside a block cost no more hashing than the block.

Engines (SGLang, vLLM) hand the store their own chained page hashes instead of
token ids; :func:`engine_keys` maps each to a 128-bit key directly.  Those
hashes are already chained SHA-256 (equal hash, equal prefix), so no chaining
is added; seeding the map with the (keyed) namespace root keeps namespaces apart.

A sequence is cut into blocks of ``block_size`` tokens (the last one may be
partial); block 0's parent is the namespace root and block k's parent is
block k-1's key, so a key names the whole prefix up to the end of its block.

Backends
--------
The public functions run the C extension ``hybridstore._cext.hashing``
(``native/src/hashing.c``) when it is built and otherwise its numpy twin in
this module; both give the same keys bit for bit.  :mod:`hybridstore._native`
makes the choice (``_native.hashing`` is the module in use, ``None`` for the
twin) and ``_native.use_twins()`` selects the twin for tests and benchmarks.
Both compute ``t * r mod p`` from 32-bit halves (``r = rh * 2**32 + rl``) in
four 64-bit partial sums that cannot overflow for blocks of up to 65536 tokens,
and reduce once per key (:func:`_reduce_sums`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np
import xxhash

from hybridstore import _native
from hybridstore.errors import ConfigError, InvalidTokensError
from hybridstore.objects import HASH_BYTES

__all__ = [
    "HashKey",
    "as_token_array",
    "block_prefix_keys",
    "bytes_to_key",
    "chain_hash_ids",
    "chain_hash_tokens",
    "engine_keys",
    "key_to_bytes",
    "keys_to_bytes",
    "namespace_root",
]

_M64 = (1 << 64) - 1
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_ID_NTOK_TAG = 1 << 40
_PERSON = b"hybridstore-v2"
_LANES_DOMAIN = b"hybridstore-v2 lanes"
PRIME = (1 << 61) - 1
"""The lanes' modulus ``p``: a Mersenne prime, so reduction is a shift and an add."""

_U64 = np.uint64
_S29, _S30, _S27, _S31, _S32, _S61 = (_U64(29), _U64(30), _U64(27), _U64(31), _U64(32),
                                      _U64(61))
_NP_P3, _NP_PRIME = _U64(_P3), _U64(PRIME)
_NP_C1, _NP_C2 = _U64(_C1), _U64(_C2)
_NP_M29, _NP_M32 = _U64((1 << 29) - 1), _U64((1 << 32) - 1)

# Tokens hashed per numpy pass of the twin (bounds its temporaries).
_TWIN_CHUNK_TOKENS = 1 << 18


# --------------------------------------------------------------------------
# the secret


class HashKey:
    """A store's hashing secret and the lane multipliers drawn from it.

    The secret never appears in ``repr`` and is kept by its store in the disk
    tier's catalog (a 0600 file); a store without a disk tier draws a fresh one.

    Attributes:
        positions: the longest block (in tokens) the key can hash.
        table: ``(4, positions)`` read-only uint32 array, the multipliers split
            in 32-bit halves: rows ``ra_lo, ra_hi, rb_lo, rb_hi`` (``ra[i] =
            ra_hi[i] * 2**32 + ra_lo[i]``; the module docstring gives ``ra``/``rb``).
    """

    SECRET_BYTES = 32
    MAX_POSITIONS = 1 << 16

    __slots__ = ("_secret", "positions", "table")

    def __init__(self, secret: bytes, positions: int) -> None:
        """Derive the multipliers of ``positions`` block positions from ``secret``.

        Args:
            secret: 16 to 64 random bytes (:data:`SECRET_BYTES` when drawn here).
            positions: block size to support, in ``[1, 65536]`` (at least 2 are
                always derived: a block id hashes as two 32-bit halves).

        Raises:
            ConfigError: a short or non-bytes secret, or ``positions`` out of range.
        """
        if not isinstance(secret, (bytes, bytearray)) or not 16 <= len(secret) <= 64:
            raise ConfigError("a hash secret is 16 to 64 random bytes, got "
                              + (f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray))
                                 else type(secret).__name__))
        if isinstance(positions, bool) or not isinstance(positions, int) \
                or not 1 <= positions <= self.MAX_POSITIONS:
            raise ConfigError(f"a hash key covers 1..{self.MAX_POSITIONS} positions, "
                              f"got {positions!r}")
        self._secret = bytes(secret)
        self.positions = max(positions, 2)
        raw = hashlib.shake_256(_LANES_DOMAIN + self._secret).digest(16 * self.positions)
        lanes = np.frombuffer(raw, "<u8").astype(np.uint64).reshape(-1, 2) & _NP_PRIME
        lanes[lanes == _NP_PRIME] = 0
        table = np.empty((4, self.positions), np.uint32)
        table[0], table[1] = lanes[:, 0] & _NP_M32, lanes[:, 0] >> _S32
        table[2], table[3] = lanes[:, 1] & _NP_M32, lanes[:, 1] >> _S32
        table.setflags(write=False)
        self.table = table

    @classmethod
    def generate(cls, positions: int) -> HashKey:
        """A key under a fresh secret from ``os.urandom``."""
        return cls(os.urandom(cls.SECRET_BYTES), positions)

    @property
    def secret(self) -> bytes:
        """The secret, for its store to persist (never log it)."""
        return self._secret

    def root(self, namespace: str | bytes) -> bytes:
        """The 16-byte root key of a namespace under this secret (:func:`namespace_root`)."""
        return namespace_root(namespace, self)

    def __repr__(self) -> str:
        return f"HashKey(positions={self.positions})"


# --------------------------------------------------------------------------
# keys and their byte form


def namespace_root(namespace: str | bytes, key: HashKey) -> bytes:
    """The 16-byte root key of a namespace (the parent of every first block).

    Args:
        namespace: tenant salt; ``str`` is encoded as UTF-8.
        key: the store's hash key; the root is keyed by its secret, so roots
            (and every key chained from them) differ between secrets.

    Returns:
        ``blake2b(namespace, key=secret, digest_size=16, person=b"hybridstore-v2")``.

    Raises:
        InvalidTokensError: ``namespace`` is neither ``str`` nor bytes-like.
    """
    data = _utf8_or_bytes(namespace, "namespace must be str or bytes",
                          "pass the tenant name as a string")
    return hashlib.blake2b(data, key=key.secret, digest_size=HASH_BYTES,
                           person=_PERSON).digest()


def _utf8_or_bytes(value: Any, what: str, fix: str) -> bytes:
    """A ``str`` (as UTF-8) or bytes-like value as bytes; InvalidTokensError otherwise."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidTokensError(f"{what}, got {type(value).__name__}; {fix}")


_ENGINE_PERSON = b"hybridstore-eng"


def _engine_seed(root: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(root, digest_size=8, person=_ENGINE_PERSON).digest(),
                          "little")


def engine_keys(engine: Any, root: bytes) -> np.ndarray:
    """Index keys of an engine's chained page hashes, a ``(n, 2)`` uint64 array.

    Each key is XXH3-128 of the hash's bytes, seeded from the namespace root
    (``engine_key`` in the module docstring).  The engines' hashes are already
    collision-resistant chains (SHA-256 by default in both), so this map only has
    to keep them apart and separate namespaces; it costs well under a microsecond a
    page, which matters because SGLang passes a sequence's whole chain on every call.

    Args:
        engine: the hashes in order: ``bytes`` (vLLM: block hash + group index)
            or ``str`` (SGLang: 64 hex digits), hashed as UTF-8.
        root: the namespace root (:func:`namespace_root`).

    Raises:
        InvalidTokensError: a hash is empty or neither ``str`` nor bytes-like.
    """
    seed = _engine_seed(root)
    digest = xxhash.xxh3_128_digest
    parts = []
    for i, e in enumerate(engine):
        raw = _utf8_or_bytes(e, f"engine page key {i} must be str or bytes",
                             "pass the engine's hashes as str (SGLang) or bytes (vLLM)")
        if not raw:
            raise InvalidTokensError(f"engine page key {i} is empty")
        parts.append(digest(raw, seed=seed))
    return np.frombuffer(b"".join(parts), dtype="<u8").astype(np.uint64).reshape(-1, 2)


def key_to_bytes(row: Any) -> bytes:
    """The 16-byte form of one key.

    Args:
        row: a ``(2,)`` uint64 array ``[lo, hi]`` (a row of a key array) or a
            ``(lo, hi)`` pair of ints.

    Returns:
        ``lo`` little-endian followed by ``hi`` little-endian.
    """
    arr = np.asarray(row, dtype="<u8")
    if arr.shape != (2,):
        raise InvalidTokensError(f"a key row has shape (2,) [lo, hi], got shape {arr.shape}")
    return arr.tobytes()


def keys_to_bytes(arr: np.ndarray) -> list[bytes]:
    """The 16-byte forms of a ``(n, 2)`` key array, in order.

    Args:
        arr: keys as returned by :func:`chain_hash_tokens` and friends.

    Returns:
        ``n`` byte strings of :data:`HASH_BYTES` bytes each.
    """
    a = np.asarray(arr)
    if a.ndim != 2 or a.shape[1] != 2:
        raise InvalidTokensError(f"a key array has shape (n, 2), got shape {a.shape}")
    raw = a.astype("<u8", copy=False).tobytes()
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def bytes_to_key(b: bytes) -> tuple[int, int]:
    """Split a key's 16-byte form into ``(lo, hi)``.

    Args:
        b: 16 bytes (``bytes``, ``bytearray`` or ``memoryview``).

    Returns:
        ``(lo, hi)`` as Python ints.

    Raises:
        InvalidTokensError: ``b`` is not 16 bytes long.
    """
    raw = bytes(b)
    if len(raw) != HASH_BYTES:
        raise InvalidTokensError(f"a key is {HASH_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def _parent_pair(parent: Any) -> tuple[int, int]:
    if isinstance(parent, (bytes, bytearray, memoryview)):
        raw = bytes(parent)
        if len(raw) == HASH_BYTES:
            return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
    elif isinstance(parent, np.ndarray) and parent.shape == (2,) and parent.dtype.kind == "u":
        return int(parent[0]), int(parent[1])
    raise InvalidTokensError(
        f"parent must be a {HASH_BYTES}-byte key (e.g. namespace_root(ns) or "
        f"key_to_bytes(keys[k])), got {type(parent).__name__}"
        + (f" of length {len(parent)}" if hasattr(parent, "__len__") else ""))


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    return int(block_size)


# --------------------------------------------------------------------------
# input validation


def _torch_to_numpy(t: Any, what: str) -> np.ndarray:
    torch = sys.modules["torch"]
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise InvalidTokensError(
            f"{what} must be an integer tensor, got dtype {t.dtype}; convert with "
            "tensor.to(torch.int64) if the values are whole ids")
    if t.device.type == "meta" or t.layout != torch.strided:
        raise InvalidTokensError(f"{what} must be a dense tensor with data, got a {t.layout} "
                                 f"tensor on {t.device}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # dtypes numpy cannot share
        return t.to(torch.int64).numpy()


def _sequence_of_ints(seq: Any, what: str, limit: int, dtype: type) -> np.ndarray:
    """Slow path for a list/tuple numpy could not turn into an int array."""
    values = list(seq)
    for v in values:
        if isinstance(v, (list, tuple, np.ndarray)):
            raise InvalidTokensError(
                f"{what} must be 1-D; got a nested sequence - flatten it or pass one "
                "sequence at a time")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise InvalidTokensError(
                f"{what} must be integers, got {type(v).__name__} {v!r}; convert the "
                "values to int ids first")
        if not 0 <= v < limit:
            raise InvalidTokensError(
                f"{what} must lie in [0, 2**{limit.bit_length() - 1}), got {v}; "
                "check the tokenizer/vocabulary mapping")
    return np.fromiter((int(v) for v in values), dtype=dtype, count=len(values))


def _to_int_array(obj: Any, what: str, limit: int, dtype: type) -> np.ndarray:
    """Validate ``obj`` as a 1-D sequence of ints in [0, limit) -> C-contiguous ``dtype``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        arr = _torch_to_numpy(obj, what)
    elif isinstance(obj, np.ndarray):
        arr = obj
    else:
        if isinstance(obj, (str, bytes, bytearray, dict, set)):
            raise InvalidTokensError(
                f"{what} must be a 1-D sequence of integer ids, got "
                f"{type(obj).__name__}; tokenize the text first")
        try:
            arr = np.asarray(obj)
        except (OverflowError, ValueError, TypeError):
            if isinstance(obj, (list, tuple)):
                return _sequence_of_ints(obj, what, limit, dtype)
            raise InvalidTokensError(
                f"{what} must be a 1-D sequence of integer ids, got {type(obj).__name__}"
            ) from None
        if arr.dtype.kind in "fO" and arr.ndim == 1 and isinstance(obj, (list, tuple)):
            # e.g. [-1, 2**63] becomes float64 and [2**64] object: check each value.
            return _sequence_of_ints(obj, what, limit, dtype)

    if arr.ndim != 1:
        raise InvalidTokensError(
            f"{what} must be 1-D, got shape {arr.shape}; pass one sequence at a time "
            "(e.g. tokens[i] of a batch) or flatten it with .reshape(-1)")
    if arr.size == 0:  # e.g. np.array([]) is float64; there is no value to misread
        return np.empty(0, dtype=dtype)
    kind = arr.dtype.kind
    if kind not in "iu":
        if kind == "O":
            return _sequence_of_ints(arr.tolist(), what, limit, dtype)
        raise InvalidTokensError(
            f"{what} must have an integer dtype, got {arr.dtype}; convert with "
            ".astype(np.int64) (or tensor.long()) if the values are whole ids")
    if kind == "i":
        lo = int(arr.min())
        if lo < 0:
            raise InvalidTokensError(
                f"{what} must be non-negative, got {lo}; remove padding or sentinel "
                "ids (e.g. -1, -100) before hashing")
    if arr.dtype.itemsize * 8 > limit.bit_length() - 1 + (kind == "i"):
        hi = int(arr.max())
        if hi >= limit:
            raise InvalidTokensError(
                f"{what} must be < 2**{limit.bit_length() - 1}, got {hi}; "
                "check the tokenizer/vocabulary mapping")
    return np.ascontiguousarray(arr, dtype=dtype)


def as_token_array(tokens: Any) -> np.ndarray:
    """Validate token ids and return them as a C-contiguous uint32 array.

    A C-contiguous 1-D uint32 array is returned as is (no copy).

    Args:
        tokens: a list/tuple of ints, a numpy array of any integer dtype or a
            torch integer tensor (any device; it is copied to the CPU), 1-D.

    Returns:
        1-D C-contiguous ``np.uint32`` array.

    Raises:
        InvalidTokensError: the input is not 1-D, not integer, or holds an id
            outside ``[0, 2**32)``.
    """
    if (isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1
            and tokens.flags.c_contiguous):
        return tokens
    return _to_int_array(tokens, "token ids", 1 << 32, np.uint32)


def _as_id_array(ids: Any) -> np.ndarray:
    if (isinstance(ids, np.ndarray) and ids.dtype == np.uint64 and ids.ndim == 1
            and ids.flags.c_contiguous):
        return ids
    return _to_int_array(ids, "block ids", 1 << 64, np.uint64)


# --------------------------------------------------------------------------
# the numpy twin


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """mix64 over a uint64 array, in place (the array is returned)."""
    x ^= x >> _S30
    x *= _NP_C1
    x ^= x >> _S27
    x *= _NP_C2
    x ^= x >> _S31
    return x


def _term_parts(t: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
    """The four 32-bit parts of ``t * r`` for ``r = hi * 2**32 + lo`` (uint64 arrays).

    ``t * lo`` and ``t * hi`` fit in 64 bits (``t``, ``lo`` < 2**32, ``hi`` < 2**29); their
    halves sum without overflow over up to 65536 terms.
    """
    u = t * lo
    v = t * hi
    return u & _NP_M32, u >> _S32, v & _NP_M32, v >> _S32


def _reduce_sums(s0: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray) -> np.ndarray:
    """``(s0 + (s1 + s2) * 2**32 + s3 * 2**64) mod p`` of the partial sums (each < 2**49).

    ``2**61 = 1 (mod p)``, so ``q * 2**32 = (q mod 2**29) * 2**32 + q >> 29`` and
    ``2**64 = 8``.  The result lies in ``[0, p)``.
    """
    q = s1 + s2
    v = s0 + ((q & _NP_M29) << _S32)
    v += q >> _S29
    v += s3 << _U64(3)
    v = (v & _NP_PRIME) + (v >> _S61)
    return np.where(v >= _NP_PRIME, v - _NP_PRIME, v)


def _lane_sums(parts: tuple[np.ndarray, ...], reduce: Any) -> np.ndarray:
    return _reduce_sums(*(reduce(x) for x in parts))


def _py_chain_tokens(tokens: np.ndarray, block_size: int, plo: int, phi: int,
                     table: np.ndarray) -> np.ndarray:
    n = tokens.shape[0]
    nblocks = -(-n // block_size)
    if nblocks == 0:
        return np.empty((0, 2), dtype=np.uint64)
    sums = np.empty((8, nblocks), dtype=np.uint64)
    per = max(1, _TWIN_CHUNK_TOKENS // block_size)
    pattern = np.tile(table[:, :block_size].astype(np.uint64), per)
    for start in range(0, n, block_size * per):
        t = tokens[start:start + block_size * per].astype(np.uint64)
        m = t.shape[0]
        starts = np.arange(0, m, block_size)
        k0 = start // block_size
        for lane in (0, 1):
            parts = _term_parts(t, pattern[2 * lane, :m], pattern[2 * lane + 1, :m])
            for j, x in enumerate(parts):
                sums[4 * lane + j, k0:k0 + starts.shape[0]] = np.add.reduceat(x, starts)
    a = _reduce_sums(*sums[:4])
    b = _reduce_sums(*sums[4:])
    last = n - (nblocks - 1) * block_size
    out = np.empty((nblocks, 2), dtype=np.uint64)
    out[:] = _finalize_chain(zip(a.tolist(), b.tolist()), nblocks, plo, phi, block_size, last)
    return out


def _finalize_chain(sums: Any, nblocks: int, plo: int, phi: int, n_full: int,
                    n_last: int) -> list[tuple[int, int]]:
    """Serial finalize over per-block pairs ``(a, b)``; each block's parent is the previous key.

    ``finalize`` and ``mix64`` are written out inline on Python ints masked to
    64 bits: this loop is the twin's only per-block Python code.
    """
    m64, c1, c2, p4 = _M64, _C1, _C2, _P4
    np_full, np_last = (n_full * _P3) & m64, (n_last * _P3) & m64
    rows: list[tuple[int, int]] = []
    append = rows.append
    lo, hi = plo, phi
    last_k = nblocks - 1
    for k, (a, b) in enumerate(sums):
        x = lo ^ (((hi << 29) | (hi >> 35)) & m64) ^ (np_full if k < last_k else np_last)
        x ^= x >> 30
        x = (x * c1) & m64
        x ^= x >> 27
        x = (x * c2) & m64
        c = x ^ (x >> 31)
        x = a ^ c
        x ^= x >> 30
        x = (x * c1) & m64
        x ^= x >> 27
        x = (x * c2) & m64
        new_lo = x ^ (x >> 31)
        x = (b + c + hi + p4) & m64
        x ^= x >> 30
        x = (x * c1) & m64
        x ^= x >> 27
        x = (x * c2) & m64
        hi = x ^ (x >> 31)
        lo = new_lo
        append((lo, hi))
    return rows


def _py_prefix_keys(tokens: np.ndarray, plo: int, phi: int, table: np.ndarray) -> np.ndarray:
    m = tokens.shape[0]
    out = np.empty((m, 2), dtype=np.uint64)
    if m == 0:
        return out
    t = tokens.astype(np.uint64)
    tab = table[:, :m].astype(np.uint64)
    cumsum = np.cumsum
    a = _lane_sums(_term_parts(t, tab[0], tab[1]), cumsum)
    b = _lane_sums(_term_parts(t, tab[2], tab[3]), cumsum)
    pos = np.arange(1, m + 1, dtype=np.uint64)
    pos *= _NP_P3  # n * P3 with n = j + 1
    pos ^= _U64(plo ^ (((phi << 29) | (phi >> 35)) & _M64))
    c = _mix64_np(pos)
    a ^= c
    out[:, 0] = _mix64_np(a)
    b += c
    b += _U64((phi + _P4) & _M64)
    out[:, 1] = _mix64_np(b)
    return out


def _py_chain_ids(ids: np.ndarray, block_size: int, last_tokens: int, plo: int,
                  phi: int, table: np.ndarray) -> np.ndarray:
    n = ids.shape[0]
    out = np.empty((n, 2), dtype=np.uint64)
    if n == 0:
        return out
    halves = (ids & _NP_M32, ids >> _S32)
    tab = table[:, :2].astype(np.uint64)
    lanes = []
    for lane in (0, 1):
        p0 = _term_parts(halves[0], tab[2 * lane, 0], tab[2 * lane + 1, 0])
        p1 = _term_parts(halves[1], tab[2 * lane, 1], tab[2 * lane + 1, 1])
        lanes.append(_reduce_sums(*(x + y for x, y in zip(p0, p1))))
    out[:] = _finalize_chain(zip(lanes[0].tolist(), lanes[1].tolist()), n, plo, phi,
                             block_size + _ID_NTOK_TAG, last_tokens + _ID_NTOK_TAG)
    return out


def _from_native(raw: bytes | bytearray) -> np.ndarray:
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(np.uint64, copy=False)


def _check_key(key: Any, positions: int) -> np.ndarray:
    """The key's table, after checking it covers ``positions`` positions."""
    if not isinstance(key, HashKey):
        raise InvalidTokensError(f"key must be a HashKey, got {type(key).__name__}")
    if positions > key.positions:
        raise InvalidTokensError(
            f"this hash key covers blocks of up to {key.positions} tokens, got {positions}; "
            "derive the key with positions >= block_size")
    return key.table


# --------------------------------------------------------------------------
# public key functions


def chain_hash_tokens(tokens: Any, block_size: int, parent: bytes, key: HashKey) -> np.ndarray:
    """Chained keys of every block of a token sequence.

    Block ``k`` covers ``tokens[k*block_size : (k+1)*block_size]``; the last
    block may be partial.  Block 0's parent is ``parent`` and block ``k``'s
    parent is block ``k-1``'s key, so row ``k`` names the whole prefix
    ``tokens[:min((k+1)*block_size, len(tokens))]``.

    Args:
        tokens: token ids (anything :func:`as_token_array` accepts; a
            C-contiguous uint32 array is used without a copy).
        block_size: tokens per block, ``>= 1``.
        parent: 16-byte key of the prefix before ``tokens`` (e.g.
            :func:`namespace_root`).
        key: the store's :class:`HashKey` (covering ``block_size`` positions).

    Returns:
        ``(ceil(len(tokens) / block_size), 2)`` uint64 array of ``[lo, hi]``
        rows; ``(0, 2)`` for no tokens.

    Raises:
        InvalidTokensError: bad token ids, a parent that is not 16 bytes, or a
            key that does not cover ``block_size`` positions.
        ConfigError: ``block_size < 1``.
    """
    t = as_token_array(tokens)
    bs = _check_block_size(block_size)
    plo, phi = _parent_pair(parent)
    table = _check_key(key, bs)
    ext = _native.hashing
    if ext is not None:
        return _from_native(ext.chain_tokens(t, bs, plo, phi, table))
    return _py_chain_tokens(t, bs, plo, phi, table)


def block_prefix_keys(tokens: Any, parent: bytes, key: HashKey) -> np.ndarray:
    """Key at every inner offset of ONE block.

    Row ``j`` is ``block_hash(parent, tokens[:j+1])``; for a full block the
    last row equals the block's row of :func:`chain_hash_tokens`, and row
    ``j`` equals the key a partial last block of ``j+1`` tokens gets there.

    Args:
        tokens: the block's token ids (at most ``key.positions``).
        parent: 16-byte key of the prefix before the block.
        key: the store's :class:`HashKey`.

    Returns:
        ``(len(tokens), 2)`` uint64 array of ``[lo, hi]`` rows.

    Raises:
        InvalidTokensError: bad token ids, a parent that is not 16 bytes, or
            more tokens than the key covers.
    """
    t = as_token_array(tokens)
    plo, phi = _parent_pair(parent)
    table = _check_key(key, int(t.shape[0]))
    ext = _native.hashing
    if ext is not None:
        return _from_native(ext.prefix_keys(t, plo, phi, table))
    return _py_prefix_keys(t, plo, phi, table)


def chain_hash_ids(ids: Any, parent: bytes, last_tokens: int | None = None, *,
                   block_size: int, key: HashKey) -> np.ndarray:
    """Chained keys over already-hashed block ids (as traces carry them).

    Key ``k`` is ``id_hash(key[k-1], ids[k], ntok)`` with ``key[-1] = parent``;
    ``ntok`` is ``block_size`` for every block but the last, which counts
    ``last_tokens`` when given.

    Args:
        ids: block ids, ints in ``[0, 2**64)`` (list/tuple, numpy integer
            array or torch integer tensor), 1-D.
        parent: 16-byte key of the prefix before the first block.
        last_tokens: tokens in the last block, in ``[1, block_size]``;
            ``None`` means a full block.
        block_size: tokens per block, ``>= 1`` (keyword-only).
        key: the store's :class:`HashKey` (keyword-only).

    Returns:
        ``(len(ids), 2)`` uint64 array of ``[lo, hi]`` rows.

    Raises:
        InvalidTokensError: negative or too large ids, a non-1-D or
            non-integer input, a bad parent or ``last_tokens`` out of range.
        ConfigError: ``block_size < 1``.
    """
    arr = _as_id_array(ids)
    bs = _check_block_size(block_size)
    if last_tokens is None:
        last = bs
    else:
        if isinstance(last_tokens, bool) or not isinstance(last_tokens, (int, np.integer)) \
                or not 1 <= last_tokens <= bs:
            raise InvalidTokensError(
                f"last_tokens must be an int in [1, block_size={bs}] (or None for a "
                f"full last block), got {last_tokens!r}")
        last = int(last_tokens)
    plo, phi = _parent_pair(parent)
    table = _check_key(key, 2)
    ext = _native.hashing
    if ext is not None:
        return _from_native(ext.chain_ids(arr, bs, last, plo, phi, table))
    return _py_chain_ids(arr, bs, last, plo, phi, table)
