"""The disk tier's read path: ``get_into``, coalesced ``read_many_into``, checksums.

A read pins its extent (a concurrent delete or replacement frees it after the
read), reads into the caller's buffer (host array or torch tensor, device
tensors too), and verifies the xxh3_64 checksum while later pieces are still
in flight.  A read that fails (an I/O error, a short read, a checksum) is retried
object by object (:data:`READ_RETRIES`); an object that still fails is dropped from
the catalog and raises :class:`~hybridstore.errors.CorruptObjectError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import numpy as np
import xxhash

from hybridstore.backends.base import FutureSum
from hybridstore.backends.catalog import CatalogRecord
from hybridstore.backends.disk.objects import (
    COALESCE_BYTES,
    checksum,
    _check_key,
    _Object,
    _TierState,
    _torch_bytes,
    _with_key,
    segment_name,
)
from hybridstore.backends.engines import Engine
from hybridstore.errors import BackendIOError, CatalogError, CorruptObjectError
from hybridstore.objects import ObjectKey, aligned_empty, byte_view

log = logging.getLogger("hybridstore.backends.disk")

READ_RETRIES = 2
"""Times a failed read of an object (an I/O error, a short read, a failed checksum) is
retried alone before the object is dropped: a transient error costs nothing, a lasting one
costs that object only, once."""


class _ReadPath(_TierState):
    """Part of :class:`~hybridstore.backends.disk.DiskTier`: reads and their checks."""

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """Read an object into ``out``; the future yields its ``nbytes``.

        ``out``: a host uint8 numpy array (or writable buffer) of at least
        ``nbytes``, or a torch tensor (CPU or CUDA; CUDA goes SSD -> GPU
        directly where kvikio has GPUDirect Storage).

        Raises:
            KeyError: the object is not visible here.
            CorruptObjectError: (from the future) it failed its checksum or cannot be read,
                even when read again; it is dropped.
        """
        return self._get_into(key, lambda n: out)[0]

    def _get_into(self, key: ObjectKey, make_out: Callable[[int], Any]) -> tuple[Future, Any]:
        """:meth:`get_into` of the object visible now into ``make_out(its nbytes)``."""
        self._check_open()
        key = _check_key(key)
        view = self._enter_read()
        try:
            with self._lock:
                obj = self._objects.get(key)
                if obj is None:
                    raise KeyError(key)
                out = make_out(obj.record.length)
                target = _ReadTarget.of(out, obj.record.length)
                self._pins[obj.extent] = self._pins.get(obj.extent, 0) + 1
            try:
                fut = self._jobs.submit(self._read_job, key, obj, target)
            except BaseException:
                self._unpin(obj.extent)
                raise
        except BaseException:
            self._leave_read(view)
            raise
        fut.add_done_callback(lambda _: self._leave_read(view))
        return fut, out

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes the slot of an ``nbytes`` object spans in its segment file (the spacing at
        which :meth:`read_many_into` reads neighbours in one I/O)."""
        return self._alloc.slot_size(nbytes)

    def read_many_into(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                       offsets: Sequence[int]) -> Future:
        """Read objects ``keys[i]`` into ``dst[offsets[i]:]``, neighbours in one I/O.

        Objects that lie back to back in one segment file, in the same order and
        spacing as their destinations in ``dst``, are read with one request of
        up to :data:`COALESCE_BYTES` (a load of many small pages written
        together reads at the device's large-I/O rate instead of paying a
        request per page), then each object's checksum is checked on its own.
        The slot padding between two coalesced objects lands in ``dst`` between
        their destinations: space destinations by :meth:`slot_bytes` where they
        should coalesce, and give each at least that much room.

        Args:
            keys: distinct keys of visible objects.
            dst: a writable, C-contiguous host uint8 array.
            offsets: where each object lands in ``dst``.

        Returns:
            One future for all of them, yielding their total ``nbytes`` once every
            read has finished (``dst`` is no longer written to); it fails with the
            first error, e.g. ``CorruptObjectError`` (every corrupt object is
            dropped; the error names the first).

        Raises:
            KeyError: a key is not visible here (nothing is read).
            ValueError: a destination does not fit in ``dst``.
        """
        self._check_open()
        if len(keys) != len(offsets):
            raise ValueError("keys and offsets must have one length")
        view = self._enter_read()
        try:
            fut = self._read_many(keys, dst, offsets)
        except BaseException:
            self._leave_read(view)
            raise
        fut.add_done_callback(lambda _: self._leave_read(view))
        return fut

    def _read_many(self, keys: Sequence[ObjectKey], dst: np.ndarray,
                   offsets: Sequence[int]) -> Future:
        with self._lock:
            found = [self._objects.get(_check_key(key)) for key in keys]
            for key, obj in zip(keys, found):
                if obj is None:
                    raise KeyError(key)
            objs = cast("list[_Object]", found)
            for obj, off in zip(objs, offsets):
                if off < 0 or off + obj.record.length > dst.nbytes:
                    raise ValueError(f"offset {off} + {obj.record.length} bytes is past dst "
                                     f"({dst.nbytes} bytes)")
            for obj in objs:
                self._pins[obj.extent] = self._pins.get(obj.extent, 0) + 1
        order = sorted(range(len(keys)), key=lambda i: (objs[i].record.segment, objs[i].record.offset))
        runs: list[list[int]] = []
        for i in order:
            if runs:
                j, head = runs[-1][-1], runs[-1][0]
                a, b = objs[j].record, objs[i].record
                if (a.segment == b.segment and b.offset - a.offset == objs[j].extent.length
                        and offsets[i] - offsets[j] == objs[j].extent.length
                        and b.offset + b.length - objs[head].record.offset <= COALESCE_BYTES):
                    runs[-1].append(i)
                    continue
            runs.append([i])
        group = FutureSum(len(runs))
        submitted = 0
        try:
            for run in runs:
                self._jobs.submit(self._read_run, [(bytes(keys[i]), objs[i]) for i in run], dst,
                                  [offsets[i] for i in run], group)
                submitted += 1
        except BaseException as e:
            for run in runs[submitted:]:
                for i in run:
                    self._unpin(objs[i].extent)
                group.done(0, e)
        return group.future

    def _read_run(self, items: list[tuple[bytes, _Object]], dst: np.ndarray, offsets: list[int],
                  group: FutureSum) -> None:
        """One I/O for neighbouring objects (see :meth:`read_many_into`), then each checksum;
        an object whose read or checksum failed is read again alone (:meth:`_salvage`)."""
        first, last = items[0][1].record, items[-1][1].record
        span = last.offset + last.length - first.offset
        error: BaseException | None = None
        got_bytes = 0
        try:
            file = self._file(first.segment)
            try:
                self.engine.read(file, dst[offsets[0]:offsets[0] + span], span, first.offset)
                failed: BackendIOError | None = None
            except BackendIOError as e:
                failed = e
            for (key, obj), off in zip(items, offsets):
                rec = obj.record
                out = dst[off:off + rec.length]
                got = None
                if failed is None:
                    got = checksum(out) if self._verify else rec.checksum
                    if got == rec.checksum:
                        got_bytes += rec.length
                        continue

                def again(out: np.ndarray = out, rec: CatalogRecord = rec) -> int:
                    self.engine.read(file, out, rec.length, rec.offset)
                    return checksum(out) if self._verify else rec.checksum

                lost = self._salvage(key, obj, again, failed, got)
                if lost is None:
                    got_bytes += rec.length
                else:
                    error = error or lost
            with self._lock:
                self._counters["reads"] += len(items)
                self._counters["bytes_read"] += got_bytes
        except BaseException as e:  # noqa: BLE001 - reported through the group's future
            error = error or e
        finally:
            self._unpin_many([obj.extent for _, obj in items])
            group.done(got_bytes, error)

    def get(self, key: ObjectKey) -> np.ndarray:
        # aligned: O_DIRECT reads land in place, no bounce; sized by the object read (one
        # replaced meanwhile by another size is read whole, never cut or padded)
        fut, out = self._get_into(key, aligned_empty)
        fut.result()
        return cast("np.ndarray", out)

    # -- read path ----------------------------------------------------------------
    def _read_job(self, key: bytes, obj: _Object, target: _ReadTarget) -> int:
        rec = obj.record
        try:
            file = self._file(rec.segment)

            def read() -> int:
                got = target.read(self.engine, file, rec.offset, rec.length, self._verify)
                return got if self._verify else rec.checksum

            failed: BackendIOError | None = None
            got: int | None = None
            try:
                got = read()
            except BackendIOError as e:
                failed = e
            if failed is not None or got != rec.checksum:
                lost = self._salvage(key, obj, read, failed, got)
                if lost is not None:
                    raise lost
            with self._lock:
                self._counters["reads"] += 1
                self._counters["bytes_read"] += rec.length
            return rec.length
        finally:
            self._unpin(obj.extent)

    def _salvage(self, key: bytes, obj: _Object, again: Callable[[], int],
                 failed: BackendIOError | None, got: int | None) -> CorruptObjectError | None:
        """After a read of an object failed (the I/O error ``failed``, or the checksum
        ``got``), read it alone again, up to :data:`READ_RETRIES` times (``again()`` reads
        it and returns its checksum).  Returns ``None`` when a retry brought its bytes back
        (a transient error costs nothing), else drops the object (it lies past the end of
        its truncated file, cannot be read, or fails its checksum: it would fail every
        later load) and returns the error that says why."""
        rec = obj.record
        for _ in range(READ_RETRIES):
            try:
                got = again()
            except BackendIOError as e:
                failed, got = e, None
                continue
            failed = None
            if got == rec.checksum:
                return None
        if failed is None:
            reason = f"failed its checksum (expected {rec.checksum:016x}, got {got or 0:016x})"
        else:
            _with_key(failed, key)
            try:
                size = os.stat(self._segment_path(rec.segment)).st_size
            except OSError:
                size = 0
            reason = (f"lies past the end of its {size}-byte segment file (truncated)"
                      if rec.offset + rec.length > size else
                      f"cannot be read ({failed}; {READ_RETRIES + 1} attempts)")
        self._drop(key, obj, reason)
        lost = CorruptObjectError(f"object {key.hex()} on the disk tier at {self.path} {reason}; "
                                  "it was dropped: recompute it and put it again", key=key,
                                  expected=rec.checksum, got=got if failed is None else None)
        lost.__cause__ = failed
        return lost

    def _drop(self, key: bytes, obj: _Object, reason: str) -> None:
        """Forget a damaged object: catalog entry, extent, and a logged reason."""
        rec = obj.record
        with self._catalog_lock:
            with self._lock:
                current = self._objects.get(key) is obj
            seq = 0
            if current:
                try:
                    seq = self.catalog.delete_record(key, rec, log=self._log())
                    forgotten = True
                except CatalogError as e:    # e.g. a full file system: the record stays,
                    forgotten = False        # and so must its slot (a reopen checks it again)
                    log.warning("disk tier %s: could not delete the record of the damaged object "
                                "%s: %s", self.path, key.hex(), e)
                if seq < 0:     # another process replaced or deleted it: sync() follows that
                    return
                with self._lock:
                    if forgotten:
                        self._forget(key, obj, seq)
                    else:
                        del self._objects[key]
                    self._counters["corrupt_dropped"] += 1
        log.warning("disk tier %s: object %s (%d bytes at %s offset %d) %s; dropped it from "
                    "the catalog", self.path, key.hex(), rec.length, segment_name(rec.segment),
                    rec.offset, reason)


class _ReadTarget:
    """Where a read lands: a host byte view, or a torch tensor (maybe on a GPU)."""

    __slots__ = ("host", "tensor")

    def __init__(self, host: np.ndarray | None, tensor: Any = None) -> None:
        self.host = host
        self.tensor = tensor

    @classmethod
    def of(cls, out: Any, nbytes: int) -> _ReadTarget:
        if type(out).__module__.startswith("torch"):
            tensor = _torch_bytes(out, nbytes)
            if tensor.device.type == "cpu":
                return cls(tensor.numpy())
            return cls(None, tensor)
        return cls(byte_view(out, nbytes, writable=True, what="out"))

    def read(self, engine: Engine, file: Any, offset: int, nbytes: int, verify: bool) -> int:
        """Read ``nbytes`` at ``offset``; returns the xxh3_64 of what landed (0 unverified)."""
        if self.host is not None:
            if not verify or nbytes <= engine.stream_piece_bytes:
                engine.read(file, self.host, nbytes, offset)
                return checksum(self.host) if verify else 0
            return _read_hashing(engine, file, self.host, nbytes, offset)
        import torch

        if engine.name.startswith("kvikio"):  # kvikio reads into device memory itself
            engine.read(file, self.tensor, nbytes, offset)
            return checksum(self.tensor.cpu().numpy()) if verify else 0
        host = aligned_empty(nbytes)
        engine.read(file, host, nbytes, offset)
        self.tensor.copy_(torch.from_numpy(host))
        return checksum(host) if verify else 0


def _read_hashing(engine: Engine, file: Any, host: np.ndarray, nbytes: int, offset: int) -> int:
    """Read into ``host`` while checksumming the pieces that have landed, in order.

    The checksum of the landed prefix overlaps the reads of the pieces after it,
    so a verified read costs the read plus the hash of its last wave of pieces,
    not of the whole object.  The digest is the same xxh3_64 as a one-shot hash.
    """
    stream = engine.pread_stream(file, host, nbytes, offset)
    hasher = xxhash.xxh3_64()
    hashed = 0  # pieces checksummed so far
    try:
        while hashed < stream.count:
            landed = stream.wait_prefix(hashed + 1)
            hasher.update(host[stream.bounds(hashed)[0]:stream.bounds(landed - 1)[1]])
            hashed = landed
    except BaseException:
        stream.wait_quietly()  # the buffer is the caller's again only once no piece is in flight
        raise
    stream.result()
    return hasher.intdigest()
