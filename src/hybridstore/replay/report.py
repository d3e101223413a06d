"""Replay output: a table per policy, the JSON document, and the plot (HiState Fig. 8–9 style).

Data mode adds, per policy that moved bytes, a ``"data"`` section (measured
restore times next to the modeled ones for the same bytes, bytes read per
tier, checks), a second table, and a third panel with both restore CDFs.
"""

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
        data = data_summary(runs[name])
        if data is not None:
            summ["data"] = data
    return {"trace": {"name": trace.name, "sessions": trace.n_sessions, "requests": trace.n_requests,
                      "input_tokens": trace.input_tokens, "block_size": trace.block_size},
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "policies": policies}


def _restores(run: PolicyRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Measured and modeled seconds of the timed restores, and the bytes each read from
    DRAM and SSD (all at the store's scale)."""
    timed = [r for r in run.results if r.measured_restore_s is not None]
    measured = np.array([r.measured_restore_s for r in timed], dtype=float)
    modeled = np.array([r.restore_s / run.scale for r in timed], dtype=float)
    slow = np.array([(r.restored_bytes.get("host", 0) + r.restored_bytes.get("disk", 0)) / run.scale
                     for r in timed], dtype=float)
    return measured, modeled, slow


def data_summary(run: PolicyRun) -> dict[str, Any] | None:
    """Data mode's figures of one run: measured vs modeled restores of the bytes moved.

    Both are at the store's scale (``scale`` times fewer bytes than the model
    preset): measured is the wall time of ``store.load(plan).result()``,
    modeled is ``store.restore_cost`` of the same plan (HiState eq. 2; GPU-tier
    objects cost nothing there, and a zero-copy view here).  ``gbps`` is the
    bytes read from DRAM and SSD over the measured time of the restores that
    read any; ``us_per_object`` is measured time per object loaded.
    """
    if run.data is None:
        return None
    measured, modeled, slow = _restores(run)
    out: dict[str, Any] = {"scale": run.scale, "restores": int(measured.size)}
    for label, xs in (("measured", measured), ("modeled", modeled)):
        xs = xs if xs.size else np.zeros(1)
        out[f"{label}_restore_p50_s"] = float(np.percentile(xs, 50))
        out[f"{label}_restore_p95_s"] = float(np.percentile(xs, 95))
        out[f"{label}_restore_mean_s"] = float(xs.mean())
    out["measured_over_modeled"] = float(measured.sum() / modeled.sum()) if modeled.sum() > 0 else None
    reads = slow > 0
    out["gbps"] = float(slow[reads].sum() / measured[reads].sum() / 1e9) if reads.any() else None
    objects = run.data["objects_loaded"]
    out["us_per_object"] = float(measured.sum() / objects * 1e6) if objects else None
    out.update({k: v for k, v in run.data.items() if k != "restore_wall_s"})
    return out


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
    measured = {name: s["data"] for name, s in doc["policies"].items() if "data" in s}
    if measured:
        _print_data_table(measured, console)


def _print_data_table(rows: dict[str, dict[str, Any]], console: Console) -> None:
    scale = next(iter(rows.values()))["scale"]
    table = Table(title=f"data mode: store.load wall time (measured) vs HiState eq. 2 (modeled) of "
                        f"the same bytes; objects and budgets / {scale:.4g}")
    cols = ["policy", "hits", "p50 ms meas/model", "p95 ms meas/model", "mean ms meas/model",
            "meas/model", "read DRAM", "read SSD", "GB/s", "us/object", "verified", "SSD files"]
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")

    def pair(d: dict[str, Any], stat: str) -> str:
        return (f"{d[f'measured_restore_{stat}_s'] * 1e3:.2f} / "
                f"{d[f'modeled_restore_{stat}_s'] * 1e3:.3f}")

    for name, d in rows.items():
        ratio, disk = d["measured_over_modeled"], d.get("disk")
        table.add_row(
            name, str(d["restores"]), pair(d, "p50"), pair(d, "p95"), pair(d, "mean"),
            "-" if ratio is None else f"{ratio:.0f}x",
            f"{d['bytes_read'].get('host', 0) / 2**30:.2f}G",
            f"{d['bytes_read'].get('disk', 0) / 2**30:.2f}G",
            "-" if d["gbps"] is None else f"{d['gbps']:.2f}",
            "-" if d["us_per_object"] is None else f"{d['us_per_object']:.1f}",
            str(d["verified_objects"]),
            "-" if disk is None else f"{disk['segment_files']} ({disk['file_bytes'] / 2**30:.2f}G)")
    console.print(table)


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, default=float))


def plot(runs: Mapping[str, PolicyRun], path: str | Path, title: str = "") -> None:
    """TTFT CDF per policy, and per-request hit rate against ``unlimited``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = {name: run for name, run in runs.items() if run.data is not None}
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(19 if timed else 13, 4.8))
    ax1, ax2 = axes[0], axes[1]
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
    if timed:
        _plot_restores(axes[2], timed, colors)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_restores(ax: Any, runs: Mapping[str, PolicyRun], colors: Mapping[str, Any]) -> None:
    """Data mode: CDF of measured (solid) and modeled (dashed) restore time per policy."""
    for name, run in runs.items():
        measured, modeled, _ = _restores(run)
        for xs, style, label in ((measured, "-", "measured"), (modeled, "--", "modeled")):
            xs = np.sort(np.maximum(xs, 1e-6))   # GPU-resident restores model as ~0 s
            if xs.size:
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, style, color=colors[name],
                        label=f"{name} {label}")
    scale = next(iter(runs.values())).scale
    ax.set_xscale("log")
    ax.set_xlabel(f"restore time (s) of a hit, objects / {scale:.4g} (under 1 us shown at 1 us)")
    ax.set_ylabel("CDF of restores")
    ax.set_title("data mode: measured (solid) vs modeled (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
