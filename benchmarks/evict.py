"""Put throughput into a full host tier, per eviction policy (what a ranking costs).

``python -m benchmarks.evict [--capacities 4096,16384,65536] [--policies lru,histate,hybridstore]
[--reps 3] [--json OUT] [--plot OUT.png]`` fills a host-only store of ``capacity`` 4 KiB pages
and keeps putting: sessions of 8 pages (16-token blocks) and a checkpoint at their end, every
third one resuming an earlier session first (a ``match`` that predicted returns learn from).
Every put past the first ``capacity`` pages makes room, so the rate is the policy's ranking
and the evictor's work per page.  Each repetition runs every policy in a rotated order; the
table and JSON give the median pages per second and the ratio to ``histate`` (the order
``hybridstore`` extends).  ``hybridstore`` ranks afresh at every eviction pass
(``EvictionPolicy.ranks_used_later`` False), the others reuse a ranking in large tiers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridstore import HybridStore, StoreConfig

PAGE_BYTES = 4096
BLOCK = 16
SESSION_PAGES = 8


def pages_per_second(policy: str, capacity: int, *, rounds: float = 3.0) -> float:
    """Pages put per second while ``capacity`` pages are kept (``rounds`` x that many put)."""
    cfg = StoreConfig(block_size=BLOCK, host_bytes=capacity * PAGE_BYTES, disk_path=None,
                      policy=policy, pin_host_memory=False)
    rng = np.random.default_rng(0)
    page = np.frombuffer(rng.bytes(PAGE_BYTES), np.uint8)
    data = [page] * SESSION_PAGES
    state = {"s": page}
    total = int(rounds * capacity)

    def tokens(s: int) -> np.ndarray:
        return np.arange(s * 1024, s * 1024 + SESSION_PAGES * BLOCK, dtype=np.int64)

    with HybridStore(cfg) as store:
        for s in range(capacity // SESSION_PAGES):       # fill the tier, untimed
            store.put_kv(tokens(s), data)
            store.put_state(tokens(s), state, position=SESSION_PAGES * BLOCK)
        s = capacity // SESSION_PAGES
        put = 0
        t0 = time.perf_counter()
        while put < total:
            if s % 3 == 0:
                store.release(store.match(tokens(s - capacity // (4 * SESSION_PAGES))))
            store.put_kv(tokens(s), data)
            store.put_state(tokens(s), state, position=SESSION_PAGES * BLOCK)
            put += SESSION_PAGES
            s += 1
        return put / (time.perf_counter() - t0)


def run(capacities: list[int], policies: list[str], reps: int) -> list[dict]:
    samples: dict[tuple[int, str], list[float]] = {(c, p): [] for c in capacities for p in policies}
    with tqdm(total=reps * len(capacities) * len(policies), desc="evict", unit="run") as bar:
        for r in range(reps):
            for c in capacities:
                order = policies[r % len(policies):] + policies[:r % len(policies)]
                for p in order:
                    samples[(c, p)].append(pages_per_second(p, c))
                    bar.update()
    rows = []
    for c in capacities:
        base = statistics.median(samples[(c, "histate")]) if "histate" in policies else None
        for p in policies:
            med = statistics.median(samples[(c, p)])
            rows.append({"capacity_pages": c, "policy": p, "pages_per_s": med,
                         "samples": samples[(c, p)],
                         "ratio_to_histate": med / base if base else None})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r["capacity_pages"], r["pages_per_s"]) for r in rows if r["policy"] == p]
        ax.plot(*zip(*pts), marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("host tier capacity (4 KiB pages)")
    ax.set_ylabel("pages put per second (median)")
    ax.set_title("put throughput into a full tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.evict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacities", default="4096,16384,65536")
    ap.add_argument("--policies", default="lru,histate,hybridstore")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    rows = run([int(c) for c in args.capacities.split(",")],
               [p.strip() for p in args.policies.split(",") if p.strip()], args.reps)
    text = json.dumps({"page_bytes": PAGE_BYTES, "session_pages": SESSION_PAGES, "rows": rows}, indent=1)
    if args.json:
        args.json.write_text(text)
    if args.plot:
        plot(rows, args.plot)
    print(text)
    print("| capacity (pages) | policy | pages/s (median) | / histate |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio_to_histate']:.2f}x" if r["ratio_to_histate"] else "-"
        print(f"| {r['capacity_pages']} | {r['policy']} | {r['pages_per_s']:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
