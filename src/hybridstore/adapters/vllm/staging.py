"""The staging region shared by vLLM's scheduler process and its worker processes.

vLLM builds the offloading spec in the scheduler process (the manager: index,
policies, the store) and again in every worker process (GPU pages).  They meet
here, as vLLM's own CPU tier meets in its ``/dev/shm`` region
(``vllm/v1/kv_offload/cpu/shared_offload_region.py``): one file, mapped by every
side, of a fixed number of *slots*, each big enough for one offload key's bytes
of every worker::

    +--------------------------- header (int64 words, 4 KiB aligned) ----------------+
    | magic | version | nslots | slot_bytes | world | ngroups | 0 | 0 |               |
    | group_bytes[rank][group]   (each worker writes its own row when it registers) |
    | flags[slot]                (load readiness: token ready, -token failed)       |
    +------------------------------- slot 0 ------------------------------------------+
    | rank 0 part (group_bytes[0][g]) | rank 1 part | ... | (unused up to slot_bytes) |
    +------------------------------- slot 1 ... --------------------------------------+

A key of group ``g`` uses the first ``world * group_bytes[g]`` bytes of its slot,
rank ``r`` at offset ``r * group_bytes[g]``; the manager stores exactly those
bytes as one store object, so an object holds every rank's shard.  Inside a
rank's part the group's layers follow one another, each as ``blocks_per_chunk``
pages of that layer (the layout of vLLM's CPU tier).

The manager allocates slots (:class:`SlotPool`) and owns the file (it unlinks it
at shutdown); workers only map it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import deque

import numpy as np

from hybridstore.errors import ConfigError

MAGIC = 0x3147545347565348  # b"HSVGSTG1" little-endian
VERSION = 1
_FIXED = 8
ALIGN = 4096


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class StagingRegion:
    """One mapping of the shared staging file (create-or-open, same geometry on every side).

    Args:
        path: the file (``/dev/shm/hybridstore-vllm-<engine id>.staging``).
        slot_bytes: bytes of one slot (rounded up to 4 KiB).
        nslots: number of slots.
        world: number of workers (ranks).
        ngroups: number of offloaded KV cache groups.

    Raises:
        ConfigError: the file exists with another geometry (another engine
            with the same engine id and a different configuration).
    """

    def __init__(self, path: str, *, slot_bytes: int, nslots: int, world: int,
                 ngroups: int) -> None:
        self.path = path
        self.slot_bytes = _round_up(max(slot_bytes, 1), ALIGN)
        self.nslots = nslots
        self.world = world
        self.ngroups = ngroups
        self._flags_at = _FIXED + world * ngroups
        self.header_bytes = _round_up(8 * (self._flags_at + nslots), ALIGN)
        size = self.header_bytes + nslots * self.slot_bytes
        want = np.array([MAGIC, VERSION, nslots, self.slot_bytes, world, ngroups], np.int64)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            have = os.fstat(fd).st_size
            if have == 0:
                os.ftruncate(fd, size)
                os.pwrite(fd, want.tobytes(), 0)
            else:
                got = np.frombuffer(os.pread(fd, want.nbytes, 0), np.int64)
                if have != size or not np.array_equal(got, want):
                    raise ConfigError(
                        f"staging file {path} exists with another geometry "
                        f"({got.tolist()}, {have} B; this engine wants {want.tolist()}, "
                        f"{size} B): remove it, or give this engine another engine_id")
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        words = self._map[: self.header_bytes].view(np.int64)
        self.group_bytes = words[_FIXED: self._flags_at].reshape(world, ngroups)
        """``group_bytes[rank, g]``: bytes of group ``g`` one rank puts in a slot (0: not yet known)."""
        self.flags = words[self._flags_at: self._flags_at + nslots]
        """Load readiness per slot: the load's token when staged, ``-token`` when it failed."""
        self.slots = self._map[self.header_bytes:].reshape(nslots, self.slot_bytes)

    def payload(self, slot: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``slot`` (a writable view of the shared file)."""
        return self.slots[slot, :nbytes]

    def close(self) -> None:
        """Drop this mapping (views taken from it must not be used after)."""
        m = getattr(self, "_map", None)
        if m is not None and m._mmap is not None:
            m._mmap.close()

    def unlink(self) -> None:
        """Remove the file (the manager, at shutdown)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SlotPool:
    """Free slots of a :class:`StagingRegion` (scheduler process only; thread-safe)."""

    def __init__(self, nslots: int) -> None:
        self._free: deque[int] = deque(range(nslots))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int, *, keep: int = 0) -> list[int] | None:
        """``n`` slots, or None when fewer than ``n + keep`` are free."""
        with self._lock:
            if len(self._free) < n + keep:
                return None
            return [self._free.popleft() for _ in range(n)]

    def take_waiting(self, n: int, timeout: float) -> list[int] | None:
        """``n`` slots, waiting up to ``timeout`` s for stores in flight to return theirs."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout):
                return None
            return [self._free.popleft() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()
