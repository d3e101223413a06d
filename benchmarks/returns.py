"""How predictable a session's return is from what a store sees: the odds of a return by time away.

``python -m benchmarks.returns TRACE [TRACE ...] [--within 30,120] [--json OUT] [--plot OUT.png]``
reads each ``TRACE`` (a path, ``synthetic:...``, or ``sample`` for the bundled one) and
measures its sessions' gaps: from the end of a turn (its arrival plus one decode step per
output token, the model preset's ``decode_s_per_token``, as the replay's sequential
discipline counts it: docs/replay.md, "Gaps count from the end of a turn") to the session's
next arrival. For each time away ``a`` it reports the share of the gaps still open after
``a`` that close within the next ``T`` seconds (``--within``), and the same in units of the
session's own cadence (the median of its previous gaps, up to
:data:`~hybridstore.policy.nextuse.WINDOW` of them, the default's prediction):
the share of the gaps open after ``k`` cadences that close within ``max(k, 1)`` more.

A store ranks an overdue session by its time away (docs/replay.md, "Predicted returns"):
if the odds fall with the time away, that order is right; where they are flat, the time
away says nothing and no order of the sessions can tell which comes back first (issue 27,
"What the store cannot know"). JSON on stdout (and ``--json``), a Markdown table, and
``--plot`` a PNG of the odds against the time away.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import load_trace, report, trace_label
from hybridstore.policy.nextuse import WINDOW
from hybridstore.replay.model_presets import model_preset
from hybridstore.replay.trace import Trace

AWAY_S = (0.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
"""Times away (seconds) at which the odds are read."""

AWAY_CADENCES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
"""Times away in cadences of the session at which the odds are read."""


def session_gaps(trace: Trace, decode_s_per_token: float, window: int
                 ) -> list[tuple[str, int, float, float | None]]:
    """Every gap of the trace: ``(session, index of the request that ends it, gap, gap over
    the session's cadence)``. A gap runs from the end of a turn (its arrival plus
    ``decode_s_per_token`` per output token) to the session's next arrival; the cadence is
    the median of up to ``window`` earlier gaps of the session (``None`` before any)."""
    out: list[tuple[str, int, float, float | None]] = []
    for s in trace.sessions:
        seen: list[float] = []
        for prev, req in zip(s.requests, s.requests[1:]):
            g = req.arrival_s - (prev.arrival_s + decode_s_per_token * prev.output_tokens)
            cadence = float(np.median(seen[-window:])) if seen else 0.0
            out.append((s.id, req.index, g, g / cadence if cadence > 0 else None))
            seen.append(max(g, 0.0))
    return out


def gaps(trace: Trace, decode_s_per_token: float, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Every gap of the trace (seconds) and, for those with a cadence, the gap over it
    (:func:`session_gaps`)."""
    rows = session_gaps(trace, decode_s_per_token, window)
    return (np.asarray([g for _, _, g, _ in rows], dtype=np.float64),
            np.asarray([r for _, _, _, r in rows if r is not None], dtype=np.float64))


def odds_by_away(g: np.ndarray, away: tuple[float, ...], within: float | None) -> list[dict[str, Any]]:
    """For each time away ``a``: the gaps still open after ``a`` (``open``) and the share of
    them that close within ``within`` more (``None``: within ``max(a, 1)`` more)."""
    rows = []
    for a in away:
        still = g[g > a]
        more = max(a, 1.0) if within is None else within
        rows.append({"away": a, "open": int(still.size),
                     "returns": float(np.mean(still <= a + more)) if still.size else None})
    return rows


def returns(trace: Trace, within: list[float], *, label: str | None = None,
            model: str = "qwen3.5-9b") -> dict[str, Any]:
    """The odds of a return by time away for one trace (module docstring)."""
    g, rel = gaps(trace, model_preset(model).decode_s_per_token, WINDOW)
    return {
        "trace": label or trace.name, "gaps": int(g.size),
        "gap_percentiles_s": {str(q): float(np.percentile(g, q)) for q in (10, 50, 90, 99)} if g.size else {},
        "by_seconds": {str(int(t)): odds_by_away(g, AWAY_S, t) for t in within},
        "by_cadences": odds_by_away(rel, AWAY_CADENCES, None),
    }


def print_table(results: list[dict[str, Any]]) -> None:
    """One row per trace and horizon: the share of open gaps that close within it."""
    def cell(r: dict[str, Any]) -> str:
        return "-" if r["returns"] is None else f"{r['returns']:.2f} ({r['open']})"

    heads = " | ".join(f"{a:g} s" for a in AWAY_S)
    print(f"| trace | returns within | {heads} |")
    print("|---|---|" + "---|" * len(AWAY_S))
    for res in results:
        for t, rows in res["by_seconds"].items():
            print(f"| {res['trace']} | {t} s | " + " | ".join(cell(r) for r in rows) + " |")
    heads = " | ".join(f"{a:g}" for a in AWAY_CADENCES)
    print(f"\n| trace | cadences away: | {heads} |")
    print("|---|---|" + "---|" * len(AWAY_CADENCES))
    for res in results:
        print(f"| {res['trace']} | back within as many more | "
              + " | ".join(cell(r) for r in res["by_cadences"]) + " |")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """The odds of a return against the time away, per trace and horizon."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        for t, rows in res["by_seconds"].items():
            pts = [(r["away"], r["returns"]) for r in rows if r["returns"] is not None]
            ax.plot(*zip(*pts), marker="o", label=f"{res['trace']}, within {t} s")
        pts = [(r["away"], r["returns"]) for r in res["by_cadences"] if r["returns"] is not None]
        bx.plot(*zip(*pts), marker="o", label=res["trace"])
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("time away (s)")
    ax.set_ylabel("share of open gaps that close")
    bx.set_xscale("symlog", linthresh=1)
    bx.set_xlabel("time away (cadences of the session)")
    bx.set_ylabel("share back within as many more")
    for a in (ax, bx):
        a.set_ylim(0, 1.05)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _horizons(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"horizons must be seconds, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"horizons must be positive seconds, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.returns", description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--within", type=_horizons, default=_horizons("30,120"),
                    help="horizons in seconds, comma-separated")
    ap.add_argument("--model", default="qwen3.5-9b", help="model preset (its decode time per token)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    within = args.within
    results = [returns(load_trace(spec), within, label=trace_label(spec), model=args.model)
               for spec in args.traces]
    report({"traces": results}, args.json, lambda: print_table(results),
           lambda p: plot(results, p), args.plot)


if __name__ == "__main__":
    main()
