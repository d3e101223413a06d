"""The ``hybridstore`` command line: ``demo``, ``replay``, ``bench core`` and ``bench engines``.

The research benchmarks (``ssd``, ``index``) live outside the package, in the
repository's ``benchmarks/``: ``python -m benchmarks ssd|index ...`` from a clone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hybridstore.errors import HybridStoreError, MissingExtraError

if TYPE_CHECKING:
    from hybridstore.replay.sim import ReplayConfig
    from hybridstore.replay.trace import Trace


def _number(kind: type, *, low: float, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` above ``low`` (``strict``) or at least ``low``."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n int' if kind is int else ' number'}"
                                             ) from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low:g}")
        return value
    return parse


_POSITIVE = _number(float, low=0, strict=True)
_NON_NEGATIVE = _number(float, low=0, strict=False)


def _ratio_or_inf(text: str) -> float:
    """An argparse type: a number >= 0, or ``inf`` (no limit)."""
    return math.inf if text.strip().lower() in ("inf", "unlimited") else _NON_NEGATIVE(text)
_COUNT = _number(int, low=1, strict=False)
_NON_NEGATIVE_INT = _number(int, low=0, strict=False)


def _counts(text: str) -> list[int]:
    """An argparse type: comma-separated ints >= 0, e.g. ``0,1,22``."""
    return [int(_NON_NEGATIVE_INT(part)) for part in text.split(",")]


def _check_outputs(parser: argparse.ArgumentParser, *paths: str | None) -> None:
    """Fail at once (exit 2) when an output file cannot be written, not after the work."""
    for path in paths:
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"cannot write {path!r}: {'it is a directory' if os.path.isdir(path) else 'its directory does not exist or is not writable'}")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            parser.error(f"cannot write {path!r}: permission denied")


def _demo(args: argparse.Namespace) -> int:
    from hybridstore.demo import run_demo

    rows = run_demo(disk_path=args.disk_path, scale=args.scale)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"turns": rows}, fh, indent=2)
    if args.plot:
        from hybridstore.demo import plot

        plot(rows, args.plot)
    return 0 if all(r["exact"] for r in rows) else 1


def _outputs(args: argparse.Namespace, doc: dict, plot: Callable[[str], None]) -> int:
    """Write a command's document to ``--json`` and its figure to ``--plot`` when asked."""
    from hybridstore.replay.report import write_json

    if args.json:
        write_json(doc, args.json)
    if args.plot:
        plot(args.plot)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from hybridstore.replay.bytes_plane import DATA_POLICIES, DATA_SCALE, data_planes
    from hybridstore.replay.loaders import load
    from hybridstore.replay.model_presets import model_preset
    from hybridstore.replay.report import plot, print_table, summarize, write_json
    from hybridstore.replay.samples import weka_sample
    from hybridstore.replay.sim import ReplayConfig, replay
    from hybridstore.replay.sweep import parse_budgets, plot_sweep, print_sweep, sweep
    from hybridstore.replay.systems import preset
    from hybridstore.replay.trace import merge

    # everything that can be checked is checked before the traces load
    policy = args.policy or (DATA_POLICIES if args.data else DEFAULT_POLICIES)
    names = [n.strip() for n in policy.split(",") if n.strip()]
    for name in names:
        preset(name)
    model_preset(args.model)
    scale = args.scale if args.scale is not None else (DATA_SCALE if args.data else 1.0)
    budgets = parse_budgets(args.sweep) if args.sweep else None
    budget = parse_budgets(args.budget)[0] if args.budget else None
    cfg = ReplayConfig(model=args.model, live_sessions=args.live_sessions, gpu_gib=args.gpu_gib,
                       host_gib=args.host_gib, disk_gib=args.disk_gib, seed=args.seed,
                       token_level=not args.block_level, max_requests=args.max_requests,
                       scale=scale, data=args.data, data_dir=args.data_dir,
                       discipline=args.discipline or ("sequential" if args.headroom else "server"),
                       budget=budget, mamba_ratio=args.mamba_ratio,
                       pools=args.pools, host_ratio=args.host_ratio,
                       disk_ratio=args.disk_ratio, state_scale=args.state_scale,
                       resume_hints=args.resume_hints)
    specs = args.trace or [str(weka_sample())]
    traces = [load(spec) for spec in specs]
    if args.divergence:
        from hybridstore.replay.divergence import (
            divergence,
            plot_divergence,
            print_divergence,
        )

        docs = [divergence(t) for t in traces]
        print_divergence(docs)
        return _outputs(args, {"traces": docs}, lambda path: plot_divergence(docs, path))
    trace = traces[0] if len(traces) == 1 else merge(traces)
    if args.headroom and cfg.discipline == "server":
        from hybridstore.errors import ConfigError
        from hybridstore.replay.server_bound import (
            plot_server_headroom,
            print_server_headroom,
            server_headroom,
        )

        if budgets is not None:
            raise ConfigError("--headroom --discipline server takes --gpu-gib/--host-gib/"
                              "--disk-gib, not --sweep")
        doc = server_headroom(trace, cfg)
        print_server_headroom(doc)
        return _outputs(args, doc, lambda path: plot_server_headroom(doc, path))
    if args.headroom:
        from hybridstore.replay.headroom import headroom, plot_headroom, print_headroom

        doc = headroom(trace, budgets or [0.05, 0.1, 0.2, 0.4], cfg, states=args.hold_states,
                       progress=not args.no_progress)
        print_headroom(doc)
        return _outputs(args, doc, lambda path: plot_headroom(doc, path))
    if args.nodes:
        return _fleet(args, trace, names, cfg)
    # the objects: real bytes (unlimited presets: sizes, as the reference) or sizes only
    plane_for = data_planes(cfg.data_dir) if cfg.data else None
    if budgets is not None:
        doc = sweep(trace, names, cfg, budgets, plane_for=plane_for,
                    progress=not args.no_progress)
        print_sweep(doc)
        return _outputs(args, doc, lambda path: plot_sweep(doc, path))
    runs = replay(trace, names, cfg, plane_for=plane_for, progress=not args.no_progress)
    doc = summarize(trace, runs, cfg)
    print_table(doc)
    if args.json:
        write_json(doc, args.json)
    if args.plot:
        plot(runs, args.plot, title=f"{trace.name} ({cfg.model})")
    return 0


def _fleet(args: argparse.Namespace, trace: Trace, names: list[str], cfg: ReplayConfig) -> int:
    """``replay --nodes``: the fleet model (``replay/fleet.py``), one document and plot."""
    from hybridstore.errors import ConfigError
    from hybridstore.replay.fleet import (
        MODES,
        ROUTINGS,
        RemoteModel,
        fleet,
        parse_nodes,
        plot_fleet,
        print_fleet,
        replicate,
    )
    from hybridstore.replay.report import write_json

    if args.sweep or args.data:
        raise ConfigError("--nodes runs the fleet model in accounting mode; it takes neither "
                          "--sweep nor --data")
    routings = [r.strip() for r in args.routing.split(",") if r.strip()] if args.routing \
        else list(ROUTINGS)
    modes = [m for m, on in (("isolated", args.isolated), ("shared", args.shared)) if on] \
        or list(MODES)
    remote = RemoteModel(gib=args.remote_gib, gbps=args.remote_gbps,
                         latency_ms=args.remote_latency_ms)
    doc = fleet(replicate(trace, args.replicate), names, cfg, parse_nodes(args.nodes),
                routings=routings, modes=modes, remote=remote, progress=not args.no_progress)
    print_fleet(doc)
    if args.json:
        write_json(doc, args.json)
    if args.plot:
        plot_fleet(doc, args.plot)
    return 0


def _bench_core(args: argparse.Namespace) -> int:
    from hybridstore.bench.core import run_core_bench

    run_core_bench(json_path=args.json, disk_dir=args.dir, quick=args.quick)
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from hybridstore.bench.remote import run_remote_bench

    run_remote_bench(json_path=args.json, disk_dir=args.dir, quick=args.quick, master=args.master)
    return 0


def _bench_shared(args: argparse.Namespace) -> int:
    from hybridstore.bench.shared import run_shared_bench
    from hybridstore.units import parse_bytes

    procs = [int(p) for p in args.procs.split(",") if p.strip()]
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    for r in routings:
        if r not in ("round-robin", "affinity"):
            raise SystemExit(f"--routing takes round-robin and/or affinity, got {r!r}")
    budget = args.budget.strip()
    fraction = float(budget[:-1]) / 100 if budget.endswith("%") else float(budget)
    run_shared_bench(json_path=args.json, plot_path=args.plot, procs=procs, routings=routings,
                     budget_fraction=fraction, trace_spec=args.trace,
                     max_requests=args.max_requests, page_bytes=parse_bytes(args.page_bytes),
                     disk_dir=args.dir)
    return 0


def _bench_engines(args: argparse.Namespace) -> int:
    from hybridstore.bench.engines import run_engines_bench

    tp = tuple(int(x) for x in args.tp.split(",")) if args.tp else None
    only = tuple(x.strip() for x in args.only.split(",") if x.strip()) if args.only else None
    run_engines_bench(json_path=args.json, plot_path=args.plot, disk_dir=args.dir, quick=args.quick,
                      use_fio=not args.no_fio, tp=tp, policy_trace=args.trace,
                      policy_requests=args.requests, print_json=not args.no_json_stdout,
                      only=only)
    return 0


MOVED_BENCHES = ("ssd", "index")
"""Benchmarks that moved to the repository's top-level ``benchmarks/`` (not installed)."""


def _bench_moved(args: argparse.Namespace) -> int:
    """One line pointing to the new place; exit status 2 (a usage error), nothing run."""
    print(f"hybridstore: `hybridstore bench {args.bench}` moved out of the package; from the root "
          f"of a clone run `python -m benchmarks {args.bench} ...` (same flags; "
          "benchmarks/README.md says what it needs)", file=sys.stderr)
    return 2


DEFAULT_POLICIES = "unlimited,vllm-disk,sglang-hicache,flashstates,histate,hybridstore"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one agent session with context mutations on a small real "
                                       "Qwen3-Next: per turn tokens reused vs recomputed, time saved")
    demo.add_argument("--disk-path", default=None, help="SSD tier directory (default: a temp dir)")
    demo.add_argument("--scale", type=_POSITIVE, default=1.0, help="multiply every message length")
    demo.add_argument("--json", default=None, help="also write the per-turn rows as JSON")
    demo.add_argument("--plot", default=None, help="also draw the per-turn figures as a PNG")
    demo.set_defaults(func=_demo)
    rep = sub.add_parser("replay", help="replay agent traces under several policies, side by side")
    rep.add_argument("trace", nargs="*",
                     help="trace files/directories (WEKA, Mooncake, TraceLab, canonical jsonl) or "
                          "synthetic:agent?... / synthetic:rewind?... specs (default: the bundled "
                          "WEKA sample)")
    rep.add_argument("--policy", default=None,
                     help=f"comma-separated presets (default: {DEFAULT_POLICIES}; with --data: "
                          "unlimited,vllm-disk,histate)")
    rep.add_argument("--model", default="qwen3.5-9b", help="model preset (replay/model_presets.py)")
    rep.add_argument("--state-scale", type=_POSITIVE, default=1.0,
                     help="checkpoints this many times the model's own (a what-if: 0.5 = states "
                          "half the size; docs/replay.md)")
    rep.add_argument("--resume-hints", type=_NON_NEGATIVE, default=None, metavar="SIGMA",
                     help="a what-if: an orchestrator announces each session's next request to "
                          "the store (HybridStore.expect(..., in_s=)), its time off by a factor "
                          "exp(N(0, SIGMA)) (0: exact), and a session's end (docs/replay.md)")
    rep.add_argument("--live-sessions", type=_COUNT, default=24)
    rep.add_argument("--gpu-gib", type=_NON_NEGATIVE, default=45.0)
    rep.add_argument("--host-gib", type=_NON_NEGATIVE, default=96.0)
    rep.add_argument("--disk-gib", type=_NON_NEGATIVE, default=150.0)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--max-requests", type=_COUNT, default=None)
    rep.add_argument("--block-level", action="store_true",
                     help="match at block boundaries only (no synthesized token ids)")
    rep.add_argument("--json", default=None, help="write the summary JSON here")
    rep.add_argument("--plot", default=None, help="write the TTFT / hit-rate plot (PNG) here")
    rep.add_argument("--data", action="store_true",
                     help="move real bytes through the pinned pool and the disk tier and time every "
                          "restore next to the modeled one (docs/replay.md, data mode)")
    rep.add_argument("--data-dir", default=None,
                     help="with --data: where the disk tier's files go (default: a temp dir)")
    rep.add_argument("--scale", type=_POSITIVE, default=None,
                     help="divide KV, checkpoint and budget bytes by this (hit rates are kept; "
                          "default 1, with --data 128)")
    rep.add_argument("--discipline", choices=("server", "sequential"), default=None,
                     help="server: HiState's FIFO prefill server with live sessions (TTFT includes "
                          "queueing; the default of a replay); sequential: every request by trace "
                          "time, one at a time (Marconi's and the engines' discipline; the default "
                          "of --headroom)")
    rep.add_argument("--budget", default=None,
                     help="cache budget as a fraction of the trace's KV footprint, e.g. 10%% "
                          "(the cache gets budget x footprint x (1 + --mamba-ratio) bytes), "
                          "instead of --gpu-gib/--host-gib/--disk-gib")
    rep.add_argument("--mamba-ratio", type=_NON_NEGATIVE, default=0.9,
                     help="state memory per KV memory under --budget (SGLang's "
                          "--mamba-full-memory-ratio; default 0.9)")
    rep.add_argument("--pools", choices=("preset", "unified", "split"), default="preset",
                     help="under --budget, how KV and states share it: as each preset does "
                          "(sglang-hicache splits), one pool for all, or SGLang's split KV and "
                          "Mamba pools for every preset")
    rep.add_argument("--host-ratio", type=_NON_NEGATIVE, default=None,
                     help="under --budget, a host tier of this many times the budget behind "
                          "it for presets that have one (vllm-cpu, vllm-disk: vLLM's "
                          "--kv-offloading-size as a multiple of its GPU pool); default: the "
                          "budget goes to the first tier only (sequential)")
    rep.add_argument("--disk-ratio", type=_ratio_or_inf, default=None,
                     help="with --host-ratio, a disk tier of this many times the budget behind "
                          "the host tier (vllm-disk), or inf: no limit, as vLLM's fs tier")
    rep.add_argument("--sweep", default=None,
                     help="a capacity curve instead of one replay: comma-separated budgets, e.g. "
                          "5%%,10%%,20%%,40%%,80%% (--json/--plot get the sweep's document/figure)")
    rep.add_argument("--divergence", action="store_true",
                     help="instead of a replay: where each request leaves its predecessor's "
                          "prefix, a histogram per trace (--json/--plot get it)")
    rep.add_argument("--headroom", action="store_true",
                     help="instead of a replay: what any cache could keep at each --sweep budget "
                          "(default 5%%,10%%,20%%,40%%): the exact free-state bound (Belady per "
                          "page), the same holding k states, and session-level LRU and Belady "
                          "(heuristics) (--pools, --json/--plot get it; docs/replay.md); with "
                          "--discipline server: the bound's TTFT tail at the --gpu-gib/--host-gib/"
                          "--disk-gib budgets against unlimited's")
    rep.add_argument("--hold-states", type=_counts, default=None, metavar="K,...",
                     help="with --headroom, the k of the bound holding k states in the budget "
                          "(default: 1 and the median number of open sessions)")
    fl = rep.add_argument_group("fleet model (docs/replay.md, The fleet model)")
    fl.add_argument("--nodes", default=None,
                    help="instead of one replay: N engine nodes per point, e.g. 1,4,16,64, "
                         "each with the tier budgets above (--json/--plot get the fleet's)")
    fl.add_argument("--routing", default=None,
                    help="round-robin (request by request), affinity (session by session) or "
                         "both, comma-separated (default: both)")
    fl.add_argument("--shared", action="store_true",
                    help="only nodes sharing one remote pool (default: shared and isolated)")
    fl.add_argument("--isolated", action="store_true",
                    help="only nodes without a remote tier (default: shared and isolated)")
    fl.add_argument("--remote-gib", type=_POSITIVE, default=1024.0,
                    help="the shared pool's capacity, all nodes together (GiB)")
    fl.add_argument("--remote-gbps", type=_POSITIVE, default=12.5,
                    help="pool-to-host bandwidth of a restore (GB/s; 12.5 = 100 Gb/s)")
    fl.add_argument("--remote-latency-ms", type=_NON_NEGATIVE, default=1.0,
                    help="one round trip per restore that reads from the pool (ms)")
    fl.add_argument("--replicate", type=_COUNT, default=1,
                    help="copies of the trace's sessions, each with its own content "
                         "(replay/fleet.py: replicate)")
    rep.add_argument("--no-progress", action="store_true")
    rep.set_defaults(func=_replay)
    bench = sub.add_parser("bench", help="benchmarks (print JSON and a table)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    core = bsub.add_parser("core", help="tier put/load throughput, match latency, hashing, index memory")
    core.add_argument("--json", default=None, help="write the results here as JSON")
    core.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    core.add_argument("--quick", action="store_true", help="fewer repetitions")
    core.set_defaults(func=_bench_core)
    rem = bsub.add_parser("remote", help="the remote tier (Mooncake Store on loopback) next to "
                                         "the disk tier: put/get throughput and latency")
    rem.add_argument("--json", default=None, help="write the results here as JSON")
    rem.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    rem.add_argument("--quick", action="store_true", help="fewer repetitions (~20 s)")
    rem.add_argument("--master", default=None, help="a running master, mooncake://HOST:PORT "
                                                    "(default: one started on loopback)")
    rem.set_defaults(func=_bench_remote)
    shr = bsub.add_parser("shared", help="engine processes sharing one disk directory vs one "
                                         "directory each: token hit on a replayed trace")
    shr.add_argument("--procs", default="1,2,4", help="process counts (default 1,2,4)")
    shr.add_argument("--routing", default="round-robin,affinity",
                     help="round-robin (per request) and/or affinity (per session)")
    shr.add_argument("--budget", default="10%", help="disk budget, share of the footprint")
    shr.add_argument("--trace", default=None, help="trace spec (default: the bundled WEKA sample)")
    shr.add_argument("--max-requests", type=int, default=None)
    shr.add_argument("--page-bytes", default="16KiB", help="bytes of one (scaled-down) page")
    shr.add_argument("--json", default=None, help="write the results here as JSON")
    shr.add_argument("--plot", default=None, help="write a PNG here")
    shr.add_argument("--dir", default=None, help="directory for the disk tiers (default: a temp dir)")
    shr.set_defaults(func=_bench_shared)
    eng = bsub.add_parser("engines", help="hybridstore vs SGLang's HiCacheFile and vLLM's fs tier "
                                          "through the engines' own storage interfaces; cold "
                                          "reads, the SSD limit, hit rate under a budget")
    eng.add_argument("--json", default=None, help="write the results here as JSON")
    eng.add_argument("--plot", default=None, help="write the figures here (PNG)")
    eng.add_argument("--dir", default=None, help="directory for the backends' files (default: a "
                                                 "temp dir)")
    eng.add_argument("--quick", action="store_true", help="TP=4 shards, 8-page batches, 2 reps, a "
                                                          "small synthetic trace (~1 min)")
    eng.add_argument("--tp", default=None, help="TP sizes to measure, e.g. 1,4 (default: 1,4; "
                                                "quick: 4)")
    eng.add_argument("--trace", default=None, help="trace spec of the policy replay (default: "
                                                   "the bundled WEKA sample)")
    eng.add_argument("--requests", type=int, default=None, help="requests of the policy replay")
    eng.add_argument("--no-fio", action="store_true", help="measure the SSD with the built-in "
                                                           "O_DIRECT pool, not fio")
    eng.add_argument("--no-json-stdout", action="store_true", help="print only the table")
    eng.add_argument("--only", default=None, help="sections to run, comma-separated: sglang, "
                                                  "vllm, policy (default: all)")
    eng.set_defaults(func=_bench_engines)
    for name in MOVED_BENCHES:
        moved = bsub.add_parser(name, help=f"moved: python -m benchmarks {name} (from a clone)",
                                add_help=False)
        moved.set_defaults(func=_bench_moved)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func is not _bench_moved:  # a moved bench gets its message whatever its flags
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _check_outputs(parser, getattr(args, "json", None), getattr(args, "plot", None))
    try:
        return int(args.func(args))
    except HybridStoreError as exc:          # bad input (a trace, a policy name, ...): one line
        print(f"hybridstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        missing = MissingExtraError.of(exc)
        if missing is None:
            raise
        print(f"hybridstore {args.command}: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
