"""Replay output: a table per policy, the JSON document, and the plot (HiState Fig. 8–9 style)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridstore.replay.sim import PolicyRun, ReplayConfig
from hybridstore.replay.trace import Trace

REFERENCE = "unlimited"


def summarize(trace: Trace, runs: Mapping[str, PolicyRun], cfg: ReplayConfig) -> dict[str, Any]:
    """The JSON document: trace facts, settings, and one summary per policy."""
    policies = {name: run.summary() for name, run in runs.items()}
    ref = policies.get(REFERENCE)
    for name, summ in policies.items():
        summ["hit_rate_vs_unlimited"] = (summ["token_hit_rate"] / ref["token_hit_rate"]
                                         if ref and ref["token_hit_rate"] else None)
        by_kind: dict[str, dict[str, float]] = {}
        for r in runs[name].results:
            k = by_kind.setdefault(r.kind, {"requests": 0, "input_tokens": 0, "hit_tokens": 0})
            k["requests"] += 1
            k["input_tokens"] += r.input_tokens
            k["hit_tokens"] += r.hit_tokens
        for k in by_kind.values():
            k["token_hit_rate"] = k["hit_tokens"] / k["input_tokens"] if k["input_tokens"] else 0.0
        summ["by_kind"] = by_kind
    return {"trace": {"name": trace.name, "sessions": trace.n_sessions, "requests": trace.n_requests,
                      "input_tokens": trace.input_tokens, "block_size": trace.block_size},
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "policies": policies}


def print_table(doc: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=160)
    t = doc["trace"]
    table = Table(title=f"replay of {t['name']}: {t['sessions']} sessions, {t['requests']} requests, "
                        f"{t['input_tokens'] / 1e6:.1f}M input tokens ({doc['config']['model']})")
    cols = ["policy", "hit rate", "vs unlimited", "TTFT p50", "p95", "p99", "mean",
            "recomputed", "restored host", "restored SSD", "evictions", "req/s"]
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for name, s in doc["policies"].items():
        rel = s["hit_rate_vs_unlimited"]
        table.add_row(
            name, f"{s['token_hit_rate']:.1%}", "-" if rel is None else f"{rel:.1%}",
            f"{s['ttft_p50_s']:.2f}s", f"{s['ttft_p95_s']:.2f}s", f"{s['ttft_p99_s']:.2f}s",
            f"{s['ttft_mean_s']:.2f}s", f"{s['recomputed_tokens'] / 1e6:.2f}M",
            f"{s['restored_bytes'].get('host', 0) / 2**30:.1f}G",
            f"{s['restored_bytes'].get('disk', 0) / 2**30:.1f}G",
            str(s["evictions"]), f"{s['requests_per_s']:.0f}")
    console.print(table)


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, default=float))


def plot(runs: Mapping[str, PolicyRun], path: str | Path, title: str = "") -> None:
    """TTFT CDF per policy, and per-request hit rate against ``unlimited``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(runs)}
    for name, run in runs.items():
        ttft = np.sort([r.ttft_s for r in run.results])
        if ttft.size:
            ax1.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name, color=colors[name])
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s)")
    ax1.set_ylabel("CDF of requests")
    ax1.set_title("TTFT")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ref = runs.get(REFERENCE)
    if ref is not None:
        ref_hit = {(r.session, r.index): r.hit_tokens / max(r.input_tokens, 1) for r in ref.results}
        lowest = 1.0
        for name, run in runs.items():
            if name == REFERENCE:
                continue
            gap = np.sort([ref_hit[(r.session, r.index)] - r.hit_tokens / max(r.input_tokens, 1)
                           for r in run.results if (r.session, r.index) in ref_hit])
            if gap.size:
                cdf = np.arange(1, gap.size + 1) / gap.size
                ax2.plot(gap, cdf, label=name, drawstyle="steps-post", color=colors[name])
                lowest = min(lowest, float(cdf[np.searchsorted(gap, 1e-9)]) if (gap > 1e-9).any() else 1.0)
        # Most requests lose nothing; zoom on the tail where policies differ.
        ax2.set_ylim(max(0.0, lowest - 0.02), 1.005)
        ax2.set_xlabel("hit rate of unlimited minus hit rate of the policy, per request")
        ax2.set_ylabel("CDF of requests")
        ax2.set_title("per-request hit rate lost against unlimited")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
