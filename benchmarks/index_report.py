"""The table and the figure of ``python -m benchmarks index`` (from its JSON document)."""

from __future__ import annotations

from typing import Any

from hybridstore.bench.common import stdout_console

__all__ = ["plot_index", "print_index_report"]

_PEERS = ("sglang", "vllm")


def _tok(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _cell(row: dict[str, Any], impl: str) -> str:
    r = row.get(impl)
    if r is None:
        return "-"
    text = f"{r['ms_median']:.3f}"
    if "ratio" in r and r["ratio"] is not None:
        color = "green" if r["ratio"] >= 1 else "red"
        text += f" [{color}]({r['ratio']:.2f}x)[/{color}]"
    return text


def _agree(row: dict[str, Any]) -> str:
    a = row.get("agree")
    return "" if a is None else ("yes" if a else "[red]NO[/red]")


def _ok(good: bool | None) -> str:
    return "" if good is None else ("[green]yes[/green]" if good else "[red]no[/red]")


def print_index_report(doc: dict[str, Any], console: Any = None) -> None:
    """Rich tables: both sweeps (median ms, peer/ours ratio), hashing, memory, goals."""
    from rich.table import Table

    console = console or stdout_console()
    for key, title, cols in (
            ("prompt_length", "latency vs prompt length (median ms; (x) = peer / ours)",
             ("shape", "tokens")),
            ("cached_blocks", ("latency vs cached blocks, 4K-token prompts (median ms; "
                               "(x) = peer / ours)"), ("blocks",))):
        rows = doc[key]
        if not rows:
            continue
        t = Table(title=f"python -m benchmarks index: {title}")
        for col in cols + ("op", "hybridstore", "sglang", "vllm", "same match"):
            t.add_column(col, justify="left" if col in ("shape", "op") else "right")
        for r in rows:
            point = ((r["shape"], _tok(r["prompt_tokens"])) if key == "prompt_length"
                     else (f"{r['cached_blocks']:,}",))
            t.add_row(*point, r["op"], _cell(r, "hybridstore"), _cell(r, "sglang"),
                      _cell(r, "vllm"), _agree(r))
        console.print(t)

    h = doc["hashing"]
    ours = h["hybridstore"]
    t = Table(title=f"hashing a {_tok(ours['tokens'])}-token prompt (GB/s of uint32 token ids)")
    for col in ("hasher", "GB/s", "ms", "ours native / it"):
        t.add_column(col, justify="left" if col == "hasher" else "right")
    if ours["native_gbps"] is not None:
        t.add_row("hybridstore native", f"{ours['native_gbps']:.2f}",
                  f"{ours['native_ms_median']:.3f}", "1.0x")
    t.add_row("hybridstore numpy twin", f"{ours['python_gbps']:.3f}",
              f"{ours['python_ms_median']:.2f}",
              f"{ours['ratio']:.1f}x" if ours["ratio"] else "")
    for name, r in (h.get("vllm") or {}).items():
        if name == "unavailable":
            t.add_row("vllm", "-", "-", f"unavailable: {r}")
            continue
        vs = r.get("ours_native_vs")
        t.add_row(f"vllm hash_block_tokens({name})", f"{r['gbps']:.4f}", f"{r['ms_median']:.2f}",
                  f"{vs:.0f}x" if vs else "")
    console.print(t)
    console.print(f"native keys == twin keys: {ours['keys_identical']}")

    m = doc["memory"]
    t = Table(title="memory per cached block (bytes)")
    for col in ("implementation", "blocks", "bytes/block", "how"):
        t.add_column(col, justify="left" if col in ("implementation", "how") else "right")
    o = m["hybridstore"]
    t.add_row("hybridstore index", f"{o['pages']:,}", f"{o['bytes_per_block_index']:.1f}",
              "HybridIndex.memory_bytes()")
    t.add_row("hybridstore index", f"{o['pages']:,}", f"{o['bytes_per_block_tracemalloc']:.1f}",
              "tracemalloc")
    for peer in _PEERS:
        r = m.get(peer)
        if r is None:
            continue
        if "unavailable" in r:
            t.add_row(peer, "-", "-", f"unavailable: {r['unavailable']}")
        else:
            t.add_row(peer, f"{r['blocks']:,}", f"{r['bytes_per_block']:.1f}", r["how"])
    console.print(t)

    g = doc["goals"]
    t = Table(title="goals")
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col, justify="left" if col == "goal" else "right")
    mm = doc["match_128k"]
    t.add_row(f"match() {_tok(mm['prompt_tokens'])} tokens with hashing (ms, median)",
              f"{g['match_128k_ms']['value']:.3f}", f"<= {g['match_128k_ms']['goal']}",
              _ok(g["match_128k_ms"]["met"]))
    vs = g["vs_sglang_min_ratio"]
    where = vs.get("where") or {}
    t.add_row(f"slowest op vs SGLang radix cache ({where.get('op', '')} {where.get('shape') or ''} "
              f"{_tok(where.get('prompt_tokens'))} {where.get('cached_blocks') or ''})".strip(),
              "-" if vs["value"] is None else f"{vs['value']:.2f}x", f">= {vs['goal']:.0f}x",
              _ok(vs["met"]))
    t.add_row("bytes per cached block (max of both measures)",
              f"{g['bytes_per_block']['value']:.1f}",
              f"<= {g['bytes_per_block']['goal']}", _ok(g["bytes_per_block"]["met"]))
    console.print(t)
    for peer, info in doc["peers"].items():
        if not info["available"]:
            console.print(f"[yellow]{peer}: unavailable: {info['unavailable']}[/yellow]")
    for issue in doc["issues"]:
        console.print(f"[yellow]issue:[/yellow] {issue}")


def plot_index(doc: dict[str, Any], path: str) -> None:
    """Median latency of each op against prompt length and cached blocks, and memory per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ("put", "match", "match_branch", "evict")
    shapes = sorted({r["shape"] for r in doc["prompt_length"]})
    ncols = len(ops)
    nrows = len(shapes) + 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    styles = {"hybridstore": ("tab:blue", "o"), "sglang": ("tab:orange", "s"),
              "vllm": ("tab:green", "^")}

    def series(ax: Any, rows: list[dict[str, Any]], xkey: str, title: str, xlabel: str) -> None:
        for impl, (color, marker) in styles.items():
            pts = [(r[xkey], r[impl]["ms_median"]) for r in rows if impl in r]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker=marker, color=color, label=impl)
        ax.set_xscale("log", base=2 if xkey == "prompt_tokens" else 10)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("median ms", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)

    for i, shape in enumerate(shapes):
        for j, op in enumerate(ops):
            rows = [r for r in doc["prompt_length"] if r["shape"] == shape and r["op"] == op]
            series(axes[i][j], rows, "prompt_tokens", f"{op} ({shape} prompts)", "prompt tokens")
    for j, op in enumerate(ops):
        rows = [r for r in doc["cached_blocks"] if r["op"] == op]
        series(axes[len(shapes)][j], rows, "cached_blocks", f"{op} (4K-token prompts)",
               "cached blocks")
    last = axes[-1]
    mem = doc["memory"]
    bars = [("ours (index)", mem["hybridstore"]["bytes_per_block_index"], "tab:blue"),
            ("ours (tracemalloc)", mem["hybridstore"]["bytes_per_block_tracemalloc"], "tab:blue")]
    for peer in _PEERS:
        if peer in mem and "bytes_per_block" in mem[peer]:
            bars.append((peer, mem[peer]["bytes_per_block"], styles[peer][0]))
    last[0].bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    last[0].axhline(doc["goals"]["bytes_per_block"]["goal"], color="red", ls="--", lw=1,
                    label="goal")
    last[0].set_title("bytes per cached block", fontsize=9)
    last[0].tick_params(axis="x", labelsize=7, rotation=20)
    last[0].legend(fontsize=7)
    h = doc["hashing"]
    hn, hv = [], []
    if h["hybridstore"]["native_gbps"]:
        hn.append("ours native")
        hv.append(h["hybridstore"]["native_gbps"])
    hn.append("ours twin")
    hv.append(h["hybridstore"]["python_gbps"])
    for name, r in (h.get("vllm") or {}).items():
        if isinstance(r, dict) and "gbps" in r:
            hn.append(f"vllm {name}")
            hv.append(r["gbps"])
    last[1].bar(hn, hv, color="tab:purple")
    last[1].set_yscale("log")
    last[1].set_title("hashing GB/s (uint32 ids, 128K tokens)", fontsize=9)
    last[1].tick_params(axis="x", labelsize=7, rotation=20)
    for ax in last[2:]:
        ax.axis("off")
    fig.suptitle("python -m benchmarks index (median latency; lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
