"""Checkpoint placement: request end, branch points, block-aligned steps, and their unions.

Placements answer one question for a new prompt segment ``(cached, length]``:
where should the engine capture recurrent states?  Each policy here is one
rule; :class:`Compose` takes the union of several.

=====================  ====================================================
policy                 positions
=====================  ====================================================
:class:`RequestEnd`    the request end (FlashStates ASC: exactly where the
                       next turn resumes, even inside a KV block) and every
                       anchor the engine gives
:class:`BranchPoints`  Marconi: the request end plus the branch point where
                       the prompt left the cached context
:class:`BlockAligned`  vLLM align mode: every scheduler chunk's end and the
                       last block boundary, all on block boundaries
:class:`Compose`       the union of its parts
=====================  ====================================================

Interval placements (SGLang's fixed interval, HiState's adaptive interval)
live in :mod:`~hybridstore.policy.intervals`, semantic anchors in
:mod:`~hybridstore.policy.anchors`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridstore.errors import ConfigError
from hybridstore.policy.base import PlacementPolicy, ResidenceStats


class RequestEnd(PlacementPolicy):
    """Checkpoint at the request end and at every anchor of the new segment."""

    name = "request-end"

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        picked = {p for p in anchors if cached < p <= length}
        if length > cached:
            picked.add(length)
        return sorted(picked)


class BranchPoints(RequestEnd):
    """Marconi's placement: the request end plus the branch point.

    The branch point is where the prompt diverges from the cached context (the
    end of its longest cached token prefix).  When it lies past ``cached`` —
    the KV matched further than a checkpoint did — the prefill passes it
    anyway, and a state there serves every later request that shares the same
    prefix and diverges at the same place.  Pass it as ``branch``; through
    :meth:`HybridStore.checkpoint_positions`, which forwards only anchors, the
    engine passes it as an anchor (anchors are taken as branch points).
    """

    name = "marconi"

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None, branch: int | None = None) -> list[int]:
        extra = () if branch is None else (branch,)
        return super().positions(cached=cached, length=length, anchors=(*anchors, *extra))


class BlockAligned(PlacementPolicy):
    """vLLM's align mode: states at scheduler-step ends that fall on block boundaries.

    The prefill of the new segment runs in chunks of ``chunk`` tokens rounded
    down to whole blocks; a state is kept at the end of each chunk and at the
    last block boundary at or before ``length``.  A request end inside a block
    gets no state (the placement misses that FlashStates' ASC avoids).

    Args:
        block_size: tokens per KV block.
        chunk: tokens per scheduler step; ``None``: only the last block boundary.
        logits_token: the last boundary is the last one *before* ``length`` (vLLM
            0.33's ``get_mamba_prefill_checkpoint_position``: the prompt's last token is
            always recomputed for its logits, so a prompt of whole blocks keeps its state
            one block earlier).
        junctions: the anchors the engine gives (the branch point: where the KV match
            ran past the deepest state) are junctions: a chunk stops at the block
            boundary at or below one and keeps its state there, the next chunk starting
            from it (vLLM 0.33's ``shared_prefix_boundary``, block-floored, in
            ``Scheduler._mamba_block_aligned_split``).  False: anchors are ignored.
    """

    name = "block-aligned"

    def __init__(self, *, block_size: int = 16, chunk: int | None = None,
                 logits_token: bool = False, junctions: bool = False) -> None:
        if block_size < 1 or (chunk is not None and chunk < 1):
            raise ConfigError(f"block_size and chunk must be positive, got {block_size}, {chunk}")
        self.block_size = block_size
        self.chunk = chunk
        self.logits_token = logits_token
        self.junctions = junctions

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        B = self.block_size
        last = max(0, length - 1) // B * B if self.logits_token else length // B * B
        stops = sorted({a // B * B for a in anchors if cached < a // B * B < last}
                       if self.junctions else set())
        picked = set(stops)
        if last > cached:
            picked.add(last)
        if self.chunk is not None:
            step = max(B, self.chunk // B * B)
            start = cached // B * B
            for end in [*stops, last]:     # chunks restart at every junction
                picked.update(range(start + step, end, step))
                start = max(start, end)
        return sorted(p for p in picked if p > cached)


class Compose(PlacementPolicy):
    """The union of several placements (e.g. adaptive intervals plus semantic anchors).

    Args:
        policies: the parts, positionally or as ``parts=`` (the registry's form).
    """

    def __init__(self, *policies: PlacementPolicy, parts: Sequence[PlacementPolicy] = ()) -> None:
        policies = (*policies, *parts)
        if not policies:
            raise ConfigError("Compose needs at least one placement policy")
        self.policies = policies
        self.name = "+".join(p.name for p in policies)
        self.resume_horizon = max(p.resume_horizon for p in policies)

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        picked: set[int] = set()
        for policy in self.policies:
            picked.update(policy.positions(cached=cached, length=length, anchors=anchors, stats=stats))
        return sorted(picked)

    def on_resume(self, back: int) -> None:
        for policy in self.policies:
            policy.on_resume(back)


__all__ = ["BlockAligned", "BranchPoints", "Compose", "RequestEnd"]
