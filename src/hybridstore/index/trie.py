"""The hybrid-state index: a trie of KV pages with checkpoints at ``(block, offset)``.

Nodes are KV pages.  A node is named by its block's chained prefix key, so the
trie needs no child tables: the child of ``n`` holding the next block of a
prompt is simply the node whose key is that block's chain key.  Node fields
live in numpy arrays (struct of arrays), indexed by a small integer node id;
one open-addressing map (:class:`~hybridstore.index.u64map.U64Map`, compiled)
maps the low 64 bits of a key to its id (the high 64 bits are compared on
every lookup, so keys are 128-bit).  That keeps a cached block well under 200
bytes and lets a walk, a put of a run of pages, a pin or a drop touch all its
pages with vectorised operations.

Checkpoints hang on their *base* node: the page that ends where the checkpoint's
block starts (the root for the first block).  A checkpoint at ``p`` inside
block ``k`` depends on every page on the path to its base plus one *cover*
page of block ``k`` whose first ``p - kB`` tokens are the checkpoint's tokens
(a partial page ending at ``p``, or any longer page that was seen to begin with
them — FlashStates' arbitrary state checkpointing).

Reference counts (ARCHITECTURE.md, FlashStates "dependency-aware hybrid
state"): ``deps[n]`` counts the retained checkpoints that need page ``n``;
``pins[n]`` counts the live resume plans that use it.  A page with neither is
*reclaimable*: no resume can use it.  :meth:`HybridIndex.recount` recomputes
both from scratch (the property tests compare).
"""

from __future__ import annotations

import itertools
import struct
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hybridstore import _native
from hybridstore.errors import InvalidTokensError, PlanReleasedError
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.u64map import U64Map
from hybridstore.objects import TIER_BITS

ROOT = 0
_NO_PARENT = -1
_MASK64 = (1 << 64) - 1



_COLUMNS = ("_klo", "_khi", "_block", "_ntok", "_tiers", "_deps", "_pins", "_nchild", "_atime",
            "_ctime", "_nbytes", "_based")
"""The per-node numpy columns (struct of arrays)."""
_RESET = ("_tiers", "_deps", "_pins", "_nchild", "_nbytes", "_based")
"""The columns a new node starts at zero (its key, place, parent and times are set)."""
_SERIALS = itertools.count()
"""Serial numbers of the indexes of this process: a PrefixKeys keeps a path per index."""


def _split(key: bytes) -> tuple[int, int]:
    lo, hi = struct.unpack("<QQ", key)
    return lo, hi


class Checkpoint:
    """A recurrent-state checkpoint known to the index.

    Attributes:
        key: 16-byte prefix key at ``position``.
        position: token position the state was taken at.
        base: node id of the page ending at the checkpoint's block start.
        offset: ``position`` minus the base's end (1..block_size).
        covers: node ids of pages of the checkpoint's block that begin with
            its tokens.
        tiers: bit mask of the tiers that hold its bytes.
        nbytes: size of its bytes.
        atime: logical time of its last put or hit.
        pins: live plans resuming from it.
        parent, children: the checkpoint tree (trajectories: HiState Fig. 6).
        hits: resumes served from it.
    """

    __slots__ = ("key", "position", "base", "offset", "covers", "tiers", "nbytes", "atime", "pins",
                 "parent", "children", "hits", "created")

    def __init__(self, key: bytes, position: int, base: int, offset: int, nbytes: int,
                 atime: int) -> None:
        self.key = key
        self.position = position
        self.base = base
        self.offset = offset
        self.covers: list[int] = []
        self.tiers = 0
        self.nbytes = nbytes
        self.atime = atime
        self.pins = 0
        self.parent: Checkpoint | None = None   # nearest retained checkpoint before it on its path
        self.children: list[Checkpoint] = []     # checkpoints whose nearest ancestor it is
        self.hits = 0                            # resumes served from it
        self.created = atime

    @property
    def terminal(self) -> bool:
        """No retained checkpoint continues its trajectory (HiState's terminal state)."""
        return not self.children

    def __repr__(self) -> str:
        return (f"Checkpoint(position={self.position}, base={self.base}, offset={self.offset}, "
                f"covers={self.covers}, tiers={self.tiers:#x})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """The deepest complete resume point for a prompt, pinned until released.

    ==================  ==========================================================
    field               meaning
    ==================  ==========================================================
    ``position``        tokens reusable without recompute (0: nothing cached)
    ``length``          tokens in the prompt that was matched
    ``page_keys``       16-byte keys of the pages covering ``[0, position)``,
                        in order (a view of ``page_blob``)
    ``page_tokens``     valid tokens of each page for this resume (the last page
                        may be used only partly: it is returned whole)
    ``state_key``       16-byte key of the checkpoint at ``position`` (``None``
                        when ``position == 0``)
    ``plan_id``         identifies the pins this plan holds
    ``block_size``      tokens per page
    ``pages``           the pages' node ids in the index (read-only int64 array;
                        ``page_ids`` as a tuple)
    ``kv_tokens``       how far the prompt's KV pages are known to the index
                        (the branch point where it leaves cached context)
    ``first_page``      block of ``pages[0]`` (0, but for a page range pinned by
                        :meth:`HybridIndex.pin_pages`)
    ==================  ==========================================================
    """

    position: int
    length: int
    page_blob: bytes          # the page keys, 16 bytes each, concatenated
    state_key: bytes | None
    plan_id: int
    block_size: int
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), compare=False,
                              repr=False)   # the pages' node ids (read-only int64)
    kv_tokens: int = 0
    first_page: int = 0

    @property
    def page_ids(self) -> tuple[int, ...]:
        """Node ids of the pages, in order (``pages`` as a tuple)."""
        return tuple(self.pages.tolist())

    @property
    def page_tokens(self) -> tuple[int, ...]:
        """Valid tokens of each page for this resume: whole blocks, the last one up to
        ``position`` (derived, not stored: a 128K-token plan has 2,048 pages)."""
        n = len(self.page_blob) // 16
        if not n:
            return ()
        return (self.block_size,) * (n - 1) + (
            self.position - (self.first_page + n - 1) * self.block_size,)

    @property
    def page_keys(self) -> tuple[bytes, ...]:
        """16-byte keys of the pages covering ``[0, position)``, in order."""
        blob = self.page_blob
        return tuple(blob[i: i + 16] for i in range(0, len(blob), 16))

    @property
    def recompute_tokens(self) -> int:
        """Tokens of the prompt the engine must prefill."""
        return self.length - self.position


class HybridIndex:
    """Trie of KV pages and the checkpoints attached to it.

    The index holds no bytes; it records which tiers hold each object (bit
    masks, :data:`TIER_BITS`).  It is not thread-safe by itself: the store
    serialises calls under its lock.

    Args:
        block_size: tokens per page.
        root: 16-byte namespace root key (the key of position 0).
    """

    def __init__(self, block_size: int, root: bytes, capacity: int = 1024) -> None:
        self.block_size = block_size
        self.root_key = root
        self._cap = 0
        self._klo = np.zeros(0, np.uint64)
        self._khi = np.zeros(0, np.uint64)
        self._block = np.zeros(0, np.int32)      # block index; -1 for the root
        self._ntok = np.zeros(0, np.int32)       # tokens in the page
        self._tiers = np.zeros(0, np.uint8)
        self._deps = np.zeros(0, np.int32)       # retained checkpoints needing the page
        self._pins = np.zeros(0, np.int32)       # live plans using the page
        self._nchild = np.zeros(0, np.int32)
        self._atime = np.zeros(0, np.int64)
        self._ctime = np.zeros(0, np.int64)      # logical time the page was first held
        self._nbytes = np.zeros(0, np.int32)     # a page is one block: < 2 GiB
        self._based = np.zeros(0, np.bool_)      # some checkpoint hangs on the node (_by_base)
        self._parent = array("i")                # scalar-walked, so a plain array; ids < 2**31
        self._ids = U64Map(capacity)             # low 64 bits of a node's key -> its id
        self._free: list[int] = []
        self._frees = 0                          # bumped whenever nodes are freed (path caches)
        self._serial = next(_SERIALS)            # names this index's path caches
        self._n_nodes = 0
        self._high_water = 0
        self._grow(max(capacity, 16))
        self._ckpts: dict[bytes, Checkpoint] = {}
        self._by_base: dict[int, list[Checkpoint]] = {}
        self._tree_roots: list[Checkpoint] = []
        # plan id -> (page ids, ckpt, the plan itself: a plan of another index, or a copy,
        # is not live here even when its id is)
        self._plans: dict[int, tuple[np.ndarray, bytes | None, ResumePlan]] = {}
        self._plan_ids = itertools.count(1)
        self._clock = 0
        lo, hi = _split(root)
        rid = self._new_node(lo, hi, -1, 0, _NO_PARENT)
        assert rid == ROOT

    # -- storage ----------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        new = max(need, self._cap + self._cap // 2)
        for name in _COLUMNS:
            old = getattr(self, name)
            arr = np.zeros(new, old.dtype)
            arr[: self._cap] = old
            setattr(self, name, arr)
        self._parent.extend([_NO_PARENT] * (new - self._cap))
        self._cap = new

    def _new_node(self, lo: int, hi: int, block: int, ntok: int, parent: int) -> int:
        if self._free:
            nid = self._free.pop()
        else:
            nid = self._high_water
            self._high_water += 1
            if nid >= self._cap:
                self._grow(nid + 1)
        self._klo[nid] = lo
        self._khi[nid] = hi
        self._block[nid] = block
        self._ntok[nid] = ntok
        for name in _RESET:
            getattr(self, name)[nid] = 0
        self._atime[nid] = self._ctime[nid] = self._tick()
        self._parent[nid] = parent
        if parent != _NO_PARENT:
            self._nchild[parent] += 1
        self._ids[lo] = nid
        self._n_nodes += 1
        return nid

    def _alloc(self, n: int) -> np.ndarray:
        """``n`` node ids: freed ones first (in the order ``_new_node`` pops them), then new."""
        take = min(n, len(self._free))
        nids = np.empty(n, np.int64)
        nids[:take] = self._free[len(self._free) - take:][::-1]
        del self._free[len(self._free) - take:]
        fresh = n - take
        if self._high_water + fresh > self._cap:
            self._grow(self._high_water + fresh)
        nids[take:] = np.arange(self._high_water, self._high_water + fresh)
        self._high_water += fresh
        return nids

    def _init_nodes(self, nids: np.ndarray, lo: np.ndarray, hi: np.ndarray, blocks: np.ndarray,
                    ntok: np.ndarray, parents: np.ndarray) -> None:
        """``_new_node`` for many ids at once (a run of new pages).

        The ``parents`` are distinct (each node of a run is the next one's
        parent), so one fancy-indexed add bumps their child counts.
        """
        self._klo[nids] = lo
        self._khi[nids] = hi
        self._block[nids] = blocks
        self._ntok[nids] = ntok
        for name in _RESET:
            getattr(self, name)[nids] = 0
        self._atime[nids] = self._ctime[nids] = self._ticks(len(nids))
        self._parent_view()[nids] = parents
        self._nchild[parents] += 1
        self._ids.set_many(lo, nids)
        self._n_nodes += len(nids)

    def _parent_view(self) -> np.ndarray:
        """The parent links as an int32 array sharing their memory.

        Use it within one statement: while the view lives, the ``array``
        cannot grow (``_grow`` would raise ``BufferError``).
        """
        return np.frombuffer(self._parent, dtype=np.int32)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _ticks(self, n: int) -> np.ndarray:
        """``n`` consecutive ticks (one per object of a batch, in its order)."""
        t = self._clock
        self._clock += n
        return np.arange(t + 1, t + n + 1, dtype=np.int64)

    def _touch_path(self, path: np.ndarray, new: int) -> None:
        """Mark the pages of a path from block 0 used now (the newest of ``new`` ticks, one
        per new page, for all of them).

        A page is useless without its ancestors, so a parent must never look older
        than its child: a put touches the whole path, as a resume does, and
        least-recently-used orders break ties deepest first
        (:func:`~hybridstore.policy.base.lru_order`), taking a prompt's tail first
        and its head last (vLLM's block pool frees a request's blocks in reverse for
        the same reason).  Otherwise an attention-only prompt, whose pages no
        checkpoint holds, would lose its head first, and with it every page after it.
        """
        self._atime[path] = self._ticks(new)[-1]

    def now(self) -> int:
        """The index's logical clock (advances on every put and hit)."""
        return self._clock

    def _lookup(self, lo: int, hi: int) -> int:
        nid = self._ids.get(lo)
        if nid is None or int(self._khi[nid]) != hi:
            return -1
        return nid

    def node_key(self, nid: int) -> bytes:
        """16-byte key of node ``nid``."""
        return struct.pack("<QQ", int(self._klo[nid]), int(self._khi[nid]))

    def find_node(self, key: bytes) -> int:
        """Node id of a page key, or -1."""
        return self._lookup(*_split(key))

    # -- paths ------------------------------------------------------------------------
    def _path(self, nid: int) -> np.ndarray:
        """Node ids from ``nid`` up to (excluding) the root (compiled: ``_cext.trie.path``)."""
        ext = _native.trie
        if ext is not None:
            return np.frombuffer(ext.path(self._parent, nid), dtype=np.int64)
        return self._path_py(nid)

    def _path_py(self, nid: int) -> np.ndarray:
        """The Python twin of ``_cext.trie.path``."""
        out = []
        parent = self._parent
        while nid > ROOT:
            out.append(nid)
            nid = parent[nid]
        return np.asarray(out, dtype=np.int64)

    def _ensure_path(self, prompt: PrefixKeys, upto: int) -> np.ndarray:
        """Ids of the nodes of blocks ``0..upto-1`` of ``prompt``, creating missing ones."""
        return self._extend_path(prompt, upto)[:upto]

    def _extend_path(self, prompt: PrefixKeys, upto: int) -> np.ndarray:
        """The prompt's cached path, extended to at least ``upto`` blocks (a view, not copied).

        Only entries ``< upto`` are validated: callers index it, never iterate past
        ``upto`` (a put of page after page would copy the path each time otherwise).

        The ids are cached on ``prompt`` (per index), so the engine's usual
        sequence (match, put pages block by block, put states) walks each
        block once.  A cached path is trusted while no node has been freed
        since it was cached (freed ids are reused for other pages); otherwise
        its ids are checked against the prompt's keys in one vectorised pass
        and the prefix that still holds them is kept.  The blocks past it are looked up in
        one :meth:`~hybridstore.index.u64map.U64Map.get_many` call and the
        missing ones created together (:meth:`_alloc`, :meth:`_init_nodes`).
        """
        cache = prompt.path_cache(self._serial)
        ids = cache.ids
        if upto <= 0:
            return ids[:0]
        if cache.n and cache.frees != self._frees:
            # Nodes were freed since the path was cached: an id may now name another
            # page (freed ids are reused).  Keep the prefix that still holds its keys.
            n = cache.n
            cached = ids[:n]
            ok = ((self._block[cached] == np.arange(n)) & (self._klo[cached] == prompt.keys[:n, 0])
                  & (self._khi[cached] == prompt.keys[:n, 1]))
            bad = np.flatnonzero(~ok)
            cache.n = int(bad[0]) if bad.size else n
        cache.frees = self._frees
        if cache.n >= upto:
            return ids[:cache.n]
        start = cache.n
        before = int(ids[start - 1]) if start else ROOT
        lo = prompt.lo_array[start:upto]
        hi = prompt.keys[start:upto, 1]
        found = np.empty(upto - start, np.int64)
        self._ids.get_many(lo, found)
        known = np.flatnonzero(found >= 0)
        if known.size and not np.array_equal(self._khi[found[known]], hi[known]):
            raise InvalidTokensError("64-bit key collision in the index; use another namespace")
        missing = np.flatnonzero(found < 0)
        if missing.size:
            # Each missing node's parent is the node before it, maybe one created here.
            B = self.block_size
            blocks = missing + start
            found[missing] = nids = self._alloc(missing.size)
            prev = np.empty(upto - start, np.int64)
            prev[0] = before
            prev[1:] = found[:-1]
            self._init_nodes(nids, lo[missing], hi[missing], blocks,
                             np.minimum(blocks * B + B, prompt.length) - blocks * B, prev[missing])
        if known.size:
            # Nodes restored after a reopen without their parent get it now, in block order
            # (a relink adds the deps the node carries to the path above it).
            orphan = known[(self._parent_view()[found[known]] == _NO_PARENT) & (known + start > 0)]
            for j in orphan.tolist():
                self._relink(int(found[j]), int(found[j - 1]) if j else before)
        ids[start:upto] = found
        cache.n = upto
        return ids[:upto]

    def _relink(self, nid: int, parent: int) -> None:
        """Give a node restored without its parent (after a reopen) its parent."""
        self._parent[nid] = parent
        self._nchild[parent] += 1
        # The checkpoints whose path runs through the node now need the path above it too;
        # those that only have it as a cover do not (a cover is not on its owner's path).
        # Those hang on the node of the block before it, of the same key: `parent`.
        carried = int(self._deps[nid]) - sum(ck.covers.count(nid)
                                             for ck in self._by_base.get(parent, ()))
        if carried:
            self._deps[self._path(parent)] += carried

    def _deps_of(self, ck: Checkpoint) -> np.ndarray:
        """The pages ``ck`` needs: its base's path and its covers."""
        return np.concatenate([self._path(ck.base), np.asarray(ck.covers, dtype=np.int64)])

    # -- pages ------------------------------------------------------------------------
    def add_page(self, prompt: PrefixKeys, block: int, tier: str, nbytes: int) -> int:
        """Record that the page of ``block`` of ``prompt`` is now held by ``tier``.

        Links the page as a cover of checkpoints inside its block that it is
        seen to begin with.  Returns the node id.
        """
        return int(self.add_pages(prompt, block, block + 1, tier, nbytes)[0])

    def add_pages(self, prompt: PrefixKeys, first: int, stop: int, tier: str | None,
                  nbytes: int) -> np.ndarray:
        """Record that ``tier`` now holds the pages of blocks ``first..stop-1`` of ``prompt``.

        One call per run of pages (an engine stores a request's new blocks
        together): the path is extended once, the columns are written
        vectorised, and only pages whose parent carries checkpoints are
        visited one by one (to link them as covers).  ``tier=None`` touches
        pages some tier already holds.  Returns the node ids.
        """
        if not 0 <= first < stop <= prompt.nblocks:
            raise InvalidTokensError(
                f"blocks {first}..{stop - 1} are outside the prompt's {prompt.nblocks} blocks")
        ids = self._extend_path(prompt, stop)
        nids = ids[first:stop].copy()
        if tier is not None:            # a touch keeps the size the page was stored with
            self._tiers[nids] |= TIER_BITS[tier]
            self._nbytes[nids] = nbytes
        self._touch_path(ids[:stop], stop - first)
        bases = np.empty(len(nids), np.int64)
        bases[0] = ids[first - 1] if first > 0 else ROOT
        bases[1:] = nids[:-1]
        for j in np.flatnonzero(self._based[bases]).tolist():
            self._link_covers(prompt, first + j, int(bases[j]), int(nids[j]))
        return nids

    def held_tiers(self, prompt: PrefixKeys, first: int, stop: int) -> np.ndarray:
        """Tier masks of the pages of blocks ``first..stop-1`` (0: no tier holds it, or the
        index does not know it); creates nothing."""
        lo = prompt.lo_array[first:stop]
        found = np.empty(len(lo), np.int64)
        self._ids.get_many(lo, found)
        ok = found >= 0
        ok[ok] = self._khi[found[ok]] == prompt.keys[first:stop, 1][ok]
        return np.where(ok, self._tiers[np.where(ok, found, ROOT)], 0).astype(np.uint8)

    def _link_covers(self, prompt: PrefixKeys, block: int, base: int, nid: int) -> None:
        waiting = self._by_base.get(base)
        if not waiting:
            return
        ntok = int(self._ntok[nid])
        inner = None
        for ck in waiting:
            # A checkpoint ending exactly where this page ends already names it
            # as a cover (same key); only checkpoints strictly inside are linked here.
            if ck.offset >= ntok or nid in ck.covers:
                continue
            if inner is None:
                inner = prompt.inner_keys(block)
                if inner is None:
                    return
            if struct.pack("<QQ", *map(int, inner[ck.offset - 1])) == ck.key:
                ck.covers.append(nid)
                self._deps[nid] += 1

    def add_page_tier(self, nid: int, tier: str) -> None:
        """Record that ``tier`` now also holds page ``nid`` (a copy between tiers)."""
        self._tiers[nid] |= TIER_BITS[tier]

    def drop_page_tier(self, nid: int, tier: str) -> None:
        """Record that ``tier`` no longer holds page ``nid``; forget it if nothing needs it."""
        self._tiers[nid] &= ~TIER_BITS[tier] & 0xFF
        self._collect(nid)

    def drop_pages_tier(self, nids: np.ndarray, tier: str) -> None:
        """:meth:`drop_page_tier` for many pages at once (a batch of evictions)."""
        self._tiers[nids] &= ~TIER_BITS[tier] & 0xFF
        self._collect_many(nids)

    def _collect(self, nid: int) -> None:
        """Remove nodes that hold no bytes and that nothing refers to, bottom-up."""
        self._collect_many(np.array([nid], np.int64))

    def _collect_many(self, starts: np.ndarray) -> None:
        """:meth:`_collect` from each of ``starts`` (compiled: ``_cext.trie.collect``)."""
        ext = _native.trie
        if ext is not None:
            freed = np.frombuffer(ext.collect(
                starts.astype(np.int64, copy=False), self._parent, self._tiers, self._deps,
                self._pins, self._nchild, self._block), dtype=np.int64)
        else:
            freed = self._collect_py(starts)
        if freed.size:
            self._ids.delete_many(self._klo[freed])
            self._free.extend(freed.tolist())
            self._n_nodes -= int(freed.size)
            self._frees += 1

    def _collect_py(self, starts: np.ndarray) -> np.ndarray:
        """The Python twin of ``_cext.trie.collect`` (the same walk, one node at a time)."""
        parent, block = self._parent, self._block
        tiers, deps, pins, nchild = self._tiers, self._deps, self._pins, self._nchild
        out: list[int] = []
        for nid in starts.tolist():
            while (nid > ROOT and tiers[nid] == 0 and deps[nid] == 0 and pins[nid] == 0
                   and nchild[nid] == 0 and block[nid] != -2):
                out.append(nid)
                up = parent[nid]
                parent[nid] = _NO_PARENT
                block[nid] = -2
                if up == _NO_PARENT:
                    break
                nchild[up] -= 1
                nid = up
        return np.asarray(out, dtype=np.int64)

    # -- checkpoints ------------------------------------------------------------------
    def add_checkpoint(self, prompt: PrefixKeys, position: int, tier: str, nbytes: int) -> Checkpoint:
        """Record that ``tier`` holds the checkpoint of ``prompt`` at ``position``."""
        key = prompt.key_at(position)
        if key is None:
            raise InvalidTokensError(
                f"position {position} lies inside a block of a prompt given as block ids; "
                "pass token ids to checkpoint inside a block")
        B = self.block_size
        k = (position - 1) // B
        ck = self._ckpts.get(key)
        if ck is None:
            ids = self._ensure_path(prompt, k)
            base = int(ids[-1]) if len(ids) else ROOT
            # Covers: the page ending exactly at `position`, and the prompt's own
            # page of block k when the prompt runs past `position`.
            covers = [(key, position - k * B)]
            if prompt.block_end(k) > position:
                covers.append((prompt.block_key(k), prompt.block_end(k) - k * B))
            ck = self._insert_checkpoint(key, position, base, ids, covers, nbytes, prompt)
        ck.tiers |= TIER_BITS[tier]
        ck.nbytes = nbytes
        ck.atime = self._tick()
        return ck

    def _insert_checkpoint(self, key: bytes, position: int, base: int, path: np.ndarray,
                           covers: Iterable[tuple[bytes, int]], nbytes: int,
                           prompt: PrefixKeys | None) -> Checkpoint:
        """Create a checkpoint on ``base``: count it on its path and covers, link it in the tree."""
        B = self.block_size
        k = (position - 1) // B
        ck = Checkpoint(key, position, base, position - k * B, nbytes, self._tick())
        self._ckpts[key] = ck
        self._by_base.setdefault(base, []).append(ck)
        self._based[base] = True
        if len(path):
            self._deps[path] += 1
        for ckey, ntok in covers:
            lo, hi = _split(ckey)
            nid = self._lookup(lo, hi)
            if nid < 0:
                nid = self._new_node(lo, hi, k, ntok, base)
            ck.covers.append(nid)
            self._deps[nid] += 1
        self._attach(ck, prompt)
        return ck

    def restore_page(self, key: bytes, block: int, ntok: int, parent_key: bytes, tier: str,
                     nbytes: int) -> int:
        """Re-insert a page listed by a durable tier after a restart."""
        lo, hi = _split(key)
        nid = self._lookup(lo, hi)
        if nid < 0:
            parent = ROOT if block == 0 else self._restore_ghost(parent_key, block - 1)
            nid = self._new_node(lo, hi, block, ntok, parent)
        elif self._parent[nid] == _NO_PARENT and block > 0:
            self._relink(nid, self._restore_ghost(parent_key, block - 1))
        self._tiers[nid] |= TIER_BITS[tier]
        self._nbytes[nid] = nbytes
        return nid

    def _restore_ghost(self, key: bytes, block: int) -> int:
        lo, hi = _split(key)
        nid = self._lookup(lo, hi)
        if nid < 0:
            nid = self._new_node(lo, hi, block, self.block_size, _NO_PARENT)
        return nid

    def restore_checkpoint(self, key: bytes, position: int, base_key: bytes,
                           covers: Iterable[tuple[bytes, int]], tier: str, nbytes: int) -> Checkpoint:
        """Re-insert a checkpoint listed by a durable tier after a restart."""
        ck = self._ckpts.get(key)
        if ck is None:
            B = self.block_size
            k = (position - 1) // B
            base = ROOT if k == 0 else self._restore_ghost(base_key, k - 1)
            ck = self._insert_checkpoint(key, position, base, self._path(base), covers, nbytes, None)
        ck.tiers |= TIER_BITS[tier]
        ck.nbytes = nbytes
        return ck

    # -- the checkpoint tree ------------------------------------------------------------
    def _precedes(self, a: Checkpoint, b: Checkpoint, prompt: PrefixKeys | None) -> bool:
        """Whether checkpoint ``a`` lies on ``b``'s path, before it."""
        if a.position >= b.position:
            return False
        B = self.block_size
        block_a = (a.position - 1) // B
        if a.base == b.base:
            if prompt is not None and prompt.tokens is not None:
                return prompt.key_at(a.position) == a.key
            return not set(a.covers).isdisjoint(b.covers)
        # the node of a's block on b's path
        node = b.base
        parent = self._parent
        while node > ROOT and self._block[node] > block_a:
            node = parent[node]
        return node > ROOT and self._block[node] == block_a and node in a.covers

    def _attach(self, ck: Checkpoint, prompt: PrefixKeys | None) -> None:
        """Link ``ck`` into the checkpoint tree under its nearest ancestor."""
        parent: Checkpoint | None = None
        for cand in self._by_base.get(ck.base, ()):
            if cand is not ck and self._precedes(cand, ck, prompt):
                if parent is None or cand.position > parent.position:
                    parent = cand
        if parent is None and ck.base > ROOT:
            # Climb from the base: a checkpoint hanging on an ancestor `up` that the
            # path's node below `up` covers precedes ck; the nearest one wins.
            path = self._path(ck.base)
            ups = np.empty(len(path), np.int64)
            ups[:-1] = path[1:]
            ups[-1] = self._parent[int(path[-1])]   # the root, or -1: restored without ancestors
            if ups[-1] == _NO_PARENT:
                path, ups = path[:-1], ups[:-1]
            for i in np.flatnonzero(self._based[ups]).tolist():
                node = int(path[i])
                for cand in self._by_base[int(ups[i])]:
                    if node in cand.covers and (parent is None or cand.position > parent.position):
                        parent = cand
                if parent is not None:
                    break
        ck.parent = parent
        siblings = parent.children if parent is not None else self._tree_roots
        # ck's descendants among its siblings hang on its base (later in its block) or
        # pass through one of its covers; when no path continues past a cover, only
        # the former need the (per-candidate) precedence test.
        if any(self._nchild[c] or self._based[c] for c in ck.covers):
            candidates = list(siblings)
        else:
            candidates = [c for c in self._by_base.get(ck.base, ())
                          if c is not ck and c.parent is parent]
        for child in candidates:
            if self._precedes(ck, child, None):
                siblings.remove(child)
                child.parent = ck
                ck.children.append(child)
        siblings.append(ck)

    def _detach(self, ck: Checkpoint) -> None:
        siblings = ck.parent.children if ck.parent is not None else self._tree_roots
        siblings.remove(ck)
        for child in ck.children:
            child.parent = ck.parent
            siblings.append(child)
        ck.children = []
        ck.parent = None

    def ancestors(self, ck: Checkpoint) -> Iterator[Checkpoint]:
        """Checkpoints before ``ck`` on its path, nearest first."""
        cur = ck.parent
        while cur is not None:
            yield cur
            cur = cur.parent

    def exclusive_pages(self, ck: Checkpoint) -> list[int]:
        """Pages only ``ck`` needs: its trajectory's last KV segment (HiState Fig. 6)."""
        return self.exclusive_page_ids(ck).tolist()

    def exclusive_page_ids(self, ck: Checkpoint) -> np.ndarray:
        """:meth:`exclusive_pages` as an int64 array: its covers, then its path upwards."""
        covers = np.asarray(ck.covers, dtype=np.int64)
        path = self._path(ck.base)
        shared = np.flatnonzero(self._deps[path] != 1)
        return np.concatenate([covers[self._deps[covers] == 1],
                               path[: int(shared[0]) if shared.size else len(path)]])

    def dependents(self, nid: int) -> list[Checkpoint]:
        """The retained checkpoints that need page ``nid``: those whose base path holds it
        and those it covers (its ``deps`` count, as checkpoints).

        A scan of the checkpoints, one path walk per distinct base at or below the page's
        block: for the evictor's last resort (a page that must go with the checkpoints that
        need it), not for hot paths.

        Args:
            nid: a page's node id.

        Returns:
            The checkpoints, in no particular order (empty when nothing needs the page).
        """
        if nid <= ROOT or not self._deps[nid]:
            return []
        blk = int(self._block[nid])
        out: list[Checkpoint] = []
        for base, cks in self._by_base.items():
            on_path = base == nid or (base > ROOT and int(self._block[base]) > blk
                                      and bool((self._path(base) == nid).any()))
            out.extend(ck for ck in cks if on_path or nid in ck.covers)
        return out

    def checkpoint(self, key: bytes) -> Checkpoint | None:
        return self._ckpts.get(key)

    def checkpoints(self) -> Iterator[Checkpoint]:
        return iter(list(self._ckpts.values()))

    def cover_keys(self, ck: Checkpoint) -> list[tuple[bytes, int]]:
        """``(key, ntok)`` of each cover page of ``ck`` (for the durable catalog)."""
        return [(self.node_key(n), int(self._ntok[n])) for n in ck.covers]

    def drop_checkpoint_tier(self, key: bytes, tier: str) -> None:
        """Record that ``tier`` no longer holds a checkpoint; forget it when no tier does."""
        ck = self._ckpts[key]
        ck.tiers &= ~TIER_BITS[tier] & 0xFF
        if ck.tiers:
            return
        del self._ckpts[key]
        self._detach(ck)
        siblings = self._by_base[ck.base]
        siblings.remove(ck)
        if not siblings:
            del self._by_base[ck.base]
            self._based[ck.base] = False
        arr = self._deps_of(ck)
        if arr.size:
            self._deps[arr] -= 1
            # Only pages that hold no bytes and that nothing else needs can go.
            gone = (self._tiers[arr] == 0) & (self._deps[arr] == 0) & (self._pins[arr] == 0)
            if gone.any():
                self._collect_many(arr[gone])

    # -- matching ---------------------------------------------------------------------
    def match(self, prompt: PrefixKeys, max_position: int | None = None) -> ResumePlan:
        """The deepest resume point of ``prompt`` whose checkpoint and pages are all held.

        A resume point at ``p`` is complete when some tier holds the
        checkpoint at ``p`` and every page covering ``[0, p)`` (the last one
        possibly a page that only begins with the prompt's tokens).  The plan
        pins its pages and checkpoint until :meth:`release`.
        """
        arr = self._walk_ids(prompt)
        for p, j, ck, cover in self._resume_points(prompt, arr, max_position):
            pages = np.empty(j + 1, np.int64)
            pages[:j] = arr[:j]
            pages[j] = cover
            return self._pin(prompt, pages, p, ck, len(arr))
        return self._pin(prompt, np.zeros(0, np.int64), 0, None, len(arr))

    def resume_checkpoint(self, prompt: PrefixKeys, max_position: int | None = None
                          ) -> Checkpoint | None:
        """The checkpoint of :meth:`match`'s resume point (``None``: no resume point),
        pinning nothing: what a request waiting in the engine's queue would resume from."""
        arr = self._walk_ids(prompt)
        return next((ck for _, _, ck, _ in self._resume_points(prompt, arr, max_position)), None)

    def restorable(self, prompt: PrefixKeys, max_position: int | None = None) -> list[int]:
        """Every position where ``prompt`` has a complete resume point, ascending.

        The positions :meth:`match` considers (its answer is the last one);
        nothing is pinned.  An engine that intersects resume points across
        ranks (SGLang's ``restorable_prefix_pages``) needs all of them.
        """
        arr = self._walk_ids(prompt)
        return sorted(p for p, _, _, _ in self._resume_points(prompt, arr, max_position))

    def _resume_points(self, prompt: PrefixKeys, arr: np.ndarray, max_position: int | None
                       ) -> Iterator[tuple[int, int, Checkpoint, int]]:
        """Complete resume points of ``prompt``, deepest first: ``(position, block,
        checkpoint, cover page id)``; ``arr`` is the prompt's walked path."""
        limit = prompt.length if max_position is None else min(max_position, prompt.length)
        walked = len(arr)
        B = self.block_size
        top = min(self._held_prefix(arr), prompt.nblocks - 1, (limit - 1) // B if limit > 0 else -1)
        if top < 0:
            return
        # The base of block j is the page of block j-1 (the root for j = 0); only
        # bases some checkpoint hangs on are visited, deepest first.
        bases = np.empty(top + 1, np.int64)
        bases[0] = ROOT
        bases[1:] = arr[:top]
        for j in np.flatnonzero(self._based[bases])[::-1].tolist():
            waiting = self._by_base[int(bases[j])]
            for ck in sorted(waiting, key=lambda c: -c.offset):
                p = j * B + ck.offset
                if p > limit or not ck.tiers:
                    continue
                if prompt.key_at(p) != ck.key:
                    continue
                cover = self._present_cover(ck, int(arr[j]) if j < walked else -1)
                if cover < 0:
                    continue
                yield p, j, ck, cover

    def held_run(self, prompt: PrefixKeys) -> int:
        """How many leading blocks of ``prompt`` have a page some tier holds."""
        return self._held_prefix(self._walk_ids(prompt))

    def _held_prefix(self, arr: np.ndarray) -> int:
        """How many leading pages of a walked path some tier holds."""
        missing = np.flatnonzero(self._tiers[arr] == 0)
        return int(missing[0]) if missing.size else len(arr)

    def pin_pages(self, prompt: PrefixKeys, first: int, stop: int) -> ResumePlan:
        """Pin the held pages of blocks ``[first, stop)`` (clipped at the leading held
        run) without a checkpoint: the plan of a page-only load (attention-only
        models, an engine fetching a range of pages).

        Raises:
            InvalidTokensError: ``first`` is negative or past ``stop``.
        """
        if not 0 <= first <= stop:
            raise InvalidTokensError(f"page range [{first}, {stop}) is empty or negative; "
                                     "pass 0 <= first <= stop")
        arr = self._walk_ids(prompt)
        stop = min(stop, self._held_prefix(arr))
        if stop <= first:
            return self._pin(prompt, np.zeros(0, np.int64), 0, None, len(arr), first)
        pages = np.array(arr[first:stop], np.int64)
        return self._pin(prompt, pages, prompt.block_end(stop - 1), None, len(arr), first)

    def path_keys(self, nid: int) -> np.ndarray:
        """Keys (``(n, 2)`` uint64) of the pages from block 0 down to node ``nid``."""
        ids = self._path(nid)[::-1]
        return np.stack([self._klo[ids], self._khi[ids]], axis=1).astype(np.uint64)

    def page_block(self, nid: int) -> int:
        """Block number of page node ``nid``."""
        return int(self._block[nid])

    def known_ids(self, prompt: PrefixKeys) -> np.ndarray:
        """Node ids of the prompt's leading blocks the index knows (held or not), in order."""
        return self._walk_ids(prompt)

    def _walk_ids(self, prompt: PrefixKeys) -> np.ndarray:
        """Ids of the prompt's leading blocks the index knows, an int64 array (one
        :meth:`~hybridstore.index.u64map.U64Map.prefix_many` probe of the low key
        halves, the high halves compared vectorised)."""
        n = prompt.nblocks
        if not n:
            return np.zeros(0, np.int64)
        arr = np.empty(n, np.int64)
        k = self._ids.prefix_many(prompt.lo_array, arr)
        arr = arr[:k]
        bad = np.flatnonzero(self._khi[arr] != prompt.keys[:k, 1])
        if bad.size:
            arr = arr[: int(bad[0])]
        return arr

    def _present_cover(self, ck: Checkpoint, preferred: int) -> int:
        if preferred in ck.covers and self._tiers[preferred]:
            return preferred
        for nid in ck.covers:
            if self._tiers[nid]:
                return nid
        return -1

    def _pin(self, prompt: PrefixKeys, pages: np.ndarray, position: int,
             ck: Checkpoint | None, walked: int, first: int = 0) -> ResumePlan:
        plan_id = next(self._plan_ids)
        B = self.block_size
        n = len(pages)
        t = self._tick()
        if n:
            self._pins[pages] += 1
            self._atime[pages] = t
        if ck is not None:
            ck.pins += 1
            ck.hits += 1
            ck.atime = t
        # Every page but the last is the prompt's own block; the last may be a cover.
        blob = (prompt.keys[first: first + n - 1].astype("<u8").tobytes()
                + self.node_key(int(pages[-1]))) if n else b""
        pages.flags.writeable = False
        plan = ResumePlan(position=position, length=prompt.length, page_blob=blob,
                          state_key=ck.key if ck else None, plan_id=plan_id, block_size=B,
                          pages=pages, kv_tokens=min(walked * B, prompt.length), first_page=first)
        self._plans[plan_id] = (pages, ck.key if ck else None, plan)
        return plan

    def release(self, plan: ResumePlan) -> None:
        """Drop the pins of ``plan``; raises PlanReleasedError when done twice."""
        if not self.is_live(plan):
            raise PlanReleasedError(f"plan {plan.plan_id} was already released (or is not this "
                                    "store's); release each plan once, to the store that made it")
        arr, ckey, _ = self._plans.pop(plan.plan_id)
        if ckey is not None and ckey in self._ckpts:
            self._ckpts[ckey].pins -= 1
        if len(arr):
            self._pins[arr] -= 1
            # Only pages that lost their bytes while pinned can now be forgotten.
            gone = arr[self._tiers[arr] == 0]
            if gone.size:
                self._collect_many(gone)

    def is_live(self, plan: ResumePlan) -> bool:
        """Whether ``plan`` is a plan of this index not released yet (not a copy of one)."""
        entry = self._plans.get(plan.plan_id)
        return entry is not None and entry[2] is plan

    # -- inspection (policies read these; they never mutate) ------------------------
    def node_ids(self) -> np.ndarray:
        """Ids of all live page nodes (the root excluded)."""
        ids = np.flatnonzero(self._block[: self._high_water] >= 0)   # freed: -2, root: -1
        return ids.astype(np.int64, copy=False)

    def page_table(self, tier: str) -> dict[str, np.ndarray]:
        """Columns of the pages held by ``tier``: ids, atime, deps, pins, nbytes, tiers, block."""
        live = self.node_ids()
        sel = live[(self._tiers[live] & TIER_BITS[tier]) != 0] if live.size else live
        return {"ids": sel, "atime": self._atime[sel], "deps": self._deps[sel],
                "pins": self._pins[sel], "nbytes": self._nbytes[sel], "tiers": self._tiers[sel],
                "block": self._block[sel]}

    def page_columns(self, ids: np.ndarray,
                     names: tuple[str, ...] = ("tiers", "nbytes")) -> dict[str, np.ndarray]:
        """Columns ``names`` (``tiers``, ``deps``, ``pins``, ``nbytes``, ``atime``,
        ``ctime``, ...) of the pages ``ids``, vectorised (restore costs, batched eviction)."""
        return {name: getattr(self, "_" + name)[ids] for name in names}

    def page_state(self, nid: int) -> tuple[int, int, int, int]:
        """``(tiers, deps, pins, nbytes)`` of page ``nid`` (eviction's hot path)."""
        return (int(self._tiers[nid]), int(self._deps[nid]), int(self._pins[nid]),
                int(self._nbytes[nid]))

    def page_keys_blob(self, ids: np.ndarray) -> bytes:
        """16-byte keys of pages ``ids``, concatenated in order."""
        return np.stack([self._klo[ids], self._khi[ids]], axis=1).astype("<u8").tobytes()

    def page_nbytes(self, nid: int) -> int:
        return int(self._nbytes[nid])

    def page_ctime(self, nid: int) -> int:
        return int(self._ctime[nid])

    def page_tiers(self, nid: int) -> int:
        """Tier mask of page ``nid`` (hot path; ``page_info`` has every field)."""
        return int(self._tiers[nid])

    def page_info(self, nid: int) -> dict[str, int]:
        return {"block": int(self._block[nid]), "ntok": int(self._ntok[nid]),
                "tiers": int(self._tiers[nid]), "deps": int(self._deps[nid]),
                "pins": int(self._pins[nid]), "nbytes": int(self._nbytes[nid]),
                "parent": int(self._parent[nid]), "atime": int(self._atime[nid]),
                "ctime": int(self._ctime[nid])}

    def parent_key(self, nid: int) -> bytes:
        parent = self._parent[nid]
        return self.root_key if parent in (ROOT, _NO_PARENT) else self.node_key(parent)

    def touch_page(self, nid: int) -> None:
        self._atime[nid] = self._tick()

    def age_pages(self, prompt: PrefixKeys, first: int, last_used: np.ndarray) -> None:
        """Rank the pages of blocks ``first..first+len(last_used)-1`` of ``prompt`` as last
        used at ``last_used`` (logical times; a page already older keeps its own).  The path
        must be known to the index.  An accounting replay's second copy of a block ranks as
        the older copy it stands for (``replay/sim.py``, ``put_duplicates``).

        Raises:
            InvalidTokensError: the blocks are outside the prompt or the index does not
                know their path.
        """
        stop = first + len(last_used)
        ids = self._walk_ids(prompt)
        if not 0 <= first <= stop <= len(ids):
            raise InvalidTokensError(f"blocks {first}..{stop - 1} of the prompt are not all "
                                     f"known to the index ({len(ids)} are)")
        nids = ids[first:stop]
        self._atime[nids] = np.minimum(self._atime[nids], np.asarray(last_used, np.int64))

    @property
    def n_pages(self) -> int:
        return self._n_nodes - 1

    @property
    def n_checkpoints(self) -> int:
        return len(self._ckpts)

    def memory_bytes(self) -> int:
        """Approximate bytes the index uses for its page nodes (columns + key map)."""
        arrays = (sum(getattr(self, n).nbytes for n in _COLUMNS)
                  + self._parent.itemsize * len(self._parent))
        return arrays + self._ids.memory_bytes()

    def recount(self) -> tuple[np.ndarray, np.ndarray]:
        """``(deps, pins)`` of every node recomputed from scratch (for checks)."""
        deps = np.zeros(self._cap, np.int32)
        pins = np.zeros(self._cap, np.int32)
        for ck in self._ckpts.values():
            for nid in self._deps_of(ck):
                deps[nid] += 1
        for page_ids, _, _ in self._plans.values():
            for nid in page_ids:
                pins[nid] += 1
        return deps, pins

    def check_refcounts(self) -> bool:
        """True when the incremental refcounts equal a from-scratch recount."""
        deps, pins = self.recount()
        live = self.node_ids()
        return bool(np.array_equal(deps[live], self._deps[live])
                    and np.array_equal(pins[live], self._pins[live]))


__all__ = ["Checkpoint", "HybridIndex", "ResumePlan", "TIER_BITS", "ROOT"]
