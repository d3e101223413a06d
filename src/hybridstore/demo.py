"""``hybridstore demo``: one agent conversation through DRAM and disk, then a restart.

A hybrid model with the shape of a small Qwen3-Next-style stack (bf16 KV pages,
fp32 Gated-DeltaNet states; the bytes are deterministic pseudo-random stand-ins
for what an engine would compute) runs a few agent turns:

1. turn 1 prefills a system prompt and a user message; the engine puts every
   page and a checkpoint at the request end, which lies *inside* a block;
2. turn 2 appends (a tool result) and resumes at turn 1's end;
3. the DRAM pool is small, so older pages spill to the SSD tier; the store is
   then closed and reopened from ``disk_path`` (a new process would see the
   same);
4. turn 3 is a *mutated* prompt: the agent truncates turn 2's tool result in
   the middle of a block; the store resumes at the deepest checkpoint that
   is still valid, restoring pages and state from disk.

Every restored page and state is compared with the bytes that were put.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from hybridstore.config import StoreConfig
from hybridstore.store import HybridStore


@dataclass(frozen=True, slots=True, kw_only=True)
class ToyModel:
    """Byte sizes of a small hybrid stack (per page: all attention layers)."""

    block_size: int = 16
    attn_layers: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_layers: int = 12
    gdn_heads: int = 4
    gdn_dim: int = 64

    def page(self, key: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(key)
        shape = (self.attn_layers, 2, self.block_size, self.kv_heads, self.head_dim)
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    def state(self, key: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(key)
        return {f"gdn.{i}": torch.randn(self.gdn_heads, self.gdn_dim, self.gdn_dim, generator=g)
                for i in range(self.gdn_layers)}


def _key(tokens: np.ndarray) -> int:
    return int(np.bitwise_xor.reduce(tokens.astype(np.int64) * 2654435761 + len(tokens)) & 0x7FFFFFFF)


def serve(store: HybridStore, model: ToyModel, tokens: np.ndarray, truth: dict, label: str) -> dict:
    """One request: match, load and verify, 'prefill' the rest, put pages and the end state."""
    B = model.block_size
    prompt = store.prefix(tokens)
    t0 = time.perf_counter()
    plan = store.match(prompt)
    pages, state = store.load(plan).result()
    restore_s = time.perf_counter() - t0
    exact = all(torch.equal(p, truth["pages"][k]) for k, p in zip(plan.page_keys, pages))
    if state is not None:
        exact &= all(torch.equal(state[n], truth["states"][plan.state_key][n]) for n in state)
    store.release(plan)
    # The engine recomputes [plan.position, len) and puts what it computed.
    first_new = plan.position // B
    new_pages = []
    for k in range(first_new, prompt.nblocks):
        page = model.page(_key(tokens[: prompt.block_end(k)]))
        truth["pages"][prompt.block_key(k)] = page
        new_pages.append(page)
    if new_pages:
        store.put_kv(prompt, new_pages)
    for p in store.checkpoint_positions(cached=plan.position, length=len(tokens)):
        state = model.state(_key(tokens[:p]))
        store.put_state(prompt, state, position=p)
        truth["states"][prompt.key_at(p)] = state
    tiers = store.stats()["tiers"]
    return {"request": label, "prompt": len(tokens), "reused": plan.position,
            "recomputed": len(tokens) - plan.position, "restore_ms": restore_s * 1e3,
            "bit_exact": exact, "host_MiB": tiers["host"]["used_bytes"] / 2**20,
            "disk_MiB": tiers.get("disk", {}).get("used_bytes", 0) / 2**20}


def run_demo(disk_path: str | None = None, console: Console | None = None) -> list[dict]:
    """Run the demo; returns one row per request (also printed as a table)."""
    console = console or Console(width=150)
    model = ToyModel()
    rng = np.random.default_rng(7)
    system = rng.integers(0, 150_000, 1_000)
    user1 = rng.integers(0, 150_000, 203)
    tool = rng.integers(0, 150_000, 611)
    user3 = rng.integers(0, 150_000, 97)
    turn1 = np.concatenate([system, user1])                      # ends inside a block
    turn2 = np.concatenate([turn1, tool])
    cut = len(turn1) + 250                                         # mid-block truncation of the tool result
    turn3 = np.concatenate([turn2[:cut], user3])
    truth: dict = {"pages": {}, "states": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridstore-demo-") as tmp:
        path = disk_path or str(Path(tmp) / "ssd")
        cfg = StoreConfig(block_size=model.block_size, host_bytes=4 << 20, disk_path=path,
                          disk_bytes=1 << 30, disk_segment_bytes=16 << 20)
        with HybridStore(cfg) as store:
            rows.append(serve(store, model, turn1, truth, "turn 1: system + user"))
            # The engine also checkpoints where the tool result will be cut later
            # (a semantic anchor inside the tool result, as seed 003 places them).
            rows.append(serve(store, model, turn2, truth, "turn 2: + tool result"))
            anchored = store.prefix(turn2)
            anchor_state = model.state(_key(turn2[:cut]))
            store.put_state(anchored, anchor_state, position=cut)
            truth["states"][anchored.key_at(cut)] = anchor_state
            store.flush()
        with HybridStore(cfg) as store:    # reopen: everything on disk is matchable again
            rows.append(serve(store, model, turn3, truth, "turn 3 (reopened): truncated tool"))
            rows.append(serve(store, model, turn3, truth, "turn 3 again (warm)"))
    table = Table(title="hybridstore demo: one agent conversation, DRAM (4 MiB) + SSD")
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "request" else "right")
    for row in rows:
        table.add_row(*[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()])
    console.print(table)
    return rows
