"""``hybridstore bench engines``: hybridstore through SGLang's and vLLM's own storage interfaces.

Side by side in one run, on the same pages, keys and disk (each backend in a
directory of its own under ``--dir``), in a rotated order per repetition:

1. **SGLang** (:mod:`~hybridstore.bench.engines.pages`): ``HybridStoreHiCache``
   vs SGLang's built-in ``HiCacheFile``: legacy ``batch_set`` / ``batch_get`` of
   flat page tensors in batches of up to 128 pages, and Mamba/GDN states with
   ``batch_set_v2`` / ``batch_get_v2`` (``PoolName.MAMBA``) from a real
   ``MambaPoolHost``; 64-token pages of Qwen3-Next-80B-A3B at TP=1 (1.5 MiB KV
   page, 73.7 MiB state) and, in full runs, TP=4 shards
   (:mod:`~hybridstore.bench.engines.geometry`).
2. **vLLM** (:mod:`~hybridstore.bench.engines.jobs`): ``HybridStoreTier`` vs
   vLLM's ``fs`` tier, ``submit_store`` / ``submit_load`` jobs over one
   ``primary_kv_view`` of the same chunk size.
3. **Cold reads**: every load is timed ``warm`` (right after the store),
   ``cold`` (page cache of every file both backends wrote dropped with
   ``posix_fadvise(DONTNEED)``, checked with ``mincore``; our DRAM tier
   emptied) and ``restart`` (backend closed, a new one opened over the same
   directory, caches dropped again).
4. **Large batches**: the cold loads of >= 4 MiB per batch next to the SSD's
   read limit measured in the same run (:mod:`hybridstore.bench.device`: fio
   when installed, else an O_DIRECT thread pool).
5. **Policy** (:mod:`~hybridstore.bench.engines.policy`): token hit rate of a
   replayed agent trace under the same SSD byte budget: our eviction policies
   vs ``HiCacheFile`` + ``LRUFileEvictor``.

Every row is a median over repetitions (p50/p99 over batches or jobs), every
load is checked byte for byte against what was stored, and each ratio is taken
inside one repetition (see :mod:`~hybridstore.bench.engines.series`).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from typing import Any

from hybridstore.bench import odirect
from hybridstore.bench.common import (
    emit,
    fs_type,
    json_safe,
    machine_info,
    progress,
    stdout_console,
)
from hybridstore.bench.device import measure_device
from hybridstore.bench.engines.series import paired_ratios
from hybridstore.bench.odirect import IoJob

__all__ = ["run_engines_bench"]

SECTIONS = ("sglang", "vllm", "policy")
"""The bench's sections, in the order they run (``only=`` picks some)."""

QUICK_POLICY_TRACE = "synthetic:agent?sessions=4&turns=8&new=2048&out=128&mutation=0.2&gap=20"


def _available(kind: str) -> tuple[bool, str]:
    """Whether our adapter for ``kind`` imports here (and why not)."""
    import importlib

    if kind == "sglang":  # SGLang's modules first, through the CPU shims (the adapter imports them)
        from hybridstore.bench.engines.sgl import sgl

        sgl()
    mod, cls = (("hybridstore.adapters.sglang", "HybridStoreHiCache") if kind == "sglang"
                else ("hybridstore.adapters.vllm", "HybridStoreTier"))
    try:
        getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        return False, f"{mod}.{cls} is not available: {e}"
    return True, ""


def run_engines_bench(json_path: str | None = None, *, plot_path: str | None = None,
                      disk_dir: str | None = None, quick: bool = False, use_fio: bool = True,
                      tp: tuple[int, ...] | None = None, policy_trace: str | None = None,
                      policy_requests: int | None = None, print_json: bool = True,
                      torch_threads: int = 1,
                      only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run the engine benchmark; print a table (and the JSON), return the document.

    Args:
        json_path: also write the JSON document here.
        plot_path: write the three-panel PNG here.
        disk_dir: where the backends' directories go (a fresh subdirectory,
            removed afterwards); a temp dir when ``None``.
        quick: TP=4 shards only, 8-page (6 MiB) batches, two repetitions, a
            small synthetic agent trace for the policy (about a minute on 2
            busy cores, engine imports included).
        use_fio: measure the SSD with fio when installed.
        tp: tensor-parallel sizes whose rank-0 shards are measured (default
            ``(4,)`` quick, ``(1, 4)`` full).
        policy_trace: trace spec of the policy replay (default: the bundled WEKA
            sample; quick: a small synthetic agent trace).
        policy_requests: first arrivals replayed (default 20 quick, 40 full).
        print_json: also print the JSON document to stdout.
        torch_threads: torch intra-op threads while measuring (see the code).
        only: the sections to run, of ``("sglang", "vllm", "policy")`` (default:
            all); the SSD limit is always measured.

    Returns:
        ``{"machine", "versions", "config", "disk", "device_limit", "rows",
        "ratios", "large_batches", "cache_drops", "restart", "policy", "goals",
        "unavailable", "issues"}``.
    """
    import torch

    # One intra-op thread: on a small, shared machine torch's OpenMP pool turns every page
    # copy of SGLang's host pools (get_data_page, get_dummy_flat_data_page) into a
    # ~10x slower barrier dance (measured here: 1.5 MiB zeros 21 ms with 2 threads, 1.8 ms
    # with 1).  Both backends pay the same copies; restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        return _run(json_path, plot_path, disk_dir, quick, use_fio, tp, policy_trace,
                    policy_requests, print_json, only)
    finally:
        torch.set_num_threads(threads)


def _run(json_path: str | None, plot_path: str | None, disk_dir: str | None, quick: bool,
         use_fio: bool, tp: tuple[int, ...] | None, policy_trace: str | None,
         policy_requests: int | None, print_json: bool,
         only: tuple[str, ...] | None = None) -> dict[str, Any]:
    import torch

    from hybridstore.bench.engines import jobs, pages, policy, report
    from hybridstore.bench.engines import sgl as S
    from hybridstore.bench.engines import vtier as V
    from hybridstore.bench.engines.geometry import QWEN3_NEXT

    sections = SECTIONS if only is None else tuple(only)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench engines sections {sorted(unknown)}; pick from "
                         f"{list(SECTIONS)}")
    tps = tp or ((4,) if quick else (1, 4))
    reps = 2 if quick else 3
    warmup = 0 if quick else 1
    plan = ([(8, 16, 1)] if quick else [(16, 256, 2), (128, 256, 2)])  # (batch, pages, states)
    budgets = (0.25, 0.5) if quick else (0.1, 0.25, 0.5)
    trace_spec = policy_trace or (QUICK_POLICY_TRACE if quick else None)
    n_requests = policy_requests or (20 if quick else 40)
    issues: list[str] = []
    unavailable: list[dict[str, str]] = []
    if disk_dir is not None:
        os.makedirs(disk_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="hybridstore-engines-", dir=disk_dir)
    started = time.perf_counter()
    sgl_names, vllm_names = [S.BUILTIN], [V.BUILTIN]
    for kind, names in (("sglang", sgl_names), ("vllm", vllm_names)):
        ok, why = _available(kind)
        if ok:
            names.append(S.OURS)
        else:
            unavailable.append({"engine": kind, "backend": S.OURS, "reason": why})
            issues.append(why)
    series: list[Any] = []
    drops: list[dict[str, Any]] = []
    restart: list[dict[str, Any]] = []
    policy_runs: list[dict[str, Any]] = []
    device_now: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []

    def measure(engine: str, geometry: str, tag: str, batch: int, run: Any) -> None:
        """Warm-up and repetitions of one run, then its rows, device reading, cache drops
        and restart hits."""
        try:
            for r in range(warmup + reps):
                run.rep(r, r >= warmup, step, last=r == warmup + reps - 1)
        finally:
            run.close()
        series.extend(run.series.values())
        device_now.append({"engine": engine, "geometry": geometry, "run": tag,
                           "gbps": run.device_now})
        drops.extend({"engine": engine, "geometry": geometry, "batch": batch, **d}
                     for d in run.drops)
        restart.append({"engine": engine, "geometry": geometry, "batch": batch, **run.restart})
        if getattr(run, "floor", None):
            floors.append({"engine": engine, "geometry": geometry, "run": tag, **run.floor})

    steps = (3 + len(tps) * len(plan) * 2 * (reps + warmup + 1)
             + len(budgets) * (1 + 4 * (len(sgl_names) > 1)) * (n_requests // 25 + 1) + 2)
    device: dict[str, Any] = {}
    wl = None
    phases: dict[str, float] = {}
    mark = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(now - mark[0], 2)
        mark[0] = now

    try:
        with progress("bench engines", steps) as step:
            step("SSD read limit")
            test_file = os.path.join(root, "device-test.dat")
            file_bytes = (128 << 20) if quick else (1 << 30)
            odirect.make_test_file(test_file, file_bytes)
            device = measure_device(test_file, file_bytes, quick, use_fio, step, issues,
                                    cell_seconds=0.1 if quick else 0.5)
            os.unlink(test_file)
            ref = device["reference_job"]
            ref_job = IoJob("read", ref["block_bytes"], ref["iodepth"])
            phase("ssd_limit")
            step("importing SGLang")
            if {"sglang", "policy"} & set(sections):
                S.sgl()
            phase("import_sglang")
            for t in (tps if "sglang" in sections else ()):
                g = QWEN3_NEXT.geometry(t)
                for batch, n_pages, n_states in plan:
                    run = pages.SglPageRun(g, batch=batch, n_pages=n_pages, n_states=n_states,
                                           root=root, names=sgl_names, issues=issues,
                                           ref_job=ref_job)
                    measure("sglang", g.label, f"b{batch}", batch, run)
                    del run
                    gc.collect()
            phase("sglang")
            step("importing vLLM")
            V.vllm()
            phase("import_vllm")
            for t in (tps if "vllm" in sections else ()):
                g = QWEN3_NEXT.geometry(t)
                for batch, n_pages, _ in plan:
                    vrun = jobs.VllmJobRun(g, job_chunks=batch, n_chunks=n_pages, root=root,
                                           names=vllm_names, issues=issues, reps=warmup + reps,
                                           ref_job=ref_job)
                    measure("vllm", g.label, f"j{batch}", batch, vrun)
                    del vrun
                    gc.collect()
            phase("vllm")
            step("policy: page keys of the trace")
            wl = policy.make_workload(QWEN3_NEXT, trace_spec, n_requests) \
                if "policy" in sections else None
            phase("policy_keys")
            # ours under our orders, and under SGLang's own radix-tree LRU (``lru-radix``):
            # the same order as the built-in's, so that row isolates the store from the order
            systems = [(S.BUILTIN, None)] + ([(S.OURS, "hybridstore"), (S.OURS, "histate"),
                                               (S.OURS, "lru"), (S.OURS, "lru-radix")]
                                              if S.OURS in sgl_names else [])
            for share in (budgets if wl is not None else ()):
                assert wl is not None
                for backend, pol in systems:
                    policy_runs.append(policy.replay_system(
                        wl, backend=backend, policy=pol, budget=int(share * wl.footprint_bytes),
                        root=root, step=step))
            phase("policy")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = [s.row() for s in series]
    ratios = (paired_ratios([s for s in series if s.engine == "sglang"], S.OURS, S.BUILTIN,
                            across={"batch_set_v1": "batch_set", "batch_get_v1": "batch_get"})
              + paired_ratios([s for s in series if s.engine == "vllm"], V.OURS, V.BUILTIN))
    large = report.large_batches(rows, device.get("read_gbps"), device_now)
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "versions": {"sglang": S.sglang_version(), "vllm": V.vllm_version(),
                     "vllm_fs_io_c": V.vllm().fs_io_c},
        "config": {"quick": quick, "sections": list(sections), "reps": reps, "warmup_reps": warmup, "tp": list(tps),
                   "plan": [{"batch": b, "pages_per_rep": p, "states_per_rep": s_}
                            for b, p, s_ in plan],
                   "geometries": [QWEN3_NEXT.geometry(t).as_dict() for t in tps],
                   "gbps_unit": "1e9 bytes/s", "elapsed_s": None, "phase_s": phases,
                   "torch_threads": torch.get_num_threads(),
                   "caches": {"write": "store calls (HiCacheFile buffered, vLLM fs O_DIRECT "
                                       "without fsync; ours per its adapter)",
                              "warm": "load right after the store",
                              "cold": "load after posix_fadvise(DONTNEED) of every file both "
                                      "backends wrote (mincore-checked) and our DRAM tier "
                                      "emptied",
                              "restart": "backend closed, a new one opened over the same "
                                         "directory, caches dropped, load"}},
        "disk": {"dir": root, "fs_type": fs_type(os.path.dirname(root) or ".")},
        "device_limit": {k: v for k, v in device.items() if k != "matrix"},
        "device_now": device_now,
        "load_floor": floors,
        "ours": S.OURS,
        "rows": rows,
        "ratios": ratios,
        "large_batches": large,
        "cache_drops": drops,
        "restart": restart,
        "policy": {"trace": wl.trace if wl else None, "requests": len(wl.keys) if wl else 0,
                   "page_bytes": wl.page_bytes if wl else None,
                   "state_bytes": wl.state_bytes if wl else None,
                   "scale": wl.scale if wl else None,
                   "footprint_bytes": wl.footprint_bytes if wl else None,
                   "runs": policy_runs},
        "goals": report.goals(ratios, large, S.OURS, floors),
        "unavailable": unavailable,
        "issues": issues,
    }
    doc["config"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    doc = json_safe(doc)
    report.print_report(doc, stdout_console())
    emit(doc, json_path=json_path, echo_json=print_json, plot_path=plot_path, plot=report.plot)
    return doc
