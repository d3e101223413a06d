"""Synthetic agent traces with controlled context mutations (deterministic per seed).

Specs (``synthetic:NAME?key=value&...``, parsed by :func:`generate`):

* ``agent`` -- the HiState microbenchmark (section 4.3): every session runs
  ``turns`` turns; a turn appends the previous turn's ``out`` output tokens and
  ``new`` new input tokens, except that with probability ``mutation`` it
  instead cuts the previous prompt at a uniformly drawn internal ``cut``-token
  boundary (a multiple of ``cut`` strictly inside it) and appends the ``new``
  input there, without restoring the discarded suffix.  Cut turns are tagged
  ``"cut"``.
* ``rewind`` -- agent sessions of user messages and tool results with four
  kinds of turn: append; ``rewind`` (back to an earlier request's last input,
  edited from a random position on: a fork); ``truncate`` (the middle of an
  old long tool result is replaced by an omission marker, head and tail kept,
  then a normal append: prefix reuse ends at the marker); ``compact`` (all
  after the system prompt becomes a short summary, then a new user message).
  The op is the request's second tag.

A prompt is kept as content pieces (one key per piece of generated content);
block ids chain ``xxh64(previous id, pieces in the block)``, so equal prefixes
have equal ids and any edit changes every later id.  Anchors are the piece
starts (system prompt end, turn and tool-result starts, the marker).  Each
session draws from ``numpy.random.default_rng([seed, session])``, so a session
does not change when ``sessions`` does.
"""

from __future__ import annotations

import inspect
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
import xxhash

from hybridstore.errors import ConfigError
from hybridstore.replay.trace import SessionBuilder, Trace, salt_of

__all__ = ["GENERATORS", "agent", "generate", "parse_spec", "rewind"]

Piece = tuple[int, int, int, str]  # (content key, offset in the content, tokens, kind)


@dataclass
class _Prompt:
    """A prompt as content pieces plus the chained ids of its full blocks."""

    block: int
    pieces: list[Piece] = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    length: int = 0

    def copy(self) -> _Prompt:
        return _Prompt(self.block, list(self.pieces), self.ids, self.length)

    def anchors(self) -> list[int]:
        """Start of every piece but the first."""
        out, pos = [], 0
        for _, _, n, _ in self.pieces:
            if pos:
                out.append(pos)
            pos += n
        return out

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens."""
        kept, pos = [], 0
        for key, off, ln, kind in self.pieces:
            if pos >= n:
                break
            kept.append((key, off, min(ln, n - pos), kind))
            pos += ln
        self.pieces, self.length = kept, min(n, self.length)
        self.ids = self.ids[: n // self.block]

    def append(self, key: int, n: int, kind: str, offset: int = 0) -> None:
        """Append ``n`` tokens of content ``key`` (from ``offset``) and extend the ids."""
        if n <= 0:
            return
        self.pieces.append((key, offset, n, kind))
        self.length += n
        self._extend()

    def _extend(self) -> None:
        bs, first, n_full = self.block, len(self.ids), self.length // self.block
        if first >= n_full:
            return
        pi, at = 0, first * bs  # find the piece holding token first * bs
        while at >= self.pieces[pi][2]:
            at -= self.pieces[pi][2]
            pi += 1
        prev = int(self.ids[-1]) if first else 0
        new: list[int] = []
        for _ in range(first, n_full):
            need, frags = bs, [prev]
            while need:
                key, off, ln, _ = self.pieces[pi]
                take = min(ln - at, need)
                frags += (key, off + at, take)
                need -= take
                at += take
                if at == ln:
                    pi, at = pi + 1, 0
            prev = xxhash.xxh64_intdigest(struct.pack(f"<{len(frags)}Q", *frags))
            new.append(prev)
        self.ids = np.concatenate([self.ids, np.array(new, dtype=np.uint64)])


def _size(rng: np.random.Generator, mean: int) -> int:
    """A length uniform in ``[mean / 2, 3 mean / 2]``, at least 1."""
    return max(1, int(rng.integers(mean // 2, mean + mean // 2 + 1)))


def _check(**conds: bool) -> None:
    bad = [k for k, ok in conds.items() if not ok]
    if bad:
        raise ConfigError(f"synthetic trace parameters out of range: {', '.join(bad)}")


def agent(sessions: int = 24, turns: int = 16, new: int = 8192, out: int = 256,
          mutation: float = 0.05, seed: int = 0, block: int = 64, cut: int = 256,
          system: int = 0, gap: float = 180.0, model: str = "synthetic") -> Trace:
    """The HiState mutation microbenchmark (see the module docstring).

    Args:
        sessions: concurrent sessions (each starts uniformly in ``[0, gap)``).
        turns: requests per session.
        new: new input tokens per turn.
        out: output tokens per turn (appended to the next prompt).
        mutation: probability that a turn (after the first) cuts instead.
        seed: random seed.
        block: tokens per block.
        cut: granularity of cut positions.
        system: tokens of a system prompt shared by all sessions (0: none).
        gap: seconds between turns (also each request's ``think_s``).
        model: model name of the requests.

    Returns:
        The trace; requests tagged ``(kind, "cut")`` on cut turns.
    """
    _check(sessions=sessions >= 1, turns=turns >= 1, new=new >= 1, out=out >= 0,
           mutation=0.0 <= mutation <= 1.0, block=block >= 1, cut=cut >= 1, system=system >= 0,
           gap=gap >= 0, seed=seed >= 0)
    built = []
    for s in range(sessions):
        rng = np.random.default_rng([seed, s])
        t0 = float(rng.uniform(0.0, gap))
        b = SessionBuilder(f"agent-{s:04d}", model, block)
        p = _Prompt(block)
        p.append(salt_of("synthetic", seed, "system"), system, "system")
        p.append(salt_of("synthetic", seed, s, 0, "in"), new, "user")
        b.add(arrival_s=t0, input_tokens=p.length, output_tokens=out, block_ids=p.ids,
              anchors=p.anchors())
        for t in range(1, turns):
            extra: tuple[str, ...] = ()
            n_cuts = (p.length - 1) // cut
            if rng.random() < mutation and n_cuts >= 1:
                p.truncate(cut * int(rng.integers(1, n_cuts + 1)))
                extra = ("cut",)
            else:
                p.append(salt_of("synthetic", seed, s, t - 1, "out"), out, "out")
            p.append(salt_of("synthetic", seed, s, t, "in"), new, "user")
            b.add(arrival_s=t0 + t * gap, input_tokens=p.length, output_tokens=out,
                  block_ids=p.ids, think_s=gap, anchors=p.anchors(), extra_tags=extra)
        built.append(b.build())
    return Trace(name="synthetic:agent", block_size=block, sessions=tuple(built))


def _truncate_long_tool(p: _Prompt, rng: np.random.Generator, key: int, long: int, marker: int,
                        keep: float, full: dict[int, int]) -> bool:
    """Replace the middle of a whole tool result of >= ``long // 2`` tokens by a marker."""
    starts, pos = [], 0
    for i, (k, off, ln, kind) in enumerate(p.pieces):
        if kind == "tool" and off == 0 and ln == full.get(k) and ln >= long // 2:
            starts.append((i, pos))
        pos += ln
    if not starts:
        return False
    i, start = starts[int(rng.integers(len(starts)))]
    k, _, ln, _ = p.pieces[i]
    head, tail = max(1, int(keep * ln)), max(1, int(keep * ln))
    rest = p.pieces[i + 1:]
    p.truncate(start + head)
    p.append(key, marker, "marker")
    p.append(k, tail, "tool", offset=ln - tail)
    for piece in rest:
        p.append(piece[0], piece[2], piece[3], offset=piece[1])
    return True


def rewind(sessions: int = 16, turns: int = 32, system: int = 2048, user: int = 512,
           tool: int = 2048, long: int = 16384, long_frac: float = 0.1, tool_frac: float = 0.7,
           out: int = 256, rewind: float = 0.05, truncate: float = 0.05, compact: float = 0.02,
           summary: int = 2048, marker: int = 16, keep: float = 0.25, seed: int = 0,
           block: int = 64, gap: float = 30.0, model: str = "synthetic") -> Trace:
    """Agent sessions with rewind/edit, middle truncation and compaction turns.

    Args:
        sessions: sessions (each starts uniformly in ``[0, gap)``).
        turns: requests per session.
        system: system-prompt tokens, shared by all sessions.
        user: mean user-message tokens (lengths uniform within +-50%).
        tool: mean tool-result tokens.
        long: mean tokens of a long tool result.
        long_frac: share of tool results that are long.
        tool_frac: share of turns whose new input is a tool result.
        out: output tokens per request.
        rewind: probability of a rewind/edit turn.
        truncate: probability of a middle-truncation turn (needs a whole tool
            result of at least ``long // 2`` tokens; else the turn appends).
        compact: probability of a compaction turn (needs a prompt of at least
            ``4 * (system + summary)`` tokens; else the turn appends).
        summary: mean summary tokens.
        marker: omission-marker tokens.
        keep: share of a truncated result kept at each of head and tail.
        seed: random seed.
        block: tokens per block.
        gap: seconds between turns (also ``think_s``).
        model: model name.

    Returns:
        The trace; mutated requests carry the op (``"rewind"``, ``"truncate"``,
        ``"compact"``) as second tag.
    """
    _check(sessions=sessions >= 1, turns=turns >= 1, system=system >= 0, user=user >= 1,
           tool=tool >= 1, long=long >= 1, long_frac=0 <= long_frac <= 1,
           tool_frac=0 <= tool_frac <= 1, out=out >= 0,
           rates=min(rewind, truncate, compact) >= 0 and rewind + truncate + compact <= 1,
           summary=summary >= 1, marker=marker >= 1, keep=0 < keep < 0.5, block=block >= 1,
           gap=gap >= 0, seed=seed >= 0)
    built = []
    for s in range(sessions):
        rng = np.random.default_rng([seed, s])
        t0 = float(rng.uniform(0.0, gap))
        b = SessionBuilder(f"rewind-{s:04d}", model, block)
        full: dict[int, int] = {}

        def key(*parts: object) -> int:
            return salt_of("synthetic-rewind", seed, s, *parts)  # noqa: B023

        def add_input(p: _Prompt, t: int) -> None:
            if rng.random() < tool_frac:
                n = _size(rng, long if rng.random() < long_frac else tool)
                full[key(t, "tool")] = n
                p.append(key(t, "tool"), n, "tool")
            else:
                p.append(key(t, "user"), _size(rng, user), "user")

        p = _Prompt(block)
        p.append(salt_of("synthetic-rewind", seed, "system"), system, "system")
        p.append(key(0, "user"), _size(rng, user), "user")
        states = [p.copy()]
        b.add(arrival_s=t0, input_tokens=p.length, output_tokens=out, block_ids=p.ids,
              anchors=p.anchors())
        for t in range(1, turns):
            u, op = rng.random(), ""
            if u < rewind:
                k = int(rng.integers(t))
                p = states[k].copy()
                last = p.pieces[-1]
                start = p.length - last[2]
                e = int(rng.integers(last[2]))
                p.truncate(start + e)
                p.append(key(t, "edit"), last[2] - e, last[3])
                op = "rewind"
            elif u < rewind + truncate and _truncate_long_tool(
                    p, rng, key(t, "marker"), long, marker, keep, full):
                op = "truncate"
            elif (rewind + truncate <= u < rewind + truncate + compact
                  and p.length >= 4 * (system + summary)):
                p.truncate(system)
                p.append(key(t, "summary"), _size(rng, summary), "summary")
                p.append(key(t, "user"), _size(rng, user), "user")
                op = "compact"
            if op in ("", "truncate"):
                p.append(key(t - 1, "out"), out, "out")
                add_input(p, t)
            states.append(p.copy())
            b.add(arrival_s=t0 + t * gap, input_tokens=p.length, output_tokens=out,
                  block_ids=p.ids, think_s=gap, anchors=p.anchors(),
                  extra_tags=(op,) if op else ())
        built.append(b.build())
    return Trace(name="synthetic:rewind", block_size=block, sessions=tuple(built))


GENERATORS: dict[str, Callable[..., Trace]] = {"agent": agent, "rewind": rewind}


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``synthetic:NAME?k=v&...`` into the generator name and typed keyword arguments.

    Values are converted to the type of the generator's default for that key.

    Raises:
        ConfigError: unknown generator, unknown key or a value of the wrong type.
    """
    body = spec.removeprefix("synthetic:")
    name, _, query = body.partition("?")
    gen = GENERATORS.get(name)
    if gen is None:
        raise ConfigError(f"unknown synthetic generator {name!r}; use one of {sorted(GENERATORS)}")
    params = inspect.signature(gen).parameters
    kwargs: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"bad synthetic spec {spec!r}: {exc}") from None
    for k, v in pairs:
        if k not in params:
            raise ConfigError(f"synthetic:{name} has no parameter {k!r}; "
                              f"known: {', '.join(params)}")
        typ = type(params[k].default)
        try:
            kwargs[k] = typ(v) if typ is not int else int(float(v)) if "e" in v.lower() else int(v)
        except (ValueError, OverflowError):
            raise ConfigError(f"synthetic:{name}: {k}={v!r} is not a {typ.__name__}") from None
        if typ is float and not math.isfinite(kwargs[k]):
            raise ConfigError(f"synthetic:{name}: {k}={v!r} is not finite")
    _check_size(name, {**{k: p.default for k, p in params.items()}, **kwargs})
    return name, kwargs


MAX_SYNTHETIC_IDS = 1 << 25
"""The most block ids a synthetic trace may hold in all (256 MiB of them)."""


def _check_size(name: str, kw: dict[str, Any]) -> None:
    """Bound a spec's trace before generating it: every prompt at most
    ``MAX_TRACE_TOKENS`` tokens, all prompts at most :data:`MAX_SYNTHETIC_IDS` block ids
    (estimated from above: each turn grows a prompt by the largest size parameter)."""
    from hybridstore.replay.loaders import MAX_TRACE_TOKENS

    sizes = [v for k, v in kw.items() if isinstance(v, int) and not isinstance(v, bool)
             and k not in ("sessions", "turns", "seed", "block")]
    prompt = max(0, kw.get("system", 0)) + max(0, kw["turns"]) * max([0, *sizes])
    requests = max(0, kw["sessions"]) * max(0, kw["turns"])
    if prompt > MAX_TRACE_TOKENS or requests * prompt // max(1, kw["block"]) > MAX_SYNTHETIC_IDS:
        raise ConfigError(f"synthetic:{name}: {requests} requests of up to {prompt} tokens is "
                          f"too large (at most {MAX_TRACE_TOKENS} tokens a prompt and "
                          f"{MAX_SYNTHETIC_IDS} block ids in all)")


def generate(spec: str) -> Trace:
    """Build the trace of a ``synthetic:NAME?k=v&...`` spec (name = the spec)."""
    name, kwargs = parse_spec(spec)
    trace = GENERATORS[name](**kwargs)
    return Trace(name=spec if spec.startswith("synthetic:") else f"synthetic:{spec}",
                 block_size=trace.block_size, sessions=trace.sessions)
