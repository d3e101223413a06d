"""GPU memory tier, and the side-stream copy that delivers host bytes to the engine.

A few large ``torch.uint8`` CUDA arenas are carved by a
:class:`~hybridstore.backends.alloc.SlabAllocator`.  Every copy into or out of
a slot runs on the tier's side stream, in order, so a slot freed by ``delete``
or a replacing ``put`` may be reused at once: later copies on the stream run
after earlier ones.  Futures complete once the stream's event has fired.

Only importing this module needs torch; constructing :class:`DeviceTier` needs
a GPU.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from hybridstore.backends.alloc import Extent, SlabAllocator, SlabBudget
from hybridstore.backends.base import ObjectTable
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.objects import ALIGN, ObjectKey, byte_view

_waiter = ThreadPoolExecutor(1, thread_name_prefix="hs-cuda-events")
"""Completes futures once their CUDA event fired (one thread: events complete in order)."""


def copy_to_device(src: np.ndarray, dst: torch.Tensor,
                   stream: torch.cuda.Stream | None = None) -> Future:
    """Copy the bytes of host array ``src`` into device tensor ``dst`` on a side stream.

    The copy is asynchronous when ``src`` is pinned (a
    :meth:`~hybridstore.backends.host.HostPool.view` of a pinned pool); keep
    ``src`` alive (hold its key) until the future completes.

    Args:
        src: host bytes, exactly as many as ``dst`` holds.
        dst: a contiguous CUDA tensor of any dtype.
        stream: the stream to copy on (default: a new side stream); it first
            waits for work already queued on ``dst``'s current stream.

    Returns:
        A future that completes (with ``dst``) when the bytes are on the device.
    """
    dst_bytes = _byte_tensor(dst, "dst", written=True)
    src_bytes = _byte_tensor(src, "src")
    if not dst_bytes.is_cuda or src_bytes.numel() != dst_bytes.numel():
        raise ValueError(f"dst must be a CUDA tensor of exactly {src_bytes.numel()} bytes, got "
                         f"{dst_bytes.numel()} bytes on {dst_bytes.device}")
    stream = stream or torch.cuda.Stream(device=dst_bytes.device)
    return _copy_on(stream, dst_bytes, src_bytes, result=dst)


def _byte_tensor(buf: Any, what: str, *, written: bool = False) -> torch.Tensor:
    """A flat uint8 tensor sharing memory with a tensor, numpy array or bytes-like."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError(f"{what} must be contiguous; pass .contiguous() of it")
        return buf.detach().view(-1).view(torch.uint8)
    arr = byte_view(buf, what=what)
    if not arr.flags.writeable:
        if written:
            raise ValueError(f"{what} is read-only; pass a writable array")
        # A copy source: torch.from_numpy wants a writable array, and only reads this one.
        arr = arr.view()
        try:
            arr.flags.writeable = True
        except ValueError:  # memory that is truly read-only (bytes): copy it
            arr = arr.copy()
    return torch.from_numpy(arr)


def _copy_on(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
             result: Any) -> Future:
    """Queue ``dst.copy_(src)`` on ``stream``; the future yields ``result`` when it is done."""
    device = dst.device if dst.is_cuda else src.device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)  # the caching allocator must not reuse it early
        # non_blocking only where it is safe: between device and pinned memory.
        dst.copy_(src, non_blocking=(dst.is_cuda or dst.is_pinned())
                  and (src.is_cuda or src.is_pinned()))
        done = torch.cuda.Event()
        done.record(stream)
    return _waiter.submit(_wait, done, result, src)


def _wait(event: torch.cuda.Event, result: Any, source: torch.Tensor) -> Any:
    """Block until ``event`` fired; ``source`` stays referenced (alive) until then."""
    event.synchronize()
    return result


class _Entry(NamedTuple):
    extent: Extent
    nbytes: int
    meta: bytes


class DeviceTier(SlabBudget, ObjectTable):
    """GPU memory carved into size-class slots.

    Args:
        capacity_bytes: hard budget of GPU memory (arena bytes allocated at once).
        arena_bytes: size of one arena; larger objects get an arena of their own.
        device: the CUDA device (default: the current one).
        d2d_gbps: device-to-device bandwidth used to model restore time.

    Raises:
        ConfigError: torch sees no GPU, or a size is out of range.
    """

    name = "device"

    def __init__(self, capacity_bytes: int, *, arena_bytes: int = 1 << 30,
                 device: str | torch.device | None = None, d2d_gbps: float = 1000.0) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise ConfigError("the device tier needs a CUDA GPU visible to torch, and none is; "
                              "set device_bytes=0 to run without it")
        if not d2d_gbps > 0:
            raise ConfigError(f"d2d_gbps must be positive, got {d2d_gbps!r}")
        self._device = (torch.device(device) if device is not None
                        else torch.device("cuda", torch.cuda.current_device()))
        self._d2d_bps = d2d_gbps * 1e9
        self._stream = torch.cuda.Stream(device=self._device)
        self._arenas: dict[int, torch.Tensor] = {}
        self._alloc = SlabAllocator(budget_bytes=capacity_bytes, arena_bytes=arena_bytes,
                                    alignment=ALIGN, on_new_arena=self._new_arena,
                                    on_release_arena=self._free_arena)
        self._objects: dict[ObjectKey, _Entry] = {}

    def put(self, key: ObjectKey, data: Any, *, nbytes: int, meta: bytes = b"") -> Future:
        """Copy ``data`` (host or device) into a slot; visible at once to later stream work."""
        src = _byte_tensor(data, "data")
        if src.numel() < nbytes:
            raise ValueError(f"data has {src.numel()} bytes, fewer than nbytes={nbytes}")
        with self._lock:
            self._check_open()
            try:
                extent = self._alloc.alloc(nbytes)
            except torch.cuda.OutOfMemoryError as e:
                raise CapacityError(f"the GPU has no memory for a new {self.name} arena ({e}); "
                                    "lower device_bytes") from None
            if extent is None:
                raise CapacityError(
                    f"the device tier has no room for {nbytes} bytes ({self.used_bytes} of "
                    f"{self.capacity_bytes} bytes in use); evict objects and retry")
            try:
                fut = _copy_on(self._stream, self._slot(extent, nbytes), src[:nbytes], None)
            except BaseException:
                self._alloc.free(extent)
                raise
            old = self._objects.get(key)
            if old is not None:
                self._alloc.free(old[0])  # later copies into it queue after ours
            self._objects[key] = _Entry(extent, nbytes, bytes(meta))
        return fut

    def get_into(self, key: ObjectKey, out: Any) -> Future:
        """Copy into ``out`` (a device or host tensor, or a numpy array)."""
        dst = _byte_tensor(out, "out", written=True)
        with self._lock:
            self._check_open()
            extent, nbytes, _ = self._objects[key]
            if dst.numel() < nbytes:
                raise ValueError(f"out has {dst.numel()} bytes; the object needs {nbytes}")
            return _copy_on(self._stream, dst[:nbytes], self._slot(extent, nbytes), nbytes)

    def delete(self, key: ObjectKey) -> int:
        with self._lock:
            self._check_open()
            entry = self._objects.pop(key, None)
            if entry is None:
                return 0
            self._alloc.free(entry[0])
            return entry[0].length

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self._d2d_bps

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"objects": len(self._objects), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes,
                    "committed_bytes": self._alloc.committed_bytes}

    def close(self) -> None:
        """Wait for queued copies, then free the arenas."""
        with self._lock:
            if self._closed:
                return
            super().close()
            self._stream.synchronize()
            self._objects.clear()
            self._arenas.clear()

    def _slot(self, extent: Extent, nbytes: int) -> torch.Tensor:
        return self._arenas[extent.arena][extent.offset: extent.offset + nbytes]

    def _new_arena(self, arena_id: int, nbytes: int) -> None:
        self._arenas[arena_id] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def _free_arena(self, arena_id: int) -> None:
        del self._arenas[arena_id]  # queued copies hold it (record_stream) until they finish
