"""A capacity curve: the same trace at a series of budgets, every preset, one document.

``hybridstore replay --sweep 5%,10%,20%,40%,80%`` runs :func:`sweep`: for each budget
(a fraction of the trace's KV footprint, :func:`~hybridstore.replay.sim.kv_footprint`)
every preset replays the same requests in the configured discipline, and the document
holds one row per (budget, preset): token hit rate, the share of ``unlimited``'s hit
rate, TTFT p50/p95/p99 and evictions.  ``unlimited`` does not depend on the budget: it
runs once and is repeated on every row set as the reference.  :func:`plot_sweep` draws
hit rate and p95/p99 TTFT against budget, one line per preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from hybridstore.errors import ConfigError
from hybridstore.replay.sim import (
    PlaneFactory,
    PolicyRun,
    ReplayConfig,
    kv_footprint,
    replay,
)
from hybridstore.replay.systems import preset
from hybridstore.replay.trace import Trace

REFERENCE = "unlimited"


def parse_budgets(text: str) -> list[float]:
    """``"5%,10%,0.4"`` -> ``[0.05, 0.1, 0.4]`` (a ``%`` suffix divides by 100).

    Raises:
        ConfigError: an entry is not a positive finite number.
    """
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        pct = part.endswith("%")
        try:
            value = float(part[:-1] if pct else part) / (100.0 if pct else 1.0)
        except ValueError:
            raise ConfigError(f"cannot read {part!r} as a budget; write e.g. 10% or 0.1") from None
        if not 0 < value < float("inf"):
            raise ConfigError(f"a budget must be positive, got {part!r}")
        out.append(value)
    if not out:
        raise ConfigError("no budget given; write e.g. --sweep 5%,10%,20%,40%,80%")
    return out


def _row(budget: float | None, name: str, run: PolicyRun, ref: float | None) -> dict[str, Any]:
    s = run.summary()
    return {"budget": budget, "policy": name, "token_hit_rate": s["token_hit_rate"],
            "hit_rate_vs_unlimited": (s["token_hit_rate"] / ref) if ref else None,
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p95_s": s["ttft_p95_s"],
            "ttft_p99_s": s["ttft_p99_s"], "evictions": s["evictions"],
            "requests": s["requests"], "requests_per_s": s["requests_per_s"]}


def sweep(trace: Trace, names: Sequence[str], cfg: ReplayConfig, budgets: Sequence[float], *,
          plane_for: PlaneFactory | None = None, progress: bool = True) -> dict[str, Any]:
    """Replay ``trace`` under every preset at every budget (see the module docstring).

    Args:
        trace: the trace.
        names: preset names; ``unlimited`` is added as the reference if missing.
        cfg: everything but the budget (its ``budget`` is replaced per point).
        budgets: fractions of the KV footprint, e.g. ``[0.05, 0.1, 0.2]``.
        plane_for: the objects of each run (sizes only by default).
        progress: one bar over the (budget, preset) runs.

    Returns:
        ``{"trace", "config", "kv_footprint_bytes", "cache_bytes", "budgets", "rows"}``.
    """
    for name in names:
        preset(name)
    names = list(dict.fromkeys([REFERENCE, *names]))
    footprint = kv_footprint(trace, cfg, cfg.full_model())
    bar = tqdm(total=1 + len(budgets) * (len(names) - 1), desc="sweep", unit="run",
               disable=not progress)
    ref_run = replay(trace, [REFERENCE], cfg, plane_for=plane_for, progress=False)[REFERENCE]
    ref = ref_run.summary()["token_hit_rate"]
    bar.update()
    rows = []
    for budget in budgets:
        point = dataclasses.replace(cfg, budget=budget)
        rows.append(_row(budget, REFERENCE, ref_run, ref))
        for name in names[1:]:
            run = replay(trace, [name], point, plane_for=plane_for, progress=False)[name]
            rows.append(_row(budget, name, run, ref))
            bar.update()
    bar.close()
    return {"trace": {"name": trace.name, "sessions": trace.n_sessions,
                      "requests": trace.n_requests, "block_size": trace.block_size},
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "budget"},
            "kv_footprint_bytes": footprint,
            "cache_bytes": {str(b): b * footprint * (1 + cfg.mamba_ratio) for b in budgets},
            "budgets": list(budgets), "rows": rows}


def print_sweep(doc: dict[str, Any]) -> None:
    """One rich table: token hit rate (and p99 TTFT) per preset and budget."""
    from rich.console import Console
    from rich.table import Table

    budgets = doc["budgets"]
    table = Table(title=f"capacity curve: {doc['trace']['name']} ({doc['config']['discipline']}, "
                        f"KV footprint {doc['kv_footprint_bytes'] / 2**30:.1f} GiB)")
    table.add_column("preset")
    for b in budgets:
        table.add_column(f"{b:.0%} hit / p99 s", justify="right")
    by = {(r["policy"], r["budget"]): r for r in doc["rows"]}
    for name in dict.fromkeys(r["policy"] for r in doc["rows"]):
        cells = []
        for b in budgets:
            r = by[(name, b)]
            cells.append(f"{r['token_hit_rate']:.3f} / {r['ttft_p99_s']:.2f}")
        table.add_row(name, *cells)
    Console().print(table)


def plot_sweep(doc: dict[str, Any], path: str) -> None:
    """Token hit rate, p95 and p99 TTFT against budget (log x), one line per preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(dict.fromkeys(r["policy"] for r in doc["rows"]))
    for name in names:
        rows = sorted((r for r in doc["rows"] if r["policy"] == name), key=lambda r: r["budget"])
        x = [100 * r["budget"] for r in rows]
        style = {"linestyle": "--", "color": "black"} if name == REFERENCE else {"marker": "o"}
        for ax, key in zip(axes, ("token_hit_rate", "ttft_p95_s", "ttft_p99_s")):
            ax.plot(x, [r[key] for r in rows], label=name, **style)
    ticks = [100 * b for b in doc["budgets"]]
    for ax, label in zip(axes, ("token hit rate", "TTFT p95 (s)", "TTFT p99 (s)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("cache budget, % of the KV footprint (KV + Mamba pools)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['trace']['name']}: capacity curve ({doc['config']['discipline']} "
                 f"discipline, {doc['config']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
