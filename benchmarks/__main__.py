"""``python -m benchmarks ssd|index|calibrate ...`` (from the root of a clone; see README.md here)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _ssd(args: argparse.Namespace) -> int:
    from benchmarks.ssd import parse_sizes, run_ssd_bench

    run_ssd_bench(json_path=args.json, disk_dir=args.dir, plot_path=args.plot, quick=args.quick,
                  sizes=parse_sizes(args.sizes) if args.sizes else None, reps=args.reps,
                  use_fio=not args.no_fio)
    return 0


def _index(args: argparse.Namespace) -> int:
    from benchmarks.index import run_index_bench

    run_index_bench(json_path=args.json, plot_path=args.plot, quick=args.quick)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from benchmarks.calibrate import (
        DEFAULT_PRESETS,
        DEFAULT_VLLM_CPU_PRESETS,
        DEFAULT_VLLM_DISK_PRESETS,
        DEFAULT_VLLM_PRESETS,
        run_calibration,
    )
    from hybridstore.replay.sweep import parse_budgets

    if args.offload_cpu is not None and args.engine != "vllm":
        raise SystemExit("--offload-cpu drives vLLM's offloading connector: add --engine vllm")
    if args.offload_disk and args.offload_cpu is None:
        raise SystemExit("--offload-disk sits behind vLLM's CPU tier: add --offload-cpu RATIO")
    policy = args.policy or ",".join(
        DEFAULT_PRESETS if args.engine != "vllm" else
        DEFAULT_VLLM_DISK_PRESETS if args.offload_disk else
        DEFAULT_VLLM_CPU_PRESETS if args.offload_cpu is not None else DEFAULT_VLLM_PRESETS)
    run_calibration(trace_spec=args.trace, budgets=parse_budgets(args.budgets),
                    presets=[p.strip() for p in policy.split(",") if p.strip()],
                    max_requests=args.max_requests, json_path=args.json, plot_path=args.plot,
                    pools=args.pools, engine=args.engine, sglang_mode=args.sglang_mode,
                    host_ratio=args.offload_cpu, disk=args.offload_disk)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    ssd = sub.add_parser("ssd", help="disk tier vs the device limit (fio), DALI, torch.load, "
                                     "safetensors, numpy; host pool copies")
    ssd.add_argument("--dir", default=None,
                     help="directory on the file system to measure (default: a temp dir)")
    ssd.add_argument("--json", default=None, help="write the results here as JSON")
    ssd.add_argument("--plot", default=None, help="write GB/s against object size here (PNG)")
    ssd.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (< 1 min)")
    ssd.add_argument("--sizes", default=None,
                     help="object sizes, e.g. 4K,4M,kv,ckpt,256M (kv: a 576-token Qwen3.5-9B KV "
                          "block, ckpt: its 50 MB checkpoint)")
    ssd.add_argument("--reps", type=int, default=None, help="read repetitions")
    ssd.add_argument("--no-fio", action="store_true",
                     help="measure the device with the built-in O_DIRECT thread pool, not fio")
    ssd.set_defaults(func=_ssd)
    index = sub.add_parser("index", help="put/match/evict latency vs prompt length and cached "
                                         "blocks, hashing, memory per block; vs SGLang and vLLM")
    index.add_argument("--json", default=None, help="write the results here as JSON")
    index.add_argument("--plot", default=None, help="write latency/memory figures here (PNG)")
    index.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (~1 min)")
    index.set_defaults(func=_index)
    cal = sub.add_parser("calibrate", help="the replay's presets against SGLang's own "
                                           "UnifiedRadixCache (or vLLM's KV cache manager), "
                                           "same requests and budgets")
    cal.add_argument("--engine", default="sglang", choices=("sglang", "vllm"),
                     help="whose own cache: SGLang 0.5.23's UnifiedRadixCache (default) or "
                          "vLLM 0.33's KVCacheManager (hybrid, align mode) via its Scheduler")
    cal.add_argument("--trace", default=None, help="trace spec (default: the bundled WEKA sample)")
    cal.add_argument("--budgets", default="10%,20%,50%",
                     help="fractions of the KV footprint (default 10%%,20%%,50%%)")
    cal.add_argument("--policy", default=None,
                     help="presets to compare (default: sglang-hicache,vllm-marconi,histate; "
                          "with --engine vllm: vllm-marconi)")
    cal.add_argument("--max-requests", type=int, default=None)
    cal.add_argument("--pools", default="preset", choices=("preset", "unified", "split"),
                     help="how KV and states share the budget (as in hybridstore replay)")
    cal.add_argument("--sglang-mode", default="no_buffer", choices=("no_buffer", "extra_buffer"),
                     help="SGLang's --mamba-radix-cache-strategy: no_buffer (page 1, a state at "
                          "each prompt's end) or extra_buffer (page 64, tracked states; what "
                          "auto resolves to with overlap scheduling); compare with sglang-extra")
    cal.add_argument("--offload-cpu", type=float, default=None, metavar="RATIO",
                     help="with --engine vllm: run vLLM's CPU offloading too (OffloadingConnector, "
                          "CPUOffloadingSpec, its LRU; --kv-offloading-size) with a CPU tier of "
                          "RATIO x the GPU pool, and give the presets a host tier of as much "
                          "(default presets then: vllm-cpu,vllm-marconi)")
    cal.add_argument("--offload-disk", action="store_true",
                     help="with --offload-cpu: vLLM's TieringOffloadingSpec, its CPU tier as "
                          "primary and its fs tier (no capacity, never evicts) in a temporary "
                          "directory; the presets get a disk tier without a limit (default "
                          "presets then: vllm-disk,vllm-cpu)")
    cal.add_argument("--json", default=None, help="write the document here")
    cal.add_argument("--plot", default=None, help="write hit rate against budget here (PNG)")
    cal.set_defaults(func=_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
