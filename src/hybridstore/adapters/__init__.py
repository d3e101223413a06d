"""Engine adapters: hybridstore as the prefix cache of a real model runner.

* :mod:`hybridstore.adapters.transformers` — :class:`CachedModel`, a Hugging
  Face ``transformers`` hybrid causal LM (Qwen3-Next, Falcon-H1, Mamba-2)
  resuming its prefills from a :class:`~hybridstore.HybridStore`.
* :mod:`hybridstore.adapters.sglang` — :class:`HybridStoreHiCache`, SGLang's
  HiCache storage backend (``--hicache-storage-backend dynamic``; settings in
  :mod:`~hybridstore.adapters.sglang_config`, host-pool bytes in
  :mod:`~hybridstore.adapters.sglang_pages`; ``docs/engines/sglang.md``).
* :mod:`hybridstore.adapters.cpu_shims` — :func:`import_sglang`: SGLang's cache
  modules on a CPU-only machine (tests, benchmarks).

Adapters import their engine lazily: ``import hybridstore`` needs none of them.
"""
