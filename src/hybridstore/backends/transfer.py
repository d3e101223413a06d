"""Byte motion between host rows and GPU buffers, for the store's batch puts and loads.

The store works on host bytes (pool slots, read buffers); an engine may hand it
page-major batches that live on a GPU.  These helpers are the only place the
store's put and load paths touch torch and CUDA streams (``store/`` imports no
torch), and import torch only when a GPU buffer is actually passed.

=================================  ============================================
helper                             meaning
=================================  ============================================
``to_host_rows(buffer, i0, i1)``   rows ``i0..i1-1`` of a GPU batch entry, as a
                                   host ``(i1 - i0, row_bytes)`` uint8 array
``rows_to_device(buffer, n,        fill pinned host staging rows with ``fill``,
nbytes, fill, rows)``              then one async H2D copy per run of filled
                                   rows, synchronised before returning
``synchronize(devices)``           wait for the current stream of each device
                                   (asynchronous H2D copies from pool slots)
=================================  ============================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


def to_host_rows(buffer: Any, i0: int, i1: int) -> np.ndarray:
    """Rows ``i0..i1-1`` of a page-major entry on a GPU, copied to host as flat uint8 rows."""
    import torch

    return buffer[i0:i1].reshape(i1 - i0, -1).view(torch.uint8).cpu().numpy()


def rows_to_device(buffer: Any, n: int, nbytes: int, fill: Callable[[np.ndarray], None],
                   rows: np.ndarray) -> None:
    """Fill rows ``rows`` of a GPU page-major entry ``buffer`` (``n`` rows of ``nbytes``).

    ``fill(staged)`` writes the rows into a ``(n, nbytes)`` pinned host array; then
    one async H2D copy per run of filled rows (rows not in ``rows``, e.g. those the
    engine already holds, stay untouched), synchronised here: nothing is left in
    flight, and the staging rows outlive the copies.
    """
    import torch

    cuda = bool(buffer.is_cuda)
    staged = torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=cuda)
    fill(staged.numpy())
    filled = np.zeros(n + 1, bool)
    filled[rows] = True
    edges = np.flatnonzero(np.diff(np.concatenate([[False], filled])))
    flat = buffer.view(buffer.shape[0], -1).view(torch.uint8)
    for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        flat[a:b].copy_(staged[a:b], non_blocking=cuda)
    if cuda:   # the staging rows must outlive the copies
        torch.cuda.current_stream(buffer.device).synchronize()


def synchronize(devices: Iterable[Any]) -> None:
    """Wait for the work queued on the current stream of each CUDA device in ``devices``."""
    devices = list(devices)
    if not devices:
        return
    import torch

    for device in devices:
        torch.cuda.current_stream(device).synchronize()


__all__ = ["rows_to_device", "synchronize", "to_host_rows"]
