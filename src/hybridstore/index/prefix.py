"""A prompt seen through its prefix hashes: :class:`PrefixKeys`.

A request reaches the index either as token ids or as already-hashed block ids
(what traces such as Mooncake or the WEKA Claude-Code sessions carry).  Both
produce the same kind of object: the chained 128-bit key of every block, and
the key at any token position ``p`` (``key_at(p)``), which is how pages and
checkpoints are named:

* the page of block ``k`` (tokens ``[kB, kB + n)``, ``n <= B``) is keyed by the
  chain key of that block;
* the checkpoint at position ``p`` is keyed by ``key_at(p)``: the hash of the
  tokens ``[s, p)`` chained onto the key at ``s = B * ((p - 1) // B)``.  At a
  block end this *is* the block key, inside a block it equals the key a
  partial page ending at ``p`` would have.

Inner keys need the token ids; a prompt given as block ids only knows the keys
at block ends (and at its end, when the last block's token count is given).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridstore.errors import InvalidTokensError
from hybridstore.index import keys as K


def _fitted_length(n: int, block_size: int, length: int | None, what: str, each: str) -> int:
    """The length of a prompt of ``n`` blocks (all full when ``length`` is ``None``; else
    the last may be partial), checked."""
    if length is None:
        return n * block_size
    if not (n - 1) * block_size < length <= n * block_size and not (n == 0 and length == 0):
        raise InvalidTokensError(
            f"{n} {what} of {block_size} tokens cannot describe a {length}-token prompt; "
            f"pass one {each} per (full or final partial) block")
    return length


class PathCache:
    """Node ids of a prompt's leading blocks in one index: ``ids[:n]`` (scratch), valid
    as of the index's free generation ``frees`` (ids freed since may name other pages)."""

    __slots__ = ("ids", "n", "frees")

    def __init__(self, nblocks: int) -> None:
        self.ids = np.empty(nblocks, np.int64)
        self.n = 0
        self.frees = -1


class PrefixKeys:
    """Chained prefix keys of one prompt.

    Attributes:
        block_size: tokens per block.
        length: tokens in the prompt.
        root: 16-byte namespace root key (the key at position 0).
        hash_key: the store's :class:`~hybridstore.index.keys.HashKey` (inner keys
            of token prompts are hashed with it); ``None`` for engine keys.
        keys: ``(nblocks, 2)`` uint64 array of block keys ``[lo, hi]``.
        tokens: the uint32 token ids, or ``None`` when built from block ids.
    """

    __slots__ = ("block_size", "length", "root", "hash_key", "keys", "tokens", "_lo_array",
                 "_inner", "_paths")

    def __init__(self, *, block_size: int, length: int, root: bytes, keys: np.ndarray,
                 tokens: np.ndarray | None, hash_key: K.HashKey | None = None) -> None:
        self.block_size = block_size
        self.length = length
        self.root = root
        self.hash_key = hash_key
        self.keys = keys
        self.tokens = tokens
        self._lo_array: np.ndarray | None = None
        self._inner: dict[int, np.ndarray] = {}
        self._paths: dict[int, PathCache] = {}

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_tokens(cls, tokens: object, *, block_size: int, root: bytes,
                    hash_key: K.HashKey) -> PrefixKeys:
        """Hash token ids (list, numpy array or torch tensor) block by block."""
        toks = K.as_token_array(tokens)
        return cls(block_size=block_size, length=int(toks.shape[0]), root=root,
                   keys=K.chain_hash_tokens(toks, block_size, root, hash_key), tokens=toks,
                   hash_key=hash_key)

    @classmethod
    def from_block_ids(cls, block_ids: Sequence[int] | np.ndarray, *, block_size: int,
                       root: bytes, hash_key: K.HashKey,
                       length: int | None = None) -> PrefixKeys:
        """Chain already-hashed block ids (full blocks; the last may be partial).

        Args:
            block_ids: one id per block, chained by the producer (equal prefix
                iff equal ids).
            block_size: tokens per block.
            root: namespace root key.
            hash_key: the store's hash key.
            length: prompt length in tokens; defaults to ``len(block_ids) *
                block_size``.  When it ends inside the last block, that block
                is partial.
        """
        n = len(block_ids)
        length = _fitted_length(n, block_size, length, "block ids", "id")
        last = length - (n - 1) * block_size if n else None
        ids = K.chain_hash_ids(block_ids, root, last_tokens=last, block_size=block_size,
                               key=hash_key)
        return cls(block_size=block_size, length=length, root=root, keys=ids, tokens=None,
                   hash_key=hash_key)

    @classmethod
    def from_engine_keys(cls, engine: Sequence[object], *, block_size: int, root: bytes,
                         length: int | None = None,
                         before: np.ndarray | None = None) -> PrefixKeys:
        """A prompt given as an engine's chained page hashes (SGLang, vLLM).

        Args:
            engine: one hash per page, in order from the page after ``before``
                (``str`` or ``bytes``; :func:`~hybridstore.index.keys.engine_keys`).
            block_size: tokens per page.
            root: namespace root key (it keys the map from engine hash to index key).
            length: prompt length in tokens; defaults to a whole number of pages.
                When it ends inside the last page, that page is partial.
            before: index keys (``(m, 2)`` uint64) of the pages before
                ``engine[0]``, from position 0 (resolved from the index).
        """
        ids = K.engine_keys(engine, root)
        if before is not None and len(before):
            ids = np.concatenate([np.asarray(before, np.uint64).reshape(-1, 2), ids])
        length = _fitted_length(int(ids.shape[0]), block_size, length, "pages", "key")
        return cls(block_size=block_size, length=length, root=root, keys=ids, tokens=None)

    # -- keys -----------------------------------------------------------------------
    @property
    def nblocks(self) -> int:
        return int(self.keys.shape[0])

    @property
    def lo_array(self) -> np.ndarray:
        """Low 64 bits of every block key, a contiguous uint64 array (the index's map key)."""
        if self._lo_array is None:
            self._lo_array = np.ascontiguousarray(self.keys[:, 0])
        return self._lo_array

    def path_cache(self, index: int) -> PathCache:
        """Scratch node ids of this prompt's blocks, kept per index.

        Args:
            index: the index's serial number, never reused in a process (not its
                ``id()``: a new index may get the address of a freed one, and its
                equal free generation would make it trust the old one's ids).

        The index validates them before trusting them; see ``HybridIndex._extend_path``.
        """
        cache = self._paths.get(index)
        if cache is None:
            cache = self._paths[index] = PathCache(self.nblocks)
        return cache

    def block_key(self, k: int) -> bytes:
        """16-byte key of block ``k``."""
        return K.key_to_bytes(self.keys[k])

    def block_end(self, k: int) -> int:
        """Token position where block ``k`` ends."""
        return min((k + 1) * self.block_size, self.length)

    def key_before(self, k: int) -> bytes:
        """Key at the start of block ``k`` (the root for ``k == 0``)."""
        return self.root if k == 0 else self.block_key(k - 1)

    def inner_keys(self, k: int) -> np.ndarray | None:
        """``(m, 2)`` keys at offsets ``1..m`` inside block ``k``; ``None`` without tokens."""
        if self.tokens is None:
            return None
        cached = self._inner.get(k)
        if cached is None:
            s = k * self.block_size
            assert self.hash_key is not None  # token prompts always carry their key
            cached = K.block_prefix_keys(self.tokens[s:s + self.block_size], self.key_before(k),
                                         self.hash_key)
            self._inner[k] = cached
        return cached

    def key_at(self, p: int) -> bytes | None:
        """Key at token position ``p`` (``1 <= p <= length``), or ``None`` when unknown.

        Unknown happens only for prompts given as block ids, at positions
        inside a block.
        """
        if not 0 < p <= self.length:
            raise InvalidTokensError(f"position {p} is outside the prompt (1..{self.length})")
        k = (p - 1) // self.block_size
        if p == self.block_end(k):
            return self.block_key(k)
        inner = self.inner_keys(k)
        if inner is None:
            return None
        return K.key_to_bytes(inner[p - k * self.block_size - 1])
