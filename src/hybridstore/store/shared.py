"""What a store does with a disk tier it shares with other processes.

A shared disk tier (``StoreConfig(disk_shared=True)``, ``backends/disk/shared.py``)
applies the other processes' puts and deletes to its own view; this module carries
them on into the store's index, so that a prefix another engine process stored is
matched here, and one it evicted is no longer promised:

* :func:`adopt_entries` makes disk objects matchable (pages, then states).  Reopening
  a store uses it for every object the catalog lists; :class:`DiskFollower` for the
  objects other processes put since.
* :meth:`DiskFollower.pull` runs before every call that reads the index (match and
  its kin) or lands objects (puts), under the store lock.
* :meth:`DiskFollower.lease` is the evictor's hold on the directory's eviction lease
  (one process at a time decides what leaves the shared tier); it pulls first, so
  the room the others' evictions made is seen before more is evicted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from hybridstore.errors import CatalogError
from hybridstore.index import meta
from hybridstore.layout import Layout
from hybridstore.objects import TIER_BITS, ObjectKey, ObjectKind, key_kind
from hybridstore.store.landing import take_layouts
from hybridstore.store.residency import Residency

log = logging.getLogger("hybridstore.store")

DISK = "disk"
SHARED_WAIT_S = 0.25
"""How long a put into a shared disk tier waits for the room its eviction freed in other
processes' segments to come back (their owners take it back within their sync interval,
0.1 s by default) before it evicts more."""


def adopt_entries(res: Residency, entries: Iterable[tuple[bytes, int, bytes]],
                  lost: set[ObjectKind] = frozenset(),  # type: ignore[assignment]
                  where: str = "") -> list[bytes]:
    """Make disk objects ``(key, nbytes, meta)`` matchable in the index (pages first, so
    that a state finds the pages it needs); objects the index already holds on disk are
    skipped.

    Args:
        res: the store's residency (its index and counters).
        entries: the objects.
        lost: kinds whose layout record is damaged (their objects cannot be used).
        where: the directory, for log lines.

    Returns:
        The keys whose metadata does not decode (or of a ``lost`` kind): the caller
        deletes them.
    """
    disk = res.tiers[DISK]
    index = res.index
    bit = TIER_BITS[DISK]
    states = []
    damaged = []
    for key, nbytes, blob in entries:
        try:
            info = meta.decode(blob)
        except CatalogError as e:
            log.warning("disk tier %s: dropping object %s: %s", where, key.hex(), e)
            damaged.append(key)
            continue
        kind = ObjectKind.PAGE if isinstance(info, meta.PageMeta) else ObjectKind.STATE
        if kind in lost or key_kind(ObjectKey(key)) != kind:
            damaged.append(key)
            continue
        if isinstance(info, meta.PageMeta):
            nid = index.find_node(key[1:])
            if nid >= 0 and index.page_tiers(nid) & bit:
                continue
            index.restore_page(key[1:], info.block, info.ntok, info.parent_key, DISK, nbytes)
            res.added(DISK, ObjectKind.PAGE, 1, disk.charge(nbytes))
        else:
            states.append((key, nbytes, info))
    for key, nbytes, state in states:
        ck = index.checkpoint(key[1:])
        if ck is not None and ck.tiers & bit:
            continue
        index.restore_checkpoint(key[1:], state.position, state.base_key, state.covers, DISK,
                                 nbytes)
        res.added(DISK, ObjectKind.STATE, 1, disk.charge(nbytes))
    return damaged


class DiskFollower:
    """Carries a shared disk tier's view of the other processes' changes into the index.

    Args:
        residency: the store's record of who holds what.
        layouts: the store's layouts (a store that has put nothing takes the directory's).
        where: the directory, for log lines.
    """

    def __init__(self, residency: Residency, layouts: dict[ObjectKind, Layout],
                 where: str) -> None:
        self.res = residency
        self.tier: Any = residency.tiers[DISK]
        self.layouts = layouts
        self.where = where
        self.adopted = 0
        self.forgotten = 0

    def pull(self) -> None:
        """Bring the index in line with the tier for every object the other processes
        changed since the last pull: what the tier holds now is adopted, what it does not
        is forgotten (its present state decides, not the order of the changes: this
        process's own put of a key another process deleted meanwhile stays)."""
        changes = self.tier.take_changes()
        if not changes:
            return
        sizes = {key: nbytes for _, key, nbytes, _ in changes}
        now = self.tier.visible(list(sizes))
        for key, n in sizes.items():
            if key not in now:
                before = self.res.objects[DISK]
                self.res.forget(ObjectKey(key), DISK, n)
                self.forgotten += before - self.res.objects[DISK]
        if now:
            take_layouts(self.tier, self.layouts, {key_kind(ObjectKey(k)) for k in now},
                         lambda msg: log.warning("disk tier %s: %s", self.where, msg))
            fitting = [(k, n, b) for k, (n, b) in now.items()
                       if (layout := self.layouts.get(key_kind(ObjectKey(k)))) is not None
                       and layout.nbytes == n]
            before = self.res.objects[DISK]
            adopt_entries(self.res, fitting, where=self.where)   # undecodable: not adopted
            self.adopted += self.res.objects[DISK] - before

    def wait_s(self) -> float:
        """How long a put waits for room its eviction freed in the other processes' segments
        (they take it back within their sync interval); 0 when no other process is there."""
        return SHARED_WAIT_S if self.tier.shared.peers() else 0.0

    @contextlib.contextmanager
    def lease(self) -> Iterator[None]:
        """Hold the directory's eviction lease, with the others' changes pulled."""
        with self.tier.shared.evict_lease():
            self.tier.sync()
            self.pull()
            yield


__all__ = ["DiskFollower", "adopt_entries"]
