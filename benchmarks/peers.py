"""The peers of ``python -m benchmarks index``, run on CPU from their installed packages.

* :class:`SGLangRadix`: ``sglang.srt.mem_cache.radix_cache.RadixCache`` built
  with ``RadixCache.create_simulated`` (no memory pools: the way SGLang's own
  simulations build it), ``page_size`` = our block size.
* :class:`VllmBlockPool`: vLLM's prefix caching: ``hash_block_tokens`` chained
  over the prompt's full blocks (``sha256`` of the pickled tuple, vLLM's default
  ``prefix_caching_hash_algo``), ``FullAttentionManager.find_longest_cache_hit``
  over a ``BlockPool`` (one dict probe of ``cached_block_hash_to_block`` per
  block), and the pool's own allocate / cache / free / evict-on-allocate paths.

Every adapter has the same four operations on the same token ids:

========================  ===================================================
``prepare(tokens)``       the peer's native input (untimed): SGLang an
                          ``array('q')`` key and an int64 KV-index tensor,
                          vLLM a ``list[int]``
``put(prep, cached)``     insert the prompt (``cached``: leading tokens the
                          engine knows are cached already)
``match(prep)``           longest cached prefix, pinned then unpinned;
                          returns the matched tokens
``evict(tokens)``         evict about ``tokens`` tokens, least recently used
                          first; returns the tokens evicted
========================  ===================================================

Importing SGLang's radix cache needs the library's CPU shims
(:func:`hybridstore.adapters.cpu_shims.import_sglang`): ``sglang/__init__.py``
is skipped, and ``triton`` / ``torchvision``, when not installed (a CPU-only
torch has neither), are stood in for during that import by SGLang's own stub.
Neither is called by the radix cache.
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridstore.adapters.cpu_shims import import_sglang, stubbed_modules

__all__ = ["PeerUnavailable", "SGLangRadix", "VllmBlockPool", "import_sglang_radix",
           "import_vllm_prefix", "init_vllm_none_hash", "sglang_version", "vllm_hash_functions"]

class PeerUnavailable(RuntimeError):
    """A peer could not be imported or built here; the message says why."""


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ---------------------------------------------------------------------------------
# imports
# ---------------------------------------------------------------------------------
def import_sglang_radix() -> tuple[types.ModuleType, types.ModuleType, list[str]]:
    """``(radix_cache, base_prefix_cache, stubbed)``: SGLang's radix cache modules.

    Imported through :func:`hybridstore.adapters.cpu_shims.import_sglang` (the CPU shims).

    Raises:
        PeerUnavailable: SGLang or one of the modules on that import path is
            missing (the message names it).
    """
    rc_name, base_name = "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache"
    try:
        fresh = rc_name not in sys.modules
        mods = import_sglang([rc_name, base_name])
        if fresh:
            _freeze()
        return mods[rc_name], mods[base_name], stubbed_modules()
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable
        raise PeerUnavailable(_reason(e)) from e


def import_vllm_prefix() -> dict[str, Any]:
    """vLLM's block hashing, block pool and full-attention cache-hit search.

    Raises:
        PeerUnavailable: vLLM or a module on that import path is missing.
    """
    try:
        fresh = "vllm.v1.core.block_pool" not in sys.modules
        with warnings.catch_warnings(), _quiet_loggers():
            warnings.simplefilter("ignore")
            ku = importlib.import_module("vllm.v1.core.kv_cache_utils")
            bp = importlib.import_module("vllm.v1.core.block_pool")
            st = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
            kci = importlib.import_module("vllm.v1.kv_cache_interface")
            hashing = importlib.import_module("vllm.utils.hashing")
        if fresh:
            _freeze()
        vllm = sys.modules["vllm"]
        return {"kv_cache_utils": ku, "BlockPool": bp.BlockPool,
                "FullAttentionManager": st.FullAttentionManager,
                "FullAttentionSpec": kci.FullAttentionSpec, "hashing": hashing,
                "version": getattr(vllm, "__version__", None)}
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(_reason(e)) from e


def _freeze() -> None:
    """Move the peers' import-time objects (millions) out of the cyclic GC's sight.

    Without it every ``gc.collect()`` of the benchmark (one per timed point)
    walks them: ~0.3 s each on 2 cores.
    """
    gc.collect()
    gc.freeze()


class _quiet_loggers:
    """Silence the peers' import-time log lines (platform warnings) for a moment."""

    def __enter__(self) -> None:
        self.level = logging.root.manager.disable
        logging.disable(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        logging.disable(self.level)


def vllm_hash_functions(v: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prefix-caching hash functions by name (``xxhash`` only where it works)."""
    h = v["hashing"]
    out = {"sha256": h.sha256, "sha256_cbor": h.sha256_cbor}
    try:
        h.xxhash((None, (1, 2), None))
        out["xxhash"] = h.xxhash
    except Exception:  # noqa: BLE001 - optional in vLLM too
        pass
    return out


def init_vllm_none_hash(v: dict[str, Any], fn: Any) -> None:
    """vLLM's ``init_none_hash(fn)`` (the chain's seed), without its xxhash seed warning."""
    with _quiet_loggers():
        v["kv_cache_utils"].init_none_hash(fn)


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------
class _NoAllocator:
    """The KV allocator a simulated radix cache frees into: nothing to free."""

    device = "cpu"

    def free_segment(self, *args: Any, **kwargs: Any) -> None:
        pass

    def free(self, *args: Any, **kwargs: Any) -> None:
        pass


class SGLangRadix:
    """SGLang's ``RadixCache`` (page size = ``block_size``), LRU eviction."""

    name = "sglang"

    def __init__(self, block_size: int) -> None:
        rc, base, self.stubbed = import_sglang_radix()
        self._RadixKey = rc.RadixKey
        self._Insert = base.InsertParams
        self._Match = base.MatchPrefixParams
        self._Evict = base.EvictParams
        try:
            self.cache = rc.RadixCache.create_simulated(mock_allocator=_NoAllocator(),
                                                        page_size=block_size)
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(_reason(e)) from e
        self.block_size = block_size
        self._slot = 0   # KV indices handed out (what an allocator would give)

    def prepare(self, tokens: np.ndarray) -> tuple[Any, Any]:
        from array import array

        import torch

        key = array("q", tokens.astype(np.int64, copy=False).tobytes())
        value = torch.arange(self._slot, self._slot + len(tokens), dtype=torch.int64)
        self._slot += len(tokens)
        return key, value

    def put(self, prep: tuple[Any, Any], cached: int = 0) -> None:
        key, value = prep
        self.cache.insert(self._Insert(key=self._RadixKey(key), value=value))

    def match(self, prep: tuple[Any, Any]) -> int:
        cache = self.cache
        res = cache.match_prefix(self._Match(key=self._RadixKey(prep[0])))
        node = res.last_device_node
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(node)
        return int(res.device_prefix_len)

    def evict(self, tokens: int) -> int:
        return int(self.cache.evict(self._Evict(num_tokens=tokens)).num_tokens_evicted)

    def after_evict(self) -> None:
        pass

    def cached_tokens(self) -> int:
        return int(self.cache.evictable_size() + self.cache.protected_size())

    def close(self) -> None:
        self.cache = None

    def nodes(self) -> Iterator[Any]:
        stack = [self.cache.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


# ---------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------
class _Request:
    """The one field ``BlockPool.cache_full_blocks`` reads of a request (no KV events)."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


class VllmBlockPool:
    """vLLM v1 prefix caching over a ``BlockPool`` of ``capacity_blocks`` blocks.

    ``put`` hashes every full block, finds the cached prefix, takes new blocks
    for the rest (evicting cached free blocks, least recently freed first, when
    the pool has no empty one: vLLM evicts on allocation), caches them and
    frees the request's blocks (tail first, as ``KVCacheManager.free`` does).
    ``evict`` is that allocation: it takes ``tokens`` worth of blocks from the
    free queue; :meth:`after_evict` gives them back (empty) untimed.
    """

    name = "vllm"

    def __init__(self, block_size: int, capacity_blocks: int, hash_name: str = "sha256") -> None:
        v = import_vllm_prefix()
        try:
            fns = vllm_hash_functions(v)
            self.hash_fn = fns[hash_name]
            init_vllm_none_hash(v, self.hash_fn)
            self._hash_block = v["kv_cache_utils"].hash_block_tokens
            self.pool = v["BlockPool"](capacity_blocks + 1, True, block_size)   # + the null block
            self._find = v["FullAttentionManager"].find_longest_cache_hit
            import torch

            self._spec = v["FullAttentionSpec"](block_size=block_size, num_kv_heads=1,
                                                head_size=64, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(_reason(e)) from e
        self.version = v["version"]
        self.hash_name = hash_name
        self.block_size = block_size
        self._taken: list[Any] = []

    def prepare(self, tokens: np.ndarray) -> list[int]:
        return tokens.tolist()

    def hashes(self, tokens: list[int]) -> list[bytes]:
        """vLLM's chained block hashes of every full block (``request_block_hasher``'s loop)."""
        B, h, out = self.block_size, None, []
        hb, fn = self._hash_block, self.hash_fn
        for start in range(0, len(tokens) - B + 1, B):
            h = hb(fn, h, tokens[start:start + B], None)
            out.append(h)
        return out

    def _hit(self, hashes: list[bytes], length: int) -> list[Any]:
        B = self.block_size
        blocks, _ = self._find(hashes, length // B * B, [0], self.pool, self._spec, False, B)
        return blocks[0]

    def put(self, tokens: list[int], cached: int = 0) -> None:
        hashes = self.hashes(tokens)
        pool = self.pool
        hit = self._hit(hashes, len(tokens))
        pool.touch(hit)
        new = pool.get_new_blocks(len(hashes) - len(hit))
        blocks = hit + new
        pool.cache_full_blocks(_Request(hashes), blocks, len(hit), len(hashes), self.block_size, 0)
        pool.free_blocks(reversed(blocks))

    def match(self, tokens: list[int]) -> int:
        hashes = self.hashes(tokens)
        hit = self._hit(hashes, len(tokens))
        self.pool.touch(hit)
        self.pool.free_blocks(reversed(hit))
        return len(hit) * self.block_size

    def evict(self, tokens: int) -> int:
        n = min(-(-tokens // self.block_size), self.pool.get_num_free_blocks())
        before = len(self.pool.cached_block_hash_to_block)
        self._taken.extend(self.pool.get_new_blocks(n))
        return (before - len(self.pool.cached_block_hash_to_block)) * self.block_size

    def after_evict(self) -> None:
        self.pool.free_blocks(self._taken)
        self._taken = []

    def cached_tokens(self) -> int:
        return len(self.pool.cached_block_hash_to_block) * self.block_size

    def close(self) -> None:
        self.pool = None
