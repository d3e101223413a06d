"""Copy one tensor entry of many stored objects into (or out of) the rows of a buffer.

``store.load(plan, into=(batch, state))`` restores a plan of thousands of pages
into page-major buffers (row ``i`` = page ``i``).  Each entry of the page
layout is one call here: the bytes of every page sit in host-pool slots (or in
the load's own read buffer for pages read from disk), and the compiled
``_cext.gather.gather`` (``native/src/gather.c``) copies them row by row
without the GIL.
``store.put_kv_batch`` goes the other way (``scatter``): the rows of a
page-major batch into the pool slots of a run of new pages.  The numpy loops
below are their twins, used when the extension is not built or the twins are
selected (:mod:`hybridstore._native`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridstore import _native

__all__ = ["gather_rows", "scatter_rows"]


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
    _copy_rows(sources, which, offsets, rows, entry_offset, nbytes, dst, scatter=False)


def scatter_rows(dests: Sequence[np.ndarray], which: np.ndarray, offsets: np.ndarray,
                 rows: np.ndarray, entry_offset: int, nbytes: int, src: np.ndarray) -> None:
    """``dests[which[i]][offsets[i] + entry_offset:][:nbytes] = src[rows[i], :nbytes]``:
    the reverse of :func:`gather_rows` (``store.put_kv_batch`` fills the pool slots of a
    run of new pages from the rows of a page-major batch).

    Args:
        dests: flat writable uint8 arrays (host-pool arenas).
        which, offsets, rows: int64 arrays of one length: the destination, the
            object's offset in it and the source row of each object.
        entry_offset, nbytes: the entry's place inside every object.
        src: a C-contiguous 2-D uint8 array whose rows are at least ``nbytes``.

    Raises:
        IndexError: an index reads or writes out of bounds (nothing is copied).
        ValueError: the arrays disagree in length, or a row is shorter than ``nbytes``.
    """
    _copy_rows(dests, which, offsets, rows, entry_offset, nbytes, src, scatter=True)


def _copy_rows(objects: Sequence[np.ndarray], which: np.ndarray, offsets: np.ndarray,
               rows: np.ndarray, entry_offset: int, nbytes: int, buf: np.ndarray, *,
               scatter: bool) -> None:
    if buf.ndim != 2 or not buf.flags.c_contiguous or buf.dtype != np.uint8:
        raise ValueError(f"{'src' if scatter else 'dst'} must be a C-contiguous 2-D uint8 array")
    stride = buf.shape[1]
    ext = _native.gather
    if ext is not None:
        (ext.scatter if scatter else ext.gather)(
            objects, which, offsets, rows, entry_offset, nbytes, buf, stride)
        return
    if not len(which) == len(offsets) == len(rows):
        raise ValueError("which, offsets and rows must have one length")
    if entry_offset < 0 or nbytes < 0 or nbytes > stride:
        raise ValueError("entry_offset and nbytes must be >= 0 and the row stride >= nbytes")
    for w, off, row in zip(which.tolist(), offsets.tolist(), rows.tolist()):
        if not 0 <= w < len(objects):
            raise IndexError(f"which = {w} names no {'dest' if scatter else 'source'}")
        if off < 0 or off + entry_offset + nbytes > objects[w].nbytes:
            raise IndexError(f"an offset {'writes' if scatter else 'reads'} past its object")
        if not 0 <= row < buf.shape[0]:
            raise IndexError(f"row {row} is past {'src' if scatter else 'dst'}")
    for w, off, row in zip(which.tolist(), offsets.tolist(), rows.tolist()):
        start = off + entry_offset
        if scatter:
            objects[w][start:start + nbytes] = buf[row, :nbytes]
        else:
            buf[row, :nbytes] = objects[w][start:start + nbytes]
