"""Research benchmarks of hybridstore, run from a clone: ``python -m benchmarks ssd|index ...``.

They live outside the installed package (as vLLM's, LMCache's and SGLang's
``benchmarks/`` do): they compare hybridstore with other loaders and caches
(fio, DALI, torch.load, safetensors; SGLang's radix cache and vLLM's block
pool, imported through a harness of their own) and need tools a library user
does not.  The short self-check stays in the package: ``hybridstore bench core``.

* :mod:`benchmarks.ssd`: the disk tier against the device limit (fio) and
  other loaders; the host pool's copies.
* :mod:`benchmarks.index`: ``put`` / ``match`` / ``evict`` against prompt
  length and cached blocks, side by side with SGLang's radix cache and vLLM's
  block hashing (:mod:`benchmarks.peers`), hashing, memory per block.

Shared with ``bench core``: :mod:`hybridstore.bench.common` (statistics,
timing, machine facts, aligned buffers, file-system probes),
:mod:`hybridstore.bench.odirect` and :mod:`hybridstore.bench.device` (fio, an
O_DIRECT thread pool of our own, page-cache drop / mincore; the device limit), and
:mod:`hybridstore.bench.index_figures` (the 128K match, hashing and index-memory
figures).  See ``benchmarks/README.md`` for what each needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridstore.replay.trace import Trace

__all__ = ["index", "load_trace", "peers", "report", "ssd", "trace_label"]


def load_trace(spec: str) -> Trace:
    """The trace a replay benchmark's ``TRACE`` names: ``sample`` for the bundled WEKA
    sample, else anything :func:`hybridstore.replay.loaders.load` reads (a path,
    ``synthetic:...``)."""
    from hybridstore.replay.loaders import load
    from hybridstore.replay.samples import weka_sample

    return load(str(weka_sample()) if spec == "sample" else spec)


def trace_label(spec: str) -> str:
    """A replay benchmark's name for ``TRACE``: ``sample`` and ``synthetic:...`` as given, a
    path by its last part."""
    return spec if spec == "sample" or spec.startswith("synthetic:") else Path(spec).name


def report(doc: dict[str, Any], json_path: Path | None, table: Callable[[], None],
           plot: Callable[[Path], None], plot_path: Path | None) -> None:
    """A replay benchmark's output: ``doc`` as JSON on stdout (and in ``json_path``), then
    its Markdown ``table``, then its ``plot`` PNG at ``plot_path``."""
    text = json.dumps(doc, indent=1)
    if json_path:
        json_path.write_text(text)
    print(text)
    table()
    if plot_path:
        plot(plot_path)
