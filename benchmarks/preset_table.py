"""The default preset against every other preset and the exact bound (issue 27).

``python -m benchmarks.preset_table DIR`` reads, for each trace ``T`` and pools ``P``
(``unified`` / ``split``), the sweeps ``DIR/T-P-*.json`` (``hybridstore replay T
--discipline sequential --sweep 5%,10%,20% --pools P --json ...``; several files per
trace are merged, rows of a preset from the later file winning; the earlier runs kept for
comparison, :data:`EARLIER`, are skipped) and the bound
``DIR/bound-T-P.json`` (the same with ``--headroom``), and writes ``DIR/summary.json``
(every cell: the default, the best other preset, the bound, the shares of the bound),
prints the Markdown table of docs/replay.md and draws ``DIR/summary.png`` (share of the
bound per trace and budget, default against the best other preset).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DEFAULT = "hybridstore"
EARLIER = ("-before", "-inherited", "-arrival", "-noodds")
"""Suffixes of the sweeps kept from earlier versions of the default (not in the table;
``-arrival``: return gaps counted from arrivals, before ``HybridStore.finished``;
``-noodds``: before the return odds, ``policy/revisits.py``)."""
REFERENCE = "unlimited"
POOLS = ("unified", "split")


def _cells(directory: Path) -> list[dict[str, Any]]:
    bounds = sorted(directory.glob("bound-*-*.json"))
    out = []
    for bpath in bounds:
        trace, pools = bpath.stem[len("bound-"):].rsplit("-", 1)
        brows = json.loads(bpath.read_text())["rows"]
        bound = {round(r["budget"], 4): r["bound"] for r in brows}
        in_pool = {round(r["budget"], 4): r.get("bound_engine_pool", r["bound"]) for r in brows}
        rows: dict[tuple[float, str], float] = {}
        for path in sorted(directory.glob(f"{trace}-{pools}-*.json")):
            if path.stem.endswith(EARLIER):    # an earlier run kept for comparison
                continue
            for r in json.loads(path.read_text())["rows"]:
                rows[(round(r["budget"], 4), r["policy"])] = r["token_hit_rate"]
        for budget in sorted(bound):
            presets = {p: h for (b, p), h in rows.items() if b == budget and p != REFERENCE}
            if DEFAULT not in presets:
                continue
            others = {p: h for p, h in presets.items() if p != DEFAULT}
            best = max(others, key=others.__getitem__) if others else None
            b, bp = bound[budget], in_pool[budget]
            out.append({"trace": trace, "pools": pools, "budget": budget, "bound": b,
                        "bound_engine_pool": bp,
                        "default_share_engine_pool": presets[DEFAULT] / bp if bp else None,
                        "default": presets[DEFAULT], "best_other": best,
                        "best_other_hit": others.get(best) if best else None,
                        "default_share": presets[DEFAULT] / b if b else None,
                        "best_other_share": others[best] / b if best and b else None,
                        "presets": presets})
    return out


def table(cells: list[dict[str, Any]]) -> str:
    """The Markdown table: one row per trace and pools, a cell per budget."""
    budgets = sorted({c["budget"] for c in cells})
    head = "| trace | pools | " + " | ".join(f"{b:.0%}" for b in budgets) + " |"
    lines = [head, "|---|---|" + "---|" * len(budgets)]
    keys = sorted({(c["trace"], c["pools"]) for c in cells},
                  key=lambda k: (k[0], POOLS.index(k[1]) if k[1] in POOLS else 9))
    for trace, pools in keys:
        row = []
        for b in budgets:
            c = next((c for c in cells if (c["trace"], c["pools"], c["budget"]) == (trace, pools, b)), None)
            if c is None:
                row.append("—")
                continue
            mark = "**" if c["best_other_hit"] is None or c["default"] >= c["best_other_hit"] else ""
            share = f"{c['default_share']:.1%}" if c["default_share"] is not None else "—"
            if c["bound_engine_pool"] != c["bound"] and c["default_share_engine_pool"] is not None:
                share += f"; {c['default_share_engine_pool']:.1%} in-pool"
            other = (f"{c['best_other_hit']:.3f} `{c['best_other']}`" if c["best_other"] else "—")
            row.append(f"{mark}{c['default']:.3f}{mark} ({share}) / {other} / {c['bound']:.3f}")
        lines.append(f"| {trace} | {pools} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """Share of the bound per trace, budget and pools: the default against the best other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, pools in zip(axes, POOLS, strict=True):
        sub = [c for c in cells if c["pools"] == pools and c["bound"]]
        labels = [f"{c['trace']}\n{c['budget']:.0%}" for c in sub]
        x = range(len(sub))
        ax.bar([i - 0.2 for i in x], [c["default_share"] for c in sub], 0.4, label=DEFAULT)
        ax.bar([i + 0.2 for i in x], [c["best_other_share"] or 0 for c in sub], 0.4,
               label="best other preset")
        ax.axhline(0.98 if pools == "unified" else 0.95, color="k", lw=0.8, ls="--",
                   label="goal at 10 %")
        ax.set_xticks(list(x), labels, fontsize=6, rotation=90)
        ax.set_title(f"{pools}: token hit rate / exact bound")
        ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else Path("docs/bench/preset27")
    cells = _cells(directory)
    (directory / "summary.json").write_text(json.dumps({"cells": cells}, indent=1))
    print(table(cells))
    plot(cells, directory / "summary.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
