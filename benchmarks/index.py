"""``python -m benchmarks index``: put / match / evict of the prefix index, side by side with peers.

Three implementations get the same token ids (uint32, block size 64):

* ``hybridstore``: :class:`~hybridstore.HybridStore` over an accounting-only
  host tier (sizes, no bytes), so only the index and the store's bookkeeping
  are timed.  ``put`` = ``put_kv_sized`` of the prompt's new pages +
  ``put_state_sized`` (a checkpoint at the prompt's end: a hybrid model's
  request leaves one); ``match`` = ``match(tokens)`` (hashing included, pins)
  + ``release``; ``evict`` = ``evict(bytes of one prompt)``.
* ``sglang``: SGLang's ``RadixCache`` (:class:`~benchmarks.peers.SGLangRadix`).
* ``vllm``: vLLM's block hashing + ``BlockPool``
  (:class:`~benchmarks.peers.VllmBlockPool`).

Workloads (every op is timed one call at a time, GC off, the three
implementations in turn, their order rotated each repetition):

1. **Prompt length** (1K-512K tokens), two shapes: ``fresh`` (independent
   prompts, each put whole) and ``turns`` (sessions growing turn by turn, put
   after every turn; the timed put is the last turn's, the match is over the
   whole conversation).  Ops: ``put``, ``match`` (the cached prompt: a full
   hit), ``match_branch`` (the prompt diverging at a random block: a partial
   hit), ``evict`` (one prompt's tokens, least recently used first).
2. **Cached blocks** (1K-1M): the cache is filled with 4K-token prompts to
   ``N`` blocks (fill throughput recorded), then ``match``, ``match_branch``,
   ``evict`` and ``put`` are timed at that size.
3. **Hashing**: our native kernel vs its numpy twin (same keys), and vLLM's
   ``hash_block_tokens`` chain with each of its hash functions, on one
   128K-token prompt.
4. **Memory per cached block**: our index (its own accounting and
   ``tracemalloc``), SGLang's tree (``tracemalloc`` + its KV-index tensors) and
   vLLM's pool (``tracemalloc``), each holding the same ~100K blocks.
5. **match() on a 128K-token prompt** with hashing (the goal figure;
   :func:`~hybridstore.bench.index_figures.bench_match`).

Every ``match`` checks that the implementations agree on the matched prefix
(tokens of KV found); disagreements are listed in ``issues``.  Ratios are
``peer median / ours median`` (above 1: ours is faster).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.peers import (
    PeerUnavailable,
    SGLangRadix,
    VllmBlockPool,
    import_sglang_radix,
    import_vllm_prefix,
    init_vllm_none_hash,
    sglang_version,
    vllm_hash_functions,
)
from hybridstore.backends.accounting import AccountingTier
from hybridstore.bench.common import (
    emit,
    json_safe,
    machine_info,
    median,
    no_gc,
    percentile,
    progress,
)
from hybridstore.bench.index_figures import (
    GOAL_INDEX_BYTES,
    GOAL_MATCH_MS,
    MATCH_BLOCK,
    MATCH_TOKENS,
    VOCAB,
    bench_hashing,
    bench_index_memory,
    bench_match,
)
from hybridstore.config import StoreConfig
from hybridstore.store import HybridStore

__all__ = ["IndexBenchConfig", "run_index_bench"]

BLOCK = MATCH_BLOCK                 # 64 tokens per page, for every implementation
PAGE_BYTES = 64 << 10               # accounting sizes of ours (nothing is copied)
STATE_BYTES = 64 << 10
GOAL_VS_SGLANG = 10.0
OPS = ("put", "match", "match_branch", "evict")
IMPLS = ("hybridstore", "sglang", "vllm")


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexBenchConfig:
    """What ``bench index`` runs (``full()``, ``quick()``, or explicit sizes for tests).

    Attributes:
        prompt_tokens: prompt lengths of the prompt-length sweep.
        shapes: ``"fresh"`` and/or ``"turns"``.
        reps: prompts (sessions) per length; each op is timed once per prompt.
        cached_blocks: cache sizes of the cached-blocks sweep.
        fill_prompt_tokens: prompt length that fills the cache in that sweep.
        block_reps: timed ops per cache size.
        turns: at most this many turns per session (``turns`` shape).
        memory_blocks: blocks held when measuring memory per block.
        match_reps, hash_reps: repetitions of the 128K match and hashing figures.
        peers: peers to run (``"sglang"``, ``"vllm"``).
    """

    prompt_tokens: tuple[int, ...] = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 128 << 10, 512 << 10)
    shapes: tuple[str, ...] = ("fresh", "turns")
    reps: int = 9
    cached_blocks: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    fill_prompt_tokens: int = 4 << 10
    block_reps: int = 15
    turns: int = 16
    memory_blocks: int = 102_400
    match_reps: int = 200
    hash_reps: int = 15
    peers: tuple[str, ...] = ("sglang", "vllm")

    def __post_init__(self) -> None:
        if any(t % BLOCK or t <= 0 for t in self.prompt_tokens + (self.fill_prompt_tokens,)):
            raise ValueError(f"prompt lengths must be positive multiples of {BLOCK}")
        if not set(self.shapes) <= {"fresh", "turns"} or not set(self.peers) <= {"sglang", "vllm"}:
            raise ValueError("shapes are 'fresh'/'turns', peers 'sglang'/'vllm'")
        if self.reps < 1 or self.block_reps < 1 or self.turns < 1:
            raise ValueError("reps, block_reps and turns must be >= 1")

    @classmethod
    def full(cls) -> IndexBenchConfig:
        return cls()

    @classmethod
    def quick(cls) -> IndexBenchConfig:
        return cls(prompt_tokens=(1 << 10, 16 << 10, 128 << 10), reps=5,
                   cached_blocks=(1_000, 10_000, 100_000), block_reps=7, turns=8,
                   memory_blocks=102_400, match_reps=30, hash_reps=5)


# ---------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------
class OursStore:
    """:class:`HybridStore` over an accounting host tier (index + bookkeeping only)."""

    name = "hybridstore"

    def __init__(self, block_size: int) -> None:
        cfg = StoreConfig(block_size=block_size, host_bytes=1 << 50, pin_host_memory=False)
        self.store = HybridStore(cfg, tiers={"host": AccountingTier("host", 1 << 50,
                                                                    read_gbps=cfg.h2d_gbps)})
        self.block_size = block_size
        self.evicted_checkpoints: list[int] = []   # per evict() call

    def prepare(self, tokens: np.ndarray) -> np.ndarray:
        return tokens

    def put(self, tokens: np.ndarray, cached: int = 0) -> None:
        store = self.store
        pk = store.prefix(tokens)
        store.put_kv_sized(pk, nbytes=PAGE_BYTES, first_block=cached // self.block_size)
        store.put_state_sized(pk, nbytes=STATE_BYTES)

    def match(self, tokens: np.ndarray) -> int:
        plan = self.store.match(tokens)
        self.store.release(plan)
        return plan.kv_tokens

    def evict(self, tokens: int) -> int:
        """Free the bytes of ``tokens`` worth of pages and one checkpoint; returns the tokens
        of the pages that went (the LRU policy may free checkpoints instead: it keeps pages
        that retained checkpoints need; ``evicted_checkpoints`` counts those)."""
        index = self.store.index
        pages, ckpts = index.n_pages, index.n_checkpoints
        self.store.evict(tokens // self.block_size * PAGE_BYTES + STATE_BYTES, tier="host")
        self.evicted_checkpoints.append(ckpts - index.n_checkpoints)
        return (pages - index.n_pages) * self.block_size

    def after_evict(self) -> None:
        pass

    def cached_tokens(self) -> int:
        return self.store.index.n_pages * self.block_size

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------
@dataclass
class _Cell:
    """Timings of one op of one workload point, per implementation."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, list[int]] = field(default_factory=dict)

    def add(self, impl: str, s: float, result: int | None) -> None:
        self.seconds.setdefault(impl, []).append(s)
        if result is not None:
            self.results.setdefault(impl, []).append(result)


def _rotated(impls: list[Any], i: int) -> list[Any]:
    k = i % len(impls)
    return impls[k:] + impls[:k]


def _row(cell: _Cell, tokens: int, **point: Any) -> dict[str, Any]:
    """One JSON row: medians, p90, tokens/s and ratios to ours."""
    row: dict[str, Any] = dict(point)
    ours = cell.seconds.get("hybridstore")
    ours_ms = median(ours) * 1e3 if ours else None
    for impl, secs in cell.seconds.items():
        ms = median(secs) * 1e3
        row[impl] = {"ms_median": ms, "ms_p90": percentile(secs, 90.0) * 1e3, "n": len(secs),
                     "tokens_per_s": tokens / (ms / 1e3) if ms > 0 else None}
        if impl != "hybridstore" and ours_ms:
            row[impl]["ratio"] = ms / ours_ms
    results = {k: v for k, v in cell.results.items() if v}
    if results and point.get("op") == "evict":
        row["evicted_tokens"] = results
    elif len(results) > 1:
        ref = results.get("hybridstore")
        row["matched_tokens"] = results
        row["agree"] = all(v == ref for v in results.values()) if ref is not None else None
    return row


def _make_branch(tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """The prompt diverging at a random block boundary (the first new token differs)."""
    nblocks = len(tokens) // BLOCK
    cut = int(rng.integers(0, nblocks)) * BLOCK
    out = tokens.copy()
    out[cut:] = rng.integers(0, VOCAB, len(tokens) - cut, dtype=np.uint32)
    out[cut] = (int(tokens[cut]) + 1) % VOCAB
    return out, cut


class _Runner:
    """The implementations of one workload point; times their ops in turn.

    A context manager: the cyclic GC is collected once on entry and kept off
    until exit (no collection lands inside a timed op); the implementations
    are closed on exit.
    """

    def __init__(self, cfg: IndexBenchConfig, capacity_blocks: int, unavailable: dict[str, str],
                 issues: list[str]) -> None:
        self.impls: list[Any] = [OursStore(BLOCK)]
        for peer in cfg.peers:
            if peer in unavailable:
                continue
            try:
                self.impls.append(SGLangRadix(BLOCK) if peer == "sglang"
                                  else VllmBlockPool(BLOCK, capacity_blocks))
            except PeerUnavailable as e:
                unavailable[peer] = str(e)
        self.issues = issues
        self._gc = no_gc()

    def __enter__(self) -> _Runner:
        self._gc.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for impl in self.impls:
                try:
                    impl.close()
                except Exception as e:  # noqa: BLE001 - report, close the rest
                    self.issues.append(f"closing {impl.name} failed: {e!r}")
            self.impls = []
        finally:
            self._gc.__exit__(None, None, None)
            gc.collect()

    def run(self, cell: _Cell | None, i: int, op: str, tokens: np.ndarray | None = None, *,
            cached: int = 0, amount: int = 0) -> None:
        """Time ``op`` once on every implementation, in an order rotated by ``i``.

        ``put``/``match``/``match_branch`` get ``tokens`` (in each one's native
        form, prepared untimed; ``put`` also ``cached``), ``evict`` gets ``amount``.
        """
        for impl in _rotated(self.impls, i):
            if op == "evict":
                t0 = time.perf_counter()
                out = impl.evict(amount)
                s = time.perf_counter() - t0
            elif op == "put":
                x = impl.prepare(tokens)
                t0 = time.perf_counter()
                impl.put(x, cached)
                s, out = time.perf_counter() - t0, None
            else:
                x = impl.prepare(tokens)
                t0 = time.perf_counter()
                out = impl.match(x)
                s = time.perf_counter() - t0
            if cell is not None:
                cell.add(impl.name, s, out)

    def put_untimed(self, tokens: np.ndarray, seconds: dict[str, float]) -> None:
        """Put ``tokens`` into every implementation, adding each one's time to ``seconds``."""
        for impl in self.impls:
            x = impl.prepare(tokens)
            t0 = time.perf_counter()
            impl.put(x, 0)
            seconds[impl.name] = seconds.get(impl.name, 0.0) + time.perf_counter() - t0


# ---------------------------------------------------------------------------------
# 1. prompt length
# ---------------------------------------------------------------------------------
def _length_point(runner: _Runner, prompts: list[np.ndarray], turn: int,
                  rng: np.random.Generator) -> dict[str, _Cell]:
    cells = {op: _Cell() for op in OPS}
    for i, p in enumerate(prompts):
        ends = list(range(turn, len(p), turn)) + [len(p)]
        for j, end in enumerate(ends):   # the timed put is the last turn's
            runner.run(cells["put"] if j == len(ends) - 1 else None, i, "put", p[:end],
                       cached=ends[j - 1] if j else 0)
    for i, p in enumerate(prompts):
        runner.run(cells["match"], i, "match", p)
    for i, p in enumerate(prompts):
        runner.run(cells["match_branch"], i, "match_branch", _make_branch(p, rng)[0])
    for i, p in enumerate(prompts):
        runner.run(cells["evict"], i, "evict", amount=len(p))
    return cells


def _sweep_length(cfg: IndexBenchConfig, rng: np.random.Generator, step: Callable[[str], None],
                  unavailable: dict[str, str], issues: list[str]) -> list[dict[str, Any]]:
    rows = []
    for shape in cfg.shapes:
        for L in cfg.prompt_tokens:
            step(f"prompt length: {shape} {L} tokens")
            prompts = [rng.integers(0, VOCAB, L, dtype=np.uint32) for _ in range(cfg.reps)]
            turn = L if shape == "fresh" else max(BLOCK, -(-L // cfg.turns) // BLOCK * BLOCK)
            with _Runner(cfg, cfg.reps * L // BLOCK, unavailable, issues) as runner:
                cells = _length_point(runner, prompts, turn, rng)
                ours_ckpts = runner.impls[0].evicted_checkpoints
            for op in OPS:
                rows.append(_row(cells[op], L, sweep="prompt_tokens", shape=shape, op=op,
                                 prompt_tokens=L, turn_tokens=turn))
            rows[-1]["hybridstore"]["evicted_checkpoints"] = ours_ckpts
    return rows


# ---------------------------------------------------------------------------------
# 2. cached blocks
# ---------------------------------------------------------------------------------
def _blocks_point(runner: _Runner, need: int, reps: int, prompt: Callable[[int], np.ndarray],
                  rng: np.random.Generator) -> dict[str, _Cell]:
    cells = {op: _Cell() for op in OPS}
    picks = [int(j) for j in rng.choice(need, size=min(reps, need), replace=False)]
    for r, j in enumerate(picks):
        runner.run(cells["match"], r, "match", prompt(j))
    for r, j in enumerate(picks):
        runner.run(cells["match_branch"], r, "match_branch", _make_branch(prompt(j), rng)[0])
    n_evict = min(reps, need - 1)
    for r in range(n_evict):
        runner.run(cells["evict"], r, "evict", amount=len(prompt(0)))
    for impl in runner.impls:
        impl.after_evict()
    for r in range(n_evict):   # fresh prompts take the evicted room: the size stays N
        runner.run(cells["put"], r, "put", prompt(need + r))
    return cells


def _sweep_blocks(cfg: IndexBenchConfig, rng: np.random.Generator, step: Callable[[str], None],
                  unavailable: dict[str, str], issues: list[str]) -> list[dict[str, Any]]:
    """Each size on fresh implementations filled to exactly ``N`` blocks (vLLM's pool too:
    a full pool is what makes its allocations evict)."""
    L = cfg.fill_prompt_tokens
    per = L // BLOCK
    rows: list[dict[str, Any]] = []
    for N in sorted(cfg.cached_blocks):
        need = max(2, -(-N // per))
        seeds = [int(x) for x in rng.integers(1 << 62, size=need + cfg.block_reps)]

        def prompt(i: int, seeds: list[int] = seeds) -> np.ndarray:   # regenerated, not held
            return np.random.default_rng(seeds[i]).integers(0, VOCAB, L, dtype=np.uint32)

        fill: dict[str, float] = {}
        with _Runner(cfg, need * per, unavailable, issues) as runner:
            step(f"cached blocks: filling to {need * per}")
            for i in range(need):
                runner.put_untimed(prompt(i), fill)
            step(f"cached blocks: timing at {need * per}")
            cells = _blocks_point(runner, need, cfg.block_reps, prompt, rng)
            held = {impl.name: impl.cached_tokens() // BLOCK for impl in runner.impls}
            ours_ckpts = runner.impls[0].evicted_checkpoints
        for op in OPS:
            row = _row(cells[op], L, sweep="cached_blocks", op=op, cached_blocks=need * per,
                       prompt_tokens=L)
            row["held_blocks_after"] = held
            if op == "put":
                row["fill_blocks_per_s"] = {k: need * per / v if v > 0 else None
                                            for k, v in fill.items()}
            if op == "evict":
                row["hybridstore"]["evicted_checkpoints"] = ours_ckpts
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------
# 3. hashing: ours native / twin, vLLM's block hashing
# ---------------------------------------------------------------------------------
def _hashing(cfg: IndexBenchConfig, rng: np.random.Generator, step: Callable[[str], None],
             unavailable: dict[str, str]) -> dict[str, Any]:
    ours = bench_hashing(cfg.hash_reps, rng, step)
    out: dict[str, Any] = {"hybridstore": ours, "vllm": {}}
    if "vllm" not in cfg.peers:
        return out
    if "vllm" in unavailable:
        out["vllm"] = {"unavailable": unavailable["vllm"]}
        return out
    step("hashing: vLLM hash_block_tokens")
    try:
        v = import_vllm_prefix()
    except PeerUnavailable as e:
        unavailable["vllm"] = str(e)
        out["vllm"] = {"unavailable": str(e)}
        return out
    tokens = rng.integers(0, VOCAB, MATCH_TOKENS, dtype=np.uint32)
    as_list = tokens.tolist()
    nbytes = tokens.nbytes
    hb = v["kv_cache_utils"].hash_block_tokens
    native = ours.get("native_gbps")
    for name, fn in vllm_hash_functions(v).items():
        init_vllm_none_hash(v, fn)
        gbps = []
        for _ in range(max(3, cfg.hash_reps // 3)):
            with no_gc():
                t0 = time.perf_counter()
                h = None
                for s in range(0, MATCH_TOKENS, BLOCK):
                    h = hb(fn, h, as_list[s:s + BLOCK], None)
                gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
        g = median(gbps)
        out["vllm"][name] = {"gbps": g, "ms_median": nbytes / g / 1e6,
                             "ours_native_vs": (native / g) if native else None}
    init_vllm_none_hash(v, vllm_hash_functions(v)["sha256"])
    return out


# ---------------------------------------------------------------------------------
# 4. memory per cached block
# ---------------------------------------------------------------------------------
def _traced(build: Callable[[], Any]) -> tuple[Any, int]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        obj = build()
        gc.collect()
        return obj, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def _memory(cfg: IndexBenchConfig, rng: np.random.Generator, step: Callable[[str], None],
            unavailable: dict[str, str]) -> dict[str, Any]:
    ours = bench_index_memory(rng, step, pages=cfg.memory_blocks)
    out: dict[str, Any] = {"hybridstore": ours}
    per = 1024 // BLOCK                    # the same 1024-token prompts as ours
    nprompts = -(-cfg.memory_blocks // per)
    seed = int(rng.integers(1 << 62))

    def prompts() -> Any:
        r = np.random.default_rng(seed)
        for _ in range(nprompts):
            yield r.integers(0, VOCAB, per * BLOCK, dtype=np.uint32)

    for peer in cfg.peers:
        if peer in unavailable:
            out[peer] = {"unavailable": unavailable[peer]}
            continue
        step(f"memory: {peer} with {nprompts * per} blocks under tracemalloc")
        try:
            # imported before tracing: module memory is not the cache's
            (import_sglang_radix if peer == "sglang" else import_vllm_prefix)()
            if peer == "sglang":
                def build() -> Any:
                    impl = SGLangRadix(BLOCK)
                    for p in prompts():
                        impl.put(impl.prepare(p))
                    return impl
                impl, traced = _traced(build)
                tensors = sum(n.value.untyped_storage().nbytes() for n in impl.nodes()
                              if n.value is not None and hasattr(n.value, "untyped_storage"))
                blocks = impl.cached_tokens() // BLOCK
                out[peer] = {"blocks": blocks, "bytes_per_block_tracemalloc": traced / blocks,
                             "tensor_bytes_per_block": tensors / blocks,
                             "bytes_per_block": (traced + tensors) / blocks,
                             "how": "tracemalloc + KV-index tensors",
                             "note": "tracemalloc (tree nodes, token-id keys) + the int64 KV-index "
                                     "tensors of the nodes (torch memory, not traced)"}
            else:
                def build() -> Any:
                    impl = VllmBlockPool(BLOCK, nprompts * per)
                    for p in prompts():
                        impl.put(impl.prepare(p))
                    return impl
                impl, traced = _traced(build)
                blocks = impl.cached_tokens() // BLOCK
                out[peer] = {"blocks": blocks, "bytes_per_block_tracemalloc": traced / blocks,
                             "bytes_per_block": traced / blocks, "how": "tracemalloc",
                             "note": "tracemalloc of the BlockPool (one KVCacheBlock per block, "
                                     "its free queue, the hash map, the 32-byte sha256 hashes)"}
            impl.close()
            del impl
            gc.collect()
        except PeerUnavailable as e:
            unavailable[peer] = str(e)
            out[peer] = {"unavailable": str(e)}
    return out


# ---------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------
def _goals(doc: dict[str, Any]) -> dict[str, Any]:
    """The issue's three goals, met or not, from the figures of this run."""
    m = doc["match_128k"]
    ix = doc["memory"]["hybridstore"]
    worst = None
    for row in doc["prompt_length"] + doc["cached_blocks"]:
        r = row.get("sglang", {}).get("ratio")
        if r is not None and (worst is None or r < worst[0]):
            worst = (r, row["op"], row.get("shape", ""), row.get("prompt_tokens"),
                     row.get("cached_blocks"))
    per_block = max(ix["bytes_per_block_index"], ix["bytes_per_block_tracemalloc"])
    return {
        "match_128k_ms": {"value": m["ms_median"], "goal": GOAL_MATCH_MS,
                          "met": m["ms_median"] <= GOAL_MATCH_MS},
        "vs_sglang_min_ratio": {
            "value": worst[0] if worst else None, "goal": GOAL_VS_SGLANG,
            "met": (worst[0] >= GOAL_VS_SGLANG) if worst else None,
            "where": None if worst is None else {"op": worst[1], "shape": worst[2],
                                                 "prompt_tokens": worst[3],
                                                 "cached_blocks": worst[4]}},
        "bytes_per_block": {"value": per_block, "goal": GOAL_INDEX_BYTES,
                            "met": per_block <= GOAL_INDEX_BYTES},
    }


def run_index_bench(json_path: str | None = None, plot_path: str | None = None, *,
                    quick: bool = False, config: IndexBenchConfig | None = None,
                    echo_json: bool = True) -> dict[str, Any]:
    """Run the index benchmark, print a table and the JSON document, return the document.

    Args:
        json_path: also write the JSON document here.
        plot_path: write the figures here (PNG, matplotlib).
        quick: :meth:`IndexBenchConfig.quick` (about a minute on 2 cores).
        config: explicit sizes (overrides ``quick``).
        echo_json: print the JSON document after the table.

    Returns:
        ``{"machine", "config", "peers", "prompt_length", "cached_blocks",
        "hashing", "memory", "match_128k", "goals", "issues"}``.
    """
    from benchmarks.index_report import plot_index, print_index_report

    cfg = config or (IndexBenchConfig.quick() if quick else IndexBenchConfig.full())
    rng = np.random.default_rng(20240611)
    issues: list[str] = []
    unavailable: dict[str, str] = {}
    started = time.perf_counter()
    steps = (len(cfg.shapes) * len(cfg.prompt_tokens) + 2 * len(cfg.cached_blocks)
             + 3 + len(cfg.peers) + 1 + 2 + 2)
    section_s: dict[str, float] = {}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        section_s[name] = round(time.perf_counter() - t0, 2)
        return out

    with progress("bench index", steps) as step:
        match = section("match_128k", lambda: bench_match(cfg.match_reps, rng, step))
        hashing = section("hashing", lambda: _hashing(cfg, rng, step, unavailable))
        length_rows = section("prompt_length",
                              lambda: _sweep_length(cfg, rng, step, unavailable, issues))
        block_rows = section("cached_blocks",
                             lambda: _sweep_blocks(cfg, rng, step, unavailable, issues))
        memory = section("memory", lambda: _memory(cfg, rng, step, unavailable))
    for row in length_rows + block_rows:
        if row.get("agree") is False:
            issues.append(f"{row['sweep']} {row.get('shape', '')} {row['op']} "
                          f"{row.get('prompt_tokens')}/{row.get('cached_blocks')}: matched "
                          f"prefixes differ: {row['matched_tokens']}")
    peers = {}
    for peer in cfg.peers:
        if peer in unavailable:
            peers[peer] = {"available": False, "unavailable": unavailable[peer]}
        elif peer == "sglang":
            peers[peer] = {"available": True, "version": sglang_version(),
                           "what": "sglang.srt.mem_cache.radix_cache.RadixCache.create_simulated"
                                   f"(page_size={BLOCK}), LRU"}
        else:
            peers[peer] = {"available": True, "version": import_vllm_prefix()["version"],
                           "what": "vllm.v1.core: hash_block_tokens(sha256) chain, BlockPool, "
                                   "FullAttentionManager.find_longest_cache_hit"}
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "config": {**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "quick": quick,
                   "block_size": BLOCK, "elapsed_s": None, "section_s": section_s,
                   "ratio": "peer median ms / hybridstore median ms (above 1: ours is faster)"},
        "peers": peers,
        "prompt_length": length_rows,
        "cached_blocks": block_rows,
        "hashing": hashing,
        "memory": memory,
        "match_128k": match,
        "issues": issues,
    }
    doc["goals"] = _goals(doc)
    doc["config"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    doc = json_safe(doc)
    print_index_report(doc)
    emit(doc, json_path=json_path, echo_json=echo_json, plot_path=plot_path, plot=plot_index)
    return doc
