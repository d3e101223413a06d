"""Where the default's gap to the exact bound goes: the next-use information, and the rest.

``python -m benchmarks.ladder TRACE [TRACE ...] [--budgets 10%] [--pools unified,split]
[--max-requests N] [--json OUT] [--plot OUT.png]`` replays each ``TRACE`` (a path,
``synthetic:...``, or ``sample`` for the bundled one) in the sequential discipline and
puts three figures side by side per budget and pools (docs/replay.md, issue 27, "What
blocks the goals"):

* ``hybridstore``: the default preset, as it runs on the trace alone;
* ``announced``: the same with an orchestrator announcing every session's next request
  at its exact time and every session's end (``ReplayConfig(resume_hints=0)``,
  ``HybridStore.expect``): the default's order given the next uses Belady's rule sees;
* ``bound``: the exact free-state bound (:func:`~hybridstore.replay.headroom.headroom`),
  in the engine's pool (``bound_engine_pool``) and holding one state, and one per open
  session (``bound_holding_states``).

The gap ``bound - hybridstore`` splits three ways:

* ``information = announced - hybridstore``: what the next uses are worth to the default
  (an online store has only its own prediction of them);
* ``engine_pool = bound - bound_engine_pool``: what the replay's engine forbids any cache
  (a prompt longer than the KV pool is not cached, a prompt's KV is resident while it
  prefills);
* ``states_and_placement = bound_engine_pool - announced``: what remains with the next uses
  known: the states' bytes, resuming only where a state was kept (vLLM's hybrid-block
  grid), and the default's order where it is not Belady's (units, eq. 7's cost term).

Where the information goes, request by request (:func:`late_returns`): ``lost_returns`` is
the part of it from requests the default restored nothing for and the announced replay
restored something (a session's whole context gone when it came back), ``lost_requests``
their number, and ``lost_gap_ratio`` / ``gap_ratio`` the median of each such request's
gap (from the end of the session's previous turn, :func:`benchmarks.returns.session_gaps`)
over the median of that session's earlier gaps (up to five: the default's own prediction,
``policy/nextuse.py``) against the same over every request with earlier gaps: how much
later than its own cadence a session came back when its context was lost.

JSON on stdout (and ``--json``), a Markdown table, and ``--plot`` a PNG of the shares of
the bound.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks import load_trace, report, trace_label
from benchmarks.returns import session_gaps
from hybridstore.policy.nextuse import WINDOW
from hybridstore.replay.headroom import headroom
from hybridstore.replay.sim import ReplayConfig, RequestResult, replay_policy
from hybridstore.replay.sweep import parse_budgets
from hybridstore.replay.trace import Trace

DEFAULT = "hybridstore"


def _run(trace: Trace, cfg: ReplayConfig) -> tuple[float, list[RequestResult]]:
    run = replay_policy(trace, DEFAULT, cfg, progress=False)
    return float(run.summary()["token_hit_rate"]), run.results


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def late_returns(trace: Trace, ours: list[RequestResult], announced: list[RequestResult],
                 decode_s_per_token: float) -> dict[str, Any]:
    """The requests the default lost whole and the announced replay did not (module docstring).

    Args:
        trace: the replayed trace.
        ours, announced: the two replays' results, request by request, in the same order.
        decode_s_per_token: the model's decode time, where a turn ends
            (:func:`benchmarks.returns.session_gaps`).
    """
    ratio = {(sid, i): r for sid, i, _, r in session_gaps(trace, decode_s_per_token, WINDOW)
             if r is not None}
    total = sum(r.input_tokens for r in ours)
    lost = [(o, a) for o, a in zip(ours, announced, strict=True)
            if o.hit_tokens == 0 and a.hit_tokens > 0]
    return {
        "lost_returns": sum(a.hit_tokens for _, a in lost) / total if total else 0.0,
        "lost_requests": len(lost),
        "lost_gap_ratio": _median([ratio[k] for o, _ in lost if (k := (o.session, o.index)) in ratio]),
        "gap_ratio": _median(list(ratio.values())),
    }


def ladder(trace: Trace, budgets: list[float], pools: str, *, label: str | None = None,
           max_requests: int | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """One row per budget: the default, the default with exact announcements, the bound.

    Args:
        trace: the trace.
        budgets: fractions of the KV footprint.
        pools: ``"unified"`` (one budget) or ``"split"`` (SGLang's KV and Mamba pools).
        label: the rows' trace name (default: the trace's own).
        max_requests: replay only the first requests (the bound sees the same ones).
        progress: show a progress bar.
    """
    base = ReplayConfig(discipline="sequential", pools=pools, max_requests=max_requests)
    model = base.full_model()
    bounds = {round(r["budget"], 6): r for r in headroom(trace, budgets, base, progress=False)["rows"]}
    rows = []
    for budget in tqdm(budgets, desc=f"ladder {label or trace.name} {pools}", unit="budget",
                       disable=not progress, leave=False):
        cfg = replace(base, budget=budget)
        ours, ours_reqs = _run(trace, cfg)
        announced, announced_reqs = _run(trace, replace(cfg, resume_hints=0.0))
        b = bounds[round(budget, 6)]
        bound = b["bound"]
        rows.append({
            "trace": label or trace.name, "pools": pools, "budget": budget,
            DEFAULT: ours, "announced": announced, "bound": bound,
            "bound_engine_pool": b["bound_engine_pool"],
            "bound_holding_states": b["bound_holding_states"],
            "share": ours / bound if bound else None,
            "announced_share": announced / bound if bound else None,
            "information": announced - ours,
            "engine_pool": bound - b["bound_engine_pool"],
            "states_and_placement": b["bound_engine_pool"] - announced,
            **late_returns(trace, ours_reqs, announced_reqs, model.decode_s_per_token),
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """The Markdown table of docs/replay.md ("What blocks the goals")."""
    print("| trace | pools | budget | hybridstore (share) | exact announcements (share) | "
          "bound (in the engine's pool) | next-use information | engine's pool | "
          "states and placement | of the information: contexts lost whole (requests; their gap "
          "/ every gap, x the session's cadence) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v:.1%}"
        print(f"| {r['trace']} | {r['pools']} | {r['budget']:.0%} | {r[DEFAULT]:.3f} ({pct(r['share'])}) | "
              f"{r['announced']:.3f} ({pct(r['announced_share'])}) | {r['bound']:.3f} "
              f"({r['bound_engine_pool']:.3f}) | {100 * r['information']:+.1f} pt | "
              f"{100 * r['engine_pool']:+.1f} pt | {100 * r['states_and_placement']:+.1f} pt | "
              f"{100 * r['lost_returns']:+.1f} pt ({r['lost_requests']}; {_x(r['lost_gap_ratio'])} / "
              f"{_x(r['gap_ratio'])}) |")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Shares of the bound per trace and pools: the default, and with exact announcements."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['trace']}\n{r['pools']} {r['budget']:.0%}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [100 * (r["share"] or 0) for r in rows], 0.4, label=DEFAULT)
    ax.bar([i + 0.2 for i in x], [100 * (r["announced_share"] or 0) for r in rows], 0.4,
           label="with exact announcements")
    ax.axhline(98, color="k", ls="--", lw=0.8, label="goal, one budget (98 %)")
    ax.axhline(95, color="k", ls=":", lw=0.8, label="goal, split pools (95 %)")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("share of the exact bound (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ladder", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--budgets", default="10%")
    ap.add_argument("--pools", default="unified,split")
    ap.add_argument("--max-requests", type=int)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    budgets = parse_budgets(args.budgets)
    rows = []
    for spec in args.traces:
        trace = load_trace(spec)
        for pools in args.pools.split(","):
            rows += ladder(trace, budgets, pools, label=trace_label(spec), max_requests=args.max_requests)
    report({"rows": rows}, args.json, lambda: print_table(rows), lambda p: plot(rows, p), args.plot)


if __name__ == "__main__":
    main()
