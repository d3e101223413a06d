"""The fleet model: the replay with N engine nodes, isolated or sharing one remote pool.

``hybridstore replay --nodes 1,4,16,64`` runs :func:`fleet`: for every preset, node
count, routing rule and remote mode, the trace's requests are served by N nodes,
each a real :class:`~hybridstore.store.HybridStore` with the preset's policies over
its own accounting GPU / DRAM / SSD tiers of the configured budgets (the budgets of
one replay, per node: ``sim.tier_budgets``), and, in ``shared`` mode, a ``remote``
tier: the node's table over ONE :class:`~hybridstore.replay.pool.RemotePool` that
every node's store shares (``replay/pool.py``).  The store decides what it sends
there and adopts from there (``store/remote.py``); the model adds no rule of its own.

**Routing** (:class:`Router`):

* ``round-robin`` — request by request: the k-th request the fleet serves goes to
  node ``k mod N``, whatever its session (a session's consecutive requests land on
  different nodes when N > 1);
* ``affinity`` — session by session: a session's first request pins it to the node
  with the fewest unfinished sessions (ties: the lowest node number), and all its
  requests go there; it is unpinned after its last request.

**Disciplines** are the replay's (``sim.py``), per node.  ``server``: each node is
one FIFO prefill server; the fleet keeps ``live_sessions x N`` sessions live (each
node as loaded as one server of the plain replay when sessions suffice; with fewer
sessions than that, all are live from the start), admitting a random waiting one
when one ends; a request waits for its own node only.  ``sequential``: every
request by trace time, one at a time, on the node its routing names; no queue.
With N = 1 either discipline is the plain replay, request for request (the test).

With fewer sessions than nodes, ``affinity`` leaves nodes idle (at most one node
per unfinished session gets work) and ``round-robin`` spreads each session over the
nodes, so a node sees a session again only every N-th request of the fleet: its
own cache holds that session's earlier context only if it served it; the shared pool
holds what other nodes sent there.  ``busy_nodes`` in each row counts the nodes
that served at least one request.

:func:`replicate` makes a larger population from a trace: copy ``r`` of every
session gets the id ``ID~r`` and block ids ``mix64(id ^ salt("copy", r))`` (content
distinct from every other copy, shapes, times, think times, anchors and the
sessions' parent links kept), so copies share nothing with each other, and the
sessions of one copy share what the originals share.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from hybridstore.errors import ConfigError
from hybridstore.objects import ObjectKind
from hybridstore.replay.model_presets import ModelPreset
from hybridstore.replay.planes import SizedObjects, TierBudget
from hybridstore.replay.pool import PoolView, RemotePool
from hybridstore.replay.sim import (
    GIB,
    PolicyRun,
    ReplayConfig,
    _prompt,
    _result,
    _serve,
    _Sessions,
    build_store,
    kv_footprint,
    kv_pool_pages,
    merged_requests,
)
from hybridstore.replay.systems import Preset, preset
from hybridstore.replay.tokens import session_tokens
from hybridstore.replay.trace import Request, Session, Trace, salt_of, salted_ids
from hybridstore.store import HybridStore

ROUTINGS = ("round-robin", "affinity")
"""How requests reach nodes (module docstring)."""

MODES = ("isolated", "shared")
"""``isolated``: each node its own tiers only; ``shared``: plus one remote pool for all."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteModel:
    """The shared pool of ``shared`` mode (Mooncake-like).

    Attributes:
        gib: the pool's capacity (GiB of objects, all nodes together).
        gbps: pool-to-host bandwidth of one node's restore (GB/s; 12.5 = 100 Gb/s).
        latency_ms: one round trip per restore that reads from the pool.
        node_gib: each node's ``remote_bytes`` (what it may reference there);
            None: the pool's capacity.
    """

    gib: float = 1024.0
    gbps: float = 12.5
    latency_ms: float = 1.0
    node_gib: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gib) and self.gib > 0):
            raise ConfigError(f"the remote pool's capacity must be > 0 GiB, got {self.gib!r}")
        if not (math.isfinite(self.gbps) and self.gbps > 0):
            raise ConfigError(f"the remote bandwidth must be > 0 GB/s, got {self.gbps!r}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ConfigError(f"the remote latency must be >= 0 ms, got {self.latency_ms!r}")
        if self.node_gib is not None and not (math.isfinite(self.node_gib) and self.node_gib > 0):
            raise ConfigError(f"a node's remote budget must be > 0 GiB, got {self.node_gib!r}")


class Router:
    """Which node serves a request (module docstring: ``round-robin`` or ``affinity``).

    Args:
        routing: one of :data:`ROUTINGS`.
        nodes: the number of nodes.
    """

    def __init__(self, routing: str, nodes: int) -> None:
        if routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if nodes < 1:
            raise ConfigError(f"a fleet needs at least one node, got {nodes}")
        self.routing = routing
        self.n = nodes
        self._next = 0
        self._pinned: dict[str, int] = {}
        self._open = [0] * nodes          # unfinished sessions per node

    def node(self, req: Request, last: bool) -> int:
        """The node of ``req``; ``last``: it is its session's last request (unpins it)."""
        if self.routing == "round-robin":
            k = self._next
            self._next = (k + 1) % self.n
            return k
        k = self._pinned.get(req.session, -1)
        if k < 0:
            k = min(range(self.n), key=self._open.__getitem__)
            self._pinned[req.session] = k
            self._open[k] += 1
        if last:
            del self._pinned[req.session]
            self._open[k] -= 1
        return k


class _NodePlane(SizedObjects):
    """Accounting tiers of one node, plus its table over the shared pool (if any)."""

    def __init__(self, remote: PoolView | None) -> None:
        self.remote = remote

    def open_tiers(self, budgets: Sequence[TierBudget]) -> dict[str, Any]:
        tiers: dict[str, Any] = super().open_tiers(budgets)
        if self.remote is not None:
            tiers["remote"] = self.remote
        return tiers


@dataclass(slots=True)
class _Node:
    index: int
    store: HybridStore
    objects: _NodePlane
    kv_pool: int | None = None       # the node's KV pool in pages (sim.kv_pool_pages)
    free: float = 0.0
    served: int = 0


@dataclass(slots=True)
class FleetRun:
    """One (preset, nodes, routing, mode) point: the fleet's requests as one run
    (``run.results`` in the order served; ``node_of[i]``: the node that served the i-th)."""

    run: PolicyRun
    nodes: int
    routing: str
    mode: str
    node_of: list[int] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    pool: dict[str, Any] | None = None
    skipped_states: int = 0

    def row(self) -> dict[str, Any]:
        """The document's row: hit rate, TTFT percentiles, where the work went."""
        s = self.run.summary()
        return {"policy": self.run.name, "nodes": self.nodes, "routing": self.routing,
                "remote": self.mode, "requests": s["requests"],
                "token_hit_rate": s["token_hit_rate"], "ttft_p50_s": s["ttft_p50_s"],
                "ttft_p95_s": s["ttft_p95_s"], "ttft_p99_s": s["ttft_p99_s"],
                "ttft_mean_s": s["ttft_mean_s"], "service_p99_s": s["service_p99_s"],
                "restored_bytes": s["restored_bytes"], "evictions": s["evictions"],
                "busy_nodes": sum(1 for n in self.served if n),
                "max_requests_per_node": max(self.served, default=0),
                "remote_skipped_states": self.skipped_states, "pool": self.pool,
                "wall_s": self.run.wall_s}


def replicate(trace: Trace, copies: int) -> Trace:
    """The trace's sessions ``copies`` times, each copy with its own content (module
    docstring); copy 0 is the trace itself."""
    if copies < 1:
        raise ConfigError(f"copies must be at least 1, got {copies}")
    if copies == 1:
        return trace
    sessions = list(trace.sessions)
    for r in range(1, copies):
        salt = salt_of("copy", r)
        for s in trace.sessions:
            sid = f"{s.id}~{r}"
            reqs = tuple(q.replace(session=sid, block_ids=salted_ids(q.block_ids, salt),
                                   parent=None if q.parent is None else f"{q.parent}~{r}")
                         for q in s.requests)
            sessions.append(Session(id=sid, requests=reqs, model=s.model))
    return Trace(name=f"{trace.name}x{copies}", block_size=trace.block_size,
                 sessions=tuple(sessions))


def fleet_policy(trace: Trace, name: str, cfg: ReplayConfig, *, nodes: int, routing: str,
                 mode: str, remote: RemoteModel | None = None,
                 progress: bool = False) -> FleetRun:
    """Replay ``trace`` on ``nodes`` nodes of preset ``name`` (see the module docstring).

    Args:
        trace: the trace.
        name: the preset (``replay/systems.py``).
        cfg: budgets per node, bandwidths, model, discipline (accounting mode only).
        nodes: the number of nodes.
        routing: one of :data:`ROUTINGS`.
        mode: one of :data:`MODES`.
        remote: the pool of ``shared`` mode (default :class:`RemoteModel()`).
        progress: a progress bar over the requests.

    Raises:
        ConfigError: a bad mode, routing or node count, or ``cfg.data``.
    """
    if mode not in MODES:
        raise ConfigError(f"remote mode must be one of {MODES}, got {mode!r}")
    if cfg.data:
        raise ConfigError("the fleet model runs in accounting mode only (no --data)")
    router = Router(routing, nodes)
    remote = remote or RemoteModel()
    p = preset(name)
    full = cfg.full_model()
    model = full.scaled(cfg.scale)
    scale = full.kv_bytes_per_token / model.kv_bytes_per_token
    footprint = kv_footprint(trace, cfg, full) if cfg.budget is not None else None
    pool = None
    if mode == "shared":
        pool = RemotePool(int(remote.gib * GIB / scale), net_gbps=remote.gbps,
                          latency_s=remote.latency_ms / 1e3, h2d_gbps=cfg.h2d_gbps,
                          sizes={ObjectKind.PAGE: model.page_bytes(trace.block_size),
                                 ObjectKind.STATE: model.checkpoint_bytes})
    node_bytes = None if remote.node_gib is None else int(remote.node_gib * GIB / scale)
    secret = secrets.token_bytes(32)          # one key for every node: objects are shared
    with contextlib.ExitStack() as stack:
        fleet_nodes = []
        for k in range(nodes):
            plane = _NodePlane(pool.view(node_bytes) if pool is not None else None)
            store = build_store(p, cfg, model, trace.block_size, plane, scale, footprint,
                                hash_secret=secret)
            stack.enter_context(store)
            fleet_nodes.append(_Node(k, store, plane,
                                     kv_pool_pages(store, p, cfg, model.page_bytes(trace.block_size))))
        loop = _sequential if cfg.discipline == "sequential" else _server
        node_of: list[int] = []
        run = loop(trace, p, cfg, model, scale, fleet_nodes, router, node_of,
                   progress=progress, label=f"{name} x{nodes} {routing} {mode}")
        run.evictions = sum(n.store.stats()["evictions"] for n in fleet_nodes)
        skipped = sum(n.store._remote.skipped_states for n in fleet_nodes
                      if n.store._remote is not None)
    return FleetRun(run, nodes, routing, mode, node_of, [n.served for n in fleet_nodes],
                    pool.stats() if pool is not None else None, skipped)


def _server(trace: Trace, p: Preset, cfg: ReplayConfig, model: ModelPreset, scale: float,
            nodes: list[_Node], router: Router, node_of: list[int], *, progress: bool,
            label: str) -> PolicyRun:
    """``sim._run`` with a server per node: the same events, the same admission, each
    request served by the node its routing names and queued behind that node only.

    Unlike ``sim._run`` (``server_loop``'s ``queued``), a node's engine does not announce
    its waiting queue to its store (``HybridStore.expect``): the router names a request's
    node only when the request is taken, so which node's queue holds it is not known while
    it waits.  ``hybridstore`` on one node is therefore the plain replay as it was before
    the queue was announced (the same except under queueing at tight budgets)."""
    run = PolicyRun(p.name, scale=scale)
    live = cfg.live_sessions * len(nodes)
    sessions = _Sessions([s for s in trace.sessions if s.requests], live, cfg.seed)
    total = trace.n_requests if cfg.max_requests is None else min(cfg.max_requests, trace.n_requests)
    events: list[tuple[float, int, Session, int]] = []
    seq = 0
    tokens: dict[str, Iterator[np.ndarray]] = {}

    def start(session: Session, at: float) -> None:
        nonlocal seq
        tokens[session.id] = session_tokens(session) if cfg.token_level else iter(())
        heapq.heappush(events, (at, seq, session, 0))
        seq += 1

    for _ in range(live):
        s = sessions.admit()
        if s is None:
            break
        start(s, max(0.0, s.requests[0].arrival_s))
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc=label, unit="req", disable=not progress, leave=False)
    while events and len(run.results) < total:
        arrival, _, session, i = heapq.heappop(events)
        req = session.requests[i]
        node = nodes[router.node(req, i + 1 == len(session.requests))]
        prompt = _prompt(node.store, req, tokens[session.id], cfg.token_level)
        begin = max(arrival, node.free)
        served = _serve(node.store, node.objects, p, model, scale, prompt, req, run, node.kv_pool)
        done = begin + served.restore_s + served.recompute_s
        node.free = done
        node.served += 1
        node_of.append(node.index)
        run.results.append(_result(session.id, req, served, arrival, begin - arrival))
        bar.update()
        if i + 1 < len(session.requests):
            nxt = session.requests[i + 1]
            at = done + req.output_tokens * model.decode_s_per_token + nxt.think_s
            heapq.heappush(events, (at, seq, session, i + 1))
            seq += 1
        else:
            tokens.pop(session.id, None)
            s = sessions.admit()
            if s is not None:
                start(s, done)
    bar.close()
    run.wall_s = time.perf_counter() - t0
    return run


def _sequential(trace: Trace, p: Preset, cfg: ReplayConfig, model: ModelPreset, scale: float,
                nodes: list[_Node], router: Router, node_of: list[int], *, progress: bool,
                label: str) -> PolicyRun:
    """``sim._run_sequential`` over the fleet: every request by trace time, on its node."""
    run = PolicyRun(p.name, scale=scale)
    order = merged_requests(trace)
    if cfg.max_requests is not None:
        order = order[:cfg.max_requests]
    by_id = {s.id: s for s in trace.sessions}
    tokens: dict[str, Iterator[np.ndarray]] = {}
    t0 = time.perf_counter()
    for req in tqdm(order, desc=label, unit="req", disable=not progress, leave=False):
        session = by_id[req.session]
        last = req.index + 1 == len(session.requests)
        node = nodes[router.node(req, last)]
        if req.session not in tokens:
            tokens[req.session] = session_tokens(session) if cfg.token_level else iter(())
        prompt = _prompt(node.store, req, tokens[req.session], cfg.token_level)
        served = _serve(node.store, node.objects, p, model, scale, prompt, req, run, node.kv_pool)
        node.served += 1
        node_of.append(node.index)
        run.results.append(_result(req.session, req, served, req.arrival_s, 0.0))
        if last:
            tokens.pop(req.session, None)
    run.wall_s = time.perf_counter() - t0
    return run


def parse_nodes(text: str) -> list[int]:
    """``"1,4,16,64"`` -> ``[1, 4, 16, 64]``.

    Raises:
        ConfigError: an entry is not a whole number >= 1.
    """
    out = []
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise ConfigError(f"cannot read {part!r} as a node count") from None
        if n < 1:
            raise ConfigError(f"a node count must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise ConfigError("no node count given; write e.g. --nodes 1,4,16,64")
    return out


def fleet(trace: Trace, names: Sequence[str], cfg: ReplayConfig, nodes: Sequence[int], *,
          routings: Sequence[str] = ROUTINGS, modes: Sequence[str] = MODES,
          remote: RemoteModel | None = None, progress: bool = True) -> dict[str, Any]:
    """Every (preset, node count, routing, mode) point of the fleet model, one document.

    Returns:
        ``{"trace", "config", "remote", "routing_rules", "nodes", "rows"}``, one row per
        point (:meth:`FleetRun.row`).
    """
    for name in names:
        preset(name)
    for r in routings:
        Router(r, 1)
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"remote mode must be one of {MODES}, got {m!r}")
    remote = remote or RemoteModel()
    points = [(name, n, r, m) for name in names for n in nodes for r in routings for m in modes]
    bar = tqdm(total=len(points), desc="fleet", unit="run", disable=not progress)
    rows = []
    for name, n, r, m in points:
        bar.set_postfix_str(f"{name} x{n} {r} {m}")
        rows.append(fleet_policy(trace, name, cfg, nodes=n, routing=r, mode=m,
                                 remote=remote).row())
        bar.update()
    bar.close()
    return {"trace": {"name": trace.name, "sessions": trace.n_sessions,
                      "requests": trace.n_requests, "input_tokens": trace.input_tokens,
                      "block_size": trace.block_size},
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "remote": {"gib": remote.gib, "gbps": remote.gbps, "latency_ms": remote.latency_ms,
                       "node_gib": remote.node_gib},
            "routing_rules": {
                "round-robin": "the k-th request the fleet serves goes to node k mod N",
                "affinity": "a session's first request pins it to the node with the fewest "
                            "unfinished sessions (ties: lowest number); all its requests "
                            "go there"},
            "live_sessions_per_node": cfg.live_sessions,
            "nodes": list(nodes), "rows": rows}


def _budget(doc: dict[str, Any]) -> str:
    """The per-node budgets of a document, in words."""
    c = doc["config"]
    if c["budget"] is not None:
        return f"{c['budget']:.0%} of the KV footprint per node"
    return f"{c['gpu_gib']:g} / {c['host_gib']:g} / {c['disk_gib']:g} GiB per node"


def print_fleet(doc: dict[str, Any]) -> None:
    """One rich table: a row per (preset, routing, mode), hit rate and TTFT per node count."""
    from rich.console import Console
    from rich.table import Table

    t = doc["trace"]
    table = Table(title=f"fleet model: {t['name']} ({t['sessions']} sessions, {t['requests']} "
                        f"requests; {doc['config']['discipline']} discipline, {_budget(doc)}; "
                        f"remote pool "
                        f"{doc['remote']['gib']:g} GiB, {doc['remote']['gbps']:g} GB/s, "
                        f"{doc['remote']['latency_ms']:g} ms)")
    for col in ("preset", "routing", "remote"):
        table.add_column(col)
    for n in doc["nodes"]:
        table.add_column(f"{n} node{'s' if n > 1 else ''}: hit / p50 / p95 / p99 s [busy]",
                         justify="right")
    by = {(r["policy"], r["routing"], r["remote"], r["nodes"]): r for r in doc["rows"]}
    for key in dict.fromkeys((r["policy"], r["routing"], r["remote"]) for r in doc["rows"]):
        cells = []
        for n in doc["nodes"]:
            r = by.get((*key, n))
            cells.append("-" if r is None else
                         f"{r['token_hit_rate']:.1%} / {r['ttft_p50_s']:.2f} / "
                         f"{r['ttft_p95_s']:.2f} / {r['ttft_p99_s']:.2f} [{r['busy_nodes']}]")
        table.add_row(*key, *cells)
    Console().print(table)


def plot_fleet(doc: dict[str, Any], path: str) -> None:
    """Token hit rate and TTFT p50 / p95 / p99 against the node count (log x): colour per
    preset, solid shared / dashed isolated, marker per routing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    names = list(dict.fromkeys(r["policy"] for r in doc["rows"]))
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    markers = {"round-robin": "o", "affinity": "s"}
    keys = dict.fromkeys((r["policy"], r["routing"], r["remote"]) for r in doc["rows"])
    for name, routing, mode in keys:
        rows = sorted((r for r in doc["rows"] if (r["policy"], r["routing"], r["remote"]) ==
                       (name, routing, mode)), key=lambda r: r["nodes"])
        x = [r["nodes"] for r in rows]
        for ax, k in zip(axes, ("token_hit_rate", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s")):
            ax.plot(x, [r[k] for r in rows], color=colors[name], marker=markers[routing],
                    linestyle="-" if mode == "shared" else "--",
                    label=f"{name}, {routing}, {mode}")
    for ax, label in zip(axes, ("token hit rate", "TTFT p50 (s)", "TTFT p95 (s)",
                                "TTFT p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(doc["nodes"], [str(n) for n in doc["nodes"]])
        ax.minorticks_off()
        ax.set_xlabel("engine nodes")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    rem = doc["remote"]
    fig.suptitle(f"{doc['trace']['name']}: fleet model ({doc['config']['discipline']} "
                 f"discipline, {doc['config']['model']}, {_budget(doc)}; shared pool "
                 f"{rem['gib']:g} GiB, "
                 f"{rem['gbps']:g} GB/s, {rem['latency_ms']:g} ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
