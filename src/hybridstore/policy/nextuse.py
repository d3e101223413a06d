"""When a trajectory will be used next: per-trajectory return gaps on the caller's clock.

The exact bound of a free-state KV cache is Belady's rule per page (farthest next use
goes first; ``replay/bound.py``).  An agent session's context is next used when the
session returns, and agents return at a cadence of their own (tool calls, a user
typing): :class:`ReturnGaps` learns, per trajectory of the checkpoint tree, the gaps
between its uses on a clock the store's owner gives (:meth:`bind_clock`: the engine's
wall clock, the replay's simulated time; the index's logical clock when none is
bound), and predicts the next use of a unit last used at ``last``:

* ``last + g`` while that lies ahead, ``g`` the median of the trajectory's last
  :attr:`ReturnGaps.window` gaps (of all trajectories' gaps when it has none yet): a
  session just served is not due again for about its own gap, so under pressure it may
  go before one that is about to return (Belady's choice against a cyclic pattern,
  where least-recently-used order evicts exactly the session due next);
* once overdue, ``now + (now - last)``: the longer a session has been away the longer
  it stays away (it may have ended); that is least-recently-used order.

A trajectory's gaps live on the checkpoint a request resumed from and are inherited by
the checkpoints below it along its chain (the session's later states, each its parent's
only child); a checkpoint several sessions resume from (a shared system prompt) learns
the gaps between any of them, the next use of a shared page being any session's.  A
branch below a branch point (a checkpoint with several children: another session after
a shared prefix, a turn an agent rewound and wrote again) inherits nothing: the branch
point's gaps are how often requests come back *to that point* (a new session, a rewind),
not how often the new branch's own turns follow each other, so it starts from the
default until it has returned itself.  :meth:`ReturnGaps.recency` turns the prediction
back into a recency term (``2 now - next``: least recent use for an overdue unit), the
``t_x`` of HiState's eq. 7 in :class:`~hybridstore.policy.histate.HybridStoreEviction`.

**Announcements** (:meth:`ReturnGaps.expect`, from ``HybridStore.expect``): where the engine
or an orchestrator knows a session's next use (a request waiting in the engine's queue: now;
an agent waiting on a tool call of known length: in so many seconds; a task that ended:
never), it replaces the prediction for the checkpoints only that session uses and bounds it
(the earlier of the two) for a prefix others share, until a request resumes there or the
announced time passes (:meth:`ReturnGaps.expectation`).

Measured in docs/replay.md (the default preset against the exact bound): tight budgets
gain most, where least-recently-used order thrashes.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

from hybridstore.errors import ConfigError
from hybridstore.index.trie import Checkpoint, HybridIndex

Clock = Callable[[], float]

WINDOW = 5
"""Gaps of a trajectory whose median is its expected gap, by default (the newest)."""

MAX_STAMPS = 1 << 16
"""Tick/time pairs kept for :meth:`ReturnGaps.time_of` (the oldest half goes past it)."""


class ReturnGaps:
    """Per-trajectory return gaps and the next use they predict (module docstring).

    Args:
        window: gaps of a trajectory its median covers (the newest).
        history: gaps of all trajectories kept for the default of a new one.
    """

    def __init__(self, *, window: int = WINDOW, history: int = 512) -> None:
        if window < 1 or history < 1:
            raise ConfigError(f"window and history must be at least 1, got {window}, {history}")
        self.window = window
        self.clock: Clock | None = None
        self._ticks: list[int] = []       # index ticks, ascending
        self._times: list[float] = []     # the clock when the index was at that tick
        self._gaps: dict[bytes, tuple[float, ...]] = {}   # newest gaps of a trajectory
        self._last: dict[bytes, float] = {}               # last resume at or below a checkpoint
        # the order of resumes and announcements: a request served and announced at one
        # reading of the clock (the replay's arrival time) resumed *before* it announced
        self._events = 0
        self._resumed: dict[bytes, int] = {}              # event of that last resume
        self._done: dict[bytes, float] = {}               # when that request finished (finish)
        # announced at, due, whether only the announcing session uses it, its event
        # (HybridStore.expect)
        self._expected: dict[bytes, tuple[float, float, bool, int]] = {}
        self._all: deque[float] = deque(maxlen=history)
        self._prune_at = 4096

    # -- the clock ---------------------------------------------------------------------
    def now(self, index: HybridIndex) -> float:
        """The clock now (the index's tick without a bound clock), stamped for :meth:`time_of`."""
        tick = index.now()
        t = float(tick) if self.clock is None else float(self.clock())
        if self._ticks and tick <= self._ticks[-1]:
            self._times[-1] = max(self._times[-1], t)
        else:
            self._ticks.append(tick)
            self._times.append(max(t, self._times[-1]) if self._times else t)
            if len(self._ticks) > MAX_STAMPS:
                del self._ticks[:MAX_STAMPS // 2], self._times[:MAX_STAMPS // 2]
        return self._times[-1]

    def latest(self) -> float:
        """The clock at the latest stamp (0 before any): the request being served, stamped
        at its lookup (:meth:`now`), without stamping again."""
        return self._times[-1] if self._times else 0.0

    def time_of(self, tick: int) -> float:
        """The clock at the last stamp at or before ``tick``: every request is stamped
        when it is looked up (:meth:`~hybridstore.policy.base.EvictionPolicy.on_match`),
        before its hit and its puts advance the index's clock, so those are dated by
        the request that made them (the oldest stamp for ticks before the first)."""
        if not self._ticks:
            return 0.0
        i = bisect.bisect_right(self._ticks, tick) - 1
        return self._times[max(i, 0)]

    # -- learning ----------------------------------------------------------------------
    def last_use(self, checkpoint: Checkpoint) -> float:
        """When ``checkpoint`` was last used: the last resume at or below it, else the
        request that made it."""
        return max(self._last.get(checkpoint.key, -math.inf), self.time_of(checkpoint.created))

    def recent_gaps(self) -> tuple[float, ...]:
        """The newest gaps of all trajectories (the default of a new one is their median)."""
        return tuple(self._all)

    def on_hit(self, index: HybridIndex, checkpoint: Checkpoint) -> None:
        """A request resumed from ``checkpoint``: one gap of its trajectory."""
        now = self.now(index)
        prev = self.last_use(checkpoint)
        done = self._done.get(checkpoint.key, -math.inf)
        if prev <= done <= now:    # from the end of that use (a finish after now: a model's)
            prev = done
        gap = now - prev
        if gap > 0:
            self._gaps[checkpoint.key] = (*self.gaps(checkpoint), gap)[-self.window:]
            self._all.append(gap)
        self._events += 1
        ck: Checkpoint | None = checkpoint
        while ck is not None:
            self._last[ck.key] = now
            self._resumed[ck.key] = self._events
            ck = ck.parent
        if len(self._last) > self._prune_at:   # forget the checkpoints no longer held
            self._gaps = {k: v for k, v in self._gaps.items() if index.checkpoint(k) is not None}
            self._last = {k: v for k, v in self._last.items() if index.checkpoint(k) is not None}
            self._resumed = {k: v for k, v in self._resumed.items() if k in self._last}
            self._done = {k: v for k, v in self._done.items() if index.checkpoint(k) is not None}
            self._expected = {k: v for k, v in self._expected.items()
                              if index.checkpoint(k) is not None}
            self._prune_at = 2 * len(self._last) + 4096

    def finish(self, index: HybridIndex, checkpoint: Checkpoint, in_s: float = 0.0) -> None:
        """The request that continued ``checkpoint``'s prompt finishes (its last output
        token) ``in_s`` seconds from now: the uses of ``checkpoint`` and the checkpoints above
        it end then (:meth:`since`), and the trajectory's next gap counts from then."""
        done = self.now(index) + in_s
        ck: Checkpoint | None = checkpoint
        while ck is not None:
            self._done[ck.key] = max(self._done.get(ck.key, -math.inf), done)
            ck = ck.parent

    def since(self, checkpoint: Checkpoint, tick: int) -> float:
        """When the last use of ``checkpoint``, at index tick ``tick``, ended: the finish
        of the request that made it (:meth:`finish`) when the engine said so and that is
        later, else the time of the tick (the request's arrival)."""
        return max(self.time_of(tick), self._done.get(checkpoint.key, -math.inf))

    def expect(self, index: HybridIndex, checkpoint: Checkpoint, in_s: float = 0.0) -> None:
        """A request that resumes from ``checkpoint`` is expected in ``in_s`` seconds (0: it
        is queued; ``math.inf``: none will come): :meth:`expectation` of it and of the
        checkpoints on its path.

        The checkpoints only this session uses (``checkpoint`` when nothing lies below it,
        and its ancestors up to the first one with another child) take the announced
        next use; a prefix other sessions share keeps the earlier of that and its own
        prediction (:class:`~hybridstore.policy.histate.HybridStoreEviction`), and a
        session's end (``math.inf``) says nothing of it. Where several announcements
        meet, the earliest due holds.
        """
        now = self.now(index)
        due = now + in_s
        self._events += 1
        own = not checkpoint.children
        ck: Checkpoint | None = checkpoint
        while ck is not None and (own or due < math.inf):
            held = self.expectation(ck, now)
            if held is None or due < held[0]:
                self._expected[ck.key] = (now, due, own, self._events)
            parent = ck.parent
            own = own and parent is not None and len(parent.children) == 1
            ck = parent

    def expectation(self, checkpoint: Checkpoint, now: float | None = None
                    ) -> tuple[float, bool] | None:
        """``(due, only this session uses it)`` of the announcement (:meth:`expect`) that
        holds for ``checkpoint`` at ``now`` (the latest stamp by default), or ``None``.

        An announcement holds until a request resumes at or below ``checkpoint`` after
        it (in the order of the calls: the request that announces its session's next one
        resumed before it, at the same reading of the clock), and one of a time to come
        (``in_s > 0``, finite) until that time has passed: an orchestrator's estimate that
        proved wrong gives way to the prediction."""
        e = self._expected.get(checkpoint.key)
        if e is None:
            return None
        at, due, own, event = e
        if self._resumed.get(checkpoint.key, -1) > event:
            return None
        if now is None:
            now = self.latest()
        if at < due < math.inf and now > due:
            return None
        return due, own

    def expected(self, checkpoint: Checkpoint) -> bool:
        """Whether an announcement (:meth:`expect`) holds for ``checkpoint`` now."""
        return self.expectation(checkpoint) is not None

    def gaps(self, checkpoint: Checkpoint) -> tuple[float, ...]:
        """The newest gaps of the trajectory through ``checkpoint`` (its own, else those of
        the nearest learnt ancestor on its chain: :func:`chain_parent`)."""
        ck: Checkpoint | None = checkpoint
        while ck is not None:
            g = self._gaps.get(ck.key)
            if g is not None:
                return g
            ck = chain_parent(ck)
        return ()

    # -- predicting --------------------------------------------------------------------
    def expected_gaps(self, index: HybridIndex) -> dict[bytes, float]:
        """The expected gap of every checkpoint's trajectory (parents before children)."""
        default = _median(self.recent_gaps()) if self._all else math.inf
        out: dict[bytes, float] = {}
        for ck in sorted(index.checkpoints(), key=lambda c: c.position):
            own = self._gaps.get(ck.key)
            if own is not None:
                out[ck.key] = _median(own)
            else:
                parent = chain_parent(ck)
                out[ck.key] = default if parent is None else out.get(parent.key, default)
        return out

    def recency(self, last: float, gap: float, now: float) -> float:
        """``2 now - next use`` for a unit last used at ``last`` whose trajectory returns
        every ``gap``: ``last`` (least recent use) once overdue, or with no gap known yet
        (``gap`` infinite)."""
        due = last + gap
        return 2.0 * now - due if now < due < math.inf else last


def chain_parent(ck: Checkpoint) -> Checkpoint | None:
    """``ck``'s parent when ``ck`` is its only child (the same trajectory, whose gaps ``ck``
    inherits), else None: ``ck`` starts a branch below a branch point (module docstring)."""
    parent = ck.parent
    return parent if parent is not None and len(parent.children) == 1 else None


def _median(values: tuple[float, ...]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


__all__ = ["WINDOW", "Clock", "ReturnGaps", "chain_parent"]
