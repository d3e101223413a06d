"""Puts straight into a slower tier: pages the caller already keeps in DRAM of its own.

:meth:`~hybridstore.HybridStore.write_kv_many` (vLLM's ``HybridStoreTier``, whose
chunks sit in vLLM's pinned CPU primary tier) writes each page from the caller's
buffer to the disk tier directly: no copy into the store's pinned pool, and that
pool is not filled with bytes the engine holds in DRAM itself.

Under the store lock the held pages are touched, the new ones reserved
(:attr:`~hybridstore.store.landing.Landing.reserved`: other puts leave them to
this one), room is made in the target tier and one ``put_many`` per run starts
the writes (neighbouring slots in one I/O).  Two futures per new page come back:
``written`` (the tier no longer reads the caller's buffer: the engine may reuse
it) and ``durable`` (bytes ``fdatasync``\\ ed, catalog entry committed).  The index
learns of a page only once it is durable, in :meth:`DirectWrites.drain` under the
store lock (every call that reads the index drains first), exactly as for a
write-through copy: durability, checksums and the catalog are the disk tier's, as
for any put.  A write that fails leaves nothing: the page is a miss.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from hybridstore.errors import CapacityError
from hybridstore.index.meta import encode_page
from hybridstore.index.prefix import PrefixKeys
from hybridstore.layout import Layout
from hybridstore.objects import (
    TIER_BITS,
    ObjectKey,
    ObjectKind,
    aligned_empty,
    object_key,
)
from hybridstore.store.landing import Landing
from hybridstore.store.staged import Staging

log = logging.getLogger("hybridstore.store")


@dataclass
class DirectPut:
    """What one :meth:`~hybridstore.HybridStore.write_kv_many` started.

    Attributes:
        held: indices of the prompts whose page some tier already holds (touched) or
            another put in progress is storing.
        new: indices of the prompts whose page is being written.
        written: per ``new`` page, completes once the tier no longer reads the
            caller's buffer (fails with the put's error if it failed before).
        durable: per ``new`` page, completes once the page is durable; the index
            holds it from the next store call on.  Fails when the write, its
            ``fdatasync`` or its catalog commit failed (the page is then a miss).
        refused: indices of the prompts whose page found no room (not stored).
    """

    held: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    written: list[Future] = field(default_factory=list)
    durable: list[Future] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)


def page_bytes(layout: Layout, page: object) -> np.ndarray:
    """The bytes of ``page`` as stored: a view of the caller's buffer when it is one
    contiguous host tensor of the layout (no copy), else packed into a new aligned buffer.

    Raises:
        LayoutMismatchError: ``page`` does not have the store's page layout.
    """
    targets = layout.targets(page)
    if len(targets) == 1:
        t = targets[0]
        if t.host is not None and t.spec.offset == 0 and t.spec.nbytes == layout.nbytes:
            return t.host
    buf = aligned_empty(layout.nbytes)
    layout.pack_into(page, buf)
    return buf


class DirectWrites:
    """Direct page writes of one store that are not durable yet (see the module docstring).

    Args:
        landing: the store's put path (residency, evictor, copies, reserved keys).
        staging: the reserved page keys (shared with :mod:`~hybridstore.store.staged`).
    """

    def __init__(self, landing: Landing, staging: Staging) -> None:
        self.landing = landing
        self.staging = staging
        self.pending: dict[ObjectKey, Future] = {}
        self._completed: deque[tuple[ObjectKey, str, PrefixKeys, int, Future]] = deque()
        self.closed = False
        """Set when the store closes: completions are then no longer indexed."""
        self.failed = 0
        """Direct writes that failed (their pages are misses)."""

    def submit(self, prompts: Sequence[PrefixKeys], datas: Sequence[np.ndarray], nbytes: int,
               tier: str) -> DirectPut:
        """Under the store lock: touch, reserve and start writing the last page of each
        prompt into ``tier`` (runs of at most an eighth of it, room made for each run)."""
        res, room = self.landing.res, self.landing.evictor
        index, target = res.index, res.tiers[tier]
        out = DirectPut()
        keys: list[ObjectKey] = []
        metas: list[bytes] = []
        B = res.block_size
        for i, prompt in enumerate(prompts):
            k = prompt.nblocks - 1
            okey = object_key(ObjectKind.PAGE, prompt.block_key(k))
            if index.held_tiers(prompt, k, k + 1)[0] != 0:
                index.add_pages(prompt, k, k + 1, None, nbytes)          # touched
                out.held.append(i)
            elif okey in self.staging.keys:
                out.held.append(i)           # another put in progress stores it
            else:
                self.staging.keys.add(okey)
                out.new.append(i)
                keys.append(okey)
                metas.append(encode_page(k, prompt.block_end(k) - k * B, prompt.key_before(k)))
        charge = target.charge(nbytes)
        step = max(1, target.capacity_bytes // 8 // max(charge, 1))
        new, out.new = out.new, []
        c = 0
        try:
            while c < len(keys):
                d = min(c + step, len(keys))
                part = keys[c:d]
                bufs = [datas[new[j]] for j in range(c, d)]
                written: list[Future] = [Future() for _ in part]
                try:
                    room.make_room(tier, charge * len(part), ObjectKind.PAGE)
                    futs = room.retry(tier, nbytes * len(part), partial(
                        self._put, target, part, bufs, nbytes, metas[c:d], written), each=nbytes)
                except CapacityError:
                    if len(part) > 1:
                        step = 1              # room only one by one
                        continue
                    self.staging.keys.discard(part[0])
                    out.refused.append(new[c])
                    c = d
                    continue
                if not target.reports_written:
                    written = futs            # the buffer is read until the put completes
                for j, okey, fut, w in zip(range(c, d), part, futs, written):
                    i = new[j]
                    out.new.append(i)
                    out.written.append(w)
                    out.durable.append(fut)
                    self.pending[okey] = fut
                    fut.add_done_callback(partial(self._done, okey, tier, prompts[i], nbytes))
                c = d
        except BaseException:
            self.staging.keys.difference_update(keys[c:])
            raise
        return out

    @staticmethod
    def _put(target: object, keys: list[ObjectKey], bufs: list[np.ndarray], nbytes: int,
             metas: list[bytes], written: list[Future]) -> list[Future]:
        put_many = target.put_many  # type: ignore[attr-defined]
        if target.reports_written:  # type: ignore[attr-defined]
            return list(put_many(keys, bufs, nbytes=nbytes, metas=metas, written=written))
        return list(put_many(keys, bufs, nbytes=nbytes, metas=metas))

    def _done(self, okey: ObjectKey, tier: str, prompt: PrefixKeys, nbytes: int,
              fut: Future) -> None:
        """Runs on the tier's commit thread: only queue it (no store lock here)."""
        self._completed.append((okey, tier, prompt, nbytes, fut))

    def drain(self) -> None:
        """Index the pages whose direct write became durable (under the store lock)."""
        res = self.landing.res
        while self._completed:
            okey, tier, prompt, nbytes, fut = self._completed.popleft()
            if self.pending.get(okey) is fut:
                del self.pending[okey]
            self.staging.keys.discard(okey)
            error = fut.exception()
            if error is not None:
                self.failed += 1
                log.warning("direct write of page %s to the %s tier failed (a miss): %s",
                            okey.hex(), tier, error)
                continue
            if self.closed:
                continue
            k = prompt.nblocks - 1
            held = int(res.index.held_tiers(prompt, k, k + 1)[0])
            if held & TIER_BITS[tier]:
                res.index.add_pages(prompt, k, k + 1, None, nbytes)
                continue
            res.index.add_pages(prompt, k, k + 1, tier, nbytes)
            res.added(tier, ObjectKind.PAGE, 1, res.tiers[tier].charge(nbytes))
            if res.writes_through(ObjectKind.PAGE):
                meta = res.page_meta(okey)
                for dst in res.chain[res.chain.index(tier) + 1:]:
                    self.landing.copies.write_through_many([okey], ObjectKind.PAGE, nbytes,
                                                           [meta], tier, dst)

    def wait(self) -> None:
        """Wait for every direct write in flight, then index them (under the store lock:
        completions never take it)."""
        with self.landing.copies.urgent():
            for fut in list(self.pending.values()):
                try:
                    fut.result()
                except Exception:  # noqa: BLE001, S110 - counted and logged by drain
                    pass
        self.drain()
