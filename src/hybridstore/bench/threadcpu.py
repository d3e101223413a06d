"""CPU time of this process's threads, by pool: where a benchmark's CPU per byte goes.

``time.process_time`` gives one number for every thread; issue 26 asks why a load costs
what it does, which needs it per thread pool: the bench's polling loop, the tier's job
threads, the store's load threads, the disk tier's I/O threads.  Linux keeps each
thread's time on a CPU in nanoseconds (``/proc/self/task/<tid>/schedstat``, first field;
``/proc/<pid>/task/<tid>/stat``'s ``utime``/``stime`` count 10 ms ticks, too coarse
for a pass of a few hundred milliseconds).  A thread is named by its Python name
(``threading.Thread.native_id``), without the index a ``ThreadPoolExecutor`` appends
(``hs-disk_3`` -> ``hs-disk``); threads Python did not start go under their kernel name
(``comm``).

The calling thread's own time is read with ``time.thread_time_ns`` right after the first
snapshot and right before the second (:class:`PoolClock`), so reading the others' files
(a few hundred microseconds, more in a process with many threads) is not counted.  The
pools' sum still runs a little above ``time.process_time`` over the same calls (5-10 % on
this VM for a pass of a few hundred milliseconds): each thread's clock is read a moment
apart from the others and from the process clock, while the pools' threads keep
running.  The breakdown says where the CPU goes; the process clock
stays the figure a goal is measured by.

Where ``/proc`` has no ``schedstat`` (another OS, a kernel without schedstats)
:func:`snapshot` returns ``None`` and the caller reports no breakdown.
"""

from __future__ import annotations

import os
import re
import threading
import time

__all__ = ["PoolClock", "Snapshot", "by_pool", "pool_name", "snapshot"]

Snapshot = dict[int, tuple[str, int]]
"""Thread id -> (pool name, nanoseconds on a CPU so far)."""

_TASKS = "/proc/self/task"
_INDEX = re.compile(r"[_-]?\d+( \(.*\))?$")


def pool_name(name: str) -> str:
    """A thread's pool: its name without the index a thread pool appends."""
    return _INDEX.sub("", name) or name


def snapshot(*, others: bool = False) -> Snapshot | None:
    """Every live thread's CPU time so far, with its pool; ``None`` where Linux's
    per-thread ``schedstat`` is not available.  ``others``: leave the calling thread out
    (:class:`PoolClock` times it itself, without the cost of reading the others)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    me = threading.get_native_id()
    out: Snapshot = {}
    for entry in tids:
        tid = int(entry)
        if others and tid == me:
            continue
        try:
            with open(f"{_TASKS}/{entry}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            if not os.path.exists(f"{_TASKS}/{entry}"):
                continue             # the thread ended meanwhile
            return None              # no schedstat here at all
        name = names.get(tid)
        if name is None:
            try:
                with open(f"{_TASKS}/{entry}/comm") as f:
                    name = f.read().strip() or "?"
            except OSError:
                continue
        out[tid] = (pool_name(name), ns)
    return out


def by_pool(before: Snapshot | None, after: Snapshot | None) -> dict[str, float] | None:
    """CPU seconds each pool spent between two snapshots (threads started meanwhile
    count from zero; threads that ended meanwhile are lost, so pools should outlive the
    measurement).  ``None`` when either snapshot is."""
    if before is None or after is None:
        return None
    out: dict[str, float] = {}
    for tid, (pool, ns) in after.items():
        was = before.get(tid)
        spent = ns - (was[1] if was is not None else 0)
        if spent > 0:
            out[pool] = out.get(pool, 0.0) + spent / 1e9
    return out


class PoolClock:
    """CPU seconds by pool between :meth:`start` and :meth:`stop`, the calling thread's
    own time read by ``time.thread_time_ns`` so that reading the other threads' times (a
    few hundred microseconds, more in a process with many threads) is not counted."""

    __slots__ = ("_before", "_own")

    def __init__(self) -> None:
        self._before: Snapshot | None = None
        self._own = 0

    def start(self) -> None:
        self._before = snapshot(others=True)
        self._own = time.thread_time_ns()

    def stop(self) -> dict[str, float] | None:
        """The pools' CPU seconds since :meth:`start` (``None`` without per-thread times)."""
        own = time.thread_time_ns() - self._own
        out = by_pool(self._before, snapshot(others=True))
        if out is not None:
            pool = pool_name(threading.current_thread().name)
            out[pool] = out.get(pool, 0.0) + own / 1e9
        return out
