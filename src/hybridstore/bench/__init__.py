"""Benchmarks of hybridstore (``hybridstore bench ...`` on the command line).

* :mod:`hybridstore.bench.core`: tier put/load throughput (host pool, disk
  tier, the :class:`~hybridstore.HybridStore` facade, a numpy memcpy as the
  reference), ``match()`` latency on a 128K-token prompt, native vs Python
  hashing and index memory per cached block.
* :mod:`hybridstore.bench.ssd`: the disk tier against the device limit (fio)
  and other loaders.
* :mod:`hybridstore.bench.index`: ``put`` / ``match`` / ``evict`` against
  prompt length and cached blocks, side by side with SGLang's radix cache and
  vLLM's block hashing (:mod:`hybridstore.bench.peers`), hashing, memory per
  block.

Shared pieces: :mod:`hybridstore.bench.common` (statistics, timing, machine
facts, progress bar) and :mod:`hybridstore.bench.index_figures` (the 128K
match, hashing and index-memory figures both ``core`` and ``index`` report).
"""

from __future__ import annotations

__all__ = ["core", "index", "ssd"]
