"""Policy seams: pure functions of index state, never I/O.

Three decisions are policies (ARCHITECTURE.md, ``policy/``):

* **eviction ranking** — :class:`EvictionPolicy`: in which order objects of a
  tier are offered for eviction.  The store applies the safety rules (never a
  pinned object, never the last copy of a page a retained checkpoint needs)
  and moves the bytes; the policy only ranks.
* **checkpoint admission** — :class:`AdmissionPolicy`: whether a checkpoint
  the engine offers is kept at all.
* **checkpoint placement** — :class:`PlacementPolicy`: at which positions of a
  new prompt segment the engine should capture recurrent states.

The same policies drive the real store and the accounting-only simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import Checkpoint, HybridIndex
from hybridstore.objects import ObjectKind


class Victim(NamedTuple):
    """One eviction candidate.

    ==========  =============================================================
    field       meaning
    ==========  =============================================================
    ``kind``    :class:`~hybridstore.objects.ObjectKind` (page or state)
    ``ref``     node id (page) or 16-byte key (checkpoint)
    ==========  =============================================================
    """

    kind: ObjectKind
    ref: int | bytes


@dataclass
class ResidenceStats:
    """How long objects stay cached before eviction, as EMAs (HiState §3.2).

    ``t_kv`` and ``t_state`` estimate the residence times T_KV and T_state of
    eq. 4, in the index's logical time (their ratio is what matters).  The
    store calls :meth:`observe` whenever an object leaves its last tier.
    """

    alpha: float = 0.05
    t_kv: float | None = None
    t_state: float | None = None

    def observe(self, kind: ObjectKind, lifetime: float) -> None:
        if kind == ObjectKind.PAGE:
            self.t_kv = lifetime if self.t_kv is None else self.t_kv + self.alpha * (lifetime - self.t_kv)
        else:
            prev = self.t_state
            self.t_state = lifetime if prev is None else prev + self.alpha * (lifetime - prev)

    def observe_many(self, kind: ObjectKind, lifetimes: np.ndarray) -> None:
        """:meth:`observe` of several lifetimes in order, in closed form: after ``n``
        steps of ``t += alpha * (x - t)``, ``t = (1-alpha)^n t + sum alpha (1-alpha)^(n-1-i) x_i``."""
        x = np.asarray(lifetimes, dtype=np.float64)
        if not x.size:
            return
        prev = self.t_kv if kind == ObjectKind.PAGE else self.t_state
        if prev is None:            # the first observation sets the average
            prev, x = float(x[0]), x[1:]
        a = self.alpha
        decay = (1.0 - a) ** np.arange(x.size - 1, -1, -1, dtype=np.float64)
        t = float((1.0 - a) ** x.size * prev + a * np.dot(decay, x))
        if kind == ObjectKind.PAGE:
            self.t_kv = t
        else:
            self.t_state = t

    def kv_state_ratio(self) -> float:
        """T_KV / T_state (1.0 until both have been observed)."""
        if not self.t_kv or not self.t_state:
            return 1.0
        return self.t_kv / self.t_state


class EvictionPolicy(ABC):
    """Ranks the objects of one tier for eviction.

    Attributes:
        dependency_aware: when True the store never drops the last copy of a
            page that a retained checkpoint needs (the checkpoint is evicted
            first, FlashStates' hybrid-state unit); when False pages go in
            plain policy order and checkpoints may be left without their KV
            (the dependency misses vLLM and SGLang show).
        room_slack, partition_slack, states_free_pages, whole_leaves, ranks_used_later: see
            below.
    """

    name: str = "eviction"
    dependency_aware: bool = True
    room_slack: float = 1 / 32
    """Room freed beyond a put's need, as a fraction of the tier (or of its partition):
    one eviction pass then serves many puts.  An engine's own eviction frees what the
    allocation needs and no more (``0``)."""
    partition_slack: float | None = None
    """:attr:`room_slack` when the room is asked of one kind's partition of a split tier
    (``TierPolicy.state_share``); ``None``: the same."""
    states_free_pages: bool = False
    """Its page ranking (``kind=PAGE``) also names the checkpoints whose eviction frees
    pages, where the engine frees a state with its KV (SGLang's radix leaves); the store
    counts only the pages freed towards the room asked for."""
    whole_leaves: bool = False
    """A checkpoint evicted (for page or for state room) takes ALL the pages only it
    needed with it, as SGLang deletes a radix leaf whole, its KV with its state (its Mamba
    eviction too); otherwise only as many as the room asked for, and after a state
    eviction none: the rest stay until the page ranking reaches them."""
    ranks_used_later: bool = True
    """A use moves an object later in this policy's order (recency orders), so a ranking
    made before the use stays valid for the rest once the used objects are skipped, and the
    store may reuse it across evictions (:meth:`~hybridstore.store.evictor.Evictor.evict`).
    ``False`` where a use can move an object *earlier* (a predicted next use: the session just
    served is due last): every eviction then ranks afresh, else a reused ranking skips the
    sessions served since it was made, exactly those due last, and takes the ones due next."""
    demotes_abandoned: bool = False
    """The store reports, at each resume, the never-resumed branches the prompt left
    (:func:`abandoned_branches`, :meth:`on_abandon`)."""

    def slack(self, partition: ObjectKind | None) -> float:
        """Room to free beyond a put's need, as a fraction of the tier or of ``partition``."""
        if partition is not None and self.partition_slack is not None:
            return self.partition_slack
        return self.room_slack

    def on_match(self, index: HybridIndex, prompt: PrefixKeys) -> None:  # noqa: B027
        """Called at every lookup of ``prompt`` (:meth:`~hybridstore.store.facade.HybridStore.match`),
        before the index looks it up: a request is being served now."""

    def on_hit(self, index: HybridIndex, checkpoint: Checkpoint) -> None:  # noqa: B027
        """Called after a resume from ``checkpoint`` (e.g. to refresh ancestors)."""

    def on_checkpoint(self, index: HybridIndex, prompt: PrefixKeys,  # noqa: B027
                      checkpoint: Checkpoint) -> None:
        """Called when a put stores a new checkpoint of ``prompt`` (after the request's
        lookup: :meth:`on_match`, :meth:`on_hit`)."""

    def on_expect(self, index: HybridIndex, checkpoint: Checkpoint,  # noqa: B027
                  in_s: float = 0.0) -> None:
        """Called when a request that would resume from ``checkpoint`` is expected in
        ``in_s`` seconds (:meth:`~hybridstore.store.facade.HybridStore.expect`; 0: it waits
        in the engine's queue, ``math.inf``: none will come)."""

    def on_finish(self, index: HybridIndex, checkpoint: Checkpoint,  # noqa: B027
                  in_s: float = 0.0) -> None:
        """Called when the request that continued ``checkpoint``'s prompt finishes
        decoding ``in_s`` seconds from now
        (:meth:`~hybridstore.store.facade.HybridStore.finished`)."""

    def bind_clock(self, clock: Callable[[], float]) -> None:  # noqa: B027
        """The store's owner gives the time requests are served at (seconds: an engine's
        wall clock, the replay's simulated time), for policies that predict returns."""

    def on_abandon(self, index: HybridIndex, branches: list[Checkpoint]) -> None:  # noqa: B027
        """Called after a resume with the checkpoints of the branches the prompt left there
        that no request ever resumed from (only when :attr:`demotes_abandoned`)."""

    @abstractmethod
    def victims(self, index: HybridIndex, tier: str, kind: ObjectKind | None = None, *,
                keep_needed: bool = False) -> Iterator[Victim]:
        """Objects held by ``tier`` (only those of ``kind``, when given, but for the
        checkpoints a ``states_free_pages`` policy names for pages), first to evict first.

        ``keep_needed``: the store will keep the last copy of every page a
        retained checkpoint needs (a dependency-aware policy and no tier below
        to spill to), so a policy may leave such pages out of the order.
        """


def lru_order(pages: dict[str, np.ndarray], mask: np.ndarray) -> list[int]:
    """Ids of the pages ``mask`` selects from a tier's page table, least recently used
    first and, among pages used at the same time, the deepest first: a put or a resume
    touches a prompt's whole path at once, so this takes its tail before its head (a
    page is useless without the pages before it)."""
    ids = pages["ids"][mask]
    return ids[np.lexsort((-pages["block"][mask], pages["atime"][mask]))].tolist()


def reclaimable_pages(index: HybridIndex, atime: np.ndarray,
                      deps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a tier's reclaimable pages (no retained checkpoint needs them) in two.

    Returns ``(old, young)`` masks over the page columns ``atime`` / ``deps``
    (:meth:`~hybridstore.index.trie.HybridIndex.page_table`).  ``young`` pages
    were touched after the newest checkpoint put or hit: most likely the KV of
    a request whose checkpoint the engine is about to put, so a dependency-aware
    policy offers them last (evicting them would leave that checkpoint without
    its KV).  ``old`` pages can resume nothing: they go first.
    """
    newest = max((ck.atime for ck in index.checkpoints()), default=-1)
    free = deps == 0
    young = free & (atime > newest)
    return free & ~young, young


REWRITE_SPAN = 0.125
"""A left branch counts as an edit of the prompt only when its part past the prompt's
shared prefix is at most this share of that prefix (:func:`abandoned_branches`)."""

REWRITE_FANOUT = 2
"""A prompt rewrites the branches it leaves at its resume point only when that checkpoint
has at most this many children (:func:`abandoned_branches`): more are a prefix that
sessions share."""


def abandoned_branches(checkpoint: Checkpoint, limit: int, walked: int, *,
                       continues: bool) -> list[Checkpoint]:
    """The checkpoints of the branches a prompt resumed at ``checkpoint`` has rewritten.

    A child of ``checkpoint`` lies off the prompt's path when

    * it sits at or before ``limit`` (the prompt's length, or the caller's
      ``max_position``): a match takes the deepest complete resume point, and a
      dependency-aware store keeps a retained checkpoint's pages, so the match passed it
      over only because the prompt's tokens leave its path first; or
    * the prompt's own KV walk ended at ``walked`` with a full block of the prompt after
      it that the index does not know (``continues``: the prompt goes on differently, it
      does not merely stop), and the child's block starts past ``walked``: its path holds
      a block there that the prompt does not.

    A child past ``limit`` that the prompt may still continue into (a lookup that stops
    early, a prompt that ends inside the block) is left alone, and so is every child of a
    checkpoint with more than :data:`REWRITE_FANOUT` children: an agent rewriting its
    turn leaves one continuation there (two when it rewrites again), while a prefix many
    branches continue is one that sessions share (a system prompt, a document several
    conversations ask about), whose other branches are sessions of their own (measured:
    docs/replay.md, "Branches at a shared prefix").  Of the children the
    prompt left, a subtree counts as rewritten, and is returned whole, when

    * no checkpoint in it was ever resumed from (``hits == 0``): a subtree some request
      resumed from is a live continuation of its own (another session on a shared
      prefix, or a branch the agent came back to); and
    * it reaches at most :data:`REWRITE_SPAN` of the shared prefix past it (its deepest
      checkpoint at or before ``walked * (1 + REWRITE_SPAN)``): the prompt keeps nearly
      all of that branch and changes its tail, as an agent rewriting its last turn does.
      A branch that goes on far past the divergence (another conversation after a shared
      system prompt, whose next turn may still come) is not an edit.

    Args:
        checkpoint: the resumed checkpoint.
        limit: the match's limit, ``min(max_position, prompt length)``.
        walked: how far the prompt's KV walk went
            (:attr:`~hybridstore.index.trie.ResumePlan.kv_tokens`).
        continues: a full block of the prompt follows ``walked``.
    """
    if len(checkpoint.children) > REWRITE_FANOUT:
        return []
    reach = walked * (1.0 + REWRITE_SPAN)
    out: list[Checkpoint] = []
    for child in _left_children(checkpoint, limit, walked, continues):
        subtree, i = [child], 0
        while i < len(subtree) and not subtree[i].hits and subtree[i].position <= reach:
            subtree.extend(subtree[i].children)
            i += 1
        if i == len(subtree):
            out.extend(subtree)
    return out


def _left_children(checkpoint: Checkpoint, limit: int, walked: int, continues: bool) -> list[Checkpoint]:
    """The children of a resumed checkpoint that the prompt left (:func:`abandoned_branches`)."""
    return [c for c in checkpoint.children
            if c.position <= limit or (continues and c.position - c.offset > walked)]


def resume_back(checkpoint: Checkpoint, limit: int, walked: int, *, continues: bool,
                horizon: int, visits: int = 256) -> int:
    """How far before the deepest checkpoint of the trajectory it left a resume landed.

    A prompt resumed at ``checkpoint`` whose KV walk ended at ``walked`` left the branches
    :func:`abandoned_branches` finds (same arguments).  The result is the deepest
    checkpoint position among them minus ``walked``: 0 when it left none (an append, or
    the end of the trajectory), the tokens of the trajectory it rewrote otherwise, and
    ``horizon + 1`` as soon as a checkpoint lies more than ``horizon`` tokens past
    ``walked`` (or after ``visits`` checkpoints: a shared prefix many sessions continue
    is not one trajectory being edited).  What :class:`~hybridstore.policy.learned.LearnedOffsets`
    learns from.
    """
    deepest = walked
    stack = _left_children(checkpoint, limit, walked, continues)
    seen = 0
    while stack and seen < visits:
        ck = stack.pop()
        seen += 1
        deepest = max(deepest, ck.position)
        if deepest - walked > horizon:
            return horizon + 1
        stack.extend(ck.children)
    return horizon + 1 if stack else deepest - walked


class AdmissionPolicy(ABC):
    """Decides whether a checkpoint offered by the engine is kept."""

    name: str = "admission"

    @abstractmethod
    def admit(self, index: HybridIndex, position: int, nbytes: int, *,
              prompt: PrefixKeys | None = None) -> bool:
        """Keep the checkpoint of ``prompt`` at ``position`` (``nbytes``)?"""

    def bind(self, *, free_bytes: Callable[[], int], tier: str | None = None) -> None:  # noqa: B027
        """The store gives the policy the room left for checkpoints in their landing ``tier``."""


class PlacementPolicy(ABC):
    """Chooses where the engine captures checkpoints in a new segment."""

    name: str = "placement"

    resume_horizon: int = 0
    """Tokens of :func:`resume_back` the placement learns from (0: it learns nothing and the
    store does not measure)."""

    def on_resume(self, back: int) -> None:  # noqa: B027
        """Called at each resume from a checkpoint with :func:`resume_back`'s distance
        (placements that learn where resumes land use it)."""

    @abstractmethod
    def positions(self, *, cached: int, length: int, anchors: Sequence[int] = (),
                  stats: ResidenceStats | None = None) -> list[int]:
        """Positions in ``(cached, length]`` to checkpoint, ascending.

        Args:
            cached: tokens restored from the cache (the new segment starts here).
            length: the prompt's length.
            anchors: semantic boundaries the engine knows (turn starts, tool
                calls and results, thinking blocks: seed 003).
            stats: residence-time estimates (adaptive placement uses them).
        """
