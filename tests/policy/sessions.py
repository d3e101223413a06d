"""Agent sessions on a real HybridStore with accounting tiers, for scenario tests.

The helpers read like HiState's figures: a :class:`Session` appends turns
(each resumes from the cache, prefills, stores its pages and the checkpoint at
the turn's end), forks at an earlier turn boundary, and asks where a request
would resume.  Checkpoints live in a capacity-limited share of DRAM (the
``partition`` tier policy): about ``state_slots`` checkpoints fit, and putting
more makes the store evict checkpoints in the order of the policy under test
(a few at a time: the store frees some slack with each eviction).
"""

from __future__ import annotations

import itertools

import numpy as np

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.index.trie import Checkpoint

B = 16                      # tokens per KV page
PAGE = 16 * B               # 16 bytes of KV per token
STATE = 1024 * 16           # a checkpoint weighs as much as 1024 tokens of KV (N_s = 1024)

_ids = itertools.count(1)


def make_store(policy: str, *, state_slots: float) -> HybridStore:
    """A store whose checkpoint share of DRAM holds ``state_slots`` checkpoints (KV has as much)."""
    cap = int(2 * state_slots * STATE)
    cfg = StoreConfig(block_size=B, tier_policy="partition", policy=policy)
    return HybridStore(cfg, tiers={"host": AccountingTier("host", cap, read_gbps=64)})


class Session:
    """One agent trajectory: its context grows by turns, each checkpointed at its end."""

    def __init__(self, store: HybridStore, name: str) -> None:
        self.store = store
        self.name = name
        self.tokens = np.zeros(0, dtype=np.int64)
        self.ends: dict[int, int] = {}    # turn -> position of its checkpoint S_turn

    def fork(self, turn: int, name: str) -> Session:
        """A new trajectory that continues this one's context after turn ``turn``."""
        other = Session(self.store, name)
        other.tokens = self.tokens[: self.ends[turn]].copy()
        other.ends = {t: p for t, p in self.ends.items() if p <= self.ends[turn]}
        return other

    def _fresh(self, n: int) -> np.ndarray:
        return np.array([next(_ids) for _ in range(n)], dtype=np.int64)

    def turn(self, number: int, new_tokens: int) -> int:
        """Append a turn; returns the position it resumed from."""
        resumed = self.begin(new_tokens)
        self.finish(number)
        return resumed

    def begin(self, new_tokens: int) -> int:
        """The first half of a turn: the request arrives and resumes (a cache hit or not)."""
        self.tokens = np.concatenate([self.tokens, self._fresh(new_tokens)])
        self._prompt = self.store.prefix(self.tokens)
        self._plan = self.store.match(self._prompt)
        return self._plan.position

    def finish(self, number: int) -> None:
        """The second half: store the prefilled pages and the turn's final checkpoint."""
        store, prompt, plan = self.store, self._prompt, self._plan
        store.put_kv_sized(prompt, nbytes=PAGE, first_block=plan.position // B)
        store.put_state_sized(prompt, nbytes=STATE)
        store.release(plan)
        self.ends[number] = len(self.tokens)

    def resume_if_appended(self) -> int:
        """Where the next append of this session would resume (a probe: no puts, no on_hit)."""
        return self._probe(np.concatenate([self.tokens, self._fresh(8)]))

    def resume_if_forked_at(self, turn: int) -> int:
        """Where a request forking right after turn ``turn`` would resume (a probe)."""
        return self._probe(np.concatenate([self.tokens[: self.ends[turn]], self._fresh(8)]))

    def _probe(self, tokens: np.ndarray) -> int:
        plan = self.store.index.match(self.store.prefix(tokens))   # no on_hit: a pure probe
        self.store.index.release(plan)
        return plan.position

    def checkpoint(self, turn: int) -> Checkpoint | None:
        key = self.store.prefix(self.tokens[: self.ends[turn]]).key_at(self.ends[turn])
        return self.store.index.checkpoint(key)

    def has(self, turn: int) -> bool:
        return self.checkpoint(turn) is not None


def evicted(store: HybridStore, *sessions_turns: tuple[Session, int]) -> list[str]:
    """Names ``"S<turn>"`` of the listed checkpoints that are gone."""
    return [f"S{turn}" for s, turn in sessions_turns if not s.has(turn)]
