"""``hybridstore demo``: one agent conversation on a real hybrid model, turn by turn.

A small Qwen3-Next (transformers' ``Qwen3NextForCausalLM``: Gated DeltaNet and
full-attention layers, MoE MLPs, random weights, CPU reference kernels) serves
one agent session through :class:`~hybridstore.adapters.transformers.CachedModel`.
The context is mutated the ways agent harnesses mutate it (HiState §2.2):
appends, a tool result truncated in the middle, a rewind that edits an earlier
user message, a compaction — and the store is closed and reopened in the
middle, so later turns resume from the SSD tier.

Checkpoints are placed by HiState's adaptive interval (eq. 3–6, sized from this
model's state and KV bytes) plus semantic anchors at message boundaries
(seed 003), so mutations inside a message still find a nearby state.

For every turn the demo measures the cached prefill (match + load + prefill of
the rest + puts) against a plain full prefill of the same prompt, and checks
that the logits agree (fp32 reassociation only; see
``tests/adapters/test_transformers.py`` for the bound).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridstore.config import StoreConfig
from hybridstore.policy import AdaptiveInterval, Compose, SemanticAnchors
from hybridstore.store import HybridStore

VOCAB = 32_000
FULL_REPEATS = 3
LOGIT_BOUND = 2e-5
"""Largest relative logit difference a resume may show (fp32 reassociation)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the session: its prompt and message boundaries (anchors)."""

    label: str
    tokens: np.ndarray
    anchors: tuple[int, ...]
    reopen_before: bool = False


def conversation(seed: int = 7, scale: float = 1.0) -> list[Turn]:
    """The session: seven requests with the four kinds of context mutation."""
    rng = np.random.default_rng(seed)

    def msg(n: int) -> np.ndarray:
        return rng.integers(1, VOCAB, max(1, int(n * scale)))

    marker = np.array([0])                                  # "[... truncated ...]"
    system, user1, asst1, tool1 = msg(1200), msg(260), msg(120), msg(1500)
    asst2, user2, summary, user3, user4 = msg(90), msg(140), msg(500), msg(180), msg(160)

    def turn(label: str, *parts: np.ndarray, reopen: bool = False) -> Turn:
        ends = tuple(int(x) for x in np.cumsum([len(p) for p in parts]))
        return Turn(label, np.concatenate(parts), ends, reopen)

    head, tail = tool1[: len(tool1) * 2 // 3 + 7], tool1[-len(tool1) // 6:]
    truncated = np.concatenate([head, marker, tail])
    edit_at = len(user1) // 2 + 3
    return [
        turn("1 system + user", system, user1),
        turn("2 append: tool result", system, user1, asst1, tool1),
        turn("3 append: user", system, user1, asst1, tool1, asst2, user2),
        turn("4 truncate tool result mid-message", system, user1, asst1, truncated, user3),
        turn("5 restart, then append", system, user1, asst1, truncated, user3, user4, reopen=True),
        turn("6 rewind + edit user message", system, user1[:edit_at], msg(300)),
        turn("7 compaction", system, summary, msg(150)),
    ]


def run_demo(disk_path: str | None = None, console: Console | None = None,
             scale: float = 1.0, width: int = 384, layers: int = 6) -> list[dict]:
    """Run the demo; returns one row per turn (also printed as a table).

    Args:
        disk_path: the SSD tier's directory (default: a temporary one).
        console: where to print.
        scale: multiply every message length (tests use a small scale).
        width, layers: the model's hidden size and depth.
    """
    from hybridstore.adapters.hf_models import small_model
    from hybridstore.adapters.transformers import CachedModel, CacheSpec

    console = console or Console(width=160)
    # wide enough that per-token compute, not per-forward overhead, dominates a prefill on CPU
    model = small_model("qwen3-next", vocab=VOCAB, width=width, layers=layers)
    block = 64
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hybridstore-demo-") as tmp:
        path = disk_path or str(Path(tmp) / "ssd")
        cfg = StoreConfig(block_size=block, host_bytes=2 << 20, disk_path=path, disk_bytes=1 << 30,
                          disk_segment_bytes=16 << 20, namespace="demo/qwen3-next-small@seed0")

        spec = CacheSpec.probe(model, block)
        placement = Compose(AdaptiveInterval(state_bytes=spec.state_bytes,
                                             kv_bytes_per_token=int(spec.kv_bytes_per_token),
                                             block_size=block, min_interval=block),
                            SemanticAnchors())
        store = HybridStore(cfg, placement=placement)
        cm = CachedModel(model, store)
        warm = np.random.default_rng(1).integers(1, VOCAB, 600)
        cm.prefill(warm)                                      # warm up kernels and the allocator
        cm.prefill(np.concatenate([warm, warm[:200]]))        # (unrelated tokens: never matched below)
        cm.reference(warm)
        try:
            turns = conversation(scale=scale)
            with console.status("serving the session") as status:
                for turn in turns:
                    if turn.reopen_before:
                        store.flush()
                        store.close()
                        store = HybridStore(cfg, placement=placement)   # what a new process sees
                        cm = CachedModel(model, store)
                    status.update(f"turn {turn.label}")
                    times = []
                    for _ in range(FULL_REPEATS):               # median of a few: the host is shared
                        t0 = time.perf_counter()
                        ref = cm.reference(turn.tokens)
                        times.append(time.perf_counter() - t0)
                    full_s = float(np.median(times))
                    out = cm.prefill(turn.tokens, anchors=turn.anchors)
                    rep = cm.last
                    err = float((out - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                    rows.append({
                        "turn": turn.label, "prompt": rep.tokens, "reused": rep.reused_tokens,
                        "recomputed": rep.recomputed_tokens,
                        "from_dram_KiB": rep.restored_bytes.get("host", 0) / 1024,
                        "from_ssd_KiB": rep.restored_bytes.get("disk", 0) / 1024,
                        "checkpoints": len(rep.checkpoints),
                        "full_ms": full_s * 1e3, "cached_ms": rep.total_s * 1e3,
                        "load_ms": rep.load_s * 1e3, "saved_ms": (full_s - rep.total_s) * 1e3,
                        "speedup": full_s / rep.total_s, "logit_rel_err": err,
                        "exact": bool(err <= LOGIT_BOUND),
                    })
        finally:
            store.close()
    _print(console, rows)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Per turn: tokens reused vs recomputed, and full vs cached prefill time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["turn"].split(" ", 1)[0] for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    reused = [r["reused"] for r in rows]
    ax1.bar(x, reused, label="reused")
    ax1.bar(x, [r["recomputed"] for r in rows], bottom=reused, label="recomputed")
    ax1.set(xticks=x, xticklabels=labels, xlabel="turn", ylabel="prompt tokens",
            title="tokens per turn")
    ax1.legend()
    ax2.bar(x - 0.2, [r["full_ms"] for r in rows], 0.4, label="full prefill")
    ax2.bar(x + 0.2, [r["cached_ms"] for r in rows], 0.4, label="hybridstore (load + rest + puts)")
    ax2.set(xticks=x, xticklabels=labels, xlabel="turn", ylabel="ms (measured, CPU)",
            title="prefill time per turn")
    ax2.legend()
    fig.suptitle("hybridstore demo: " + "; ".join(f"{lab}: {r['turn'].split(' ', 1)[1]}"
                                                 for lab, r in zip(labels, rows)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(console: Console, rows: list[dict]) -> None:
    table = Table(title="hybridstore demo: one agent session on a small Qwen3-Next (CPU), "
                        "DRAM 2 MiB + SSD, adaptive interval + anchors")
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "turn" else "right")
    for row in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) and k == "logit_rel_err" else
                        f"{v:.1f}" if isinstance(v, float) else str(v) for k, v in row.items()])
    console.print(table)
    reused = sum(r["reused"] for r in rows)
    total = sum(r["prompt"] for r in rows)
    saved = sum(r["saved_ms"] for r in rows)
    full = sum(r["full_ms"] for r in rows)
    console.print(f"reused {reused}/{total} tokens ({reused / total:.0%}); measured time saved "
                  f"{saved / 1e3:.2f} s of {full / 1e3:.2f} s of full prefills "
                  f"({full / max(1e-9, full - saved):.1f}x)")
