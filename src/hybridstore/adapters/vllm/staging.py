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
at shutdown); workers only map it.  Every process that maps the file holds a
shared ``flock`` on it while it does, so a file nobody holds is one a killed
engine left behind: the next engine's manager removes those at start
(:meth:`StagingRegion.reclaim`), as vLLM's own CPU tier leaves its region to the
next start.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import threading
from collections import deque

import numpy as np

from hybridstore.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "hybridstore-vllm-"
SUFFIX = ".staging"
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
        fd = self._open_shared(path, size, want)
        try:
            have = os.fstat(fd).st_size
            got = np.frombuffer(os.pread(fd, want.nbytes, 0), np.int64)
            if have != size or not np.array_equal(got, want):
                raise ConfigError(
                    f"staging file {path} exists with another geometry "
                    f"({got.tolist()}, {have} B; this engine wants {want.tolist()}, "
                    f"{size} B): remove it, or give this engine another engine_id")
            self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        except BaseException:
            os.close(fd)
            raise
        self._hold: int | None = fd
        words = self._map[: self.header_bytes].view(np.int64)
        self.group_bytes = words[_FIXED: self._flags_at].reshape(world, ngroups)
        """``group_bytes[rank, g]``: bytes of group ``g`` one rank puts in a slot (0: not yet known)."""
        self.flags = words[self._flags_at: self._flags_at + nslots]
        """Load readiness per slot: the load's token when staged, ``-token`` when it failed."""
        self.slots = self._map[self.header_bytes:].reshape(nslots, self.slot_bytes)

    @staticmethod
    def _open_shared(path: str, size: int, header: np.ndarray) -> int:
        """Open ``path`` with a shared lock held (creating it, whole, if it is absent).

        A new file is made complete under a temporary name and linked into place, so
        a process that finds the file never sees it half made; the lock is taken
        again if another engine's :meth:`reclaim` removed the file between our open
        and our lock.
        """
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
                tfd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(tfd, size)
                    os.pwrite(tfd, header.tobytes(), 0)
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        pass                  # another process made it first: use theirs
                finally:
                    os.close(tfd)
                    os.unlink(tmp)
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)    # held while mapped: the file is in use
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    @staticmethod
    def reclaim(directory: str) -> list[str]:
        """Remove the staging files in ``directory`` that no process maps any more.

        A live engine's processes each hold a shared lock on its file; a file whose
        exclusive lock is free was left by an engine that was killed (SIGKILL, OOM)
        before its manager's shutdown unlinked it.

        Returns:
            The paths removed.
        """
        removed = []
        for path in glob.glob(os.path.join(glob.escape(directory), f"{PREFIX}*{SUFFIX}")):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)           # in use by a live engine
                continue
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
            finally:
                os.close(fd)
        if removed:
            log.info("hybridstore: removed %d staging files of engines that were killed: %s",
                     len(removed), removed)
        return removed

    def payload(self, slot: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``slot`` (a writable view of the shared file)."""
        return self.slots[slot, :nbytes]

    def close(self) -> None:
        """Drop this mapping (views taken from it must not be used after)."""
        m = getattr(self, "_map", None)
        if m is not None and m._mmap is not None:
            m._mmap.close()
        fd = getattr(self, "_hold", None)
        if fd is not None:
            self._hold = None
            os.close(fd)              # drops the shared lock

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

    def take_waiting(self, n: int, timeout: float, *, keep: int = 0) -> list[int] | None:
        """``n`` slots, waiting up to ``timeout`` s for stores in flight to return theirs
        (None if fewer than ``n + keep`` are free by then)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n + keep, timeout):
                return None
            return [self._free.popleft() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()
