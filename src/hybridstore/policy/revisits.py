"""Whether a trajectory is used again: its odds of another use, by the uses it has had.

:class:`~hybridstore.policy.nextuse.ReturnGaps` predicts *when* a trajectory's session
returns; it takes for granted that it does.  On agent traces nearly every session does
(the WEKA Claude Code sessions: 94-97 % of trajectories with ``n`` uses get another, at
every ``n``), but on chat traffic most do not: of the first 2,000 requests of Mooncake's
conversation trace, a session with one request gets a second in 25 % of cases, one with
two a third in 32 %, one with five a sixth in 60 %.  A unit whose session may never return
is worth less than its predicted return time says, and one that ends the first turn of a
session is the likeliest never to be used again.

:class:`ReturnOdds` counts, per trajectory of the checkpoint tree, its uses ``n`` (the
request that made it, then every resume at or below it) and learns ``p_n``, the share of
trajectories with ``n`` uses that had another (``n`` of 1 to :attr:`~ReturnOdds.classes`,
the rest pooled).  :class:`~hybridstore.policy.histate.HybridStoreEviction` divides the time
to a trajectory end's predicted next use by ``p_n`` (an expected wait that grows as the odds
fall), for ends no announcement covers.

Two things make the counts right where the cache is short:

* **Evicted trajectories** (a *ghost list*, as ARC's, Megiddo and Modha, FAST 2003): the
  count of a checkpoint outlives it, in a bounded table of keys; a request whose own
  checkpoint went, and that resumes above it (a shared prefix, or nothing), finds the
  deepest such key on its path when its new state is placed, and its trajectory goes on
  from that count instead of starting again at 1 (which would count the return as a new
  session that never came back, and learn ``p_1`` near 0 exactly when the cache is short).
* **Uses not yet followed** (right censoring): a trajectory used a moment ago has not had
  its chance to return.  ``p_n`` counts only uses older than the 90th percentile of the
  learnt return gaps (the *horizon*), and the returns of those uses, whenever they came.

The odds act only where the data shows them below 1: ``p_n`` is the Wilson score upper
bound (``z`` = 2) of the observed share, so a class with few uses seen, or whose
trajectories nearly all return, keeps the prediction as it is.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict

from hybridstore.errors import ConfigError
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.policy.nextuse import chain_parent


class ReturnOdds:
    """Uses per trajectory and the learnt odds ``p_n`` of another use (module docstring).

    Args:
        classes: use counts with odds of their own (``1..classes``; more are pooled).
        ghosts: counts remembered, held or evicted (the oldest noted goes first).
        horizon: quantile of the learnt return gaps after which a use that had no
            return counts as one that did not come back.
        z: the Wilson bound's z (0: the Laplace estimate ``(k + 1) / (m + 2)``).
        window: uses per class kept for the estimate (the newest).
    """

    def __init__(self, *, classes: int = 6, ghosts: int = 1 << 14, horizon: float = 0.9,
                 z: float = 2.0, window: int = 4096) -> None:
        if classes < 1 or ghosts < 1 or window < 1:
            raise ConfigError(f"classes, ghosts and window must be at least 1, got "
                              f"{classes}, {ghosts}, {window}")
        if not 0.0 <= horizon <= 1.0 or z < 0:
            raise ConfigError(f"horizon must be in [0, 1] and z non-negative, got {horizon}, {z}")
        self.classes = classes
        self.ghosts = ghosts
        self.horizon = horizon
        self.z = z
        self.window = window
        self._uses: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # key -> (n, when)
        self._at: list[list[float]] = [[] for _ in range(classes + 2)]     # uses at n, sorted
        self._back: list[list[float]] = [[] for _ in range(classes + 2)]   # their returns' use
        self._resumed: tuple[bytes, int] | None = None   # this request's own resume
        # this request and when it came, until its resume or its state counts it (start)
        self._pending: tuple[PrefixKeys, float] | None = None
        self._cut = -math.inf

    def _class(self, n: int) -> int:
        return min(max(n, 1), self.classes + 1)

    # -- counting ----------------------------------------------------------------------
    def count(self, ck: Checkpoint) -> int:
        """Uses of the trajectory through ``ck`` (its own count, else its chain's; 0: none)."""
        c: Checkpoint | None = ck
        while c is not None:
            v = self._uses.get(c.key)
            if v is not None:
                return v[0]
            c = chain_parent(c)
        return 0

    def _note(self, key: bytes, n: int, now: float) -> None:
        self._uses[key] = (n, now)
        self._uses.move_to_end(key)
        if len(self._uses) > self.ghosts:
            self._uses.popitem(last=False)

    def _use(self, n: int, now: float, before: float | None) -> None:
        """A trajectory's ``n``-th use at ``now``; ``before``: when its previous one was."""
        at = self._at[self._class(n)]
        bisect.insort(at, now)
        if before is not None and n > 1:
            bisect.insort(self._back[self._class(n - 1)], before)
        if len(at) > self.window:    # forget the oldest uses, and the returns of those
            first = at[len(at) - self.window]
            del at[:len(at) - self.window]
            back = self._back[self._class(n)]
            del back[:bisect.bisect_left(back, first)]

    def start(self, index: HybridIndex, prompt: PrefixKeys, now: float) -> None:
        """A request is looked up at ``now``: it has resumed from nothing yet.

        The request before it, if it neither resumed its own trajectory nor placed a state
        (a prompt the engine would not cache, a put the store refused), counts now: as a
        use of the evicted trajectory on its path, when there was one (without it that
        trajectory's last use would count as one that never came back)."""
        if self._pending is not None:
            previous, at = self._pending
            ghost = self._ghost(index, previous, previous.length, 0)
            if ghost is not None:
                key, (n, before) = ghost
                self._use(n + 1, at, before)
                self._note(key, n + 1, at)
        self._resumed = None
        self._pending = (prompt, now)

    def resumed(self, ck: Checkpoint, now: float, before: float) -> None:
        """The request resumed from ``ck``, whose last use was at ``before``: another use
        of its trajectory, unless ``ck`` is a branch point (a prefix other sessions share:
        the trajectory below it is the request's own, counted when its state is placed)."""
        if len(ck.children) > 1:
            return
        n = max(self.count(ck), 1) + 1
        self._use(n, now, before if before > -math.inf else None)
        self._resumed = (ck.key, n)
        self._pending = None
        c: Checkpoint | None = ck
        while c is not None:          # the chain above carries the trajectory's count
            self._note(c.key, n, now)
            c = chain_parent(c)

    def placed(self, index: HybridIndex, prompt: PrefixKeys, ck: Checkpoint, now: float) -> None:
        """A new checkpoint ``ck`` of ``prompt``: it continues the trajectory above it (the
        chain's, or the one the request resumed from), or it starts one, or it carries on
        the count of an evicted trajectory on its path (the deepest, below the nearest held
        checkpoint; looked for at ``ck``'s own key and at the block boundaries, so an
        evicted state inside a block, which only prompts of token ids have, is missed)."""
        self._pending = None    # a request that places a state is counted here
        parent = ck.parent
        if parent is not None:
            if len(parent.children) == 1 and (n := self.count(parent)):
                self._note(ck.key, n, now)
                return
            if self._resumed is not None and self._resumed[0] == parent.key:
                self._note(ck.key, self._resumed[1], now)
                return
        ghost = self._uses.get(ck.key)
        if ghost is None:
            found = self._ghost(index, prompt, ck.position, parent.position if parent else 0)
            ghost = None if found is None else found[1]
        n = 1 if ghost is None else ghost[0] + 1
        self._use(n, now, None if ghost is None else ghost[1])
        self._note(ck.key, n, now)

    def _ghost(self, index: HybridIndex, prompt: PrefixKeys, top: int, stop: int
               ) -> tuple[bytes, tuple[int, float]] | None:
        """The deepest evicted checkpoint with a count on ``prompt``'s path at or below
        position ``top`` and above ``stop`` (looked for at the block boundaries: an evicted
        state inside a block, which only prompts of token ids have, is missed); the search
        ends at a held checkpoint, whose own count is the trajectory's."""
        B = prompt.block_size
        for k in range(min(top, prompt.length) // B - 1, -1, -1):
            if (k + 1) * B <= stop:
                break
            key = prompt.block_key(k)
            if index.checkpoint(key) is not None:
                if (k + 1) * B < top:
                    break
                continue
            ghost = self._uses.get(key)
            if ghost is not None:
                return key, ghost
        return None

    # -- the odds ----------------------------------------------------------------------
    def settle(self, now: float, gaps: tuple[float, ...]) -> None:
        """Before ranking: uses from the last :attr:`horizon` quantile of ``gaps`` (the
        learnt return gaps) on are too recent to count (module docstring)."""
        if not gaps:
            self._cut = -math.inf
            return
        s = sorted(gaps)
        self._cut = now - s[min(len(s) - 1, int(self.horizon * len(s)))]

    def odds(self, ck: Checkpoint) -> float:
        """``p_n`` of ``ck``'s trajectory: the Wilson upper bound of the share of the
        settled uses of its class that had another (1 with none settled)."""
        c = self._class(self.count(ck))
        m = bisect.bisect_left(self._at[c], self._cut)
        if m == 0:
            return 1.0
        k = min(bisect.bisect_left(self._back[c], self._cut), m)
        return _upper(k, m, self.z)


def _upper(k: int, m: int, z: float) -> float:
    """The Wilson score upper bound of ``k`` successes in ``m`` trials (``z`` 0: Laplace)."""
    if z == 0:
        return (k + 1) / (m + 2)
    p = k / m
    z2 = z * z
    centre = p + z2 / (2 * m)
    spread = z * math.sqrt(p * (1 - p) / m + z2 / (4 * m * m))
    return min(1.0, (centre + spread) / (1 + z2 / m))


__all__ = ["ReturnOdds"]
