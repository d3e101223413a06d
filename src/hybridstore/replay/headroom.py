"""How much any eviction order could keep at a budget: a clairvoyant session-level estimate.

``hybridstore replay --headroom [TRACE] --sweep 5%,10%,20%`` answers the question the
capacity curve raises: at a tight budget, how far below the ``unlimited`` reference is a
cache *bound* to be, whatever it evicts?  It replays the sequential discipline's requests
(:func:`~hybridstore.replay.sim.merged_requests`) in a deliberately simple model:

* a session's cached context is its last prompt's full blocks; a request hits the blocks
  it shares with its own session's cached context (states wherever they are needed, at
  no cost: the state bytes and the placement misses of real presets are left out, so the
  estimate is optimistic for every policy alike);
* the budget is the replay's, ``budget x KV footprint x (1 + mamba_ratio)`` tokens with
  one pool (``--pools unified``), or ``budget x footprint`` for KV alone (SGLang's
  split pools); a context longer than the budget is not kept;
* when the contexts exceed the budget, whole contexts go, other sessions' only: by least
  recent use (``lru``), or **clairvoyantly** (``oracle``: the session whose next request
  comes last, Belady's rule, sessions with no next request first).

``oracle`` is not a strict bound (contexts are whole, Belady is not optimal for objects
of different sizes, and shared prefixes across sessions are ignored), but it shows how
much of the gap to ``unlimited`` is capacity no online order can win back, and how much
an order that knew the future could.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridstore.replay.divergence import shared_blocks
from hybridstore.replay.sim import ReplayConfig, kv_footprint, merged_requests
from hybridstore.replay.trace import Request, Trace

ORDERS = ("unlimited", "oracle", "lru")


def session_hit_rate(reqs: Sequence[Request], capacity: float | None, order: str, block: int) -> float:
    """Token hit rate of the session-level model (module docstring) under ``order``.

    Args:
        reqs: requests in serving order.
        capacity: blocks the cache holds (``None``: unlimited).
        order: ``"lru"`` or ``"oracle"`` (the session whose next request comes last goes).
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


def headroom(trace: Trace, budgets: Sequence[float], cfg: ReplayConfig, *,
             progress: bool = True) -> dict:
    """The model's hit rate per budget and order (JSON-ready ``rows``)."""
    reqs = merged_requests(trace)
    if cfg.max_requests is not None:
        reqs = reqs[:cfg.max_requests]
    model = cfg.full_model()
    tokens = kv_footprint(trace, cfg, model) / model.kv_bytes_per_token
    share = 1.0 if cfg.pools == "split" else 1.0 + cfg.mamba_ratio
    block = trace.block_size
    unlimited = session_hit_rate(reqs, None, "lru", block)
    rows = []
    for b in tqdm(budgets, desc="headroom", unit="budget", disable=not progress, leave=False):
        capacity = b * tokens * share / block
        row = {"budget": b, "unlimited": unlimited}
        for order in ORDERS[1:]:
            row[order] = session_hit_rate(reqs, capacity, order, block)
        row["oracle_share_of_unlimited"] = row["oracle"] / unlimited if unlimited else 0.0
        rows.append(row)
    return {"trace": trace.name, "requests": len(reqs), "pools": cfg.pools,
            "footprint_tokens": tokens, "model": cfg.model, "rows": rows}


def print_headroom(doc: dict) -> None:
    """The table: budget, unlimited, clairvoyant, LRU, clairvoyant / unlimited."""
    print(f"session-level headroom, {doc['trace']} ({doc['requests']} requests, pools "
          f"{doc['pools']}): token hit rate")
    print(f"{'budget':>8} {'unlimited':>10} {'oracle':>8} {'lru':>8} {'oracle/unl':>11}")
    for r in doc["rows"]:
        print(f"{r['budget']:>8.0%} {r['unlimited']:>10.3f} {r['oracle']:>8.3f} {r['lru']:>8.3f} "
              f"{r['oracle_share_of_unlimited']:>11.1%}")


def plot_headroom(doc: dict, path: str | Path) -> None:
    """Hit rate against budget, one line per order (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [100 * r["budget"] for r in doc["rows"]]
    for order, style in zip(ORDERS, ("k--", "g-o", "b-s"), strict=True):
        ax.plot(x, [r[order] for r in doc["rows"]], style, label=order)
    ax.set_xlabel("budget (% of the KV footprint)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"session-level headroom: {doc['trace']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["headroom", "plot_headroom", "print_headroom", "session_hit_rate"]
