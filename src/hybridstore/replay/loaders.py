"""Trace loaders: WEKA Claude-Code sessions, Mooncake, TraceLab rounds, the canonical jsonl.

Every loader returns a :class:`~hybridstore.replay.trace.Trace`; :func:`load`
picks one from a spec (a path, ``FORMAT:PATH`` or ``synthetic:...``).  Files
ending in ``.zst`` are decompressed as a stream.  The formats, and the rules
this module applies to them (id salting, session inference, synthesized ids),
are documented in ``docs/traces.md``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import zstandard
from tqdm import tqdm

from hybridstore.replay.trace import (
    APPEND,
    Request,
    Session,
    SessionBuilder,
    Trace,
    TraceFormatError,
    _as_ids,
    salt_of,
    salted_ids,
)

__all__ = [
    "CANONICAL_FORMAT",
    "FORMATS",
    "load",
    "load_canonical",
    "load_mooncake",
    "load_tracelab",
    "load_weka",
    "save_canonical",
    "sniff_format",
]

PathLike = str | Path

#: ``format`` field of the canonical jsonl header line.
CANONICAL_FORMAT = "hybridstore.trace"
CANONICAL_VERSION = 1
#: A progress bar is shown when a loader reads more files than this.
_PROGRESS_MIN_FILES = 4


# -- files ----------------------------------------------------------------------------
@contextlib.contextmanager
def _open_text(path: Path) -> Iterator[IO[str]]:
    """Open ``path`` for text reading, decompressing ``.zst`` as a stream; bytes that are
    not UTF-8 (or not zstd) raise :class:`TraceFormatError` from the reading body."""
    try:
        with open(path, "rb") as raw:
            if path.name.endswith(".zst"):
                reader = zstandard.ZstdDecompressor().stream_reader(raw)
                with io.TextIOWrapper(reader, encoding="utf-8") as text:
                    yield text
            else:
                with io.TextIOWrapper(raw, encoding="utf-8") as text:
                    yield text
    except (UnicodeDecodeError, zstandard.ZstdError) as e:
        raise TraceFormatError(f"{path}: not a UTF-8 text trace"
                               f"{' compressed with zstd' if path.name.endswith('.zst') else ''}"
                               f" ({type(e).__name__}: {e})") from e
    except OSError as e:           # missing, a directory, unreadable
        raise TraceFormatError(f"cannot read the trace file {path}: {e.strerror or e}") from e


@contextlib.contextmanager
def _open_write(path: Path) -> Iterator[IO[str]]:
    """Open ``path`` for text writing, zstd-compressing when it ends in ``.zst``."""
    with open(path, "wb") as raw:
        if path.name.endswith(".zst"):
            writer = zstandard.ZstdCompressor(level=10).stream_writer(raw)
            with io.TextIOWrapper(writer, encoding="utf-8") as text:
                yield text
        else:
            with io.TextIOWrapper(raw, encoding="utf-8") as text:
                yield text


def _parse_json(text: str, where: str, what: str) -> Any:
    """``json.loads(text)``, else :class:`TraceFormatError` naming ``where`` (the file, and
    the line of a jsonl trace): text that is not JSON, or nested too deeply for the parser
    (a ``RecursionError`` otherwise)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not {what} ({exc.msg})") from exc
    except RecursionError:
        raise TraceFormatError(f"{where}: {what} whose arrays or objects are nested too "
                               "deeply to parse; no trace format nests more than a few "
                               "levels: fix or remove it") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a jsonl file."""
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = _parse_json(line, f"{path}:{n}", "JSON")
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{path}:{n}: expected a JSON object per line")
            yield n, obj


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".zst", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _progress(items: list[Any], desc: str, progress: bool | None) -> Iterable[Any]:
    show = len(items) > _PROGRESS_MIN_FILES if progress is None else progress
    return tqdm(items, desc=desc, unit="file", disable=not show, leave=False, file=sys.stderr)


def _objects(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    """A JSON list of objects, else :class:`TraceFormatError`."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise TraceFormatError(f"{where}: {what} must be a list of JSON objects")
    return value


def _field(obj: dict[str, Any], key: str, where: str) -> Any:
    try:
        return obj[key]
    except (KeyError, TypeError):
        raise TraceFormatError(f"{where}: missing field {key!r}") from None


MAX_TRACE_TOKENS = 1 << 24
"""The largest token count a trace field may hold (16 Mi tokens, ~8x the longest context
any model serves): every size read from a trace is checked against it before anything
is allocated for it."""

MAX_BLOCK_SIZE = 1 << 16
"""The largest block size a trace header may declare."""


def _count(value: Any, where: str, what: str, limit: int = MAX_TRACE_TOKENS) -> int:
    """A trace's count field as an int in ``[0, limit]`` (``None``/missing reads 0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceFormatError(f"{where}: {what} must be a whole number, got {value!r}")
    try:
        n = int(value)
    except (ValueError, OverflowError):
        raise TraceFormatError(f"{where}: {what} must be a whole number, got {value!r}") from None
    if not 0 <= n <= limit:
        raise TraceFormatError(f"{where}: {what}={n} is outside 0..{limit}")
    return n


def _ids(value: Any, where: str) -> np.ndarray:
    """A trace's block ids (a JSON list of integers in [0, 2**64)) as a uint64 array."""
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: block ids must be a list of integers")
    try:
        return _as_ids(value)
    except TraceFormatError as e:
        raise TraceFormatError(f"{where}: {e}") from None


def _seconds(value: Any, where: str, what: str) -> float:
    """A trace's time field as a finite float (``None``/missing reads 0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceFormatError(f"{where}: {what} must be a number, got {value!r:.40}")
    try:
        t = float(value)
    except (ValueError, OverflowError):
        raise TraceFormatError(f"{where}: {what} must be a number, got {value!r:.40}") from None
    if not math.isfinite(t):
        raise TraceFormatError(f"{where}: {what} must be finite, got {value!r:.40}")
    return t


def _block_size(value: Any, where: str) -> int:
    bs = _count(value, where, "block_size", MAX_BLOCK_SIZE)
    if bs < 1:
        raise TraceFormatError(f"{where}: block_size must be >= 1, got {value!r}")
    return bs


def _split_models(base: str, rows: list[dict[str, Any]],
                  model_of: Callable[[dict[str, Any]], str]) -> list[tuple[str, str, list]]:
    """Split a request stream by model: ``[(session id, model, rows)]``.

    The most used model (first seen on ties) keeps ``base`` as id; the others
    become ``base@model``.
    """
    counts = Counter(model_of(r) for r in rows)
    if len(counts) <= 1:
        return [(base, next(iter(counts), ""), rows)]
    main = max(counts, key=lambda m: counts[m])  # Counter keeps first-seen order on ties
    out = [(base, main, [r for r in rows if model_of(r) == main])]
    out += [(f"{base}@{m}", m, [r for r in rows if model_of(r) == m]) for m in counts if m != main]
    return out


# -- WEKA -----------------------------------------------------------------------------
def _weka_files(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for p in map(Path, items):
        if p.is_dir():
            files += sorted(q for q in p.iterdir()
                            if q.is_file() and q.name.endswith((".json", ".json.zst")))
        elif p.is_file():
            files.append(p)
        else:
            raise TraceFormatError(f"no such WEKA trace file or directory: {p}")
    if not files:
        raise TraceFormatError(f"no .json or .json.zst files in {items}")
    return files


def _weka_stream(builder: SessionBuilder, rows: list[dict[str, Any]], base_t: float, salt_for,
                 first_anchors: tuple[int, ...], where: str) -> Session:
    bs = builder.block_size
    for i, r in enumerate(rows):
        n_in = _count(_field(r, "in", where), where, "in")
        ids = salted_ids(_field(r, "hash_ids", where), salt_for(builder.model))
        if not n_in // bs <= len(ids) <= -(-n_in // bs):
            raise TraceFormatError(
                f"{where}: request with in={n_in} has {len(ids)} hash_ids; WEKA ids cover "
                f"the {n_in // bs} full blocks of {bs} tokens")
        builder.add(arrival_s=base_t + _seconds(_field(r, "t", where), where, "t"),
                    input_tokens=n_in,
                    output_tokens=_count(r.get("out"), where, "out"), block_ids=ids,
                    think_s=_seconds(r.get("think_time"), where, "think_time"),
                    anchors=first_anchors if i == 0 else (), inherit_anchors=True)
    return builder.build()


def _prompt_anchors(entry: dict[str, Any]) -> tuple[int, ...]:
    """End of the tool definitions and of the system prompt (tools come first)."""
    where = "a WEKA trace entry"
    tools = _count(entry.get("tool_tokens"), where, "tool_tokens")
    system = _count(entry.get("system_tokens"), where, "system_tokens")
    return tuple(a for a in (tools, tools + system) if a > 0)


def _weka_sessions(doc: Any, path: Path) -> tuple[int, list[Session]]:
    where = str(path)
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{where}: a WEKA document is a JSON object")
    tid = str(doc.get("id") or _stem(path))
    bs = _block_size(_field(doc, "block_size", where), where)
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise TraceFormatError(f"{where}: unknown hash_id_scope {scope!r}")

    def salt_for(model: str) -> int:
        return salt_of("weka", tid if scope == "local" else "", model)

    def model_of(r: dict[str, Any]) -> str:
        return str(_field(r, "model", where))

    requests = _objects(_field(doc, "requests", where), where, "requests")
    main = [r for r in requests if r.get("type") != "subagent"]
    sessions: list[Session] = []
    for sid, model, rows in _split_models(tid, main, model_of):
        b = SessionBuilder(sid, model, bs, parent=None if sid == tid else tid)
        sessions.append(_weka_stream(b, rows, 0.0, salt_for, _prompt_anchors(doc), where))
    for entry in requests:
        if entry.get("type") != "subagent":
            continue
        agent = f"{tid}/{entry.get('agent_id') or len(sessions)}"
        rows_of = _objects(_field(entry, "requests", where), where, "a sub-agent's requests")
        for sid, model, rows in _split_models(agent, rows_of, model_of):
            b = SessionBuilder(sid, model, bs, parent=tid)
            sessions.append(_weka_stream(b, rows, _seconds(_field(entry, "t", where), where, "t"),
                                         salt_for,
                                         _prompt_anchors(entry), where))
    return bs, [s for s in sessions if s.requests]


def load_weka(paths: PathLike | Iterable[PathLike], *, name: str | None = None,
              progress: bool | None = None) -> Trace:
    """Load WEKA / SemiAnalysis Claude-Code session documents.

    Each document (``.json`` or ``.json.zst``) is one session; its sub-agents
    become sessions ``ID/agent_id`` with ``parent=ID``, and requests of a
    second model become ``ID@model``.  Session-local ``hash_ids`` are made
    global with :func:`~hybridstore.replay.trace.salted_ids` salted by
    (document id, model), so sub-agents of one document still share their
    common system prompt while nothing is shared across documents or models.
    Sub-agent times are shifted by their entry's ``t``.

    Args:
        paths: a directory, a file, or several of either.
        name: trace name (default: the directory or file stem).
        progress: force the tqdm bar on/off (default: on above 4 files).

    Returns:
        The trace (block size from the files, 64 for the public ones).

    Raises:
        TraceFormatError: unreadable documents, inconsistent block sizes, or
            ``hash_ids`` that do not match ``in``.
    """
    files = _weka_files(paths)
    sessions: list[Session] = []
    sizes: set[int] = set()
    for path in _progress(files, "weka", progress):
        with _open_text(path) as f:
            doc = _parse_json(f.read(), str(path), "a JSON document")
        bs, found = _weka_sessions(doc, path)
        sizes.add(bs)
        sessions += found
    if len(sizes) != 1:
        raise TraceFormatError(f"WEKA files mix block sizes {sorted(sizes)}")
    if name is None:
        first = Path(paths) if isinstance(paths, (str, Path)) else files[0]
        name = first.name if first.is_dir() else _stem(first)
    return Trace(name=name, block_size=sizes.pop(), sessions=tuple(sessions))


# -- Mooncake -------------------------------------------------------------------------
def _system_ids(rows: list[tuple[float, int, int, list[int]]], fanout: int,
                max_blocks: int) -> set[int]:
    """Ids at positions ``< max_blocks`` followed by ``>= fanout`` distinct continuations."""
    nxt: dict[int, set[int]] = {}
    for _, _, _, ids in rows:
        for i in range(min(max_blocks, len(ids))):
            nxt.setdefault(ids[i], set()).add(ids[i + 1] if i + 1 < len(ids) else -1)
    return {x for x, s in nxt.items() if len(s) >= fanout}


def load_mooncake(path: PathLike, *, model: str = "kimi", block_size: int = 512,
                  system_fanout: int = 4, max_system_blocks: int = 8,
                  name: str | None = None) -> Trace:
    """Load a Mooncake jsonl trace, inferring sessions from prefix chaining.

    Rule: an id is a *system-prompt id* when it sits in the first
    ``max_system_blocks`` blocks of some request and is followed, over the
    whole file, by at least ``system_fanout`` distinct next ids (or ends).  The
    *anchor block* of a request is its first id after the leading run of
    system-prompt ids.  Requests with the same anchor block id form a session:
    a request continues the session of the previous requests it shares more
    than the system prompt with (ids are chained, so sharing the anchor block
    is sharing everything before it); a request that shares nothing beyond
    the system prompt (or is all system prompt) starts a new session.  Hence
    every non-first request of a session shares at least its first block with
    the session's previous request.

    Args:
        path: the ``.jsonl`` / ``.jsonl.zst`` file.
        model: model name given to every request (Mooncake has none).
        block_size: tokens per block (512 in the public traces).
        system_fanout: continuations that make a leading id a shared prompt.
        max_system_blocks: how deep a shared system prompt may reach.
        name: trace name (default: the file stem).

    Returns:
        The trace; ``arrival_s`` is ``timestamp / 1000``, ``think_s`` the gap
        to the session's previous arrival.

    Raises:
        TraceFormatError: a line without the fields or with
            ``len(hash_ids) != ceil(input_length / block_size)``.
    """
    path = Path(path)
    rows: list[tuple[float, int, int, list[int]]] = []
    for n, obj in _iter_jsonl(path):
        where = f"{path}:{n}"
        ids = _ids(_field(obj, "hash_ids", where), where).tolist()
        n_in = _count(_field(obj, "input_length", where), where, "input_length")
        if len(ids) != -(-n_in // block_size):
            raise TraceFormatError(f"{where}: {len(ids)} hash_ids for input_length {n_in}; "
                                   f"expected ceil({n_in}/{block_size})")
        rows.append((_seconds(_field(obj, "timestamp", where), where, "timestamp") / 1000.0, n_in,
                     _count(obj.get("output_length"), where, "output_length"), ids))
    system = _system_ids(rows, system_fanout, max_system_blocks)
    salt = salt_of("mooncake", _stem(path), model)
    stem = _stem(path)
    owner: dict[int, SessionBuilder] = {}
    builders: list[SessionBuilder] = []
    for t, n_in, n_out, ids in rows:
        s = 0
        while s < len(ids) and s < max_system_blocks and ids[s] in system:
            s += 1
        b = owner.get(ids[s]) if s < len(ids) else None
        if b is None:
            b = SessionBuilder(f"{stem}#{len(builders)}", model, block_size)
            builders.append(b)
            if s < len(ids):
                owner[ids[s]] = b
        prev = b.last
        b.add(arrival_s=t, input_tokens=n_in, output_tokens=n_out, block_ids=salted_ids(ids, salt),
              think_s=t - prev.arrival_s if prev else 0.0, inherit_anchors=True)
    return Trace(name=name or stem, block_size=block_size,
                 sessions=tuple(b.build() for b in builders))


# -- TraceLab -------------------------------------------------------------------------
_INPUT_EVENTS = ("user_message", "tool_result")


def _ts(value: str, where: str) -> float:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: bad timestamp {value!r}") from exc


def _round_times(row: dict[str, Any], where: str) -> tuple[float | None, float | None, list]:
    """``(request time, last event time, input events)`` of a round."""
    events = row.get("timing_events") or []
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceFormatError(f"{where}: timing_events must be a list of objects")
    times = [_ts(e["timestamp"], where) for e in events if e.get("timestamp")]
    inputs = [e for e in events if e.get("event_type") in _INPUT_EVENTS]
    in_times = [_ts(e["timestamp"], where) for e in inputs if e.get("timestamp")]
    sent = max(in_times) if in_times else (min(times) if times else None)
    return sent, (max(times) if times else None), inputs


def _input_anchors(prev: Request, n_in: int, inputs: list[dict[str, Any]]) -> list[int]:
    """Starts of this round's input events, placed after the previous output by char share."""
    base = prev.input_tokens + prev.output_tokens
    chars = [_count(e.get("result_chars") or e.get("content_chars"), "a TraceLab input event",
                    "result_chars", 1 << 40) for e in inputs]
    total = sum(chars)
    if base >= n_in or total <= 0:
        return []
    scale, acc, out = (n_in - base) / total, 0, []
    for c in chars:
        out.append(base + int(acc * scale))
        acc += c
    return out


def _tracelab_stream(b: SessionBuilder, rows: list[dict[str, Any]], salt: int,
                     where: str) -> Session:
    bs = b.block_size
    prev_ids = np.empty(0, dtype=np.uint64)
    counter, t0, prev_end = 1, None, None
    for row in rows:
        w = f"{where} round {row.get('round_index')}"
        n_in = _count(_field(row, "input_tokens_total", w), w, "input_tokens_total")
        prefix = min(_count(row.get("prefix_tokens"), w, "prefix_tokens"), n_in)
        keep = 0 if b.last is None else min(prefix // bs, len(prev_ids))
        fresh = n_in // bs - keep
        fresh_ids = salted_ids(np.arange(counter, counter + fresh, dtype=np.uint64), salt)
        ids = np.concatenate([prev_ids[:keep], fresh_ids])
        counter += fresh
        sent, last, inputs = _round_times(row, w)
        sent = sent if sent is not None else (prev_end if prev_end is not None else 0.0)
        t0 = sent if t0 is None else t0
        think = max(0.0, sent - prev_end) if prev_end is not None else 0.0
        anchors: list[int] = []
        if b.last is not None and b.kind_of(ids, n_in) == APPEND:
            anchors = _input_anchors(b.last, n_in, inputs)
        b.add(arrival_s=sent - t0, input_tokens=n_in,
              output_tokens=_count(row.get("output_tokens"), w, "output_tokens"), block_ids=ids,
              think_s=think,
              anchors=anchors, inherit_anchors=True)
        prev_ids, prev_end = ids, (last if last is not None else sent)
    return b.build()


def load_tracelab(path: PathLike, *, block_size: int = 64, name: str | None = None) -> Trace:
    """Load a TraceLab round trace (one JSON line per round).

    TraceLab has token counts, no hashes; chained ids are synthesized per
    session: round ``r`` reuses the first ``prefix_tokens // block_size`` full-
    block ids of round ``r - 1`` (capped by what round ``r - 1`` had), and its
    other full blocks get fresh ids.  ``prefix_tokens`` below the previous
    prompt length therefore shows up as a mutation / compaction (it may also be
    a provider-side cache miss).  Round 0's prefix is not shared with anything.
    Times come from ``timing_events``: a round arrives at its last input event
    (user message / tool result); ``think_s`` is the gap since the previous
    round's last event.

    Args:
        path: the ``.jsonl`` (or ``.jsonl.zst``) round trace.
        block_size: tokens per synthesized block.
        name: trace name (default: the file stem).

    Returns:
        The trace, sessions in order of first appearance (split by model if a
        session switches model).

    Raises:
        TraceFormatError: missing fields or a repeated ``round_index``.
    """
    path = Path(path)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for n, obj in _iter_jsonl(path):
        by_session.setdefault(str(_field(obj, "session_id", f"{path}:{n}")), []).append(obj)
    sessions: list[Session] = []
    for sid, rows in by_session.items():
        rows.sort(key=lambda r: _count(_field(r, "round_index", f"{path} {sid}"),
                                       f"{path} {sid}", "round_index"))
        idx = [r["round_index"] for r in rows]
        if len(set(idx)) != len(idx):
            raise TraceFormatError(f"{path}: session {sid} repeats a round_index")
        for stream, model, part in _split_models(sid, rows, lambda r: str(r.get("model") or "")):
            b = SessionBuilder(stream, model, block_size, parent=None if stream == sid else sid)
            sessions.append(_tracelab_stream(b, part, salt_of("tracelab", sid, model), str(path)))
    return Trace(name=name or _stem(path), block_size=block_size, sessions=tuple(sessions))


# -- canonical jsonl ------------------------------------------------------------------
def save_canonical(trace: Trace, path: PathLike) -> None:
    """Write ``trace`` as canonical jsonl (zstd-compressed when ``path`` ends in ``.zst``).

    Line 1 is a header; then one request per line, session by session.  Ids
    and anchors are stored as the count kept from the session's previous
    request plus the new ones (see ``docs/traces.md``).
    """
    path = Path(path)
    header = {"format": CANONICAL_FORMAT, "version": CANONICAL_VERSION, "name": trace.name,
              "block_size": trace.block_size, "sessions": trace.n_sessions,
              "requests": trace.n_requests}
    with _open_write(path) as f:
        f.write(json.dumps(header) + "\n")
        for s in trace.sessions:
            prev_ids: list[int] = []
            prev_anchors: tuple[int, ...] = ()
            for r in s.requests:
                ids = r.block_ids.tolist()
                k = _shared(prev_ids, ids)
                ak = _shared(prev_anchors, r.anchors)
                line = {"session": r.session, "index": r.index, "arrival_s": r.arrival_s,
                        "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                        "think_s": r.think_s, "model": r.model, "parent": r.parent,
                        "tags": list(r.tags), "ids_keep": k, "ids": ids[k:],
                        "anchors_keep": ak, "anchors": list(r.anchors[ak:])}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                prev_ids, prev_anchors = ids, r.anchors


def _positions(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in value):
        raise TraceFormatError(f"{where}: anchors must be a list of whole numbers")
    return tuple(value)


def _strings(value: Any, where: str, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TraceFormatError(f"{where}: {what} must be a list of strings")
    return value


def _parent(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TraceFormatError(f"{where}: parent must be a session id (a string) or null")
    return value


def _shared(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_canonical(path: PathLike) -> Trace:
    """Read a trace written by :func:`save_canonical` (exact round trip).

    Request lines of different sessions may interleave; within a session they
    must come in index order.

    Raises:
        TraceFormatError: a missing/foreign header, a gap in a session's
            indices, or inconsistent fields.
    """
    path = Path(path)
    lines = _iter_jsonl(path)
    try:
        _, header = next(lines)
    except StopIteration:
        raise TraceFormatError(
            f"{path}: empty file, expected a {CANONICAL_FORMAT} header") from None
    if header.get("format") != CANONICAL_FORMAT or header.get("version") != CANONICAL_VERSION:
        raise TraceFormatError(f"{path}: not a {CANONICAL_FORMAT} v{CANONICAL_VERSION} file "
                               f"(header {str(header)[:80]})")
    bs = _block_size(_field(header, "block_size", str(path)), str(path))
    sessions: dict[str, list[Request]] = {}
    for n, obj in lines:
        where = f"{path}:{n}"
        sid = str(_field(obj, "session", where))
        reqs = sessions.setdefault(sid, [])
        prev = reqs[-1] if reqs else None
        k = _count(obj.get("ids_keep"), where, "ids_keep")
        ak = _count(obj.get("anchors_keep"), where, "anchors_keep")
        if prev is None and (k or ak) or prev is not None and (
                k > len(prev.block_ids) or ak > len(prev.anchors)):
            raise TraceFormatError(f"{where}: ids_keep/anchors_keep exceed the previous request")
        ids = _ids(_field(obj, "ids", where), where)
        if k:
            ids = np.concatenate([prev.block_ids[:k], ids])
        anchors = (prev.anchors[:ak] if ak else ()) + _positions(obj.get("anchors") or [], where)
        if _count(_field(obj, "index", where), where, "index") != len(reqs):
            raise TraceFormatError(f"{where}: session {sid!r} expects request {len(reqs)} here")
        reqs.append(Request(session=sid, index=len(reqs), arrival_s=_seconds(_field(obj, "arrival_s", where),
                                                                    where, "arrival_s"),
                            input_tokens=_count(_field(obj, "input_tokens", where), where,
                                                "input_tokens"),
                            output_tokens=_count(_field(obj, "output_tokens", where), where,
                                                 "output_tokens"),
                            block_size=bs, block_ids=ids,
                            think_s=_seconds(obj.get("think_s"), where, "think_s"),
                            anchors=anchors,
                            model=str(obj.get("model", "")), parent=_parent(obj.get("parent"), where),
                            tags=tuple(_strings(obj.get("tags") or [], where, "tags"))))
    return Trace(name=str(header.get("name") or _stem(path)), block_size=bs,
                 sessions=tuple(Session(id=sid, requests=tuple(rs), model=rs[0].model)
                                for sid, rs in sessions.items()))


# -- dispatch -------------------------------------------------------------------------
FORMATS: dict[str, Callable[..., Trace]] = {
    "weka": load_weka, "mooncake": load_mooncake, "tracelab": load_tracelab,
    "canonical": load_canonical,
}


def _sniff_file(path: Path) -> str:
    with _open_text(path) as f:
        head = f.read(4096)
    first = head.lstrip()
    if first.startswith("{") and f'"{CANONICAL_FORMAT}"' in first.split("\n", 1)[0]:
        return "canonical"
    if '"round_index"' in head and '"session_id"' in head:
        return "tracelab"
    if '"input_length"' in head and '"hash_ids"' in head:
        return "mooncake"
    if '"block_size"' in head and ('"requests"' in head or '"hash_id_scope"' in head):
        return "weka"
    raise TraceFormatError(f"{path}: unknown trace format; prefix the path with one of "
                           f"{', '.join(f'{k}:' for k in FORMATS)}")


def sniff_format(path: PathLike) -> str:
    """Name of the loader (a key of :data:`FORMATS`) for a file or directory."""
    path = Path(path)
    if path.is_file():
        return _sniff_file(path)
    if not path.is_dir():
        raise TraceFormatError(f"no such trace file or directory: {path}")
    files = sorted(q for q in path.iterdir() if q.is_file() and q.name.endswith(
        (".json", ".json.zst", ".jsonl", ".jsonl.zst")))
    if not files:
        raise TraceFormatError(f"{path}: no .json[l][.zst] trace files")
    kinds = {_sniff_file(q) for q in files[:3]}
    if kinds == {"weka"}:
        return "weka"
    raise TraceFormatError(f"{path}: a directory loads only as WEKA documents (found {kinds}); "
                           f"pass its files one by one")


def load(spec: str) -> Trace:
    """Load a trace from a spec.

    Accepted specs: ``synthetic:GENERATOR?key=value&...`` (see
    :mod:`hybridstore.replay.synthetic`), ``FORMAT:PATH`` with ``FORMAT`` in
    :data:`FORMATS`, or a bare path whose format is sniffed (a directory is
    read as WEKA documents).

    Raises:
        TraceFormatError: unknown format or missing path.
    """
    if spec.startswith("synthetic:"):
        from hybridstore.replay.synthetic import generate
        return generate(spec)
    fmt, sep, rest = spec.partition(":")
    if sep and fmt in FORMATS:
        return FORMATS[fmt](Path(rest))
    return FORMATS[sniff_format(spec)](Path(spec))
