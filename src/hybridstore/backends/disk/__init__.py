"""The SSD tier: objects packed into segment files, a durable lmdb catalog.

Directory layout (``path``)::

    LOCK              the holder's process id; it and the directory itself are
                      fcntl.flock'ed by the one process that has the tier open
    catalog/          lmdb environment (see backends/catalog.py)
    seg-000000.dat    segment files: the SlabAllocator's arenas, one file each;
    seg-000001.dat    objects sit at 4 KiB-aligned offsets (O_DIRECT / GDS)

Segments are 1/16 of the budget (a power of two in [4 MiB, 256 MiB]) unless
``segment_bytes`` says otherwise, and each file grows as its objects need room
(twice its size at a time): a new directory takes a few MiB, whatever its budget.

Write path (``put``): allocate an extent, write the caller's bytes straight
from its buffer (the engine bounces only what is unaligned), ``fdatasync`` the
segment, *then* commit the catalog entry.  An object is visible
(``contains``/``entries``/``get``) only once its bytes are durable and its
entry committed, so a crash never exposes a torn object.  A committer thread
groups the completions that arrive together: one ``fdatasync`` per segment and
one lmdb transaction per group.

Read path (``get_into``): read the extent into ``out`` (host numpy buffer or a
torch tensor, device tensors too), verify its xxh3_64 checksum.  A read that
fails (an I/O error, a short read, a mismatch) is retried object by object; an
object that still fails is dropped from the catalog, a warning is logged, and
:class:`~hybridstore.errors.CorruptObjectError` is raised.  Extents being read
are pinned: a concurrent delete or replacement frees them after the read.

A full file system: segment files (and the catalog's slack, reserved before
a segment grows) have their blocks allocated before anything is written into
them, so ``ENOSPC``/``EDQUOT`` arrives there as
:class:`~hybridstore.errors.DiskFullError` (a ``CapacityError``).  The tier then
holds what its grown segments hold (its ``capacity_bytes`` is their bytes for a
few seconds, then it tries to grow again), so the store evicts from them what a
put needs, not a share of a budget the device cannot hold.  One under a write,
``fdatasync`` or commit fails that put with ``DiskFullError``, with nothing of it
visible.

Reopen: the catalog is the truth.  Every entry whose segment file exists and
is long enough is reserved in a fresh allocator and visible again; others are
dropped with a logged reason (of entries that claim overlapping slots, those
whose bytes pass their checksum win).  Segment files no surviving entry uses
are removed.

Modules (one path through the tier each):

=================  ===============================================================
``tier.py``        :class:`DiskTier`: construction, bookkeeping (contains, delete,
                   entries, stats), pins, segment files, close
``writer.py``      ``put`` / ``put_many``, write jobs, the committer thread
``reader.py``      ``get_into`` / ``read_many_into`` / ``get``, checksums
``recovery.py``    directory lock, segment geometry, reopen from the catalog
``objects.py``     what they share: names, object records, key and buffer checks
=================  ===============================================================
"""

from __future__ import annotations

from hybridstore.backends.disk.objects import (
    CATALOG_DIR,
    COALESCE_BYTES,
    LOCK_NAME,
    segment_name,
)
from hybridstore.backends.disk.tier import DiskTier

__all__ = ["CATALOG_DIR", "COALESCE_BYTES", "LOCK_NAME", "DiskTier", "segment_name"]
