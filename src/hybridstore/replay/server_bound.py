"""The bound in the server discipline: what any cache could do for the tail TTFT.

``hybridstore replay --headroom --discipline server [--gpu-gib G --host-gib H --disk-gib
D]`` answers the question the server discipline's p99 raises: at these tier budgets, how
close to ``unlimited``'s p99 TTFT can *any* cache come?  It runs the server discipline's
own events (:func:`~hybridstore.replay.sim.server_loop`: the same live sessions, admission,
FIFO prefill server and closed-loop arrivals as every preset's replay) with each request's
hit taken from the free-state bound (:mod:`hybridstore.replay.bound`, Belady per page)
instead of a store:

* one pool of ``G + H + D`` GiB of pages: the tiers hold disjoint bytes, and states are
  free (the free-state model);
* restores are free (no tier's bandwidth is charged), so TTFT = queueing + the prefill
  of what the bound misses;
* a prompt whose KV alone exceeds the GPU pool (``G`` GiB of pages) cannot be prefilled
  with its KV resident, and the replay's engine refuses to cache it for every preset
  (``sim._serve``); the bound is held to the same engine: such a prompt stores nothing
  (``belady_hits(..., stores=...)``, relaxed so as to stay an upper bound: see
  :mod:`hybridstore.replay.bound`), and a prompt being prefilled holds its whole
  KV meanwhile, the other pages in the rest of the pool (``resident=True``,
  ``sim._allocate``).  ``free_state`` is the same without those rules (what a cache could
  keep if the engine could hold any prompt and needed no room to prefill it).

Belady needs the serving order and the serving order depends on the hits (a miss is a
longer prefill, which moves later arrivals), so the two are iterated to a fixed point:
the sequential discipline's order first, then the bound of each run's order, until a run
serves in the order its hits were computed for (``converged``; at most ``iterations``).
At the fixed point the hits bound those of any cache serving that order (the relaxed
optimum: no cache serving it hits more tokens in all), every TTFT is what that order's prefills cost, and
restores cost nothing.  It is the reference a cache's tail is compared with, not a bound
on every cache's p99: Belady maximises the hits summed, not the tail, and a cache that
serves another order meets other queues; the document says when the iteration did not
converge.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.replay.bound import belady_hits
from hybridstore.replay.headroom import fits_pool, page_prompts
from hybridstore.replay.sim import (
    GIB,
    PolicyRun,
    ReplayConfig,
    Served,
    merged_requests,
    server_loop,
)
from hybridstore.replay.trace import Request, Session, Trace

ITERATIONS = 12
"""Most bound-and-serve rounds before the fixed point is given up (it is reached in 1-8
on the bundled sample and the shared WEKA sessions)."""

def _hits(order: Sequence[Request], block: int, capacity: int | None,
          pool: int | None) -> dict[tuple[str, int], int]:
    """Hit tokens per request (session, index) of the bound for ``order``; a prompt of
    more than ``pool`` pages stores nothing (``None``: every prompt stores)."""
    stores = None if pool is None else fits_pool(order, block, pool)
    pages = belady_hits(page_prompts(order, block), capacity, stores=stores,
                        resident=pool is not None)
    return {(r.session, r.index): min(int(n) * block, r.input_tokens)
            for r, n in zip(order, pages.tolist(), strict=True)}


def _serve_order(trace: Trace, cfg: ReplayConfig, hits: dict[tuple[str, int], int], *,
                 name: str) -> tuple[PolicyRun, list[Request]]:
    """The server discipline with these hits (free restores): its run and serving order."""
    model = cfg.full_model()
    run = PolicyRun(name)
    order: list[Request] = []

    def serve(session: Session, i: int, begin: float) -> Served:
        req = session.requests[i]
        order.append(req)
        hit = hits.get((session.id, i), 0)
        return Served(hit, 0.0, model.prefill_seconds(hit, req.input_tokens), {}, None)

    server_loop(trace, cfg, model, serve, run.results, desc=name, progress=False)
    return run, order


def fixed_point(trace: Trace, cfg: ReplayConfig, capacity: int | None, pool: int | None, *,
                name: str, iterations: int = ITERATIONS) -> tuple[PolicyRun, int, bool, int]:
    """Bound and serve until the order served is the order bounded (module docstring).

    Returns:
        ``(run, rounds, converged, refused)``: the last run, the rounds it took, whether
        its order was the one its hits were computed for, and its prompts over ``pool``.
    """
    block = trace.block_size
    order: list[Request] = merged_requests(trace)
    if cfg.max_requests is not None:
        order = order[:cfg.max_requests]
    run, rounds, converged = PolicyRun(name), 0, False
    while not converged and rounds < iterations:
        rounds += 1
        run, served = _serve_order(trace, cfg, _hits(order, block, capacity, pool), name=name)
        converged = [(r.session, r.index) for r in served] == [(r.session, r.index) for r in order]
        order = served
    refused = 0 if pool is None else fits_pool(order, block, pool).count(False)
    return run, rounds, converged, refused


def server_headroom(trace: Trace, cfg: ReplayConfig, *,
                    iterations: int = ITERATIONS) -> dict:
    """``unlimited``, the free-state bound and the bound under the engine's GPU pool, in
    the server discipline at ``cfg``'s tier budgets (JSON-ready ``rows``).

    Raises:
        ConfigError: ``cfg`` gives a budget as a fraction (the server discipline's tiers
            are given in GiB here) or is not the server discipline.
    """
    if cfg.discipline != "server" or cfg.budget is not None:
        raise ConfigError("the server headroom takes the server discipline's tier budgets "
                          "(--gpu-gib/--host-gib/--disk-gib), not --budget/--sweep")
    model = cfg.full_model()
    page = model.page_bytes(trace.block_size)
    capacity = int((cfg.gpu_gib + cfg.host_gib + cfg.disk_gib) * GIB) // page
    pool = int(cfg.gpu_gib * GIB) // page
    cases = {"unlimited": (None, None), "free_state": (capacity, None), "bound": (capacity, pool)}
    rows = []
    for name, (cap, gpu) in cases.items():
        run, rounds, converged, refused = fixed_point(trace, cfg, cap, gpu, name=name,
                                                      iterations=iterations)
        s = run.summary()
        rows.append({"name": name, "token_hit_rate": s["token_hit_rate"],
                     "ttft_p50_s": s["ttft_p50_s"], "ttft_p95_s": s["ttft_p95_s"],
                     "ttft_p99_s": s["ttft_p99_s"], "service_p99_s": s["service_p99_s"],
                     "refused_requests": refused, "rounds": rounds, "converged": converged,
                     "ttft_s": sorted(r.ttft_s for r in run.results)})
    unl = rows[0]["ttft_p99_s"]
    for r in rows:
        r["p99_vs_unlimited"] = r["ttft_p99_s"] / unl if unl else None
    return {"trace": trace.name, "requests": len(rows[0]["ttft_s"]), "model": model.name,
            "discipline": "server", "gib": {"gpu": cfg.gpu_gib, "host": cfg.host_gib,
                                            "disk": cfg.disk_gib},
            "pages": {"capacity": capacity, "gpu_pool": pool}, "rows": rows}


def print_server_headroom(doc: dict) -> None:
    """The table: hit rate, p50/p95/p99 TTFT, p99 against ``unlimited``'s, refused prompts."""
    g = doc["gib"]
    print(f"server headroom, {doc['trace']} ({doc['requests']} requests, {doc['model']}, "
          f"{g['gpu']:g}/{g['host']:g}/{g['disk']:g} GiB): free restores, free states")
    print(f"{'':>11} {'hit rate':>8} {'p50 s':>7} {'p95 s':>7} {'p99 s':>7} {'p99/unl':>8} "
          f"{'refused':>7} {'rounds':>6}")
    for r in doc["rows"]:
        mark = "" if r["converged"] else " (not converged)"
        print(f"{r['name']:>11} {r['token_hit_rate']:>8.4f} {r['ttft_p50_s']:>7.2f} "
              f"{r['ttft_p95_s']:>7.2f} {r['ttft_p99_s']:>7.2f} {r['p99_vs_unlimited']:>7.2f}x "
              f"{r['refused_requests']:>7} {r['rounds']:>6}{mark}")
    print("bound: the free-state bound of the order served, held to the replay's engine "
          "(prompts over the GPU pool uncached, a prompt's KV resident while it prefills); "
          "free_state: without those rules")


def plot_server_headroom(doc: dict, path: str | Path) -> None:
    """TTFT tail (complementary CDF, log scale) of each row (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r, style in zip(doc["rows"], ("k--", "g-", "r-"), strict=True):
        t = np.asarray(r["ttft_s"])
        if not t.size:
            continue
        tail = 1.0 - np.arange(t.size) / t.size
        ax.step(t, tail, style, where="post",
                label=f"{r['name']} (hit {r['token_hit_rate']:.3f}, p99 {r['ttft_p99_s']:.1f} s)")
    ax.axhline(0.01, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests above")
    g = doc["gib"]
    ax.set_title(f"server headroom: {doc['trace']}, {g['gpu']:g}/{g['host']:g}/{g['disk']:g} GiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["ITERATIONS", "fixed_point", "plot_server_headroom", "print_server_headroom",
           "server_headroom"]
