"""The exact free-state bound (``replay/bound.py``) against an exhaustive search."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridstore.errors import ConfigError
from hybridstore.replay.bound import NEVER, belady_hits, next_uses, relax_refused


def chained(prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Block contents -> chained page ids (equal id <=> equal prefix)."""
    ids: dict[tuple[int, ...], int] = {}
    return [np.array([ids.setdefault(tuple(p[: d + 1]), len(ids)) for d in range(len(p))],
                     dtype=np.int64) for p in prompts]


def leading(prompt: np.ndarray, cached: frozenset[int]) -> int:
    n = 0
    while n < len(prompt) and int(prompt[n]) in cached:
        n += 1
    return n


def optimum(prompts: list[np.ndarray], capacity: int, stores: Sequence[bool] | None = None,
            resident: bool = False, exempt: Sequence[bool] | None = None) -> int:
    """Most leading cached pages summed over the requests, over every cache content a
    cache could hold after each request (any subset of what it held and what the request
    brought, within capacity; not assumed prefix-closed).  A request whose ``stores`` is
    False brings nothing: the cache chooses among what it held.  ``resident``: a request
    holds its whole prompt in the cache while it runs, so what the cache keeps of other
    prompts fits beside it (a prompt longer than the cache brings nothing), but for the
    requests ``exempt`` names."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for i, prompt in enumerate(prompts):
        nxt: dict[frozenset[int], int] = {}
        brought = {int(x) for x in prompt} if stores is None or stores[i] else set()
        held_whole = resident and not (exempt is not None and exempt[i])
        if held_whole and len(prompt) > capacity:
            brought = set()
        for cached, value in best.items():
            value += leading(prompt, cached)
            pool = sorted(cached | brought)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    key = frozenset(keep)
                    if brought and held_whole and len(key | brought) > capacity:
                        continue                 # the prompt did not fit beside it
                    if nxt.get(key, -1) < value:
                        nxt[key] = value
        best = nxt
    return max(best.values())


def test_next_use_is_the_next_request_holding_the_page_of_any_session():
    a, b, c = chained([[1, 2, 3], [1, 2, 9], [1, 2, 3, 4]])
    uses = next_uses([a, b, c])
    assert uses[0].tolist() == [1, 1, 2]          # 1 and 12 in the next prompt, 123 in the last
    assert uses[1].tolist() == [2, 2, NEVER]
    assert uses[2].tolist() == [NEVER] * 4


def test_it_keeps_part_of_a_context_where_whole_contexts_cannot():
    # Two 4-page contexts alternate in room for 6 pages: whole-context orders keep one
    # (4 pages a return); pages keep one context and half the other (6 a return).
    a, b = chained([[1, 1, 1, 1], [2, 2, 2, 2]])
    hits = belady_hits([a, b, a, b, a, b], 6)
    assert hits.tolist() == [0, 0, 4, 2, 4, 2]
    assert optimum([a, b, a, b, a, b], 6) == hits.sum()


def test_it_drops_the_deepest_pages_of_a_tie_and_keeps_the_cache_prefix_closed():
    # Room for 3: after [1,2,3,4] the tie (all next used at request 2) keeps the top 3.
    p, q = chained([[1, 2, 3, 4], [7]])
    assert belady_hits([p, q, p], 3).tolist() == [0, 0, 3]
    assert belady_hits([p, q, p], 0).tolist() == [0, 0, 0]
    assert belady_hits([p, q, p], None).tolist() == [0, 0, 4]
    with pytest.raises(ConfigError, match="capacity must be >= 0"):
        belady_hits([p], -1)
    # A tie across requests: after the third request x and y are both due at the last,
    # x from the second request, y from the first; the page of 7 pushes one out: y, the
    # deeper (x without y still hits; y without x would be no use).
    xy, x, p7 = chained([[5, 5], [5], [7]])
    assert belady_hits([xy, x, p7, p7, xy], 2).tolist() == [0, 1, 0, 1, 1]
    assert optimum([xy, x, p7, p7, xy], 2) == 3


prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=4), min_size=1, max_size=7)


@settings(max_examples=300, deadline=None)
@given(prompt_lists, st.integers(0, 4))
def test_belady_per_page_equals_the_exhaustive_optimum(contents, capacity):
    prompts = chained(contents)
    hits = belady_hits(prompts, capacity)
    assert int(hits.sum()) == optimum(prompts, capacity)
    assert all(0 <= h <= len(p) for h, p in zip(hits.tolist(), prompts, strict=True))


@settings(max_examples=300, deadline=None)
@given(prompt_lists, st.integers(0, 4), st.lists(st.booleans(), min_size=7, max_size=7))
def test_belady_per_page_equals_the_exhaustive_optimum_when_some_prompts_cannot_be_cached(
        contents, capacity, stores):
    prompts = chained(contents)
    mask = stores[:len(prompts)]
    hits = belady_hits(prompts, capacity, stores=mask)
    # an upper bound on every cache of the engine's model, exact for the relaxation
    assert int(hits.sum()) >= optimum(prompts, capacity, mask)
    assert int(hits.sum()) == optimum(relax_refused(prompts, [not m for m in mask]), capacity)
    assert hits.sum() <= belady_hits(prompts, capacity).sum()
    # both of the replay's engine's constraints at once (headroom's in-pool, the server bound)
    both = belady_hits(prompts, capacity, stores=mask, resident=True)
    refused = [not m or len(p) > capacity for m, p in zip(mask, prompts, strict=True)]
    assert int(both.sum()) >= optimum(prompts, capacity, mask, resident=True)
    assert int(both.sum()) == optimum(relax_refused(prompts, refused), capacity, resident=True,
                                      exempt=refused)


def test_belady_is_no_optimum_where_prompts_are_refused_so_the_bound_relaxes_them():
    # Room for one page; the last three requests cannot be cached.  Keeping B (used twice
    # later, by refused requests that cannot fetch it) beats keeping A (used next): 2 hits
    # against Belady's 1 on the engine's model.  The relaxation lets a refused request fetch
    # what a cacheable one brought before, and Belady is exact for it: 2.
    prompts = chained([[0], [1], [0], [1], [1]])
    mask = [True, True, False, False, False]
    assert optimum(prompts, 1, mask) == 2
    assert belady_hits(prompts, 1, stores=mask).sum() == 2


def test_a_prompt_the_engine_cannot_cache_leaves_only_what_it_hit():
    # [1,2] is cached; [1,2,3,4] cannot be: it hits 2 and its pages 3, 4 never enter, so
    # the third request hits 2 where a cache that kept them hits 4.
    p, q = chained([[1, 2], [1, 2, 3, 4]])
    assert belady_hits([p, q, q], 8).tolist() == [0, 2, 4]
    assert belady_hits([p, q, q], 8, stores=[True, False, True]).tolist() == [0, 2, 2]
    assert belady_hits([p, q, q], None, stores=[False, False, False]).tolist() == [0, 0, 0]


@settings(max_examples=100, deadline=None)
@given(prompt_lists, st.integers(0, 6))
def test_the_bound_grows_with_capacity_up_to_unlimited(contents, capacity):
    prompts = chained(contents)
    small, large = belady_hits(prompts, capacity), belady_hits(prompts, capacity + 1)
    assert small.sum() <= large.sum() <= belady_hits(prompts, None).sum()


def test_a_prompt_held_whole_while_it_runs_pushes_out_what_it_does_not_fit_beside():
    # Room for 3: [1,2] is cached; [7,8,9] is never used again, but while it runs it takes
    # the whole cache, so [1,2] is gone when it returns (the free bound keeps it).
    p, q, r = chained([[1, 2], [7, 8, 9], [3, 3, 3, 3]])
    assert belady_hits([p, q, p], 3).tolist() == [0, 0, 2]
    assert belady_hits([p, q, p], 3, resident=True).tolist() == [0, 0, 0]
    # a prompt longer than the cache is refused: it leaves the cache as it was
    assert belady_hits([p, r, p], 3, resident=True).tolist() == [0, 0, 2]


@settings(max_examples=300, deadline=None)
@given(prompt_lists, st.integers(0, 4))
def test_belady_per_page_equals_the_exhaustive_optimum_with_the_prompt_resident(contents, capacity):
    prompts = chained(contents)
    hits = belady_hits(prompts, capacity, resident=True)
    refused = [len(p) > capacity for p in prompts]
    assert int(hits.sum()) >= optimum(prompts, capacity, resident=True)
    assert int(hits.sum()) == optimum(relax_refused(prompts, refused), capacity, resident=True,
                                      exempt=refused)
    assert hits.sum() <= belady_hits(prompts, capacity).sum()
