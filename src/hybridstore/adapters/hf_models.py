"""Small random-weight hybrid models from ``transformers``, for tests and the demo.

Each is the real architecture class (reference PyTorch kernels on CPU) at a
size that prefills a few hundred tokens in well under a second; the weights
are drawn from a seeded generator, so two processes build the same model.
Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHITECTURES = ("qwen3-next", "falcon-h1", "mamba2", "jamba")


def _config(arch: str, vocab: int, width: int, layers: int) -> tuple[Any, Any]:
    import transformers as tf

    if arch == "qwen3-next":
        # Gated DeltaNet and full attention alternating (MoE MLPs); 4 layers: GDN, attn, GDN, attn
        cfg = tf.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
            moe_intermediate_size=width // 2, shared_expert_intermediate_size=width // 2,
            num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers,
            num_attention_heads=width // 32, num_key_value_heads=2, head_dim=32,
            linear_num_value_heads=width // 32, linear_num_key_heads=2, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=2,
            max_position_embeddings=8192)
        return cfg, tf.Qwen3NextForCausalLM
    if arch == "falcon-h1":
        # every layer runs attention and a Mamba-2 mixer in parallel ("hybrid" cache layers)
        cfg = tf.FalconH1Config(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_d_ssm=256,
            mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
            mamba_chunk_size=64, max_position_embeddings=8192)
        return cfg, tf.FalconH1ForCausalLM
    if arch == "mamba2":
        cfg = tf.Mamba2Config(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_heads=8,
                              head_dim=32, state_size=16, n_groups=1, expand=2, conv_kernel=4,
                              chunk_size=64)
        return cfg, tf.Mamba2ForCausalLM
    if arch == "jamba":
        cfg = tf.JambaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                             expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)
        return cfg, tf.JambaForCausalLM
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")


def small_model(arch: str = "qwen3-next", *, seed: int = 0, vocab: int = 1024,
                dtype: torch.dtype = torch.float32, width: int = 128, layers: int = 4) -> Any:
    """A small ``arch`` causal LM with seeded random weights, in eval mode.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        seed: weight seed (the same seed gives the same weights in any process).
        vocab: vocabulary size.
        dtype: parameter dtype.
        width, layers: Qwen3-Next's hidden size (a multiple of 32) and layer
            count; the other architectures have one fixed small shape.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    if width % 32 or width < 64 or layers < 2:
        raise ValueError(f"width must be a multiple of 32 (>= 64) and layers >= 2; got {width}, {layers}")
    cfg, cls = _config(arch, vocab, width, layers)
    cpu = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(cfg)
    finally:
        torch.random.set_rng_state(cpu)
    return model.to(dtype).eval()
