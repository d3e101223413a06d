"""Model presets for the replay: bytes per token, checkpoint bytes, and a prefill cost model.

Prefill time of tokens ``[start, end)`` on one GPU follows a per-token term
(dense FLOPs: 2 x active parameters) plus an attention term that grows with
context (full-attention layers only; recurrent layers cost no more at long
context)::

    T(start, end) = (end - start) * (2 * P_active) / F
                  + (end^2 - start^2) / 2 * (4 * L_attn * H_q * d_head) / F

with ``F`` the effective prefill FLOP/s of the GPU.  Decode runs at a fixed
time per output token.  The numbers below come from the models' public
configs; where a figure is rounded it says so.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from hybridstore.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPreset:
    """A hybrid model as the cache sees it.

    Attributes:
        name: preset name.
        kv_bytes_per_token: attention KV of one token, all attention layers.
        checkpoint_bytes: one recurrent-state checkpoint, all recurrent layers.
        active_params: parameters touched per token (MoE: active only).
        attn_layers, q_heads, head_dim: full-attention shape (attention term).
        recurrent_layers: linear-attention / Mamba layers (their states make up
            ``checkpoint_bytes``); how vLLM lays out its hybrid pages
            (:func:`vllm_hybrid_pages`).  0: unknown.
        prefill_flops: effective prefill FLOP/s of the serving GPU.
        decode_s_per_token: decode time per output token.
        source: where the numbers come from.
    """

    name: str
    kv_bytes_per_token: int
    checkpoint_bytes: int
    active_params: float
    attn_layers: int
    q_heads: int
    head_dim: int
    recurrent_layers: int = 0
    prefill_flops: float = 400e12
    decode_s_per_token: float = 0.012
    source: str = ""

    def prefill_seconds(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)`` given a cached ``[0, start)``."""
        if end <= start:
            return 0.0
        dense = (end - start) * 2.0 * self.active_params
        attention = (end * end - start * start) / 2.0 * 4.0 * self.attn_layers * self.q_heads * self.head_dim
        return (dense + attention) / self.prefill_flops

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one KV page of ``block_size`` tokens."""
        return self.kv_bytes_per_token * block_size

    def state_tokens(self) -> float:
        """N_s of HiState eq. 4: one checkpoint in token equivalents of KV."""
        return self.checkpoint_bytes / self.kv_bytes_per_token

    def with_state_scale(self, factor: float) -> ModelPreset:
        """The same model with checkpoints ``factor`` times its own (a what-if: a model with
        smaller or larger recurrent states, or states kept at another precision).  KV,
        compute and the layer counts are unchanged; vLLM's hybrid block follows the state
        (:func:`vllm_hybrid_pages`), as it would for such a model.

        Raises:
            ConfigError: ``factor`` is not positive and finite.
        """
        if factor == 1:
            return self
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"state scale must be positive and finite, got {factor!r}")
        return replace(self, checkpoint_bytes=max(1, round(self.checkpoint_bytes * factor)))

    def scaled(self, factor: float) -> ModelPreset:
        """The same model with KV and checkpoints ``factor`` times smaller (data-mode replay).

        KV bytes per token are rounded to an int and the checkpoint follows
        them, so N_s (HiState eq. 4) is kept; the exact factor applied is
        ``self.kv_bytes_per_token / result.kv_bytes_per_token``.  Compute
        costs are unchanged.

        Raises:
            ConfigError: ``factor`` is below 1 or leaves less than a byte of KV per token.
        """
        if factor == 1:
            return self
        kv = round(self.kv_bytes_per_token / factor)
        if not factor >= 1 or kv < 1:
            raise ConfigError(f"scale must be at least 1 and at most {self.kv_bytes_per_token} "
                              f"(a byte of KV per token of {self.name}), got {factor}")
        return replace(self, kv_bytes_per_token=kv,
                       checkpoint_bytes=max(1, round(self.checkpoint_bytes * kv / self.kv_bytes_per_token)))


MODELS: dict[str, ModelPreset] = {
    # HiState's setting: BF16 KV, FP32 recurrent matrices; ~1.1 GB of KV and
    # ~1.6 GB of checkpoints at a 1,024-token interval over 32K tokens
    # (32 checkpoints of ~50 MB).  8 of 32 layers full attention.
    "qwen3.5-9b": ModelPreset(
        name="qwen3.5-9b", kv_bytes_per_token=1_100_000_000 // 32_768,
        checkpoint_bytes=1_600_000_000 // 32, active_params=9e9, attn_layers=8, q_heads=16,
        head_dim=256, recurrent_layers=24, source="HiState §3.1 (1.1 GB KV, 1.6 GB checkpoints / 32K @ I=1024)"),
    # Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (12), 2 KV heads
    # x 256, 16 query heads; 36 Gated DeltaNet layers with 32 value heads of
    # 128x128 FP32 state (+ a small conv state): ~75 MB per checkpoint.
    "qwen3-next-80b-a3b": ModelPreset(
        name="qwen3-next-80b-a3b", kv_bytes_per_token=12 * 2 * 2 * 256 * 2,
        checkpoint_bytes=36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2), active_params=3e9,
        attn_layers=12, q_heads=16, head_dim=256, recurrent_layers=36,
        source="Qwen3-Next-80B-A3B config.json (rounded conv state)"),
    # Nemotron-H-8B: 52 layers, 4 attention (8 KV heads x 128), Mamba-2 layers
    # with 128 heads x 64 head dim x 128 state, kept in FP32.
    "nemotron-h-8b": ModelPreset(
        name="nemotron-h-8b", kv_bytes_per_token=4 * 2 * 8 * 128 * 2,
        checkpoint_bytes=24 * 128 * 64 * 128 * 4, active_params=8e9, attn_layers=4, q_heads=32,
        head_dim=128, recurrent_layers=24, source="Nemotron-H-8B config (24 Mamba-2 layers counted, FP32 SSM state)"),
}


@dataclass(frozen=True, slots=True)
class VLLMPages:
    """How vLLM 0.33 lays out a hybrid model's one block pool (see :func:`vllm_hybrid_pages`).

    Attributes:
        block_tokens: tokens per block of every group (attention and Mamba alike).
        group_layers: layers per KV cache group (one page each per block).
        attention_groups, mamba_groups: groups of each kind; a request's Mamba state
            takes one block in each Mamba group.
        block_bytes: bytes of one block id (``group_layers`` pages).
    """

    block_tokens: int
    group_layers: int
    attention_groups: int
    mamba_groups: int
    block_bytes: float


@functools.cache
def vllm_hybrid_pages(model: ModelPreset, kernel_block: int = 16) -> VLLMPages:
    """vLLM's hybrid page layout for ``model``.

    ``platforms/interface.py`` (``_align_hybrid_block_size``) raises the attention block
    size to the smallest multiple of the kernel block (16 for FlashAttention) whose
    per-layer page covers one layer's Mamba state, and pads the Mamba page to it (align
    mode: the Mamba block size follows); ``v1/core/kv_cache_planning.py`` groups the
    layers in groups of the smaller layer count (the larger when under 1.5 x), and one
    block id of the shared pool is one page in every layer of a group; ``num_blocks =
    memory // (group_layers x page)``.

    Raises:
        ConfigError: the model preset does not give its recurrent layer count.
    """
    if model.recurrent_layers < 1 or model.attn_layers < 1:
        raise ConfigError(f"model {model.name} gives no recurrent layer count")
    kv_layer = model.kv_bytes_per_token / model.attn_layers       # one layer, one token
    state_layer = model.checkpoint_bytes / model.recurrent_layers
    block = kernel_block * math.ceil(state_layer / (kernel_block * kv_layer))
    lo, hi = sorted((model.attn_layers, model.recurrent_layers))
    group = hi if hi < 1.5 * lo else lo
    return VLLMPages(block_tokens=block, group_layers=group,
                     attention_groups=math.ceil(model.attn_layers / group),
                     mamba_groups=math.ceil(model.recurrent_layers / group),
                     block_bytes=group * block * kv_layer)


def model_preset(name: str) -> ModelPreset:
    """The model preset called ``name``; ConfigError lists the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
