"""SGLang's extra-buffer state tracking: one state per prefill chunk, or the branch point.

With ``--mamba-radix-cache-strategy extra_buffer`` (what ``auto`` resolves to with overlap
scheduling or pages over one token) SGLang 0.5.23 keeps a recurrent state only where its
scheduler tracks one (``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``):

* each prefill chunk ``[s, e)`` (``chunked_prefill_size`` tokens from the resume point,
  the last one shorter) tracks ONE state, at ``s + (e - s) // B * B`` (``B``: the
  checkpoint grid, ``lcm(mamba chunk 64, page size)``), none when the chunk is shorter
  than ``B``;
* instead, the branch point (``mamba_branching_seqlen``: the KV match floored to the grid,
  where it runs past the state match) when it lies strictly inside the chunk, on its grid;
* during decode, every ``mamba_track_interval`` tokens (not a placement of the prompt).

The radix insert then stops at the last tracked state (``checkpoint_into_tree``:
``effective_cache_len``): KV past it is freed, which the preset models with
``Preset.kv_to_last_state``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridstore.errors import ConfigError
from hybridstore.policy.base import PlacementPolicy, ResidenceStats


class ChunkTrack(PlacementPolicy):
    """One state per scheduler chunk of the new segment, or the branch point in its chunk.

    Args:
        block_size: the checkpoint grid (tokens per KV page, 64 for SGLang's default).
        chunk: tokens per prefill chunk (SGLang's ``chunked_prefill_size``, 8192 on an
            H100 / H200).

    The branch point comes as an anchor (the engine passes it with ``branch=True``); any
    other anchor is ignored.
    """

    name = "chunk-track"

    def __init__(self, *, block_size: int = 64, chunk: int = 8192) -> None:
        if block_size < 1 or chunk < block_size:
            raise ConfigError(f"need 1 <= block_size <= chunk, got {block_size}, {chunk}")
        self.block_size = block_size
        self.chunk = chunk // block_size * block_size

    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        B = self.block_size
        branches = [a // B * B for a in anchors]
        out = []
        s = cached
        while s < length:
            e = min(s + self.chunk, length)
            if e - s >= B:
                t = s + (e - s) // B * B
                inside = [b for b in branches if s < b < e and (b - s) % B == 0]
                out.append(max(inside) if inside else t)
            s = e
        return out


__all__ = ["ChunkTrack"]
