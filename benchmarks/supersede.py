"""``hybridstore`` with and without superseded checkpoints (``HybridStoreEviction.supersede``).

``python -m benchmarks.supersede TRACE [--values 0,0.25] [--budgets 5%,10%,20%] [--pools unified]
[--json OUT]`` replays ``TRACE`` (a path, ``synthetic:...``, or ``sample`` for the bundled one)
in the sequential discipline with the ``hybridstore`` preset, its eviction's ``supersede`` set
to each value, and prints the token hit rates as JSON and a table (docs/replay.md, issue 27:
why the rule is off by default).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from benchmarks import load_trace
from hybridstore.replay import systems
from hybridstore.replay.sim import ReplayConfig, replay_policy
from hybridstore.replay.sweep import parse_budgets


def run(trace: str, values: list[float], budgets: list[float], pools: str) -> list[dict]:
    requests = load_trace(trace)
    base = systems.PRESETS["hybridstore"]
    rows = []
    try:
        with tqdm(total=len(values) * len(budgets), desc="supersede", unit="run") as bar:
            for value in values:
                systems.PRESETS["hybridstore"] = base.with_eviction(supersede=value)
                for budget in budgets:
                    cfg = ReplayConfig(discipline="sequential", budget=budget, pools=pools)
                    hit = replay_policy(requests, "hybridstore", cfg, progress=False).summary()["token_hit_rate"]
                    rows.append({"supersede": value, "budget": budget, "pools": pools,
                                 "token_hit_rate": hit})
                    bar.update()
    finally:
        systems.PRESETS["hybridstore"] = base
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.supersede", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--values", default="0,0.25")
    ap.add_argument("--budgets", default="5%,10%,20%")
    ap.add_argument("--pools", choices=("unified", "split"), default="unified")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    values = [float(v) for v in args.values.split(",")]
    budgets = parse_budgets(args.budgets)
    rows = run(args.trace, values, budgets, args.pools)
    doc = {"trace": args.trace, "pools": args.pools, "rows": rows}
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    print("| supersede | " + " | ".join(f"{b:.0%}" for b in budgets) + " |")
    print("|---" * (len(budgets) + 1) + "|")
    for value in values:
        hits = [r["token_hit_rate"] for r in rows if r["supersede"] == value]
        print(f"| {value:g} | " + " | ".join(f"{h:.4f}" for h in hits) + " |")


if __name__ == "__main__":
    main()
