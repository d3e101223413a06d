"""An accounting stand-in for the Mooncake pool, shared by the stores of a modelled fleet.

The real remote tier (``backends/remote/tier.py``, :class:`MooncakeTier`) is two
things: one **pool** that every store reaches (Mooncake's master and the memory
its clients lend) and, in each store, a **table** of the objects that store put
(``own``) or found there and adopted (``foreign``), charged against the store's
``remote_bytes``.  The store's remote rules (``store/remote.py``,
:class:`~hybridstore.store.remote.RemoteSync`: what is worth sending, what is
found for a prompt) run over that per-store table.  The fleet model keeps the
same split, sizes only:

* :class:`RemotePool` — ONE object per fleet: which objects the pool holds
  (sizes and meta, no bytes), its capacity, and its own eviction: least recently
  put or adopted first when a put does not fit (Mooncake evicts under its own
  high-water mark; reads are not modelled, so they do not refresh recency).  An
  object the pool drops is dropped from every node's table and reported by
  :meth:`PoolView.take_lost`, so each store forgets it at its next ``match``
  (the real tier learns it at the read that misses: the model is optimistic by
  that one failed read).
* :class:`PoolView` — one per node: the node's table, with the verbs
  ``RemoteSync`` calls on a ``MooncakeTier`` (``exist_many``, ``adopt``,
  ``take_lost``, ``available``, ``client.warn``, ``get_info``) and the tier
  contract.  It reports ``stores_bytes = True`` because that is what makes the
  store run its remote rules on a ``remote`` tier (``HybridStore.__init__``); it
  holds no bytes, and the replay never loads (restores are modelled from
  :meth:`PoolView.read_seconds`).  A put of a key the pool holds already (another
  node put the same prefix) becomes a reference to that object, as Mooncake
  keeps one value per name; deleting an own object removes it from the pool (every
  node that adopted it loses it), deleting a foreign one only forgets it, as
  ``MooncakeTier.delete`` does.

Restore time from the pool (:meth:`PoolView.read_seconds`) is
``latency + X / B_net + X / B_H2D`` per restore: one batched get of the restore's
remote objects, one round trip, then the link and the host-to-GPU copy (the last
two as ``MooncakeTier.read_seconds``).  Every store of the fleet must hash with
one ``hash_secret`` (``StoreConfig.hash_secret``), as stores sharing a real pool
must.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridstore.backends.base import ObjectTable, done_future
from hybridstore.errors import CapacityError, ConfigError, ObjectTooLargeError
from hybridstore.layout import Layout
from hybridstore.objects import ObjectKey, ObjectKind
from hybridstore.store.landing import LAYOUT_INFO

log = logging.getLogger("hybridstore.replay")

__all__ = ["PoolView", "RemotePool"]

_DONE = done_future()


class RemotePool:
    """The shared pool of a fleet: objects by key, a capacity, LRU eviction.

    Args:
        capacity_bytes: bytes of objects the pool holds at most.
        net_gbps: pool-to-host bandwidth of a restore (GB/s).
        latency_s: one round trip per restore that reads from the pool.
        h2d_gbps: host-to-GPU bandwidth (HiState eq. 2's ``B_H2D``).
        sizes: page and checkpoint bytes of the run; the pool offers their layouts
            to stores that adopt before they have put anything (as the first store
            records them in a real pool: ``PREFIX/info/layout.*``).

    Raises:
        ConfigError: a size, bandwidth or latency is out of range.
    """

    def __init__(self, capacity_bytes: int, *, net_gbps: float, latency_s: float,
                 h2d_gbps: float, sizes: Mapping[ObjectKind, int]) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"the remote pool needs a positive byte capacity, got "
                              f"{capacity_bytes!r}")
        if not (net_gbps > 0 and h2d_gbps > 0):
            raise ConfigError(f"bandwidths must be positive, got net {net_gbps!r}, h2d "
                              f"{h2d_gbps!r}")
        if not latency_s >= 0:
            raise ConfigError(f"latency must be >= 0 s, got {latency_s!r}")
        self.capacity_bytes = capacity_bytes
        self.net_gbps = net_gbps
        self.latency_s = latency_s
        self.h2d_gbps = h2d_gbps
        self.used_bytes = 0
        self._objects: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # oldest first
        self._info = {LAYOUT_INFO[kind]: Layout.of(np.empty(n, np.uint8)).to_json()
                      for kind, n in sizes.items()}
        self.views: list[PoolView] = []
        self.counts = dict.fromkeys(("puts", "references", "adopted", "evicted", "removed"), 0)

    def view(self, capacity_bytes: int | None = None) -> PoolView:
        """A new node's table over this pool (``capacity_bytes``: the node's
        ``remote_bytes``; default the pool's capacity)."""
        v = PoolView(self, self.capacity_bytes if capacity_bytes is None else capacity_bytes)
        self.views.append(v)
        return v

    # -- what the views call -----------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        return key in self._objects

    def entry(self, key: bytes) -> tuple[int, bytes] | None:
        return self._objects.get(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` recently used (a put or an adoption)."""
        self._objects.move_to_end(key)

    def put(self, key: bytes, nbytes: int, meta: bytes) -> None:
        """Hold a new object, dropping the least recently used ones until it fits.

        Raises:
            ObjectTooLargeError: it is larger than the whole pool.
        """
        if nbytes > self.capacity_bytes:
            raise ObjectTooLargeError(f"an object of {nbytes} bytes is larger than the remote "
                                      f"pool ({self.capacity_bytes} bytes)")
        while self.used_bytes + nbytes > self.capacity_bytes:
            old, (n, _) = self._objects.popitem(last=False)
            self.used_bytes -= n
            self.counts["evicted"] += 1
            self._gone(old)
        self._objects[key] = (nbytes, meta)
        self.used_bytes += nbytes
        self.counts["puts"] += 1

    def remove(self, key: bytes, by: PoolView) -> None:
        """An owner deleted ``key``: it leaves the pool and every other node's table."""
        entry = self._objects.pop(key, None)
        if entry is None:
            return
        self.used_bytes -= entry[0]
        self.counts["removed"] += 1
        self._gone(key, but=by)

    def _gone(self, key: bytes, but: PoolView | None = None) -> None:
        for v in self.views:
            if v is not but:
                v.lose(key)

    def get_info(self, name: str) -> bytes | None:
        return self._info.get(name)

    def put_info(self, name: str, value: bytes) -> None:
        self._info[name] = bytes(value)

    def stats(self) -> dict[str, Any]:
        """Objects and bytes held now, and the counters (puts, references to objects
        another node put, adoptions, evictions, removals by owners)."""
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "objects": len(self._objects), **self.counts}


class _Client:
    """What ``RemoteSync`` expects of ``MooncakeTier.client``: ``warn``."""

    @staticmethod
    def warn(message: str) -> None:
        log.warning("remote pool: %s", message)


@dataclass(slots=True)
class _Entry:
    nbytes: int
    meta: bytes
    own: bool


class PoolView(ObjectTable):
    """One node's table over a :class:`RemotePool` (see the module docstring).

    Args:
        pool: the fleet's pool.
        capacity_bytes: the node's ``remote_bytes`` (objects it put or adopted).
    """

    name = "remote"
    stores_bytes = True     # the store runs its remote rules (RemoteSync) on this tier
    client = _Client()

    def __init__(self, pool: RemotePool, capacity_bytes: int) -> None:
        super().__init__()
        self.pool = pool
        self._capacity = int(capacity_bytes)
        self._objects: dict[ObjectKey, _Entry] = {}
        self._used = 0
        self._lost: list[ObjectKey] = []

    # -- capacity ------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def charge(self, nbytes: int) -> int:
        if nbytes > self._capacity:
            raise ObjectTooLargeError(f"an object of {nbytes} bytes is larger than this "
                                      f"node's remote budget ({self._capacity} bytes)")
        return int(nbytes)

    @property
    def available(self) -> bool:
        """The modelled pool never goes down."""
        return not self._closed

    def read_seconds(self, nbytes: int) -> float:
        """``latency + X / B_net + X / B_H2D``: one round trip per restore, then the link
        and the host-to-GPU copy."""
        p = self.pool
        return p.latency_s + nbytes / (p.net_gbps * 1e9) + nbytes / (p.h2d_gbps * 1e9)

    # -- objects ---------------------------------------------------------------------
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Send an object to the pool (sizes only; ``data`` is ignored).

        Raises:
            CapacityError: the node's remote budget is full (the store evicts and retries).
        """
        self._check_open()
        charged = self.charge(nbytes)
        k = bytes(key)
        old = self._objects.get(ObjectKey(k))
        freed = self.charge(old.nbytes) if old is not None else 0
        if self._used - freed + charged > self._capacity:
            raise CapacityError(f"remote tier: {charged} bytes do not fit this node's budget "
                                f"({self._capacity - self._used + freed} free)")
        if old is not None:
            self._used -= freed
            del self._objects[ObjectKey(k)]
        if not self.pool.holds(k):
            own = True
            self.pool.put(k, int(nbytes), bytes(meta))     # may evict others' objects
        else:
            own = old is not None and old.own              # else another node's object
            if not own:
                self.pool.counts["references"] += 1
            self.pool.touch(k)
        self._objects[ObjectKey(k)] = _Entry(int(nbytes), bytes(meta), own)
        self._used += charged
        return _DONE

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """Sizes only: the future yields ``nbytes``; ``out`` is left untouched."""
        self._check_open()
        entry = self._objects.get(key)
        if entry is None:
            raise KeyError(key)
        return done_future(entry.nbytes)

    def delete(self, key: ObjectKey) -> int:
        self._check_open()
        entry = self._objects.pop(key, None)
        if entry is None:
            return 0
        freed = self.charge(entry.nbytes)
        self._used -= freed
        if entry.own:
            self.pool.remove(bytes(key), self)
        return freed

    def delete_many(self, keys: Iterable[ObjectKey]) -> int:
        return sum(self.delete(key) for key in keys)

    def lose(self, key: bytes) -> None:
        """The pool dropped ``key``: a miss from now on (listed by :meth:`take_lost`)."""
        okey = ObjectKey(key)
        entry = self._objects.pop(okey, None)
        if entry is not None:
            self._used -= self.charge(entry.nbytes)
            self._lost.append(okey)

    def take_lost(self) -> list[ObjectKey]:
        """Objects the pool dropped since the last call (for the store's index)."""
        lost, self._lost = self._lost, []
        return lost

    # -- foreign objects (RemoteSync) -------------------------------------------------
    def exist_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the pool holds."""
        if self._closed:
            return [False] * len(keys)
        return [self.pool.holds(bytes(k)) for k in keys]

    def adopt(self, keys: Sequence[ObjectKey]) -> list[tuple[ObjectKey, int, bytes]]:
        """Join the objects another node put to this table (charged while there is room);
        returns ``(key, nbytes, meta)`` of those adopted."""
        self._check_open()
        out = []
        for key in keys:
            k = bytes(key)
            okey = ObjectKey(k)
            entry = self.pool.entry(k)
            if entry is None or okey in self._objects:
                continue
            nbytes, meta = entry
            charged = self.charge(nbytes)
            if self._used + charged > self._capacity:
                break
            self._used += charged
            self._objects[okey] = _Entry(nbytes, meta, False)
            self.pool.touch(k)
            self.pool.counts["adopted"] += 1
            out.append((okey, nbytes, meta))
        return out

    # -- info blobs and the rest --------------------------------------------------------
    def put_info(self, name: str, value: bytes) -> None:
        self.pool.put_info(name, value)

    def get_info(self, name: str) -> bytes | None:
        return self.pool.get_info(name)

    def entries(self) -> Iterator[tuple[ObjectKey, int, bytes]]:
        self._check_open()
        return iter([(k, e.nbytes, e.meta) for k, e in self._objects.items()])

    def stats(self) -> dict[str, float]:
        return {"capacity_bytes": self._capacity, "used_bytes": self._used,
                "objects": len(self._objects),
                "foreign": sum(not e.own for e in self._objects.values())}

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._objects.clear()
        self._used = 0
