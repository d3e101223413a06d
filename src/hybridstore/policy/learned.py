"""Learned resume offsets: states where this workload's resumes land (issue 15, part 3).

HiState's adaptive interval prices a state inside a new segment with eq. 3's
``p_t = 1/L``: a later request may resume anywhere in it.  Agent traces do not
resume uniformly.  On the WEKA Claude Code sessions about 90 % of requests append
to the previous one (they resume at its end), 4-8 % rewrite its last turn (they
resume one to three 64-token blocks before its end), about 3 % go back tens of
thousands of tokens, and almost none land in between (``replay/divergence.py``).
Where the mass sits depends on the agent and the engine, so it is learned online.

:class:`LearnedOffsets` wraps a base placement (vLLM's align mode, HiState's
interval, anchors: whatever the engine can checkpoint) and keeps an exponentially
weighted histogram of ``back``: at each resume, how far before the deepest
checkpoint of the trajectory the prompt left it left that trajectory
(:func:`~hybridstore.policy.base.resume_back`, reported by
:meth:`HybridStore.match <hybridstore.store.facade.HybridStore.match>`; 0 for an
append).  For a new segment whose base placement ends at ``e`` it adds states at
``e - k B`` (``B`` the alignment grid) greedily, each where eq. 3 with the learned
``p`` (instead of ``1/L``) saves more than eq. 4 charges for one state:

    gain(x) = sum_b p_b (x - s_b) [s_b < x <= e - b]  >  (T_KV / T_state) N_s

``s_b`` is the deepest state already placed (or the segment's resume point) at or
before ``e - b``: a resume there now starts ``x - s_b`` tokens later.  The right
side is eq. 4 for one state, so under the same memory pressure that sets HiState's
interval the offsets pay or are not placed.  With the WEKA mix and a 9B hybrid
(``N_s`` about 1,600 tokens) the learned gain of a state one vLLM block before the
end is some 70 tokens: none is placed, and the placement stays the base's.  A
workload that rewrites often, or a model with small states, gets them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.policy.base import PlacementPolicy, ResidenceStats


class LearnedOffsets(PlacementPolicy):
    """A base placement plus states at the learned resume offsets before its last state.

    Args:
        base: the placement whose positions are kept (at least one part).
        block_size: the offset grid and alignment, in tokens (an engine's checkpoint
            granularity: vLLM's hybrid block in align mode).
        state_tokens: ``N_s``, a state's bytes in KV-token equivalents (eq. 4).
        horizon_blocks: offsets considered, in grid blocks; a resume further back
            counts as "far" (no offset serves it).
        ema: weight of each observed resume in the histogram.
        max_states: most states added per segment.
    """

    name = "learned"

    def __init__(self, *base: PlacementPolicy, parts: Sequence[PlacementPolicy] = (),
                 block_size: int = 16, state_tokens: float = 1.0, horizon_blocks: int = 16,
                 ema: float = 0.02, max_states: int = 2) -> None:
        base = (*base, *parts)
        if not base:
            raise ConfigError("LearnedOffsets needs a base placement")
        if block_size < 1 or horizon_blocks < 1 or max_states < 0 or state_tokens <= 0:
            raise ConfigError("block_size, horizon_blocks and state_tokens must be positive and "
                              f"max_states >= 0; got {block_size}, {horizon_blocks}, "
                              f"{state_tokens}, {max_states}")
        if not 0.0 < ema <= 1.0:
            raise ConfigError(f"ema must be in (0, 1], got {ema}")
        self.base = base
        self.block_size = block_size
        self.state_tokens = float(state_tokens)
        self.ema = ema
        self.max_states = max_states
        self.name = "+".join([*(p.name for p in base), "learned"])
        # p_b for b = 0..horizon grid blocks back, then "far"; before any evidence every
        # resume is an append (nothing is added until the workload shows otherwise)
        self.probs = np.zeros(horizon_blocks + 2)
        self.probs[0] = 1.0
        self.observed = 0
        self.resume_horizon = horizon_blocks * block_size

    def on_resume(self, back: int) -> None:
        """One resume landed ``back`` tokens before the left trajectory's deepest state."""
        k = min(-(-max(back, 0) // self.block_size), len(self.probs) - 1)
        self.probs *= 1.0 - self.ema
        self.probs[k] += self.ema
        self.observed += 1
        for part in self.base:
            part.on_resume(back)

    def gains(self, end: int, states: Sequence[int]) -> np.ndarray:
        """Expected tokens saved per resume by a state at ``end - k B``, for ``k = 0..horizon``."""
        B = self.block_size
        k = np.arange(len(self.probs) - 1)
        land = end - k * B                       # a resume b blocks back lands at or after this
        have = np.sort(np.asarray(states, dtype=np.int64))
        at = np.searchsorted(have, land, side="right") - 1
        prev = np.where(at >= 0, have[np.maximum(at, 0)], 0)    # s_b
        p = self.probs[:-1]
        x = (land // B * B)[:, None]             # candidates x (rows, grid-aligned), resumes b (cols)
        use = (prev[None, :] < x) & (x <= land[None, :])
        return (use * (x - prev[None, :]) * p[None, :]).sum(axis=1)

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        picked: set[int] = set()
        for part in self.base:
            picked.update(part.positions(cached=cached, length=length, anchors=anchors, stats=stats))
        if not picked or not self.max_states or self.probs[0] >= 1.0:
            return sorted(picked)
        end = max(picked)
        cost = (stats.kv_state_ratio() if stats is not None else 1.0) * self.state_tokens
        B = self.block_size
        states = [cached, *picked]
        for _ in range(self.max_states):
            gain = self.gains(end, states)
            gain[0] = 0.0                        # the base's own last state
            k = int(np.argmax(gain))
            x = (end - k * B) // B * B           # the candidate gains() priced
            if gain[k] <= cost or x <= cached:
                break
            picked.add(x)
            states.append(x)
        return sorted(picked)


__all__ = ["LearnedOffsets"]
