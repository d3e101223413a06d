"""``MooncakeTier``: the tier contract over a Mooncake Store shared by many stores.

What this tier knows is its *table*: the objects it put (``own``) and the objects
other stores put that :class:`~hybridstore.store.remote.RemoteSync` found for a
prompt (``foreign``).  Both are charged to ``capacity_bytes`` (``StoreConfig.
remote_bytes``: how much of the shared pool this store references);
``delete`` removes an own object from the pool and only forgets a foreign one (it
is another store's).  The pool may drop any object at any time (its own eviction, a
lender's segment unmounted, the master restarted): a read of such an object is a
miss (``CorruptObjectError``; the object leaves the table), never stale bytes.

Failure of the master never blocks or crashes the caller: every call is bounded
(:mod:`~hybridstore.backends.remote.client`); while the master is down ``put``'s
future fails with ``BackendIOError``, reads fail the same way, lookups find
nothing, and the objects the table held are dropped (they are listed by
:meth:`MooncakeTier.take_lost` so that the store forgets them too).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from hybridstore.backends.base import FutureSum, ObjectTable, done_future
from hybridstore.backends.remote import frame
from hybridstore.backends.remote.client import (
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    MooncakeClient,
    RemoteDown,
)
from hybridstore.errors import (
    BackendIOError,
    CapacityError,
    CorruptObjectError,
    ObjectTooLargeError,
    UnauthenticValueError,
)
from hybridstore.objects import ObjectKey, ObjectKind, byte_view, key_kind
from hybridstore.remote_url import RemoteSpec, parse_remote

_SLOT = 4096
REPUBLISH_S = 2.0
"""How often (at most) a tier checks that the pool still holds its info records (a
master restart loses them all) and writes back those it lost."""



class LayoutRecord(Protocol):
    """What the tier reads of the store's layout of a kind (``hybridstore.layout.Layout``,
    a row above the backends): its canonical record, which a value's layout tag keys."""

    def to_json(self) -> bytes: ...

class RemoteMiss(BackendIOError, KeyError):
    """An object a batch read asked for is not (or no longer) in the tier: a ``KeyError``
    as the contract says, and a ``BackendIOError`` for the loader, which then forgets
    what the tier dropped."""

    def __str__(self) -> str:
        return BackendIOError.__str__(self)


@dataclass(slots=True)
class _Entry:
    nbytes: int
    meta: bytes
    own: bool
    layout: bytes


def _get_ranges(store: Any, args: tuple[Any, ...]) -> Any:
    return store.get_into_ranges(*args)


def _failed(error: BaseException) -> Future:  # a read that failed
    fut: Future = Future()
    fut.set_exception(error)
    return fut


class MooncakeTier(ObjectTable):
    """Objects in a Mooncake Store (see the module docstring).

    Args:
        remote: a ``mooncake://HOST:PORT?...`` URL (:mod:`~hybridstore.backends.remote.url`)
            or a parsed :class:`RemoteSpec`.
        capacity_bytes: this store's budget in the pool.
        net_gbps, h2d_gbps: bandwidths that model :meth:`read_seconds`.
        client: an open :class:`MooncakeClient` of the same master to share (it stays
            open when this tier closes; Mooncake's ``close`` takes about 2 s); by
            default the tier opens its own and closes it.
        secret, tenant: what every value is sealed under (:class:`~hybridstore.backends.
            remote.frame.Sealer`): the store's hash secret and namespace root.  Without a
            secret the tier draws its own: its values open for it alone.
        encrypt: encrypt payloads too (AES-256-GCM; the ``cryptography`` package).
        layouts: the store's layouts by kind (read at each put and adopt): a value names
            the layout it was written with, and one of another layout is never adopted.

    Raises:
        MissingExtraError: Mooncake (or, with ``encrypt``, cryptography) is not installed.
        ConfigError: a bad URL, or the master is unreachable or does not answer.
    """

    name = "remote"

    def __init__(self, remote: str | RemoteSpec, capacity_bytes: int, *, net_gbps: float = 10.0,
                 h2d_gbps: float = 64.0, client: MooncakeClient | None = None,
                 secret: bytes | None = None, tenant: bytes = b"", encrypt: bool = False,
                 layouts: Mapping[ObjectKind, LayoutRecord] | None = None) -> None:
        super().__init__()
        self.spec = parse_remote(remote) if isinstance(remote, str) else remote
        self._seal = frame.Sealer(secret if secret is not None else os.urandom(32), tenant,
                                  encrypt=encrypt)
        self._layouts: Mapping[ObjectKind, LayoutRecord] = layouts if layouts is not None else {}
        self._layout_tags: dict[ObjectKind, tuple[LayoutRecord, bytes]] = {}
        self._records: dict[str, bytes] = {}     # info records, written back when lost
        self._republish_at = 0.0
        self._capacity = int(capacity_bytes)
        self._net = net_gbps
        self._h2d = h2d_gbps
        self._objects: dict[ObjectKey, _Entry] = {}
        self._used = 0           # charges of the table's objects
        self._reserved = 0       # charges of puts in flight
        self._lost: list[ObjectKey] = []
        self._keylocks = [threading.RLock() for _ in range(64)]
        self._counts = dict.fromkeys(("puts", "gets", "misses", "corrupt", "unauthentic",
                                      "other_layout", "failed", "republished"), 0)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hybridstore-remote")
        self._owns_client = client is None
        self.client = client if client is not None else MooncakeClient(self.spec)
        self.staging = self.client.staging

    # -- capacity -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used + self._reserved

    def charge(self, nbytes: int) -> int:
        """The object plus its header, in 4 KiB units."""
        n = -(-(int(nbytes) + frame.HEADER_BYTES) // _SLOT) * _SLOT
        if n > self._capacity:
            raise ObjectTooLargeError(f"an object of {nbytes} bytes is larger than the remote "
                                      f"tier's capacity ({self._capacity} bytes)")
        return n

    @property
    def available(self) -> bool:
        """Whether the master answers now."""
        return not self._closed and self.client.available

    def _name(self, key: bytes) -> str:
        return frame.object_name(self.spec.prefix, key)

    def _keylock(self, key: bytes) -> threading.RLock:
        return self._keylocks[hash(key) % len(self._keylocks)]

    def _layout_of(self, key: ObjectKey) -> bytes:
        """The id of the store's layout of ``key``'s kind (:data:`frame.NO_LAYOUT` when it
        has none yet)."""
        kind = key_kind(key)
        layout = self._layouts.get(kind)
        if layout is None:
            return frame.NO_LAYOUT
        cached = self._layout_tags.get(kind)
        if cached is None or cached[0] is not layout:
            cached = self._layout_tags[kind] = (layout, frame.layout_tag(layout.to_json()))
        return cached[1]

    # -- objects ------------------------------------------------------------------
    def put(self, key: ObjectKey, data: np.ndarray | None, *, nbytes: int,
            meta: bytes = b"") -> Future:
        """Reserve the budget now (``CapacityError`` if short), write on the tier's
        threads; the future completes once the value is in the pool (or fails with
        ``BackendIOError``, the reservation given back)."""
        self._check_open()
        charged = self.charge(nbytes)
        payload = byte_view(data, nbytes, what="data")
        with self._lock:
            old = self._objects.get(key)
            freed = self.charge(old.nbytes) if old is not None else 0
            if self.used_bytes - freed + charged > self._capacity:
                raise CapacityError(f"remote tier: {charged} bytes do not fit "
                                    f"({self.free_bytes + freed} free)")
            self._reserved += charged                  # until the write ends
        try:
            return self._pool.submit(self._put_now, key, payload, int(nbytes), bytes(meta),
                                     charged)
        except RuntimeError:                           # the pool was shut down: closed
            with self._lock:
                self._reserved -= charged
            self._check_open()
            raise

    def _put_now(self, key: ObjectKey, payload: np.ndarray, nbytes: int, meta: bytes,
                 charged: int) -> None:
        with self._keylock(key):
            try:
                with self._lock:
                    replacing = key in self._objects
                if replacing:
                    self._remove(key)
                layout = self._write(key, payload, meta)
            except BaseException as e:
                with self._lock:
                    self._reserved -= charged
                self._counts["failed"] += 1
                if isinstance(e, RemoteDown):
                    self._drop_all()
                raise
            with self._lock:
                self._reserved -= charged
                old = self._objects.get(key)
                self._used += charged - (self.charge(old.nbytes) if old is not None else 0)
                self._objects[key] = _Entry(nbytes, meta, True, layout)
                self._counts["puts"] += 1
        self._republish()

    def _write(self, key: ObjectKey, payload: np.ndarray, meta: bytes) -> bytes:
        """One sealed value in the pool: through a registered slot, or the client's buffer.
        A transfer that fails (the segment chosen belongs to a lender that just left: the
        master learns of it only after its ``client_ttl``) is tried once more, elsewhere.
        Returns the id of the layout it was written with."""
        name = self._name(key)
        layout = self._layout_of(key)
        head, payload = self._seal.seal(name, meta, layout, payload)
        total = len(head) + payload.nbytes
        for attempt in range(2):
            if self.staging.fits(total):
                with self.staging.slot() as slot:
                    slot[:len(head)] = np.frombuffer(head, np.uint8)
                    slot[len(head):total] = payload
                    rc = self.client.call("put", lambda s: s.put_from(name, slot.ctypes.data,
                                                                      total))
            else:
                rc = self.client.call("put", lambda s: s.put_parts(name, head, payload))
            if rc != TRANSFER_FAIL or attempt:
                break
            self.client.call("remove", lambda s: s.remove(name, True))
        if rc != 0:
            raise BackendIOError(f"remote put of {key.hex()} failed with Mooncake code {rc}",
                                 key=key, expected=total)
        return layout

    def _remove(self, key: bytes) -> None:
        rc = self.client.call("remove", lambda s: s.remove(self._name(key), True))
        if rc not in (0, OBJECT_NOT_FOUND):
            raise BackendIOError(f"remote remove of {key.hex()} failed with Mooncake code {rc}",
                                 key=key)

    def get(self, key: ObjectKey) -> np.ndarray:
        self._check_open()
        with self._keylock(key):           # its size and bytes from one version of it
            return super().get(key)

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        self._check_open()
        with self._keylock(key):           # not while a put replaces it
            with self._lock:
                entry = self._objects.get(key)
            if entry is None:
                raise KeyError(key)
            dst = byte_view(out, entry.nbytes, writable=True, what="out")
            try:
                self._read(key, entry, dst)
            except (CorruptObjectError, BackendIOError) as e:
                return _failed(e)
        self._counts["gets"] += 1
        return done_future(entry.nbytes)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        """:meth:`get_into` of each, on the tier's threads (up to 4 at once, one staging
        slot each); the future fails with the first error (with the master down the
        others fail at once too)."""
        self._check_open()
        if len(keys) != len(offsets):
            raise ValueError("keys and offsets must have one length")
        sizes = []
        with self._lock:
            for key, off in zip(keys, offsets):
                entry = self._objects.get(key)
                if entry is None:     # never here, or dropped since the caller looked
                    return _failed(RemoteMiss(f"remote object {key.hex()} is not in the "
                                              "remote tier", key=key))
                if off < 0 or off + entry.nbytes > dst.nbytes:
                    raise ValueError(f"offset {off} + {entry.nbytes} bytes is past dst "
                                     f"({dst.nbytes} bytes)")
                sizes.append(entry.nbytes)
        if len(keys) == 1:
            return self._get_one(keys[0], dst[offsets[0]:offsets[0] + sizes[0]])
        total = FutureSum(len(keys))
        for key, off, n in zip(keys, offsets, sizes):
            fut = self._pool.submit(self._get_now, key, dst[off:off + n])
            fut.add_done_callback(total.done_future)
        return total.future

    def _get_now(self, key: ObjectKey, out: np.ndarray) -> int:
        """:meth:`_get_one`, waited for (on the tier's threads)."""
        return int(self._get_one(key, out).result())

    def _get_one(self, key: ObjectKey, out: np.ndarray) -> Future:
        """:meth:`get_into`; a key dropped since it was listed is a ``BackendIOError``."""
        try:
            return self.get_into(key, out)
        except KeyError:          # dropped since (the master went down, or it vanished)
            return _failed(RemoteMiss(f"remote object {key.hex()} was dropped during the "
                                      "read", key=key))

    def _read(self, key: ObjectKey, entry: _Entry, dst: np.ndarray) -> None:
        """The verified payload into ``dst``; a missing or damaged value leaves the table."""
        name = self._name(key)
        total = frame.HEADER_BYTES + len(entry.meta) + entry.nbytes
        try:
            if self.staging.fits(total):
                with self.staging.slot() as slot:
                    n = self.client.call("get", lambda s: s.get_into(name, slot.ctypes.data,
                                                                     slot.nbytes))
                    if n == OBJECT_NOT_FOUND:
                        self._vanished(key, "is no longer in the pool")
                    if n < 0:
                        raise BackendIOError(f"remote get of {key.hex()} failed with Mooncake "
                                             f"code {n}", key=key)
                    self._copy_checked(key, entry, slot[:n], dst)
            else:
                handle = self.client.call("get", lambda s: s.get_buffer(name))
                if handle is None:
                    self._vanished(key, "is no longer in the pool")
                view = np.ctypeslib.as_array((ctypes.c_uint8 * handle.size()).from_address(
                    handle.ptr()))
                self._copy_checked(key, entry, view, dst)
                del view, handle
        except RemoteDown:
            self._drop_all()
            raise

    def _copy_checked(self, key: ObjectKey, entry: _Entry, value: np.ndarray,
                      dst: np.ndarray) -> None:
        try:
            meta, layout, payload = self._seal.open(self._name(key), value)
            if payload.nbytes != entry.nbytes or meta != entry.meta or layout != entry.layout:
                raise CorruptObjectError(f"remote object {key.hex()} changed size, meta or "
                                         "layout", key=key)
        except CorruptObjectError as e:
            self._counts["corrupt"] += 1
            if isinstance(e, UnauthenticValueError):
                self._counts["unauthentic"] += 1
            e.key = key
            self._vanished(key, str(e), e)
        dst[:] = payload

    def _vanished(self, key: ObjectKey, why: str, error: CorruptObjectError | None = None) -> None:
        """A value of the table is gone or damaged: forget it, raise ``CorruptObjectError``."""
        self._counts["misses"] += 1
        with self._lock:
            entry = self._objects.pop(key, None)
            if entry is not None:
                self._used -= self.charge(entry.nbytes)
                self._lost.append(key)
        self.client.warn(f"remote object {key.hex()} {why}: a miss")
        raise error or CorruptObjectError(f"remote object {key.hex()} {why}", key=key)

    def _drop_all(self) -> None:
        """The master is down: every object of the table is a miss from now on."""
        with self._lock:
            self._lost.extend(self._objects)
            self._objects.clear()
            self._used = 0

    def take_lost(self) -> list[ObjectKey]:
        """Objects dropped from the table since the last call (for the store's index)."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def delete(self, key: ObjectKey) -> int:
        self._check_open()
        with self._keylock(key):
            with self._lock:
                entry = self._objects.pop(key, None)
                if entry is None:
                    return 0
                freed = self.charge(entry.nbytes)
                self._used -= freed
            if entry.own:
                try:
                    self._remove(key)
                except RemoteDown:
                    self._drop_all()
                except BackendIOError as e:
                    self.client.warn(str(e))
        return freed

    # -- foreign objects (RemoteSync) ---------------------------------------------
    def exist_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the pool holds (all False while the master is down)."""
        if not keys or self._closed:
            return [False] * len(keys)
        try:
            got = self.client.call("exist", lambda s: s.batch_is_exist(
                [self._name(k) for k in keys]))
        except RemoteDown:
            self._drop_all()
            return [False] * len(keys)
        self._republish()
        return [c == 1 for c in got]

    def adopt(self, keys: Sequence[ObjectKey]) -> list[tuple[ObjectKey, int, bytes]]:
        """Read the headers and meta of objects another store put; those that parse join
        the table (as foreign, charged while there is room) and are returned as
        ``(key, nbytes, meta)``.  Two ranged reads for all of them."""
        self._check_open()
        keys = [k for k in keys if k not in self._objects]
        if not keys:
            return []
        try:
            heads = self._ranges(keys, [0] * len(keys), [frame.HEADER_BYTES] * len(keys))
            parsed: dict[ObjectKey, tuple[int, int, bytes]] = {}
            for key, head in zip(keys, heads):
                try:
                    if head is not None:
                        meta_len, nbytes, layout = self._seal.parse(self._name(key), head)
                        if layout != self._layout_of(key):
                            self._counts["other_layout"] += 1
                            raise CorruptObjectError(f"remote object {key.hex()} was written "
                                                     "with another layout (another model?)")
                        parsed[key] = (meta_len, nbytes, layout)
                except CorruptObjectError as e:
                    self._counts["unauthentic"] += isinstance(e, UnauthenticValueError)
                    self.client.warn(f"{e}: ignored")
            todo = [k for k in parsed if parsed[k][0]]
            metas = dict(zip(todo, self._ranges(todo, [frame.HEADER_BYTES] * len(todo),
                                                [parsed[k][0] for k in todo])))
        except RemoteDown:
            self._drop_all()
            return []
        out = []
        with self._lock:
            for key, (meta_len, nbytes, layout) in parsed.items():
                meta = metas.get(key, b"") if meta_len else b""
                if meta is None or key in self._objects:
                    continue
                charged = self.charge(nbytes)
                if self.used_bytes + charged > self._capacity:
                    break
                self._used += charged
                self._objects[key] = _Entry(nbytes, meta, False, layout)
                out.append((key, nbytes, meta))
        return out

    def _ranges(self, keys: Sequence[bytes], starts: list[int],
                sizes: list[int]) -> list[bytes | None]:
        """Byte ranges of several values (``None`` where one could not be read)."""
        out: list[bytes | None] = []
        step = max(1, self.staging.slot_bytes // max(max(sizes, default=1), 1))
        for i in range(0, len(keys), step):
            chunk = list(keys[i:i + step])
            names = [[self._name(k) for k in chunk]]
            offs = np.cumsum([0] + sizes[i:i + step]).tolist()
            src = [[[s0] for s0 in starts[i:i + step]]]
            size = [[[n] for n in sizes[i:i + step]]]
            with self.staging.slot() as slot:
                base, dsts = [slot.ctypes.data], [[[o] for o in offs[:-1]]]
                got: list[Any] = self.client.call("get ranges", partial(
                    _get_ranges, args=(base, names, dsts, src, size)))
                for j in range(len(chunk)):
                    ok = got[0][j][0] == sizes[i + j]
                    out.append(bytes(slot[offs[j]:offs[j + 1]]) if ok else None)
        return out

    # -- info blobs ---------------------------------------------------------------
    def put_info(self, name: str, value: bytes) -> None:
        """Kept here and in the pool (``PREFIX/info/TENANT/NAME``, sealed), where the other
        stores of this tenant read it; written back there when the pool loses it."""
        super().put_info(name, value)
        with self._lock:
            self._records[name] = bytes(value)
        try:
            self._put_record(name, bytes(value))
        except RemoteDown:
            pass

    def _put_record(self, name: str, value: bytes) -> None:
        full = self._seal.info_name(self.spec.prefix, name)
        head, body = self._seal.seal(full, b"", frame.NO_LAYOUT, np.frombuffer(value, np.uint8))
        self.client.call("remove", lambda s: s.remove(full, True))
        rc = self.client.call("put", lambda s: s.put_parts(full, head, body))
        if rc != 0:
            self.client.warn(f"remote put_info {name!r}: Mooncake code {rc}")

    def _republish(self) -> None:
        """Write back the info records the pool lost (a master restart loses every one):
        checked at most once per :data:`REPUBLISH_S`, one ``batch_is_exist``."""
        now = time.monotonic()
        with self._lock:
            if now < self._republish_at or not self._records or self._closed:
                return
            self._republish_at = now + REPUBLISH_S
            records = dict(self._records)
        names = list(records)
        try:
            there = self.client.call("exist", lambda s: s.batch_is_exist(
                [self._seal.info_name(self.spec.prefix, n) for n in names]))
            for name, ok in zip(names, there):
                if ok != 1:
                    self._put_record(name, records[name])
                    self._counts["republished"] += 1
        except RemoteDown:
            pass

    def get_info(self, name: str) -> bytes | None:
        """This store's blob, else this tenant's record in the pool (kept here once read,
        so that this store writes it back too if the pool loses it)."""
        local = super().get_info(name)
        if local is not None:
            return local
        full = self._seal.info_name(self.spec.prefix, name)
        try:
            raw = self.client.call("get", lambda s: s.get(full))
        except RemoteDown:
            return None
        if not raw:
            return None
        try:
            _, _, payload = self._seal.open(full, np.frombuffer(raw, np.uint8))
        except CorruptObjectError as e:
            self._counts["unauthentic"] += 1
            self.client.warn(f"{e}: ignored")
            return None
        value = payload.tobytes()
        super().put_info(name, value)
        with self._lock:
            self._records[name] = value
        return value

    # -- the rest of the contract ---------------------------------------------------
    def read_seconds(self, nbytes: int) -> float:
        """``X / B_net + X / B_H2D`` (pool to host, host to GPU)."""
        return nbytes / (self._net * 1e9) + nbytes / (self._h2d * 1e9)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {"capacity_bytes": self._capacity, "used_bytes": self.used_bytes,
                                     "objects": len(self._objects),
                                     "foreign": sum(not e.own for e in self._objects.values())}
        out.update(self._counts)
        out["down_events"] = self.client.down_events
        out["refused_calls"] = self.client.refused
        out["available"] = float(self.client.available)
        return out

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._pool.shutdown(wait=True)       # every call is bounded: this ends
        if self._owns_client:
            self.client.close()
