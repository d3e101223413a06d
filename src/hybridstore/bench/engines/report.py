"""The report of ``hybridstore bench engines``: goals, the table and the figure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridstore.bench.common import fmt_bytes, median

__all__ = ["GOAL_LARGE_BYTES", "GOAL_LOAD_CPU_MS_PER_MIB", "GOAL_LOAD_RATIO", "GOAL_READ_SHARE",
           "GOAL_SPEEDUP", "goals", "plot", "print_report"]

GOAL_SPEEDUP = 3.0          # issue 12: >= 3x the built-in file backends' page throughput
GOAL_LARGE_BYTES = 4 << 20  # issue 12: batch loads of >= 4 MiB ...
GOAL_READ_SHARE = 0.9       # ... at >= 90% of the SSD's read limit
GOAL_LOAD_CPU_MS_PER_MIB = 0.15  # issue 26: vLLM tier loads at <= 0.15 ms of CPU per MiB ...
GOAL_LOAD_RATIO = 1.0            # ... and >= 1.0x vLLM's fs tier's GB/s


def large_batches(rows: list[dict[str, Any]], read_gbps: float | None,
                  device_now: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Cold and restart batch loads of >= 4 MiB next to the SSD's read limit of this run.

    ``share_of_ssd`` divides by the limit (fio or the pool on a test file, before the
    runs); ``share_of_device_now`` by the median of the pool's O_DIRECT reads of the
    built-in backend's just-written files in the same run (``device_now``).
    """
    now = {(d["engine"], d["geometry"], d["run"]): median(d["gbps"])
           for d in device_now or [] if d["gbps"]}
    out = []
    for r in rows:
        if (r["op"] in ("batch_get", "batch_get_v1", "submit_load") and r["cache"] in ("cold", "restart")
                and r["batch_bytes"] >= GOAL_LARGE_BYTES):
            share = r["gbps"] / read_gbps if read_gbps else None
            dn = now.get((r["engine"], r["geometry"], r.get("run", "")))
            out.append({k: r[k] for k in ("engine", "backend", "op", "cache", "geometry",
                                          "batch_bytes", "gbps")}
                       | {"run": r.get("run", ""), "ssd_read_gbps": read_gbps, "share_of_ssd": share,
                          "goal_met": None if share is None else share >= GOAL_READ_SHARE,
                          "device_now_gbps": dn,
                          "share_of_device_now": r["gbps"] / dn if dn else None})
    return out


def goals(ratios: list[dict[str, Any]], large: list[dict[str, Any]], ours: str,
          floors: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Issue 12's two goals (page throughput ops only) and issue 26's load CPU goal against
    what was measured (with the load floors, ``floors``)."""
    page_ops = [r for r in ratios if r["op"] in ("batch_set", "batch_get", "submit_store",
                                                 "submit_load", "batch_set_v1/batch_set",
                                                 "batch_get_v1/batch_get")]
    worst = min(page_ops, key=lambda r: r["ratio"]) if page_ops else None
    ours_large = [x for x in large if x["backend"] == ours and x["share_of_ssd"] is not None]
    worst_large = min(ours_large, key=lambda x: x["share_of_ssd"]) if ours_large else None
    ours_now = [x["share_of_device_now"] for x in large
                if x["backend"] == ours and x["share_of_device_now"] is not None]
    return {
        "speedup_goal": GOAL_SPEEDUP,
        "speedup_min": worst["ratio"] if worst else None,
        "speedup_min_row": worst,
        "speedup_met": None if worst is None else worst["ratio"] >= GOAL_SPEEDUP,
        "speedup_met_rows": sum(r["ratio"] >= GOAL_SPEEDUP for r in page_ops),
        "speedup_rows": len(page_ops),
        "speedup_best": max((r["ratio"] for r in page_ops), default=None),
        "large_batch_goal": GOAL_READ_SHARE,
        "large_batch_min_share": worst_large["share_of_ssd"] if worst_large else None,
        "large_batch_min_row": worst_large,
        "large_batch_met": None if worst_large is None else
        worst_large["share_of_ssd"] >= GOAL_READ_SHARE,
        "large_batch_min_share_of_device_now": min(ours_now) if ours_now else None,
        "large_batch_max_share_of_device_now": max(ours_now) if ours_now else None,
        **load_cpu_goal(ratios, floors),
    }


def load_cpu_goal(ratios: list[dict[str, Any]], floors: Sequence[dict[str, Any]] = ()
                  ) -> dict[str, Any]:
    """Issue 26: the vLLM tier's loads at <= :data:`GOAL_LOAD_CPU_MS_PER_MIB` ms of CPU per
    MiB and >= :data:`GOAL_LOAD_RATIO` x ``fs``'s GB/s, over every load row (worst row);
    beside it the most a load floor cost (one thread's O_DIRECT reads with and without
    the checksums, no tier: :mod:`~hybridstore.bench.engines.floor`)."""
    checked = [f["checked_cpu_ms_per_mib"] for f in floors]
    floor = {"load_floor_checked_max": max(checked) if checked else None,
             "load_floor_read_max": max(f["read_cpu_ms_per_mib"] for f in floors)
             if floors else None}
    loads = [r for r in ratios if r["engine"] == "vllm" and r["op"] == "submit_load"
             and "cpu_ms_per_mib_ours" in r]
    if not loads:
        return {"load_cpu_goal_ms_per_mib": GOAL_LOAD_CPU_MS_PER_MIB, "load_cpu_max": None,
                "load_cpu_met": None, "load_ratio_min": None, "load_ratio_met": None, **floor}
    cpu = max(r["cpu_ms_per_mib_ours"] for r in loads)
    ratio = min(r["ratio"] for r in loads)
    return {"load_cpu_goal_ms_per_mib": GOAL_LOAD_CPU_MS_PER_MIB, "load_cpu_max": cpu,
            "load_cpu_theirs_max": max(r["cpu_ms_per_mib_theirs"] for r in loads),
            "load_cpu_ratio_max": max(r["cpu_ratio"] for r in loads),
            "load_cpu_met": cpu <= GOAL_LOAD_CPU_MS_PER_MIB,
            "load_ratio_goal": GOAL_LOAD_RATIO, "load_ratio_min": ratio,
            "load_ratio_met": ratio >= GOAL_LOAD_RATIO, **floor}


def print_report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="hybridstore bench engines: page/state throughput through each engine's "
                    "storage interface (median of reps)")
    for col in ("engine", "backend", "op", "cache", "geom", "object", "batch", "pages/s", "GB/s",
                "+flush", "CPU ms/MiB", "p50 ms", "p99 ms", "exact"):
        t.add_column(col, justify="left" if col in ("engine", "backend", "op", "cache") else "right")
    for r in doc["rows"]:
        t.add_row(r["engine"], r["backend"], r["op"], r["cache"], r["geometry"],
                  fmt_bytes(r["object_bytes"]), str(r["batch_objects"]),
                  f"{r['objects_per_s']:.0f}", f"{r['gbps']:.3f}",
                  f"{r['gbps_incl_flush']:.3f}" if "gbps_incl_flush" in r else "",
                  _cpu_cell(r), f"{r['p50_ms']:.2f}",
                  f"{r['p99_ms']:.2f}", str(r["bit_exact"]))
    console.print(t)
    q = Table(title="ours / built-in, same repetition (median)")
    for col in ("engine", "op", "cache", "geom", "run", "batch", "ratio", "min", "max",
                "CPU/MiB ours", "theirs", "CPU ratio"):
        q.add_column(col, justify="left" if col in ("engine", "op", "cache") else "right")
    for r in doc["ratios"]:
        cpu = ([f"{r['cpu_ms_per_mib_ours']:.3f}", f"{r['cpu_ms_per_mib_theirs']:.3f}",
                f"{r['cpu_ratio']:.2f}x"] if "cpu_ratio" in r else ["", "", ""])
        q.add_row(r["engine"], r["op"], r["cache"], r["geometry"], r.get("run", ""), str(r["batch_objects"]),
                  f"{r['ratio']:.2f}x", f"{r['ratio_min']:.2f}", f"{r['ratio_max']:.2f}", *cpu)
    console.print(q)
    pooled = [r for r in doc["rows"] if r.get("cpu_ms_per_mib_by_pool")]
    if pooled:
        w = Table(title="where the CPU per MiB goes: each thread pool's ms per MiB (median); "
                        "MainThread is the bench's polling loop")
        for col in ("backend", "op", "cache", "run", "total", "by pool"):
            w.add_column(col, justify="right" if col == "total" else "left")
        for r in pooled:
            w.add_row(r["backend"], r["op"], r["cache"], r.get("run", ""), _cpu_cell(r),
                      ", ".join(f"{k} {v:.3f}" for k, v in sorted(
                          r["cpu_ms_per_mib_by_pool"].items(), key=lambda kv: -kv[1])))
        console.print(w)
    d = doc["device_limit"]
    console.print(f"SSD read limit {d.get('read_gbps') or float('nan'):.2f} GB/s "
                  f"({d.get('tool')}); large cold batch loads:")
    for x in doc["large_batches"]:
        share, now = x["share_of_ssd"], x["share_of_device_now"]
        console.print(f"  {x['engine']:6} {x['backend']:12} {x['op']:12} {x['cache']:8} "
                      f"{x['geometry']} {fmt_bytes(x['batch_bytes'])}: {x['gbps']:.2f} GB/s = "
                      f"{'n/a' if share is None else f'{share:.0%}'} of the SSD limit, "
                      f"{'n/a' if now is None else f'{now:.0%}'} of O_DIRECT reads of the "
                      "same data now")
    p = Table(title=f"token hit rate under an SSD byte budget ({doc['policy']['trace']})")
    for col in ("backend", "policy", "budget", "share of footprint", "token hit rate", "s"):
        p.add_column(col, justify="left" if col in ("backend", "policy") else "right")
    for r in doc["policy"]["runs"]:
        p.add_row(r["backend"], r["policy"], fmt_bytes(r["budget_bytes"]),
                  f"{r['budget_share']:.0%}", f"{r['token_hit_rate']:.1%}", f"{r['seconds']:.1f}")
    console.print(p)
    g = doc["goals"]
    console.print(f"goal >= {g['speedup_goal']}x page throughput: min {g['speedup_min']}, best "
                  f"{g['speedup_best']}, met "
                  f"{g['speedup_met_rows']}/{g['speedup_rows']} rows; goal >= "
                  f"{g['large_batch_goal']:.0%} of the SSD for >= 4 MiB loads: min "
                  f"{g['large_batch_min_share']}")
    if g.get("load_cpu_max") is not None:
        console.print(f"goal vLLM loads <= {g['load_cpu_goal_ms_per_mib']} ms CPU/MiB and >= "
                      f"{g['load_ratio_goal']}x fs: worst {g['load_cpu_max']:.3f} ms/MiB "
                      f"(fs {g['load_cpu_theirs_max']:.3f}), min {g['load_ratio_min']:.2f}x; met "
                      f"{g['load_cpu_met']} / {g['load_ratio_met']}")
    if g.get("load_floor_checked_max") is not None:
        console.print(f"load floor (one thread, O_DIRECT reads in coalesced runs, no tier): "
                      f"{g['load_floor_checked_max']:.3f} ms CPU/MiB with every chunk's "
                      f"checksum, {g['load_floor_read_max']:.3f} without (worst run)")
    for issue in doc["issues"]:
        console.print(f"[yellow]issue:[/yellow] {issue}")


def _cpu_cell(r: dict[str, Any]) -> str:
    """CPU ms/MiB of a row (until durable in brackets, where measured)."""
    if "cpu_ms_per_mib" not in r:
        return ""
    flush = r.get("cpu_ms_per_mib_incl_flush")
    return f"{r['cpu_ms_per_mib']:.3f}" + (f" ({flush:.3f})" if flush is not None else "")


def plot(doc: dict[str, Any], path: str) -> None:
    """Up to four panels, those the run has data for (``--only`` runs some sections):
    GB/s per backend and op, CPU per MiB, large loads vs the SSD, hit rate vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [draw for draw, data in ((_throughput_panel, doc["rows"]),
                                      (_cpu_panel, [r for r in doc["rows"]
                                                    if "cpu_ms_per_mib" in r]),
                                      (_large_panel, doc["large_batches"]),
                                      (_policy_panel, doc["policy"]["runs"])) if data]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(doc, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLOURS = {"HiCacheFile": "C0", "fs": "C1"}


def _throughput_panel(doc: dict[str, Any], ax: Any) -> None:
    _bars(doc, ax, doc["rows"], "gbps")
    ax.set_xlabel("GB/s (median of reps)")
    ax.set_title("throughput through the engines' storage interfaces")


def _cpu_panel(doc: dict[str, Any], ax: Any) -> None:
    _bars(doc, ax, [r for r in doc["rows"] if "cpu_ms_per_mib" in r], "cpu_ms_per_mib")
    ax.axvline(GOAL_LOAD_CPU_MS_PER_MIB, color="g", linestyle=":",
               label=f"{GOAL_LOAD_CPU_MS_PER_MIB} ms/MiB (load goal)")
    ax.legend(fontsize=7)
    ax.set_xlabel("process CPU ms per MiB (every thread, median of reps)")
    ax.set_title("CPU per byte")


def _bars(doc: dict[str, Any], ax: Any, rows: list[dict[str, Any]], field: str) -> None:
    """One horizontal bar per backend and row label of ``rows``' ``field``."""
    colour = {doc["ours"]: "C2", **_COLOURS}
    labels = sorted({(r["engine"], r["op"], r["cache"], r["geometry"], r.get("run", "")) for r in rows})
    backends = sorted({r["backend"] for r in rows})
    width = 0.8 / max(1, len(backends))
    for k, b in enumerate(backends):
        vals = []
        for lab in labels:
            hit = [r[field] for r in rows if (r["engine"], r["op"], r["cache"], r["geometry"],
                                              r.get("run", "")) == lab and r["backend"] == b]
            vals.append(hit[0] if hit else 0.0)
        ax.barh([i + k * width for i in range(len(labels))], vals, height=width, label=b,
                color=colour.get(b))
    ax.set_yticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_yticklabels([f"{e} {o} {c} {g} {n}" for e, o, c, g, n in labels], fontsize=6)
    ax.legend(fontsize=7)


def _large_panel(doc: dict[str, Any], ax: Any) -> None:
    colour = {doc["ours"]: "C2", **_COLOURS}
    large = doc["large_batches"]
    ax.barh(range(len(large)), [x["gbps"] for x in large],
            color=[colour.get(x["backend"], "C7") for x in large])
    ax.set_yticks(range(len(large)))
    ax.set_yticklabels([f"{x['engine']} {x['backend']} {x['op']} {x['cache']} {x['geometry']} "
                        f"{fmt_bytes(x['batch_bytes'])}" for x in large], fontsize=6)
    read = doc["device_limit"].get("read_gbps")
    if read:
        ax.axvline(read, color="k", linestyle="--", label=f"SSD read limit {read:.2f} GB/s")
        ax.axvline(read * GOAL_READ_SHARE, color="g", linestyle=":", label="90% of it (goal)")
        ax.legend(fontsize=7)
    ax.set_xlabel("GB/s")
    ax.set_title("cold batch loads >= 4 MiB vs the SSD")


def _policy_panel(doc: dict[str, Any], ax: Any) -> None:
    runs = doc["policy"]["runs"]
    for key in sorted({(r["backend"], r["policy"]) for r in runs}):
        pts = sorted((r["budget_share"], r["token_hit_rate"]) for r in runs
                     if (r["backend"], r["policy"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}")
    ax.set_xlabel("SSD budget / footprint of the replay")
    ax.set_ylabel("token hit rate (restorable prefix)")
    ax.set_title(f"policy: {str(doc['policy']['trace']).split('?')[0]}, same SSD budget")
    ax.legend(fontsize=7)
