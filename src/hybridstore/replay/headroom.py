"""How much any cache could keep at a budget: the exact bound, and session-level orders.

``hybridstore replay --headroom [TRACE] --sweep 5%,10%,20%`` answers the question the
capacity curve raises: at a tight budget, how far below ``unlimited`` is a cache *bound*
to be, whatever it evicts and wherever it places states?  It replays the sequential
discipline's requests (:func:`~hybridstore.replay.sim.merged_requests`) with a page
budget of ``budget x KV footprint x (1 + mamba_ratio)`` bytes with one pool
(``--pools unified``), or ``budget x footprint`` for the KV pool alone (``--pools
split``: SGLang's KV pool), in pages of ``block`` tokens (the KV of one full block):

* **bound** (:mod:`hybridstore.replay.bound`): the *exact* optimum of the free-state KV
  model: a request hits the leading pages of its prompt that are cached, any session's,
  states cost nothing, and Belady's rule per page (farthest next use, deepest first on
  ties) keeps the most; no eviction order and no state placement keeps more tokens in
  the same page budget.  ``unlimited`` is the same model with no limit (every page seen
  before hits).
* **bound in the engine's KV pool** (``bound_engine_pool``): the same optimum held to the
  replay's engine, as every preset is (``sim._serve``): a prompt whose KV alone exceeds
  the pool (``refused``; the one pool, or the KV pool under split pools) stores nothing
  (``belady_hits(..., stores=...)``), and a prompt the engine prefills holds its whole KV
  in the pool meanwhile, so the other pages must fit in the rest (``resident=True``,
  ``sim._allocate``).  An upper bound on what the replay lets any preset keep, exact for
  the relaxation :mod:`hybridstore.replay.bound` describes.
* **bound holding k states** (``bound_holding_states``): the same optimum when ``k``
  recurrent states (``checkpoint_bytes`` each, ``--state-scale`` applied) are charged
  against the budget for the whole replay: one pool, ``budget - k x state`` bytes of
  pages; split pools, the states go to the Mamba pool (``budget x footprint x
  mamba_ratio``), so the KV bound is unchanged while ``k`` states fit there and ``None``
  when they do not.  The default ``k`` are 1 (any cache that resumes holds at least
  one) and the median number of *open* sessions at a request (seen and coming back:
  :func:`open_sessions`), what a cache holding a state for every session it will resume
  pays.  The charge is constant, so this is the exact optimum of a cache that keeps
  ``k`` states throughout, not a bound on every cache (``k = 0`` is that: ``bound``).
* **session-level orders** (:func:`session_hit_rate`, the first version of this command):
  a session's cached context is its last prompt's full blocks, a request hits only its
  own session's context, and whole contexts go by least recent use (``lru``) or by
  Belady over sessions (``session_belady``: the session whose next request comes last).
  These are heuristics, not bounds: contexts are whole, Belady over objects of different
  sizes is not optimal, and pages shared across sessions or kept from older branches are
  ignored; ``session_belady`` was labelled a clairvoyant bound before the exact one
  existed and lies up to 22 points below it (docs/replay.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridstore.replay.bound import belady_hits
from hybridstore.replay.divergence import shared_blocks
from hybridstore.replay.sim import ReplayConfig, kv_footprint, merged_requests
from hybridstore.replay.trace import Request, Trace


def session_hit_rate(reqs: Sequence[Request], capacity: float | None, order: str, block: int) -> float:
    """Token hit rate of the session-level model (module docstring) under ``order``.

    Args:
        reqs: requests in serving order.
        capacity: blocks the cache holds (``None``: unlimited; fractions count).
        order: ``"lru"`` or ``"session_belady"`` (the session whose next request comes
            last goes).
        block: tokens per block.
    """
    following: list[int] = [0] * len(reqs)
    upcoming: dict[str, int] = {}
    for i in range(len(reqs) - 1, -1, -1):
        following[i] = upcoming.get(reqs[i].session, len(reqs))
        upcoming[reqs[i].session] = i
    cached: dict[str, tuple[np.ndarray, int, int]] = {}   # session -> (blocks, last use, next use)
    held = hit = total = 0
    for i, r in enumerate(reqs):
        blocks = r.block_ids[: r.input_tokens // block]
        total += r.input_tokens
        old = cached.pop(r.session, None)
        if old is not None:
            hit += shared_blocks(old[0], blocks) * block
            held -= len(old[0])
        if capacity is not None and len(blocks) > capacity:
            continue
        cached[r.session] = (blocks, i, following[i])
        held += len(blocks)
        while capacity is not None and held > capacity:
            others = [s for s in cached if s != r.session]
            if order == "lru":
                victim = min(others, key=lambda s: cached[s][1])
            else:
                victim = max(others, key=lambda s: cached[s][2])
            held -= len(cached.pop(victim)[0])
    return hit / total if total else 0.0


def page_prompts(reqs: Sequence[Request], block: int) -> list[np.ndarray]:
    """Each request's full-block page ids (chained): the prompts the bound sees."""
    return [r.block_ids[: r.input_tokens // block] for r in reqs]


def fits_pool(reqs: Sequence[Request], block: int, pool: int) -> list[bool]:
    """Whether each prompt's KV fits an engine pool of ``pool`` pages: the replay's engine
    caches no prompt longer than its pool (``sim._serve``, ``prompt.nblocks > kv_pool``)."""
    return [-(-r.input_tokens // block) <= pool for r in reqs]


def open_sessions(reqs: Sequence[Request]) -> int:
    """Median over the requests of the sessions open at each: seen at or before it and
    with a request after it (the states a cache must hold to resume every one of them)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, r in enumerate(reqs):
        first.setdefault(r.session, i)
        last[r.session] = i
    delta = np.zeros(len(reqs) + 1, dtype=np.int64)
    for s, a in first.items():
        delta[a] += 1
        delta[last[s]] -= 1
    return int(np.median(np.cumsum(delta)[:-1])) if reqs else 0


def headroom(trace: Trace, budgets: Sequence[float], cfg: ReplayConfig, *,
             states: Sequence[int] | None = None, progress: bool = True) -> dict:
    """The exact bound and the session-level orders per budget (JSON-ready ``rows``).

    Args:
        trace: the trace; its requests in the sequential discipline's order.
        budgets: fractions of the KV footprint (:func:`~hybridstore.replay.sim.kv_footprint`).
        cfg: the replay's configuration (``pools``, ``mamba_ratio``, ``model``,
            ``state_scale``, ``max_requests``).
        states: the ``k`` of the bound while holding ``k`` states (module docstring);
            default: 1 and the median number of open sessions (:func:`open_sessions`).
        progress: show a progress bar.
    """
    reqs = merged_requests(trace)
    if cfg.max_requests is not None:
        reqs = reqs[:cfg.max_requests]
    model = cfg.full_model()
    block = trace.block_size
    page = model.page_bytes(block)
    footprint = kv_footprint(trace, cfg, model)
    split = cfg.pools == "split"
    share = 1.0 if split else 1.0 + cfg.mamba_ratio
    prompts = page_prompts(reqs, block)
    total = sum(r.input_tokens for r in reqs)

    def rate(hit_pages: np.ndarray) -> float:
        return float(hit_pages.sum()) * block / total if total else 0.0

    live = open_sessions(reqs)
    ks = sorted(set(states if states is not None else (1, live)))
    unlimited = rate(belady_hits(prompts, None))
    session_unlimited = session_hit_rate(reqs, None, "lru", block)
    rows = []
    for b in tqdm(budgets, desc="headroom", unit="budget", disable=not progress, leave=False):
        kv_bytes = b * footprint * share               # the KV pool, or the one pool
        state_room = b * footprint * cfg.mamba_ratio   # the Mamba pool under split pools
        pool = int(kv_bytes // page)
        stores = fits_pool(reqs, block, pool)
        row: dict = {"budget": b, "unlimited": unlimited,
                     "bound": rate(belady_hits(prompts, pool)),
                     "bound_engine_pool": rate(belady_hits(prompts, pool, stores=stores,
                                                           resident=True)),
                     "refused": stores.count(False)}
        held = {}
        for k in ks:
            if split:   # states in their own pool: free for the KV pool while they fit
                held[str(k)] = row["bound"] if k * model.checkpoint_bytes <= state_room else None
            else:
                room = kv_bytes - k * model.checkpoint_bytes
                held[str(k)] = rate(belady_hits(prompts, int(room // page))) if room >= 0 else None
        row["bound_holding_states"] = held
        row["session_unlimited"] = session_unlimited
        for order in ("session_belady", "lru"):
            row[order] = session_hit_rate(reqs, kv_bytes / page, order, block)
        row["bound_share_of_unlimited"] = row["bound"] / unlimited if unlimited else 0.0
        rows.append(row)
    return {"trace": trace.name, "requests": len(reqs), "pools": cfg.pools,
            "footprint_tokens": footprint / model.kv_bytes_per_token, "model": model.name,
            "state_bytes": model.checkpoint_bytes, "page_bytes": page,
            "open_sessions": live, "rows": rows}


def print_headroom(doc: dict) -> None:
    """The table: budget, unlimited, the exact bound (free states and holding k states),
    the session-level orders, bound / unlimited."""
    ks = list(doc["rows"][0]["bound_holding_states"]) if doc["rows"] else []
    print(f"headroom, {doc['trace']} ({doc['requests']} requests, pools {doc['pools']}, "
          f"{doc['open_sessions']} sessions open at the median request): token hit rate")
    held = "".join(f" {'k=' + k:>7}" for k in ks)
    print(f"{'budget':>8} {'unlimited':>10} {'bound':>7} {'in-pool':>7}{held} {'sess-Belady':>11} "
          f"{'lru':>7} {'bound/unl':>10}")
    for r in doc["rows"]:
        cells = "".join(f" {'-' if v is None else format(v, '.3f'):>7}"
                        for v in r["bound_holding_states"].values())
        print(f"{r['budget']:>8.0%} {r['unlimited']:>10.3f} {r['bound']:>7.3f} "
              f"{r['bound_engine_pool']:>7.3f}{cells} "
              f"{r['session_belady']:>11.3f} {r['lru']:>7.3f} {r['bound_share_of_unlimited']:>10.1%}")
    print("bound: exact, free states (Belady per page); in-pool: the same held to the replay's "
          "engine (prompts over the KV pool uncached, a prompt's KV resident while it "
          "prefills); k=K: the same holding K states "
          "in the budget; sess-Belady, lru: whole session contexts (heuristics, not bounds)")


def plot_headroom(doc: dict, path: str | Path) -> None:
    """Hit rate against budget: the exact bound, holding k states, the session orders (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = doc["rows"]
    x = [100 * r["budget"] for r in rows]
    lines = [("unlimited", [r["unlimited"] for r in rows], "k--"),
             ("exact bound (free states)", [r["bound"] for r in rows], "r-o"),
             ("bound held to the engine's KV pool",
              [r["bound_engine_pool"] for r in rows], "r:x")]
    for k in rows[0]["bound_holding_states"] if rows else ():
        lines.append((f"bound holding k={k} states",
                      [r["bound_holding_states"][k] for r in rows], "m:^"))
    lines += [("session Belady (heuristic)", [r["session_belady"] for r in rows], "g-o"),
              ("session LRU", [r["lru"] for r in rows], "b-s")]
    for label, ys, style in lines:
        ax.plot(x, [float("nan") if y is None else y for y in ys], style, label=label)
    ax.set_xlabel("budget (% of the KV footprint)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"headroom: {doc['trace']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["fits_pool", "headroom", "open_sessions", "page_prompts", "plot_headroom",
           "print_headroom", "session_hit_rate"]
