"""Canonical in-memory form of a trace: :class:`Trace` > :class:`Session` > :class:`Request`.

Every loader (WEKA, Mooncake, TraceLab, the canonical jsonl) and every
synthetic generator produces this one form, so the replay never sees a source
format.  A request is described by its prompt length and the chained ids of
its blocks (equal prefix <=> equal ids), which is all a prefix cache needs;
:mod:`hybridstore.replay.tokens` derives pseudo token ids from them when the
index should match inside blocks.

Block ids of a trace are global: loaders salt session-local ids and key them
per model, so two requests share an id only when they could share a KV page.

Each request carries a *kind* tag computed against the previous request of its
session (see :func:`classify`), which is how :meth:`Trace.mutation_stats`
measures the share of appends and context mutations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from hybridstore.errors import HybridStoreError

__all__ = [
    "KINDS",
    "MutationStats",
    "Request",
    "Session",
    "SessionBuilder",
    "Trace",
    "TraceFormatError",
    "classify",
    "common_prefix",
    "merge",
    "mix64",
    "salt_of",
    "salted_ids",
]

#: Kind tags, computed against the previous request of the session (the first tag).
FIRST, APPEND, LAST_BLOCK, MUTATION, COMPACTION = (
    "first", "append", "last_block", "mutation", "compaction")
KINDS = (FIRST, APPEND, LAST_BLOCK, MUTATION, COMPACTION)

#: A divergence is a compaction when the shared prefix is at most this share of
#: the previous prompt and the new prompt at most ``_COMPACT_SHRINK`` of it.
_COMPACT_SHARED = 0.25
_COMPACT_SHRINK = 0.6


class TraceFormatError(HybridStoreError, ValueError):
    """A trace file or spec that does not parse, or requests that contradict each other."""


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over a uint64 array (a bijection), in place; returns ``x``."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def salt_of(*parts: object) -> int:
    """A 64-bit salt: xxh64 of the parts' ``str`` joined by NUL bytes."""
    return xxhash.xxh64_intdigest("\0".join(str(p) for p in parts).encode())


def salted_ids(local_ids: Any, salt: int) -> np.ndarray:
    """Make scope-local block ids global: ``mix64(id ^ salt)`` (injective per salt).

    Returns:
        A read-only uint64 array.
    """
    x = _as_ids(local_ids).copy()
    x ^= np.uint64(salt)
    mix64(x)
    x.setflags(write=False)
    return x


def _as_ids(block_ids: Any) -> np.ndarray:
    """Return ``block_ids`` as a read-only 1-D uint64 array (copying unless already one)."""
    if (isinstance(block_ids, np.ndarray) and block_ids.dtype == np.uint64
            and block_ids.ndim == 1 and not block_ids.flags.writeable):
        return block_ids
    try:
        if isinstance(block_ids, (list, tuple)):
            # no floats, bools or strings (numpy would truncate or parse them)
            if not all(type(x) is int or isinstance(x, np.integer) for x in block_ids):
                raise TypeError("got values that are not integers")
            arr = np.array(block_ids, dtype=np.uint64)   # raises for < 0 or >= 2**64
        else:
            raw = np.asarray(block_ids)
            if raw.size and raw.dtype.kind not in "iu":
                raise TypeError(f"got {raw.dtype} values")
            if raw.dtype.kind == "i" and raw.size and raw.min() < 0:
                raise ValueError("negative ids")
            arr = raw.astype(np.uint64) if raw.size else np.zeros(raw.shape, np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceFormatError(f"block ids must be integers in [0, 2**64): {exc}") from exc
    if arr.ndim != 1:
        raise TraceFormatError(f"block ids must be 1-D, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


def _positions(values: Any, what: str) -> tuple[int, ...]:
    """Token positions as ints (a JSON list of integers), else :class:`TraceFormatError`."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise TraceFormatError(f"{what} must be a list of token positions, got {values!r:.40}")
    out = tuple(values)
    if not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in out):
        raise TraceFormatError(f"{what} must be whole numbers, got {list(out)!r:.60}")
    return tuple(int(a) for a in out)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading ids that ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One prefill request of a session.

    Attributes:
        session: id of the session (unique in the trace).
        index: position of the request in its session, from 0.
        arrival_s: arrival time in seconds on the trace clock.  Sources without
            a common clock (WEKA, TraceLab, the generators) start each session
            at (or near) 0 and leave scheduling of sessions to the replay.
        input_tokens: prompt length in tokens.
        output_tokens: tokens generated by this request.
        block_size: tokens per block.
        block_ids: read-only uint64 chained ids, one per full block of the
            prompt, plus optionally one for a final partial block.  Ids past
            ``input_tokens // block_size`` describe that partial block.
        think_s: seconds between the end of the previous response of the
            session and this arrival (the gap between arrivals where the
            source has no response times); 0 for the first request.
        anchors: sorted token positions ``0 < a < input_tokens`` of semantic
            boundaries known from trace metadata (turn starts, tool-result
            starts, the end of the system prompt).
        model: model the request is served by (caches are keyed per model).
        parent: for sub-agents and split-off side streams, the id of the
            session that spawned this one; else ``None``.
        tags: ``tags[0]`` is the kind (see :data:`KINDS` and :func:`classify`);
            sources may add more (e.g. the generators' ``"cut"``).
    """

    session: str
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_size: int
    block_ids: np.ndarray
    think_s: float = 0.0
    anchors: tuple[int, ...] = ()
    model: str = ""
    parent: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = _as_ids(self.block_ids)
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "anchors", _positions(self.anchors, "anchors"))
        object.__setattr__(self, "tags", tuple(str(t) for t in self.tags))
        where = f"request {self.session!r}#{self.index}"
        if self.block_size <= 0:
            raise TraceFormatError(f"{where}: block_size must be positive, got {self.block_size}")
        if self.index < 0 or self.input_tokens < 0 or self.output_tokens < 0:
            raise TraceFormatError(f"{where}: index and token counts must be >= 0")
        n_full = self.input_tokens // self.block_size
        n_max = -(-self.input_tokens // self.block_size)
        if not n_full <= len(ids) <= n_max:
            raise TraceFormatError(
                f"{where}: {len(ids)} block ids cannot describe {self.input_tokens} tokens in "
                f"blocks of {self.block_size}; give one id per full block ({n_full}) and "
                f"optionally one for the final partial block")
        a = self.anchors
        if a and (a[0] <= 0 or a[-1] >= self.input_tokens or any(x >= y for x, y in zip(a, a[1:]))):
            raise TraceFormatError(
                f"{where}: anchors must be strictly increasing positions in "
                f"(0, {self.input_tokens})")

    @property
    def kind(self) -> str:
        """The kind tag (``tags[0]``), or ``""`` when untagged."""
        return self.tags[0] if self.tags else ""

    @property
    def n_full_blocks(self) -> int:
        """Number of full blocks in the prompt."""
        return self.input_tokens // self.block_size

    @property
    def full_ids(self) -> np.ndarray:
        """The ids of the full blocks (without a partial block's id)."""
        return self.block_ids[: self.n_full_blocks]

    @property
    def has_partial_id(self) -> bool:
        """Whether ``block_ids`` ends with the id of a final partial block."""
        return len(self.block_ids) > self.n_full_blocks

    @property
    def tail_tokens(self) -> int:
        """Tokens past the last full block (0 when the prompt ends a block)."""
        return self.input_tokens - self.n_full_blocks * self.block_size

    def replace(self, **changes: Any) -> Request:
        """A copy with ``changes`` applied (dataclasses.replace)."""
        return replace(self, **changes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _SCALAR_FIELDS) and \
            np.array_equal(self.block_ids, other.block_ids)

    def __hash__(self) -> int:
        return hash((self.session, self.index, self.input_tokens))

    def __repr__(self) -> str:
        return (f"Request({self.session!r}#{self.index}, t={self.arrival_s:.3f}, "
                f"in={self.input_tokens}, out={self.output_tokens}, ids={len(self.block_ids)}, "
                f"tags={self.tags})")


_SCALAR_FIELDS = ("session", "index", "arrival_s", "input_tokens", "output_tokens", "block_size",
                  "think_s", "anchors", "model", "parent", "tags")


def classify(prev: Request | None, block_ids: np.ndarray, input_tokens: int) -> tuple[str, int]:
    """Kind of a request relative to the previous request of its session.

    Only the previous request's *full* blocks are compared (a partial block's
    id cannot survive an append).  With ``P`` the previous request's number of
    full blocks and ``k`` the leading full-block ids both share:

    * ``"first"``: no previous request;
    * ``"append"``: ``k == P`` (the previous prompt is a prefix, up to its tail);
    * ``"last_block"``: ``k == P - 1`` (only the previous last block changed);
    * ``"compaction"``: diverged (``k < P - 1``) with ``k`` blocks covering at
      most 25% of the previous prompt and the new prompt at most 60% of its
      length (a heuristic: compaction keeps the system prompt only);
    * ``"mutation"``: any other divergence inside earlier context (truncation,
      rewind/edit, changed early message).

    Args:
        prev: previous request of the session, or ``None``.
        block_ids: this request's block ids.
        input_tokens: this request's prompt length.

    Returns:
        ``(kind, k)``; ``k`` is 0 for the first request.
    """
    if prev is None:
        return FIRST, 0
    full = prev.full_ids
    k = common_prefix(full, block_ids)
    if k == len(full):
        return APPEND, k
    if k == len(full) - 1:
        return LAST_BLOCK, k
    if (k * prev.block_size <= _COMPACT_SHARED * prev.input_tokens
            and input_tokens <= _COMPACT_SHRINK * prev.input_tokens):
        return COMPACTION, k
    return MUTATION, k


@dataclass(frozen=True, slots=True)
class Session:
    """The requests of one conversation / agent, in order.

    Attributes:
        id: session id, unique in its trace.
        requests: the requests; ``requests[i].index == i``.
        model: the model every request of the session uses.
    """

    id: str
    requests: tuple[Request, ...]
    model: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        for i, r in enumerate(self.requests):
            if r.session != self.id or r.index != i or r.model != self.model:
                raise TraceFormatError(
                    f"session {self.id!r} ({self.model}): request {i} is {r.session!r}#{r.index} "
                    f"of model {r.model!r}; requests must be that session's, indexed 0.. in order, "
                    f"of one model")

    @property
    def parent(self) -> str | None:
        """Parent session id (sub-agents), from the first request."""
        return self.requests[0].parent if self.requests else None

    @property
    def n_requests(self) -> int:
        """Number of requests."""
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        """Sum of the prompt lengths."""
        return sum(r.input_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Sum of the generated tokens."""
        return sum(r.output_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class MutationStats:
    """Shares of consecutive request pairs (within sessions) by kind.

    Attributes:
        pairs: number of non-first requests.
        append: share whose previous prompt is a prefix (up to its tail).
        last_block: share that changed only the previous last full block.
        diverged: share that diverged earlier (mutations and compactions).
        compaction: share of the divergences classified as compactions.
    """

    pairs: int
    append: float
    last_block: float
    diverged: float
    compaction: float


@dataclass(frozen=True, slots=True)
class Trace:
    """A named set of sessions sharing one block size.

    Attributes:
        name: label (file stem or generator spec).
        block_size: tokens per block of every request.
        sessions: the sessions, in source order.
    """

    name: str
    block_size: int
    sessions: tuple[Session, ...]
    _by_id: dict[str, Session] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sessions", tuple(self.sessions))
        for s in self.sessions:
            if s.id in self._by_id:
                raise TraceFormatError(f"trace {self.name!r}: duplicate session id {s.id!r}")
            self._by_id[s.id] = s
            if s.requests and s.requests[0].block_size != self.block_size:
                raise TraceFormatError(
                    f"trace {self.name!r}: session {s.id!r} uses blocks of "
                    f"{s.requests[0].block_size}, the trace {self.block_size}")

    def session(self, session_id: str) -> Session:
        """The session with id ``session_id`` (KeyError when absent)."""
        return self._by_id[session_id]

    @property
    def n_sessions(self) -> int:
        """Number of sessions."""
        return len(self.sessions)

    @property
    def n_requests(self) -> int:
        """Number of requests over all sessions."""
        return sum(s.n_requests for s in self.sessions)

    @property
    def input_tokens(self) -> int:
        """Total prompt tokens."""
        return sum(s.input_tokens for s in self.sessions)

    @property
    def output_tokens(self) -> int:
        """Total generated tokens."""
        return sum(s.output_tokens for s in self.sessions)

    @property
    def models(self) -> tuple[str, ...]:
        """The distinct models, in order of first use."""
        return tuple(dict.fromkeys(s.model for s in self.sessions))

    def requests(self) -> Iterator[Request]:
        """Every request, session by session."""
        for s in self.sessions:
            yield from s.requests

    def arrivals(self) -> list[Request]:
        """Every request sorted by ``(arrival_s, session order, index)``."""
        order = {s.id: i for i, s in enumerate(self.sessions)}
        return sorted(self.requests(), key=lambda r: (r.arrival_s, order[r.session], r.index))

    def kind_counts(self) -> Counter[str]:
        """How many requests carry each kind tag."""
        return Counter(r.kind for r in self.requests())

    def tag_counts(self) -> Counter[str]:
        """How many requests carry each tag (any position)."""
        return Counter(t for r in self.requests() for t in r.tags)

    def mutation_stats(self) -> MutationStats:
        """Shares of append / last-block-changed / diverged requests.

        Recomputed from the block ids with :func:`classify` (tags are not
        trusted), over every request that has a predecessor in its session:
        the measure of the traces README (~93% / ~4% / ~2.7% on full WEKA).
        """
        c: Counter[str] = Counter()
        for s in self.sessions:
            for prev, cur in zip(s.requests, s.requests[1:]):
                c[classify(prev, cur.block_ids, cur.input_tokens)[0]] += 1
        n = sum(c.values())
        div = c[MUTATION] + c[COMPACTION]
        f = (lambda x: x / n) if n else (lambda x: 0.0)
        return MutationStats(pairs=n, append=f(c[APPEND]), last_block=f(c[LAST_BLOCK]),
                             diverged=f(div), compaction=f(c[COMPACTION]))

    def summary(self) -> dict[str, Any]:
        """A JSON-able digest: counts, tokens, models, kinds and mutation shares."""
        m = self.mutation_stats()
        return {"name": self.name, "block_size": self.block_size, "sessions": self.n_sessions,
                "requests": self.n_requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "models": list(self.models),
                "kinds": dict(self.kind_counts()),
                "mutation": {"pairs": m.pairs, "append": round(m.append, 4),
                             "last_block": round(m.last_block, 4),
                             "diverged": round(m.diverged, 4),
                             "compaction": round(m.compaction, 4)}}


def merge(traces: Sequence[Trace], name: str | None = None) -> Trace:
    """Combine traces of one block size into one (session ids must not clash).

    Raises:
        TraceFormatError: block sizes differ or a session id repeats.
    """
    if not traces:
        raise TraceFormatError("merge() needs at least one trace")
    sizes = {t.block_size for t in traces}
    if len(sizes) > 1:
        raise TraceFormatError(
            f"cannot merge traces of block sizes {sorted(sizes)}; replay them separately")
    return Trace(name=name or "+".join(t.name for t in traces), block_size=traces[0].block_size,
                 sessions=tuple(s for t in traces for s in t.sessions))


class SessionBuilder:
    """Appends requests to one session, computing kind tags and anchors.

    Args:
        session: the session id.
        model: the model of every request.
        block_size: tokens per block.
        parent: parent session id, if any.
    """

    def __init__(self, session: str, model: str, block_size: int,
                 parent: str | None = None) -> None:
        self.session = session
        self.model = model
        self.block_size = block_size
        self.parent = parent
        self.requests: list[Request] = []

    @property
    def last(self) -> Request | None:
        """The previous request, or ``None``."""
        return self.requests[-1] if self.requests else None

    def kind_of(self, block_ids: Any, input_tokens: int) -> str:
        """The kind a request with these ids would get if added now."""
        return classify(self.last, _as_ids(block_ids), input_tokens)[0]

    def add(self, *, arrival_s: float, input_tokens: int, output_tokens: int, block_ids: Any,
            think_s: float = 0.0, anchors: Iterable[int] = (), extra_tags: Iterable[str] = (),
            inherit_anchors: bool = False) -> Request:
        """Append a request; its kind tag comes from :func:`classify`.

        Args:
            arrival_s: arrival time (seconds).
            input_tokens: prompt length.
            output_tokens: generated tokens.
            block_ids: chained block ids (see :class:`Request`).
            think_s: think time before this request.
            anchors: new semantic boundaries (out-of-range ones are dropped).
            extra_tags: tags after the kind.
            inherit_anchors: also keep the previous request's anchors that are
                still inside the shared prefix: all of them after an append,
                those at or before the shared full blocks otherwise.  After an
                append, the previous prompt's end (where its response starts)
                and that end plus its output tokens (where the new input
                starts; approximate when thinking is stripped) are added.

        Returns:
            The new request.
        """
        ids = _as_ids(block_ids)
        prev = self.last
        kind, k = classify(prev, ids, input_tokens)
        pos = set(int(a) for a in anchors)
        if inherit_anchors and prev is not None:
            if kind == APPEND:
                pos.update(prev.anchors)
                pos.update((prev.input_tokens, prev.input_tokens + prev.output_tokens))
            else:
                limit = k * self.block_size
                pos.update(a for a in prev.anchors if a <= limit)
        req = Request(session=self.session, index=len(self.requests), arrival_s=float(arrival_s),
                      input_tokens=int(input_tokens), output_tokens=int(output_tokens),
                      block_size=self.block_size, block_ids=ids, think_s=float(think_s),
                      anchors=tuple(sorted(a for a in pos if 0 < a < input_tokens)),
                      model=self.model, parent=self.parent, tags=(kind, *extra_tags))
        self.requests.append(req)
        return req

    def build(self) -> Session:
        """The session of the requests added so far."""
        return Session(id=self.session, requests=tuple(self.requests), model=self.model)
