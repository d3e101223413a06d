"""Benchmarks of hybridstore (``hybridstore bench ...`` on the command line).

* :mod:`hybridstore.bench.core`: tier put/load throughput (host pool, disk
  tier, the :class:`~hybridstore.HybridStore` facade, a numpy memcpy as the
  reference), ``match()`` latency on a 128K-token prompt, native vs Python
  hashing and index memory per cached block.
"""

from __future__ import annotations

__all__ = ["core"]
