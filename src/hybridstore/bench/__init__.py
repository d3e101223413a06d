"""The store's self-check benchmark (``hybridstore bench core`` on the command line).

* :mod:`hybridstore.bench.core`: tier put/load throughput (host pool, disk
  tier, the :class:`~hybridstore.HybridStore` facade, a numpy memcpy as the
  reference), ``match()`` latency on a 128K-token prompt, native vs Python
  hashing and index memory per cached block.

Shared pieces, also used by the research benchmarks in the repository's
top-level ``benchmarks/`` (``python -m benchmarks ssd|index`` from a clone):
:mod:`hybridstore.bench.common` (statistics, timing, machine facts, progress
bar, aligned buffers, file-system probes),
:mod:`hybridstore.bench.odirect` (fio, an O_DIRECT thread pool, page-cache
drop and ``mincore``), :mod:`hybridstore.bench.device` (the SSD's read and
write limit: fio or that pool) and :mod:`hybridstore.bench.index_figures`
(the 128K match, hashing and index-memory figures both ``core`` and
``benchmarks index`` report).
"""

from __future__ import annotations

__all__ = ["common", "core", "device", "index_figures", "odirect"]
