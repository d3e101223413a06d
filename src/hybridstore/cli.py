"""The ``hybridstore`` command line: ``demo`` (the main job for now) and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from hybridstore.demo import run_demo

    rows = run_demo(disk_path=args.disk_path)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"requests": rows}, fh, indent=2)
    return 0 if all(r["bit_exact"] for r in rows) else 1


def _bench_core(args: argparse.Namespace) -> int:
    from hybridstore.bench.core import run_core_bench

    run_core_bench(json_path=args.json, disk_dir=args.dir, quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk one agent conversation through DRAM, SSD and a restart")
    demo.add_argument("--disk-path", default=None, help="SSD tier directory (default: a temp dir)")
    demo.add_argument("--json", default=None, help="also write the per-request rows as JSON")
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="benchmarks (print JSON and a table)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    core = bsub.add_parser("core", help="tier put/load throughput, match latency, hashing, index memory")
    core.add_argument("--json", default=None, help="write the results here as JSON")
    core.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    core.add_argument("--quick", action="store_true", help="fewer repetitions")
    core.set_defaults(func=_bench_core)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
