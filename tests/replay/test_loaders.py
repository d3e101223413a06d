"""Loaders against the real shared traces, at full size, plus the canonical round trip."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zstandard

from hybridstore.errors import ConfigError
from hybridstore.replay import (
    Request,
    Trace,
    TraceFormatError,
    load,
    load_canonical,
    load_mooncake,
    load_tracelab,
    load_weka,
    merge,
    save_canonical,
    sniff_format,
)
from hybridstore.replay.trace import SessionBuilder, classify, common_prefix

TRACES = (Path(__file__).parents[2] / ".." / "shared" / "traces").resolve()
WEKA = TRACES / "weka"
MOONCAKE_CONV = TRACES / "mooncake" / "conversation_trace.jsonl.zst"
MOONCAKE_SYN = TRACES / "mooncake" / "synthetic_trace.jsonl.zst"
TRACELAB = TRACES / "tracelab" / "example_sessions_sanitized_round_trace.jsonl"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared trace {path} is absent (expected next to the repo in shared/traces)")
    return path


@pytest.fixture(scope="module")
def weka() -> Trace:
    return load_weka(_need(WEKA), progress=False)


@pytest.fixture(scope="module")
def weka_docs() -> dict[str, dict]:
    docs = {}
    for f in sorted(_need(WEKA).glob("*.json.zst")):
        with open(f, "rb") as fh:
            docs[f.name] = json.loads(zstandard.ZstdDecompressor().stream_reader(fh).read())
    return docs


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_mooncake(_need(MOONCAKE_CONV))


@pytest.fixture(scope="module")
def tracelab() -> Trace:
    return load_tracelab(_need(TRACELAB))


# -- WEKA -----------------------------------------------------------------------------
def test_weka_counts_match_the_raw_documents(weka: Trace, weka_docs: dict[str, dict]) -> None:
    raw = 0
    for doc in weka_docs.values():
        for r in doc["requests"]:
            raw += len(r["requests"]) if r["type"] == "subagent" else 1
    assert raw == 2020 == weka.n_requests
    assert len(weka_docs) == 30
    assert weka.block_size == 64
    # 30 documents + 5 sub-agents + 2 side streams of a second model
    assert weka.n_sessions == 37
    assert weka.input_tokens == sum(
        r["in"] for d in weka_docs.values() for e in d["requests"]
        for r in (e["requests"] if e["type"] == "subagent" else [e]))


def test_weka_subagents_are_separate_sessions(weka: Trace) -> None:
    subs = [s for s in weka.sessions if "/" in s.id]
    assert len(subs) == 5
    for s in subs:
        parent = weka.session(s.parent)
        assert s.id.startswith(parent.id + "/")
        parent_ids = set(np.concatenate([r.block_ids for r in parent.requests]).tolist())
        assert not parent_ids & set(np.concatenate([r.block_ids for r in s.requests]).tolist())
    # sub-agents of one document still share their own system prompt (156 blocks)
    a, b = (weka.session(f"trace_0010/agent_00{i}").requests[0] for i in (1, 2))
    assert common_prefix(a.block_ids, b.block_ids) == 156
    assert a.anchors[:2] == (7771, 7771 + 2227)


def test_weka_subagent_times_are_shifted_by_their_entry(weka: Trace,
                                                        weka_docs: dict[str, dict]) -> None:
    entry = next(e for e in weka_docs["trace_0010.json.zst"]["requests"]
                 if e.get("agent_id") == "agent_002")
    s = weka.session("trace_0010/agent_002")
    assert [r.arrival_s for r in s.requests] == [entry["t"] + q["t"] for q in entry["requests"]]


def test_weka_models_split_and_keyed(weka: Trace) -> None:
    side = weka.session("trace_0073@claude-sonnet-4-5-20250929")
    main = weka.session("trace_0073")
    assert side.parent == "trace_0073" and main.model == "claude-opus-4-5-20251101"
    assert side.n_requests == 20 and main.n_requests == 64
    # both start with local ids 1, 2, 3 but are keyed per model
    assert common_prefix(side.requests[-1].block_ids, main.requests[0].block_ids) == 0
    for s in weka.sessions:
        assert {r.model for r in s.requests} == {s.model}


def test_weka_ids_are_chained_and_global(weka: Trace) -> None:
    appends = 0
    for s in weka.sessions:
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert len(cur.block_ids) == cur.input_tokens // 64 and not cur.has_partial_id
            if cur.kind == "append":
                appends += 1
                assert np.array_equal(cur.block_ids[: len(prev.block_ids)], prev.block_ids)
    assert appends == 1803
    firsts = [s.requests[0].block_ids[0] for s in weka.sessions if "/" not in s.id]
    assert len(set(firsts)) == len(firsts)  # every document's local id 1 became distinct


def test_weka_mutation_fractions_like_the_readme(weka: Trace) -> None:
    m = weka.mutation_stats()
    # README (full set): ~93% append, ~4% last block, ~2.7% diverged; this
    # sample was chosen for mutations: 90.9% / 5.1% / 4.0%.
    assert m.pairs == 2020 - 37
    assert 0.88 < m.append < 0.96
    assert 0.02 < m.last_block < 0.08
    assert 0.015 < m.diverged < 0.06
    assert m.append + m.last_block + m.diverged == pytest.approx(1.0)
    kinds = weka.kind_counts()
    assert kinds["first"] == 37 and kinds["compaction"] > 0 and kinds["mutation"] > 0


def test_weka_anchors_mark_turn_starts(weka: Trace) -> None:
    for s in weka.sessions:
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert all(0 < a < cur.input_tokens for a in cur.anchors)
            if cur.kind == "append" and prev.input_tokens < cur.input_tokens:
                assert prev.input_tokens in cur.anchors
                assert set(prev.anchors) <= set(cur.anchors)


def test_weka_single_file_and_list(weka_docs: dict[str, dict]) -> None:
    one = load_weka(WEKA / "trace_0001.json.zst")
    assert one.name == "trace_0001" and one.n_requests == 41 and one.n_sessions == 1
    two = load_weka([WEKA / "trace_0001.json.zst", WEKA / "trace_0007.json.zst"])
    assert two.n_requests == 41 + 12


# -- Mooncake -------------------------------------------------------------------------
def test_mooncake_counts_and_partial_blocks(mooncake: Trace) -> None:
    assert mooncake.n_requests == 12031
    assert mooncake.block_size == 512
    assert mooncake.input_tokens == 144_793_823
    for r in mooncake.requests():
        assert len(r.block_ids) == -(-r.input_tokens // 512)
        assert r.has_partial_id == bool(r.input_tokens % 512)
    assert mooncake.n_sessions == 7425
    sizes = Counter(s.n_requests for s in mooncake.sessions)
    assert sizes[1] < mooncake.n_sessions  # many multi-turn sessions were found
    assert max(sizes) == 43


def test_mooncake_sessions_are_inferred_consistently(mooncake: Trace) -> None:
    owner: dict[int, str] = {}
    for s in mooncake.sessions:
        times = [r.arrival_s for r in s.requests]
        assert times == sorted(times)
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert cur.block_ids[0] == prev.block_ids[0]
            assert common_prefix(prev.block_ids, cur.block_ids) >= 2  # beyond the system block
            assert cur.think_s == pytest.approx(cur.arrival_s - prev.arrival_s)
        for r in s.requests:
            # prefixes deeper than any system prompt (8 blocks) never cross sessions
            if len(r.block_ids) > 8:
                assert owner.setdefault(int(r.block_ids[8]), s.id) == s.id
    # the one block every request starts with is the shared system prompt
    assert len({int(s.requests[0].block_ids[0]) for s in mooncake.sessions}) == 1


def test_mooncake_synthetic_file_and_session_rule_knobs() -> None:
    syn = load_mooncake(_need(MOONCAKE_SYN))
    assert syn.n_requests == 3993 and syn.n_sessions == 2211
    lumped = load_mooncake(MOONCAKE_CONV, system_fanout=10**9)  # nothing is a system prompt
    assert lumped.n_sessions == 1  # all share block 0: one giant "session"


# -- TraceLab -------------------------------------------------------------------------
def _tracelab_rows() -> list[dict]:
    return [json.loads(line) for line in _need(TRACELAB).read_text().splitlines() if line.strip()]


def test_tracelab_prefix_structure(tracelab: Trace) -> None:
    rows = _tracelab_rows()
    assert tracelab.n_requests == len(rows) == 19
    assert tracelab.n_sessions == 2
    assert {s.model for s in tracelab.sessions} == {"claude-opus-4-8", "gpt-5.4"}
    by = {(r["session_id"], r["round_index"]): r for r in rows}
    for s in tracelab.sessions:
        for prev, cur in zip(s.requests, s.requests[1:]):
            row = by[(s.id, cur.index)]
            assert cur.input_tokens == row["input_tokens_total"]
            assert cur.output_tokens == row["output_tokens"]
            expect = min(row["prefix_tokens"] // 64, prev.n_full_blocks)
            assert common_prefix(prev.block_ids, cur.block_ids) == expect
            assert cur.arrival_s >= prev.arrival_s and cur.think_s >= 0
    codex = tracelab.session("codex:a611041f-625d-6fad-5e59-845850dc6543")
    # round 3 drops to 3456 cached tokens: a mutation at block 54
    assert codex.requests[3].kind == "mutation"
    assert common_prefix(codex.requests[2].block_ids, codex.requests[3].block_ids) == 54


def test_tracelab_timing_and_tool_anchors(tracelab: Trace) -> None:
    claude = tracelab.session("claude:92ee5b8a-429c-e80b-5db6-5381512f4697")
    r1 = claude.requests[1]
    # round 1 is sent at its last tool result (05:40:50.938) ; round 0 began 05:40:20.151
    assert r1.arrival_s == pytest.approx(50.938 - 20.151, abs=1e-3)
    assert r1.think_s == pytest.approx(50.938 - 31.647, abs=1e-3)
    codex = tracelab.sessions[1]
    r1 = codex.requests[1]
    assert r1.kind == "append"
    prev = codex.requests[0]
    assert {prev.input_tokens, prev.input_tokens + prev.output_tokens} <= set(r1.anchors)


# -- canonical ------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_canonical_round_trip_is_exact(weka: Trace, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"weka{suffix}"
    save_canonical(weka, path)
    back = load_canonical(path)
    assert back == weka
    assert back.name == weka.name and back.summary() == weka.summary()
    assert sniff_format(path) == "canonical"
    assert load(str(path)) == weka


def test_canonical_round_trip_mooncake_and_tracelab(mooncake: Trace, tracelab: Trace,
                                                    tmp_path: Path) -> None:
    for t in (mooncake, tracelab):
        path = tmp_path / f"{t.name}.jsonl.zst"
        save_canonical(t, path)
        back = load_canonical(path)
        assert back == t
        r, b = next(t.requests()), next(back.requests())
        assert b.block_ids.dtype == np.uint64 and not b.block_ids.flags.writeable
        assert (b.arrival_s, b.think_s, b.anchors, b.tags) == (r.arrival_s, r.think_s, r.anchors,
                                                               r.tags)


def test_canonical_rejects_foreign_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(TraceFormatError, match="not a hybridstore.trace"):
        load_canonical(bad)
    gap = tmp_path / "gap.jsonl"
    gap.write_text('{"format": "hybridstore.trace", "version": 1, "block_size": 4}\n'
                   '{"session": "a", "index": 1, "arrival_s": 0, "input_tokens": 4, '
                   '"output_tokens": 1, "ids": [7]}\n')
    with pytest.raises(TraceFormatError, match="expects request 0"):
        load_canonical(gap)


# -- dispatch -------------------------------------------------------------------------
def test_load_sniffs_every_format() -> None:
    assert sniff_format(_need(WEKA)) == "weka"
    assert sniff_format(WEKA / "trace_0001.json.zst") == "weka"
    assert sniff_format(_need(MOONCAKE_CONV)) == "mooncake"
    assert sniff_format(_need(TRACELAB)) == "tracelab"
    assert load(str(TRACELAB)).n_requests == 19
    assert load(f"tracelab:{TRACELAB}").n_requests == 19
    assert load(f"weka:{WEKA / 'trace_0007.json.zst'}").n_requests == 12
    assert load("synthetic:agent?sessions=2&turns=3").n_requests == 6


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such trace"):
        load(str(tmp_path / "missing.jsonl"))
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"a": 1}\n')
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load(str(junk))
    with pytest.raises(ConfigError, match="unknown synthetic generator"):
        load("synthetic:nope")
    bad = tmp_path / "moon.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r"moon.jsonl:1: 1 hash_ids"):
        load_mooncake(bad)


# -- canonical types ------------------------------------------------------------------
def test_request_validation_and_immutability() -> None:
    ids = np.arange(3, dtype=np.uint64)
    r = Request("s", 0, 0.0, 150, 1, 64, ids)
    assert r.n_full_blocks == 2 and r.has_partial_id and r.tail_tokens == 22
    assert ids.flags.writeable  # the caller's array is copied, not frozen
    with pytest.raises(ValueError):
        r.block_ids[0] = 5
    with pytest.raises(TraceFormatError, match="block ids cannot describe"):
        Request("s", 0, 0.0, 150, 1, 64, np.arange(1, dtype=np.uint64))
    with pytest.raises(TraceFormatError, match="anchors"):
        Request("s", 0, 0.0, 150, 1, 64, ids[:2], anchors=(10, 5))
    assert r == r.replace(tags=()).replace(tags=())
    assert r != r.replace(block_ids=np.array([0, 1, 9], dtype=np.uint64))


def test_classify_kinds() -> None:
    b = SessionBuilder("s", "m", 4)
    ids = np.arange(1, 101, dtype=np.uint64)
    b.add(arrival_s=0, input_tokens=402, output_tokens=1, block_ids=ids)
    assert classify(b.last, np.r_[ids, 7], 404)[0] == "append"
    assert classify(b.last, np.r_[ids[:99], 7], 400)[0] == "last_block"
    assert classify(b.last, np.r_[ids[:50], 7], 204)[0] == "mutation"
    assert classify(b.last, np.r_[ids[:5], 7], 40)[0] == "compaction"
    assert classify(None, ids, 400)[0] == "first"


def test_merge_requires_one_block_size(weka: Trace, tracelab: Trace, mooncake: Trace) -> None:
    both = merge([weka, tracelab])
    assert both.n_requests == 2020 + 19 and both.block_size == 64
    with pytest.raises(TraceFormatError, match="block sizes"):
        merge([weka, mooncake])
    by_session: dict[str, list] = defaultdict(list)
    for r in both.arrivals():
        by_session[r.session].append(r.index)
    assert all(v == sorted(v) for v in by_session.values())


# -- hostile input (issue 13, items 6 and 7) ---------------------------------------------
@pytest.mark.parametrize("value", [200_000_000_000, -5, "lots", 1e300, [3], True])
def test_a_size_field_is_bounded_and_typed_before_anything_is_allocated(tmp_path: Path,
                                                                        value: object) -> None:
    """One TraceLab round with ``input_tokens_total: 200000000000`` made the loader
    allocate 23 GiB; every size read from a trace is validated first."""
    rows = [json.loads(line) for line in _need(TRACELAB).read_text().splitlines() if line.strip()]
    rows[0]["input_tokens_total"] = value
    bad = tmp_path / "bad_round_trace.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceFormatError, match="input_tokens_total"):
        load_tracelab(bad)


@pytest.mark.parametrize("field,value", [("input_length", 10**12), ("output_length", "x"),
                                         ("input_length", None)])
def test_mooncake_sizes_are_validated(tmp_path: Path, field: str, value: object) -> None:
    row = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
    row[field] = value
    bad = tmp_path / "moon.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceFormatError):
        load_mooncake(bad)


def test_canonical_header_block_size_is_validated(tmp_path: Path) -> None:
    bad = tmp_path / "c.jsonl"
    for size in (0, 10**9, "big"):
        bad.write_text(json.dumps({"format": "hybridstore.trace", "version": 1,
                                   "block_size": size}) + "\n")
        with pytest.raises(TraceFormatError, match="block_size"):
            load_canonical(bad)


def _mutants(raw: bytes, name: str) -> Iterator[tuple[str, bytes]]:
    """Damaged copies of a trace file: what a user's broken download or editor produces."""
    text = raw.decode()
    yield f"trunc-{name}", raw[: len(raw) // 3]
    yield f"latin1-{name}", b"\xff\xfe" + raw[:200]
    yield f"zst-cut-{name}.zst", zstandard.ZstdCompressor().compress(raw)[:60]
    yield f"zst-junk-{name}.zst", b"\x28\xb5\x2f\xfd" + bytes(range(200))
    for key in ('"t"', '"in"', '"out"', '"block_size"', '"think_time"', '"hash_ids"'):
        yield f"str-{key.strip(chr(34))}-{name}", text.replace(f"{key}:", f'{key}: "zz", "_":', 1).encode()
    yield f"neg-{name}", text.replace('"in": ', '"in": -', 3).encode()
    yield f"nan-{name}", text.replace('"t": ', '"t": NaN, "_": ', 2).encode()
    yield f"huge-{name}", text.replace('"in": ', '"in": 999999999999999', 1).encode()
    yield f"events-{name}", text.replace('"hash_ids": [', '"hash_ids": [{"a": 1}, ', 1).encode()


def test_damaged_trace_files_raise_trace_format_errors(tmp_path: Path) -> None:
    """Issue 13, item 6: ~27% of malformed trace files raised untyped errors
    (UnicodeDecodeError, ZstdError, ZeroDivisionError, ValueError ...)."""
    samples = Path(__file__).parents[2] / "src" / "hybridstore" / "replay" / "samples" / "weka"
    files = sorted(samples.glob("*.json*"))[:3]
    assert files
    untyped, tried = [], 0
    for f in files:
        raw = f.read_bytes()
        if f.name.endswith(".zst"):
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 26)
        for name, data in _mutants(raw, f.name.removesuffix(".zst")):
            path = tmp_path / name
            path.write_bytes(data)
            tried += 1
            try:
                load(str(path))
            except TraceFormatError:
                pass
            except Exception as e:  # noqa: BLE001 - anything untyped is the defect
                untyped.append(f"{name}: {type(e).__name__}: {e}")
    assert tried >= 30 and not untyped, untyped


_MOON = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
_CANON_HEAD = {"format": "hybridstore.trace", "version": 1, "block_size": 16}
_CANON_ROW = {"session": "s", "index": 0, "arrival_s": 0.0, "input_tokens": 32,
              "output_tokens": 1, "ids": [1, 2], "anchors": [], "tags": []}


@pytest.mark.parametrize(("fmt", "lines"), [
    ("weka", [[1, 2]]),                                                  # not an object
    ("weka", [None]),
    ("weka", [{"block_size": 64, "requests": [[1]]}]),                   # requests not objects
    ("weka", [{"block_size": 64, "requests": [{"type": "subagent", "t": 0, "requests": 5}]}]),
    ("mooncake", [{**_MOON, "hash_ids": [1.5, 2]}]),
    ("mooncake", [{**_MOON, "hash_ids": ["1", "2"]}]),
    ("mooncake", [{**_MOON, "hash_ids": [[1], [2]]}]),
    ("mooncake", [{**_MOON, "hash_ids": 7}]),
    ("mooncake", [{**_MOON, "hash_ids": [2**64, 1]}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "ids": [2**70, 1]}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "ids": [1.0, 2.0]}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "anchors": ["x"]}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "anchors": 5}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "tags": 5}]),
    ("canonical", [_CANON_HEAD, {**_CANON_ROW, "parent": ["s"]}]),
])
def test_fuzzed_field_types_raise_trace_format_errors(tmp_path: Path, fmt: str,
                                                      lines: list) -> None:
    """Issue 13 fuzz: these raised AttributeError, ValueError, OverflowError or TypeError
    (or loaded floats and strings as ids)."""
    path = tmp_path / ("t.json" if fmt == "weka" else "t.jsonl")
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(TraceFormatError):
        load(f"{fmt}:{path}")


@pytest.mark.parametrize("fmt", ["weka", "mooncake", "tracelab", "canonical"])
def test_a_deeply_nested_line_is_a_trace_format_error_naming_it(tmp_path: Path,
                                                                 fmt: str) -> None:
    """Issue 26, item 7: JSON nested deeper than the parser recurses raised RecursionError."""
    deep = "[" * 200_000 + "]" * 200_000
    if fmt == "weka":
        path = tmp_path / "t.json"
        path.write_text('{"block_size": 64, "requests": ' + deep + "}")
        where = r"t\.json:"
    else:
        path = tmp_path / "t.jsonl"                 # after a sound line where one decodes
        first = {"canonical": [_CANON_HEAD], "mooncake": [_MOON], "tracelab": []}[fmt]
        path.write_text("".join(json.dumps(x) + "\n" for x in first)
                        + '{"hash_ids": ' + deep + "}\n")
        where = rf"t\.jsonl:{len(first) + 1}:"
    with pytest.raises(TraceFormatError, match=where + ".*nested too deeply"):
        load(f"{fmt}:{path}")


@pytest.mark.parametrize("loader", [load_mooncake, load_tracelab, load_canonical])
def test_a_missing_or_unreadable_file_is_a_trace_format_error(tmp_path: Path, loader) -> None:
    """Issue 13 fuzz: a loader given a directory or a missing file raised an OSError."""
    for path in (tmp_path, tmp_path / "missing.jsonl"):
        with pytest.raises(TraceFormatError, match="cannot read"):
            loader(path)


def test_request_ids_and_anchors_are_typed() -> None:
    with pytest.raises(TraceFormatError):
        Request(session="s", index=0, arrival_s=0.0, input_tokens=32, output_tokens=0,
                block_size=16, block_ids=[1, 2], anchors=("3",))
    with pytest.raises(TraceFormatError):
        Request(session="s", index=0, arrival_s=0.0, input_tokens=32, output_tokens=0,
                block_size=16, block_ids=np.array([1.0, 2.0]))
    ok = Request(session="s", index=0, arrival_s=0.0, input_tokens=32, output_tokens=0,
                 block_size=16, block_ids=[2**64 - 1, 1], anchors=(np.int64(3),))
    assert ok.block_ids.tolist() == [2**64 - 1, 1] and ok.anchors == (3,)
