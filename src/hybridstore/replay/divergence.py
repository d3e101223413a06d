"""Where agent requests leave the previous request's prefix (issue 15, part 3).

For every request with a predecessor in its session, the *divergence point* is the
longest block-aligned prefix it shares with that predecessor (chained block ids: equal
id, equal prefix), and ``back`` is how far that point lies before the predecessor's end,
in tokens.  A pure append keeps every full block of the predecessor, so its ``back`` is
the predecessor's partial last block (``< block_size``); a rewrite of the last turn,
a truncation or a compaction lands further back; ``back == len(prev)`` shares nothing.

HiState's interval (eq. 3) assumes a hit lands uniformly inside a new segment.  The
histogram shows how far from uniform agent traces are: on the WEKA Claude Code sessions
~90 % of resumes land at the previous end (appends), ~6-8 % one to three blocks before it
(the last turn rewritten), ~3 % tens of thousands of tokens back, and next to nothing in
between (``docs/replay.md``).

:func:`divergence` computes the figures of one trace, :func:`print_divergence` a table
and :func:`plot_divergence` a histogram per trace (log-spaced distance bins).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from hybridstore.replay.trace import Trace

EDGES_BLOCKS = (1, 4, 16, 64, 256, 1024)
"""Bin edges of ``back``, in blocks: ``[0, 1)`` is the partial last block (appends)."""


def shared_blocks(a: np.ndarray, b: np.ndarray) -> int:
    """Leading entries two block-id arrays share (where a request leaves another)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def divergence(trace: Trace) -> dict[str, Any]:
    """The divergence figures of ``trace`` (see the module docstring).

    Returns:
        ``{"trace", "block_size", "pairs", "bins": [{"from_tokens", "to_tokens", "count",
        "share"}], "resets", "appends", "back_tokens_quantiles" (of the non-appends),
        "back_fraction_quantiles" (``back / len(prev)``, non-appends)}``.
    """
    B = trace.block_size
    backs, fractions = [], []
    resets = 0
    for session in trace.sessions:
        reqs = session.requests
        for prev, cur in pairwise(reqs):
            p = prev.block_ids[:prev.input_tokens // B]
            c = cur.block_ids[:cur.input_tokens // B]
            shared = shared_blocks(p, c) * B
            back = prev.input_tokens - shared
            backs.append(back)
            fractions.append(back / prev.input_tokens if prev.input_tokens else 0.0)
            resets += shared == 0
    arr = np.asarray(backs, dtype=np.int64)
    frac = np.asarray(fractions, dtype=np.float64)
    edges = [0, *(e * B for e in EDGES_BLOCKS), None]
    bins = []
    for lo, hi in pairwise(edges):
        sel = (arr >= lo) & (arr < hi) if hi is not None else arr >= lo
        count = int(sel.sum())
        bins.append({"from_tokens": lo, "to_tokens": hi, "count": count,
                     "share": count / len(arr) if len(arr) else 0.0})
    far = arr >= B
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    return {"trace": trace.name, "block_size": B, "pairs": len(arr), "bins": bins,
            "appends": int((~far).sum()), "resets": int(resets),
            "back_tokens_quantiles": ({str(q): float(np.quantile(arr[far], q)) for q in qs}
                                      if far.any() else {}),
            "back_fraction_quantiles": ({str(q): float(np.quantile(frac[far], q)) for q in qs}
                                        if far.any() else {})}


def _label(b: dict[str, Any]) -> str:
    def k(t: int) -> str:
        return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)

    return f">= {k(b['from_tokens'])}" if b["to_tokens"] is None else \
        f"[{k(b['from_tokens'])}, {k(b['to_tokens'])})"


def print_divergence(docs: Sequence[dict[str, Any]]) -> None:
    """One rich table: the share of requests per distance bin, one column per trace."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="where a request leaves its predecessor: tokens before the previous end")
    table.add_column("back (tokens)")
    for d in docs:
        table.add_column(f"{d['trace']} ({d['pairs']} pairs)", justify="right")
    for i, b in enumerate(docs[0]["bins"]):
        table.add_row(_label(b), *(f"{d['bins'][i]['share']:.1%}" for d in docs))
    table.add_row("shares nothing", *(f"{d['resets'] / d['pairs']:.1%}" if d["pairs"] else "-"
                                      for d in docs))
    Console().print(table)


def plot_divergence(docs: Sequence[dict[str, Any]], path: str) -> None:
    """Bars of the share of requests per distance bin, one group per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [_label(b) for b in docs[0]["bins"]]
    width = 0.8 / max(1, len(docs))
    x = np.arange(len(labels))
    for i, d in enumerate(docs):
        ax.bar(x + i * width, [b["share"] for b in d["bins"]], width,
               label=f"{d['trace']} ({d['pairs']} pairs)")
    ax.set_xticks(x + width * (len(docs) - 1) / 2, labels)
    ax.set_xlabel("divergence point, tokens before the previous request's end")
    ax.set_ylabel("share of requests")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
