"""Copy one tensor entry of many stored objects into the rows of a staging buffer.

``store.load(plan, into=(batch, state))`` restores a plan of thousands of pages
into page-major buffers (row ``i`` = page ``i``).  Each entry of the page
layout is one call here: the bytes of every page sit in host-pool slots (or in
the load's own read buffer for pages read from disk), and the compiled
``native._gather.gather`` copies them row by row without the GIL.  The numpy
loop below is its twin, used when the extension is not built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    from hybridstore.native import _gather as _native
except ImportError:  # pragma: no cover - the extension is optional
    _native = None

__all__ = ["gather_rows", "NATIVE"]

NATIVE = _native is not None


def gather_rows(sources: Sequence[np.ndarray], which: np.ndarray, offsets: np.ndarray,
                rows: np.ndarray, entry_offset: int, nbytes: int, dst: np.ndarray) -> None:
    """``dst[rows[i], :nbytes] = sources[which[i]][offsets[i] + entry_offset:][:nbytes]``.

    Args:
        sources: flat uint8 arrays (host-pool arenas, a read buffer).
        which, offsets, rows: int64 arrays of one length: the source, the
            object's offset in it and the destination row of each object.
        entry_offset, nbytes: the entry's place inside every object.
        dst: a C-contiguous 2-D uint8 array whose rows are at least ``nbytes``.

    Raises:
        IndexError: an index reads or writes out of bounds (nothing is copied).
        ValueError: the arrays disagree in length, or a row is shorter than ``nbytes``.
    """
    if dst.ndim != 2 or not dst.flags.c_contiguous or dst.dtype != np.uint8:
        raise ValueError("dst must be a C-contiguous 2-D uint8 array")
    stride = dst.shape[1]
    if _native is not None:
        _native.gather(sources, which, offsets, rows, entry_offset, nbytes, dst, stride)
        return
    if not len(which) == len(offsets) == len(rows):
        raise ValueError("which, offsets and rows must have one length")
    if nbytes > stride:
        raise ValueError("entry_offset and nbytes must be >= 0 and dst_stride >= nbytes")
    for w, off, row in zip(which.tolist(), offsets.tolist(), rows.tolist()):
        if not 0 <= w < len(sources):
            raise IndexError(f"which = {w} names no source")
        if off < 0 or off + entry_offset + nbytes > sources[w].nbytes:
            raise IndexError("an offset reads past its source")
        if not 0 <= row < dst.shape[0]:
            raise IndexError(f"row {row} writes past dst")
    for w, off, row in zip(which.tolist(), offsets.tolist(), rows.tolist()):
        start = off + entry_offset
        dst[row, :nbytes] = sources[w][start:start + nbytes]
