"""The exact hit bound of a free-state KV cache: Belady at page granularity.

The model (``hybridstore replay --headroom``): requests are served one at a time in a
fixed order; each prompt is a chain of pages (its full blocks, ``Request.block_ids``:
chained ids, equal id ⇔ equal prefix); the cache holds at most ``capacity`` pages of any
requests, and a request **hits the leading pages of its prompt that are cached** (a
page behind a missing one is no use: its KV needs the missing one's).  After a request
the cache may keep any pages it held or the request brought, within ``capacity``.
Recurrent states are free and wherever they are needed, so no hybrid cache — any
eviction order, any state placement — keeps more under the same page budget.

A request may also be one the engine cannot cache (``stores``): a prompt whose KV alone
exceeds the engine's KV pool cannot be prefilled with its KV resident, so the replay's
engine serves it from its match and stores nothing of it (``sim._serve``, every preset
alike).  Belady's rule is *not* exact under that constraint: a page whose next use is
such a request cannot come back there once evicted, so its later uses count too (the
exhaustive search finds a case: ``[A], [B], [A], [B], [B]`` in room for one page, the last
three refused, keeps 2 where Belady keeps 1).  The bound relaxes it instead: a refused
prompt only ever holds the leading pages some cacheable prompt brought before it (the
rest were never in any cache), and it may fetch those as any request can.  Every cache of
the engine's model is a cache of the relaxed one, so Belady on the relaxed instance, which
is exact for it, is an upper bound for the engine's; the tests check both against the
exhaustive search.

The optimum of that model is Belady's rule at page granularity:

* a page's *next use* is the next request (in serving order) whose prompt holds it: the
  next request of any session whose prompt carries that page's block chain;
* after each request its pages are cached, then the page of farthest next use goes
  while the cache is over capacity, the **deepest first on ties** (pages never used
  again go first).

A deeper page of a chain is never used before a shallower one (a prompt that holds it
holds its parent), so its next use is never earlier and the tie rule evicts it first:
the cache stays prefix-closed and every cached page of a prompt is one of its leading
pages.  Belady's rule maximises the cached pages of each prompt summed over the
requests (uniform pages, a page may be dropped at once), that sum bounds the leading
cached pages whatever the cache does, and the rule's cache reaches it; so it is exact.
``tests/replay/test_bound.py`` checks it against an exhaustive search of every cache
content on small cases.

The simulation works on *runs*, not pages: a prompt's next uses never decrease with
depth, so its pages fall into a few runs of one next use each.  A run sits in a heap
keyed by (farthest next use, deepest end), is evicted from its deep end, and is
consumed whole when the request of its next use arrives (its pages are that prompt's; the
hit is the leading ones, which by the tie rule is all of them); stale heap entries are
skipped (lazy invalidation).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from hybridstore.errors import ConfigError

NEVER = np.iinfo(np.int64).max   # the next use of a page no later request holds


def next_uses(prompts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For each prompt, the index of the next prompt that holds each of its pages.

    Args:
        prompts: page ids per request in serving order (chained: an id once per prompt).

    Returns:
        one int64 array per prompt, :data:`NEVER` where no later prompt holds the page;
        non-decreasing along a prompt for chained ids.
    """
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    if not lengths.sum():
        return [np.empty(0, dtype=np.int64) for _ in prompts]
    ids = np.concatenate([np.asarray(p) for p in prompts])
    owner = np.repeat(np.arange(len(prompts), dtype=np.int64), lengths)
    order = np.lexsort((owner, ids))             # by page, then by request
    sorted_ids, sorted_owner = ids[order], owner[order]
    following = np.full(len(ids), NEVER, dtype=np.int64)
    same = sorted_ids[1:] == sorted_ids[:-1]
    following[order[:-1][same]] = sorted_owner[1:][same]
    return np.split(following, np.cumsum(lengths)[:-1])


def belady_hits(prompts: Sequence[np.ndarray], capacity: int | None, *,
                stores: Sequence[bool] | None = None, resident: bool = False) -> np.ndarray:
    """Cached leading pages of each prompt under Belady's rule (module docstring).

    Args:
        prompts: page ids per request in serving order (chained).
        capacity: pages the cache holds; ``None``: no limit.
        stores: per request, whether the engine caches the prompt (``False``: it cannot;
            the bound then relaxes the request as the module docstring says); default all.
        resident: the engine's prefill holds the whole prompt's KV in the pool while it
            runs (``sim._allocate``): before a request's pages enter, the pages of other
            prompts are cut to ``capacity - len(prompt)`` by the same rule; a prompt
            longer than ``capacity`` is then one the engine cannot cache (as ``stores``
            False; refused prompts run no prefill of their own KV, so no cut).  Issue 27:
            about 1 point below the free bound at 10 % split pools.

    Returns:
        int64 array: per request, the pages of its prompt the cache held when it came.

    Raises:
        ConfigError: ``capacity`` is negative.
    """
    if capacity is not None and capacity < 0:
        raise ConfigError(f"capacity must be >= 0 pages (None: no limit), got {capacity}")
    refused = [(stores is not None and not stores[i])
               or (resident and capacity is not None and len(p) > capacity)
               for i, p in enumerate(prompts)]
    if any(refused):
        prompts = relax_refused(prompts, refused)
    uses = next_uses(prompts)
    hits = np.zeros(len(prompts), dtype=np.int64)
    # runs: id -> [shallow end, deep end) of its prompt; due: next use -> run ids;
    # heap: (-next use, -deep end, id), stale entries skipped
    runs: dict[int, list[int]] = {}
    due: dict[int, list[int]] = {}
    heap: list[tuple[int, int, int]] = []
    held = serial = 0

    def cut(cap: int) -> None:
        nonlocal held
        while held > cap:
            neg_next, neg_end, rid = heapq.heappop(heap)
            run = runs.get(rid)
            if run is None or run[1] != -neg_end:
                continue                         # consumed, or shrunk since pushed
            excess = held - cap
            if run[1] - run[0] <= excess:
                held -= run[1] - run[0]
                del runs[rid]
            else:
                run[1] -= excess
                held -= excess
                heapq.heappush(heap, (neg_next, -run[1], rid))

    for i, nxt in enumerate(uses):
        cached = sorted(runs.pop(rid) for rid in due.pop(i, ()) if rid in runs)
        for a, b in cached:                      # the leading ones hit (all, by the tie rule)
            if a != hits[i]:
                break
            hits[i] = b
        held -= sum(b - a for a, b in cached)
        if resident and capacity is not None and not refused[i]:
            cut(capacity - len(nxt))             # room for the whole prompt while it runs
        if not len(nxt):
            continue
        cuts = np.flatnonzero(nxt[1:] != nxt[:-1]) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), len(nxt)]
        for a, b in zip(starts, ends, strict=True):
            j = int(nxt[a])
            if j == NEVER:                       # never used again: dropped at once
                continue
            runs[serial] = [a, b]
            due.setdefault(j, []).append(serial)
            heapq.heappush(heap, (-j, -b, serial))
            held += b - a
            serial += 1
        if capacity is not None:
            cut(capacity)
    return hits


def relax_refused(prompts: Sequence[np.ndarray], refused: Sequence[bool]) -> list[np.ndarray]:
    """Each refused prompt cut to its leading pages that a prompt not refused brought
    before it (module docstring: the relaxation the bound is exact for); the others as
    they are."""
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    kept = [i for i, no in enumerate(refused) if not no and len(arrays[i])]
    if kept:   # each page's first request that brought it (lowest index first after sort)
        ids = np.concatenate([arrays[i] for i in kept])
        owner = np.repeat(np.asarray(kept, dtype=np.int64), [len(arrays[i]) for i in kept])
        pages, first = np.unique(ids, return_index=True)   # ids sorted; first occurrence
        since = owner[first]
    else:
        pages = since = np.empty(0, dtype=np.int64)
    out = []
    for i, (p, no) in enumerate(zip(arrays, refused, strict=True)):
        if no and len(pages):
            at = np.minimum(np.searchsorted(pages, p), len(pages) - 1)
            ok = (pages[at] == p) & (since[at] < i)       # brought before this request
            p = p if ok.all() else p[:int(np.argmin(ok))]
        elif no:
            p = p[:0]                                       # nothing brought yet
        out.append(p)
    return out


__all__ = ["NEVER", "belady_hits", "next_uses", "relax_refused"]
