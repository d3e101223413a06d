"""Page and state sizes of a real hybrid model, per tensor-parallel rank.

Qwen3-Next-80B-A3B (``config.json`` of ``Qwen/Qwen3-Next-80B-A3B-Instruct``):
``num_hidden_layers=48``, ``full_attention_interval=4`` (12 full-attention layers,
36 Gated DeltaNet layers), ``num_key_value_heads=2``, ``head_dim=256``, bf16 KV;
``linear_num_value_heads=32``, ``linear_num_key_heads=16``,
``linear_key_head_dim=128``, ``linear_value_head_dim=128``,
``linear_conv_kernel_dim=4``.  Per GDN layer SGLang keeps a temporal (SSM) state
of ``value_heads x key_dim x value_dim`` fp32 and a conv state of
``conv_dim x (kernel - 1)`` bf16 with ``conv_dim = 2 * key_heads * key_dim +
value_heads * value_dim`` (8192): the bytes of
:data:`hybridstore.replay.model_presets.MODELS` ``["qwen3-next-80b-a3b"]``, which
this module checks.

Under tensor parallelism SGLang shards attention KV heads (replicated when
``tp > num_key_value_heads``: each rank keeps ``max(1, kv_heads // tp)``) and the
GDN heads and conv channels (``/ tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridstore.replay.model_presets import model_preset

__all__ = ["PAGE_TOKENS", "QWEN3_NEXT", "Geometry", "HybridShape"]

PAGE_TOKENS = 64
"""Tokens per page: SGLang's ``--page-size 64`` (and vLLM's chunk in this bench)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridShape:
    """The cache-relevant shape of a hybrid attention / linear-attention model."""

    name: str
    preset: str                 # model preset (replay/model_presets.py) holding the same bytes
    attn_layers: int
    kv_heads: int
    head_dim: int
    kv_itemsize: int
    linear_layers: int
    v_heads: int
    k_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    ssm_itemsize: int = 4       # fp32 temporal state
    conv_itemsize: int = 2      # bf16 conv state

    def geometry(self, tp: int) -> Geometry:
        """Per-rank sizes at tensor-parallel size ``tp``."""
        if tp < 1 or self.v_heads % tp or self.k_heads % tp:
            raise ValueError(f"tp={tp} does not divide {self.name}'s linear-attention heads")
        kv_heads = max(1, self.kv_heads // tp)
        v_heads, k_heads = self.v_heads // tp, self.k_heads // tp
        conv_dim = 2 * k_heads * self.k_dim + v_heads * self.v_dim
        return Geometry(
            model=self.name, tp=tp, page_tokens=PAGE_TOKENS, attn_layers=self.attn_layers,
            kv_heads=kv_heads, head_dim=self.head_dim,
            kv_page_bytes=self.attn_layers * 2 * kv_heads * self.head_dim * self.kv_itemsize
            * PAGE_TOKENS,
            linear_layers=self.linear_layers,
            temporal_shape=(v_heads, self.k_dim, self.v_dim),
            conv_shape=(conv_dim, self.conv_kernel - 1),
            ssm_itemsize=self.ssm_itemsize, conv_itemsize=self.conv_itemsize)


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """Bytes one rank moves: a KV page of ``page_tokens`` tokens and one recurrent state.

    ``attn_layers`` x K,V x ``kv_heads`` x ``head_dim`` bf16 per token (SGLang's
    ``MHATokenToKVPoolHost`` shape); ``temporal_shape`` / ``conv_shape`` are one
    layer's state tensors (``MambaPoolHost`` buffers after the layer and slot axes).
    """

    model: str
    tp: int
    page_tokens: int
    attn_layers: int
    kv_heads: int
    head_dim: int
    kv_page_bytes: int
    linear_layers: int
    temporal_shape: tuple[int, ...]
    conv_shape: tuple[int, ...]
    ssm_itemsize: int
    conv_itemsize: int

    @property
    def state_bytes(self) -> int:
        t = c = 1
        for d in self.temporal_shape:
            t *= d
        for d in self.conv_shape:
            c *= d
        return self.linear_layers * (t * self.ssm_itemsize + c * self.conv_itemsize)

    @property
    def label(self) -> str:
        return f"tp{self.tp}"

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "tp": self.tp, "page_tokens": self.page_tokens,
                "attn_layers": self.attn_layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "kv_page_bytes": self.kv_page_bytes, "state_bytes": self.state_bytes,
                "linear_layers": self.linear_layers,
                "temporal_shape": list(self.temporal_shape), "conv_shape": list(self.conv_shape)}


QWEN3_NEXT = HybridShape(
    name="Qwen/Qwen3-Next-80B-A3B", preset="qwen3-next-80b-a3b", attn_layers=12, kv_heads=2,
    head_dim=256, kv_itemsize=2, linear_layers=36, v_heads=32, k_heads=16, k_dim=128, v_dim=128,
    conv_kernel=4)


def _check(shape: HybridShape) -> None:
    """The shape and its model preset describe the same bytes (one source of truth each)."""
    preset, g = model_preset(shape.preset), shape.geometry(1)
    if g.kv_page_bytes != preset.page_bytes(PAGE_TOKENS) or g.state_bytes != preset.checkpoint_bytes:
        raise AssertionError(f"{shape.name}: shape gives {g.kv_page_bytes} B/page, {g.state_bytes} "
                             f"B/state; preset {preset.name} says {preset.page_bytes(PAGE_TOKENS)}, "
                             f"{preset.checkpoint_bytes}")


_check(QWEN3_NEXT)
