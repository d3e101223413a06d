"""``hybridstore bench shared``: engine processes sharing one disk directory vs one each.

Real processes, real bytes.  The requests of a trace (the bundled WEKA sample by
default), merged by trace time, are routed to ``P`` worker processes, each a
:class:`~hybridstore.HybridStore` with a small DRAM pool and a disk tier:

* ``shared``: every worker opens one directory with ``disk_shared=True`` and the
  whole disk budget (the processes evict together, one at a time);
* ``separate``: each worker has a directory of its own with ``1/P`` of the budget
  (what a deployment without a shared cache gets).

Routing: ``round-robin`` sends each request to the next worker (a load balancer
without session affinity); ``affinity`` sends every request of a session to one
worker (a hash of the session id).

Per request, in trace order, one at a time, its worker matches the prompt (hit =
the resumable prefix, in tokens), loads the plan's pages and state and checks them
(each page holds its block id, so a page another process wrote is verified), then
stores the pages of its full blocks and a state at their end.  The disk budget is
``--budget`` of the unlimited footprint (every distinct page and one state per
request).  Pages are ``--page-bytes`` (scaled down: the hit rate depends on the
budget's share of the footprint, not on the size).  Prints a table and the JSON
document; ``--plot`` writes a PNG.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridstore.bench.common import emit, machine_info, progress, stdout_console

__all__ = ["run_shared_bench"]

MIB = 1 << 20
HOST_PAGES = 256
"""Each process's DRAM pool, in pages (small: the disk tier is the cache measured)."""


def _worker(conn: Any, cfg_kwargs: dict[str, Any], page_words: int, state_words: int) -> None:
    """One engine process: serve requests from the pipe until ``None``."""
    from hybridstore import HybridStore, StoreConfig
    from hybridstore.errors import CapacityError, CorruptObjectError

    store = HybridStore(StoreConfig(**cfg_kwargs))
    wrong = refused = lost = 0
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            ids = np.asarray(msg, dtype=np.uint64)
            prompt = store.prefix_from_block_ids(ids)
            plan = store.match(prompt)
            hit = plan.position
            if hit:
                try:
                    pages, state = store.load(plan).result()
                except CorruptObjectError:    # another process evicted it after the match
                    hit = 0
                    lost += 1
                else:
                    for i, page in enumerate(pages):
                        wrong += int(np.asarray(page).view(np.uint64)[0] != ids[i])
                    wrong += int(np.asarray(state).view(np.uint64)[0] != ids[len(pages) - 1])
            store.release(plan)
            batch = np.repeat(ids[:, None], page_words, axis=1)
            try:
                store.put_kv_batch(prompt, batch)
                store.put_state(prompt, np.full(state_words, ids[-1], np.uint64))
            except CapacityError:             # a put the budget refused: a documented outcome
                refused += 1
            conn.send(hit)
        store.flush()
        conn.send({"wrong_pages": wrong, "refused_puts": refused, "lost_plans": lost,
                   "disk": store.stats()["tiers"]["disk"]})
    finally:
        store.close()


def _answer(proc: Any, conn: Any) -> Any:
    """The worker's reply; a worker that died is an error, not a hang."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"a benchmark worker died (exit code {proc.exitcode}); its "
                               "traceback is above")
    return conn.recv()


def _route(requests: Sequence[Any], procs: int, routing: str) -> list[int]:
    if routing == "round-robin":
        return [i % procs for i in range(len(requests))]
    return [zlib.crc32(r.session.encode()) % procs for r in requests]


def _one(requests: Sequence[Any], procs: int, routing: str, mode: str, budget: int,
         root: str, block: int, page_words: int, state_words: int,
         step: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    workers = []
    for w in range(procs):
        path = os.path.join(root, f"{mode}-{procs}-{routing}" + ("" if mode == "shared" else f"-{w}"))
        cfg = dict(block_size=block, host_bytes=HOST_PAGES * page_words * 8, disk_path=path,
                   disk_bytes=budget if mode == "shared" else budget // procs,
                   disk_segment_bytes=MIB, disk_shared=mode == "shared", disk_engine="posix",
                   io_threads=2)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, cfg, page_words, state_words),
                           daemon=True)
        proc.start()
        workers.append((proc, parent))
    hit = total = 0
    t0 = time.perf_counter()
    try:
        for req, w in zip(requests, _route(requests, procs, routing)):
            full = req.input_tokens // block
            ids = req.block_ids[:full]
            if not full:
                continue
            workers[w][1].send(ids.tolist())
            hit += _answer(*workers[w])
            total += full * block
            step(f"P={procs} {routing} {mode}")
        finals = []
        for proc, conn in workers:
            conn.send(None)
            finals.append(_answer(proc, conn))
    finally:
        for proc, _ in workers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    wall = time.perf_counter() - t0
    return {"procs": procs, "routing": routing, "mode": mode, "token_hit": hit / max(total, 1),
            "hit_tokens": hit, "input_tokens": total, "wall_s": round(wall, 2),
            "wrong_pages": sum(f["wrong_pages"] for f in finals),
            "refused_puts": sum(f["refused_puts"] for f in finals),
            "lost_plans": sum(f["lost_plans"] for f in finals),
            "disk_objects": [f["disk"]["objects"] for f in finals]}


def run_shared_bench(json_path: str | None = None, plot_path: str | None = None,
                     procs: Sequence[int] = (1, 2, 4),
                     routings: Sequence[str] = ("round-robin", "affinity"),
                     budget_fraction: float = 0.1, trace_spec: str | None = None,
                     max_requests: int | None = None, page_bytes: int = 16 << 10,
                     disk_dir: str | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table and the JSON document, return the document."""
    from hybridstore.replay.loaders import load
    from hybridstore.replay.samples import weka_sample
    from hybridstore.replay.sim import merged_requests

    trace = load(trace_spec or str(weka_sample()))
    requests = merged_requests(trace)[:max_requests]
    block = requests[0].block_size
    page_words = page_bytes // 8
    state_words = 4 * page_words
    distinct = len({int(b) for r in requests for b in r.block_ids[:r.input_tokens // block]})
    footprint = distinct * page_bytes + len(requests) * state_words * 8
    budget = max(int(budget_fraction * footprint), 8 * MIB)
    root = tempfile.mkdtemp(prefix="hybridstore-bench-shared-", dir=disk_dir)
    plan = [(p, routing, mode) for p in procs for routing in routings
            for mode in (("shared",) if p == 1 else ("shared", "separate"))
            if not (p == 1 and routing != routings[0])]
    rows = []
    try:
        with progress("bench shared", len(plan) * len(requests)) as step:
            for p, routing, mode in plan:
                rows.append(_one(requests, p, routing, mode, budget, root, block, page_words,
                                 state_words, step))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {(r["procs"], r["routing"]): r["token_hit"] for r in rows if r["mode"] == "separate"}
    for r in rows:
        if r["mode"] == "shared" and (r["procs"], r["routing"]) in base:
            sep = base[(r["procs"], r["routing"])]
            r["vs_separate"] = r["token_hit"] / sep if sep else None
    doc = {"bench": "shared", "machine": machine_info(),
           "config": {"trace": trace_spec or "bundled WEKA sample", "requests": len(requests),
                      "block_size": block, "page_bytes": page_bytes,
                      "state_bytes": state_words * 8, "footprint_bytes": footprint,
                      "budget_fraction": budget_fraction, "disk_budget_bytes": budget,
                      "host_bytes_per_process": HOST_PAGES * page_bytes},
           "rows": rows}
    _table(rows, budget_fraction)
    if plot_path:
        _plot(rows, plot_path, budget_fraction)
    emit(doc, json_path=json_path)
    return doc


def _table(rows: list[dict[str, Any]], fraction: float) -> None:
    from rich.table import Table

    table = Table(title=f"token hit, engine processes on one shared disk directory vs one "
                        f"each (disk budget {fraction:.0%} of the footprint)")
    for col in ("processes", "routing", "mode", "token hit", "shared/separate", "wrong pages",
                "wall s"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["procs"]), r["routing"], r["mode"], f"{r['token_hit']:.3f}",
                      f"{r['vs_separate']:.2f}" if r.get("vs_separate") else "",
                      str(r["wrong_pages"]), f"{r['wall_s']:.1f}")
    stdout_console().print(table)


def _plot(rows: list[dict[str, Any]], path: str, fraction: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for routing in dict.fromkeys(r["routing"] for r in rows if r["procs"] > 1):
        for mode, style in (("shared", "-o"), ("separate", "--s")):
            pts = sorted((r["procs"], r["token_hit"]) for r in rows
                         if r["mode"] == mode and (r["routing"] == routing or r["procs"] == 1))
            ax.plot([p for p, _ in pts], [h for _, h in pts], style, label=f"{mode}, {routing}")
    ax.set_xlabel("engine processes")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"one shared disk directory vs one each ({fraction:.0%} budget)")
    ax.set_xticks(sorted({r["procs"] for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
