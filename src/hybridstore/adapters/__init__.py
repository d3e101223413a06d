"""Engine adapters: hybridstore as the prefix cache of a real model runner.

* :mod:`hybridstore.adapters.transformers` — :class:`CachedModel`, a Hugging
  Face ``transformers`` hybrid causal LM (Qwen3-Next, Falcon-H1, Mamba-2)
  resuming its prefills from a :class:`~hybridstore.HybridStore`.

Adapters import their engine lazily: ``import hybridstore`` needs none of them.
"""
