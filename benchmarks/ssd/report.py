"""The SSD benchmark's ratios, target rows, table and plot."""

from __future__ import annotations

from typing import Any

from benchmarks.ssd.rows import Row
from benchmarks.ssd.sizes import (
    OURS,
    SIZE_NAMES,
    TARGET_MIN_BYTES,
    TARGET_RATIO,
    size_label,
)
from hybridstore.bench.common import median


def ratios(rows: list[Row], device_limit: dict[str, Any],
            device_now: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    ours = {(r.op, r.object_bytes): r for r in rows if r.path == OURS}
    out = []
    for r in rows:
        d = r.doc()
        limit = device_limit["read_gbps"] if r.op.startswith("read") else device_limit["write_gbps"]
        if limit:
            d["vs_device_limit"] = d["gbps"] / limit
        if r.op.startswith("read") and r.path != "device-ref":
            now = [g / device_now[(r.object_bytes, rep)] for rep, g in r.rep_gbps.items()
                   if (r.object_bytes, rep) in device_now]
            if now:
                d["vs_device_now"] = median(now)
        mine = ours.get((r.op, r.object_bytes))
        if mine is not None and r.path not in (OURS, "device-ref"):
            both = [g / mine.rep_gbps[rep] for rep, g in r.rep_gbps.items()
                    if rep in mine.rep_gbps]
            if both:
                d["vs_hybridstore"] = median(both)
        out.append(d)
    return out


def target_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """hybridstore vs the device limit and vs DALI / torch.load, objects >= 4 MiB."""
    rows = []
    for r in results:
        if r["path"] != OURS or r["op"] != "read" or r["object_bytes"] < TARGET_MIN_BYTES:
            continue
        size = r["object_bytes"]
        others = {f"{o['path']} [{o['cache']}]": o["gbps"] for o in results
                  if o["object_bytes"] == size and o["op"].startswith("read")
                  and ("dali" in o["path"] or o["path"] == "torch.load")}
        cold_others = {k: v for k, v in others.items() if "warm" not in k}
        rows.append({
            "object_bytes": size, "hybridstore_gbps": r["gbps"],
            "vs_device_limit": r.get("vs_device_limit"), "vs_device_now": r.get("vs_device_now"),
            "device_limit_met": (r.get("vs_device_limit") or 0) >= TARGET_RATIO,
            "device_now_met": (r.get("vs_device_now") or 0) >= TARGET_RATIO,
            "others_gbps": others,
            "ahead_of_cold_others": all(r["gbps"] > g for g in cold_others.values()),
            "ahead_of_all_others": all(r["gbps"] > g for g in others.values()),
        })
    return {"goal": f"{OURS} reads >= {TARGET_RATIO:.0%} of the device read limit for objects "
                    f">= {TARGET_MIN_BYTES >> 20} MiB, ahead of DALI and torch.load",
            "rows": rows}


def print_report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    dl = doc["device_limit"]
    best = dl["best_read"]
    console.print(f"device limit on {doc['disk']['dir']} ({doc['disk']['fs_type']}): read "
                  f"{dl['read_gbps']:.2f} GB/s ({best['rw']} bs={best['block_bytes']} "
                  f"qd={best['iodepth']}), write {dl['write_gbps'] or 0:.2f} GB/s; {dl['method']}")
    t = Table(title="python -m benchmarks ssd (GB/s: median of reps; ms per op)")
    for col in ("object", "op", "path", "cache", "GB/s", "p50 ms", "p99 ms", "vs limit",
                "vs dev now", "vs hybridstore"):
        t.add_column(col, justify="left" if col in ("object", "op", "path", "cache") else "right")

    def f(x: Any, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in sorted(doc["results"], key=lambda r: (r["object_bytes"], r["op"], -r["gbps"])):
        t.add_row(size_label(r["object_bytes"]), r["op"], r["path"], r["cache"],
                  f(r["gbps"], ".2f"), f(r["p50_ms"], ".3f"), f(r["p99_ms"], ".3f"),
                  f(r.get("vs_device_limit"), ".2f"), f(r.get("vs_device_now"), ".2f"),
                  f(r.get("vs_hybridstore"), ".2f"))
    console.print(t)
    if doc["host_pool"]:
        h = Table(title=f"host pool (pinned: {doc['host']['pinned']})")
        for col in ("object", "path", "op", "GB/s", "p50 ms", "p99 ms", "vs memcpy / pinned"):
            h.add_column(col, justify="left" if col in ("object", "path", "op") else "right")
        for r in doc["host_pool"]:
            h.add_row(size_label(r["object_bytes"]), r["path"], r["op"], f(r["gbps"], ".2f"),
                      f(r["p50_ms"], ".3f"), f(r["p99_ms"], ".3f"),
                      f(r.get("vs_memcpy", r.get("vs_torch_pinned")), ".2f"))
        console.print(h)
    for row in doc["target"]["rows"]:
        ok = "[green]met[/green]" if row["device_limit_met"] else "[red]short[/red]"
        console.print(f"target {size_label(row['object_bytes'])}: {OURS} "
                      f"{row['hybridstore_gbps']:.2f} GB/s = {row['vs_device_limit'] or 0:.2f}x "
                      f"the device limit ({ok}), {row['vs_device_now'] or 0:.2f}x the device in "
                      f"the same reps; ahead of DALI/torch.load (cold): "
                      f"{row['ahead_of_cold_others']}")
    for u in doc["unavailable"]:
        console.print(f"[yellow]unavailable:[/yellow] {u['path']} {u['op']}: {u['reason']}")
    for issue in doc["issues"]:
        console.print(f"[yellow]issue:[/yellow] {issue}")


def plot_results(doc: dict[str, Any], path: str) -> None:
    """PNG of GB/s against object size per path: cold reads, warm reads, writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(20, 6.5))
    dl = doc["device_limit"]
    panels = ((axes[0], "read", lambda c: not c.startswith("warm"), dl["read_gbps"],
               "reads from the device (cold: O_DIRECT, or page cache dropped)", "linear"),
              (axes[1], "read", lambda c: c.startswith("warm"), dl["read_gbps"],
               "reads from the page cache (warm)", "log"),
              (axes[2], "write", lambda c: True, dl["write_gbps"], "durable writes", "linear"))
    for ax, op, keep, limit, title, yscale in panels:
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in doc["results"]:
            if r["op"] == op and keep(r["cache"]):
                lines.setdefault(f"{r['path']} [{r['cache']}]", []).append(
                    (r["object_bytes"], r["gbps"]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            style: dict[str, Any] = {}
            if label.startswith(OURS):
                style = {"lw": 2.8, "color": "black", "zorder": 5}
            elif label.startswith("device-ref"):
                style = {"ls": "--", "color": "red", "lw": 1.2}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=label,
                    **style)
        if limit:
            ax.axhline(limit, color="red", ls=":", lw=1.5, label=f"device limit {limit:.2f} GB/s")
            if op == "read" and yscale == "linear":
                ax.axhline(TARGET_RATIO * limit, color="red", ls=":", lw=0.8, alpha=0.5,
                           label=f"{TARGET_RATIO:.0%} of the limit")
        for size, name in SIZE_NAMES.items():
            ax.axvline(size, color="grey", lw=0.6, alpha=0.4)
            ax.text(size, 0.98, name, rotation=90, va="top", ha="right", fontsize=7,
                    color="grey", transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel("object size (bytes)")
        ax.set_ylabel("GB/s (1e9 B/s), median of reps")
        ax.set_title(f"{title}, one object per op", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    bd = doc["disk"].get("block_device", {})
    fig.suptitle(f"python -m benchmarks ssd: {doc['disk']['fs_type']} on {bd.get('name', '?')}; "
                 f"device limit by {dl['method'].split(',')[0]}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
