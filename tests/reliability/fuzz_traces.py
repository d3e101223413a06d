"""Fuzz target of every trace loader: mutated bytes, JSON and zstd of the shared real traces
(``shared/traces``, see its README) and of generated valid files, plus fuzzed
``synthetic:`` specs.  Each file must load or raise a typed error
(:class:`~hybridstore.replay.TraceFormatError` or another
:class:`~hybridstore.errors.HybridStoreError`), within a memory limit and a time limit.

Loads run in a sandbox process (:class:`Sandbox`) whose address space is limited
(``RLIMIT_AS``): an allocation sized from the input fails there with ``MemoryError`` (a
defect) instead of taking the machine; a load that does not return in time is a hang (the
sandbox is killed and restarted).
"""

from __future__ import annotations

import copy
import io
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard
from hypothesis import strategies as st

from tests.reliability.fuzz_tally import Tally

_REPO = Path(__file__).parents[2]
TRACES = next((p for p in (Path(os.environ.get("HYBRIDSTORE_TRACES", "/nonexistent")),
                           (_REPO / ".." / "shared" / "traces").resolve(), _REPO / "shared" / "traces")
               if p.is_dir()), _REPO / "shared" / "traces")
"""The shared real traces (``$HYBRIDSTORE_TRACES``, else ``shared/traces`` beside or in the
repository); without them the corpus is the packaged WEKA samples and generated files."""
SAMPLES = Path(__file__).parents[2] / "src" / "hybridstore" / "replay" / "samples" / "weka"
MEMORY_HEADROOM = 1 << 30
"""Address space a load may take beyond what the sandbox holds after its imports."""
TIMEOUT_S = 20.0
"""A load of a fuzzed file (at most a few hundred KiB) that takes longer hangs."""
LOADERS = ("load", "load:fmt", "weka", "mooncake", "tracelab", "canonical", "sniff")


# -- the sandbox ---------------------------------------------------------------------------
def _serve(conn: Any, headroom: int) -> None:
    """The sandbox's loop: load each ``(loader, path, kwargs)`` and report the outcome."""
    import warnings

    from hybridstore.errors import HybridStoreError
    from hybridstore.replay import loaders

    warnings.simplefilter("ignore")
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    funcs = {"weka": loaders.load_weka, "mooncake": loaders.load_mooncake,
             "tracelab": loaders.load_tracelab, "canonical": loaders.load_canonical}
    while True:
        try:
            loader, path, kwargs = conn.recv()
        except EOFError:
            return
        try:
            if loader == "load":
                trace = loaders.load(path)
            elif loader == "sniff":
                conn.send(("ok", loaders.sniff_format(path)))
                continue
            else:
                trace = funcs[loader](Path(path), **kwargs)
            conn.send(("ok", f"{trace.n_sessions} sessions, {trace.n_requests} requests"))
        except HybridStoreError as e:
            conn.send(("typed", type(e).__name__))
        except BaseException as e:  # noqa: BLE001 - reported, the parent decides
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "hybridstore" in
                      f.filename] or traceback.extract_tb(e.__traceback__)
            where = f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}" if frames else "?"
            conn.send(("untyped", f"{type(e).__name__} at {where}", f"{type(e).__name__}: {e}"[:300]))


class Sandbox:
    """A process that runs loads under a memory limit; restarted after a hang or a crash."""

    def __init__(self, headroom: int = MEMORY_HEADROOM, timeout_s: float = TIMEOUT_S) -> None:
        self.headroom = headroom
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.headroom), daemon=True)
        self._proc.start()
        child.close()

    def run(self, loader: str, path: str, kwargs: dict[str, Any]) -> tuple[str, ...]:
        """``("ok", what)``, ``("typed", class)``, ``("untyped", kind, message)``,
        ``("hang",)`` or ``("died", exitcode)``."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((loader, path, kwargs))
        if not self._conn.poll(self.timeout_s):
            self.stop()
            return ("hang",)
        try:
            return tuple(self._conn.recv())
        except EOFError:
            code = self._proc.exitcode
            self.stop()
            return ("died", str(code))

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None


# -- the corpus ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seed:
    """One valid trace file's text and the loader it belongs to."""

    name: str
    fmt: str       # weka, mooncake, tracelab, canonical
    text: str
    suffix: str    # .json, .jsonl


def _read(path: Path) -> str:
    raw = path.read_bytes()
    if path.name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    return raw.decode()


def corpus(max_lines: int = 40) -> list[Seed]:
    """Valid files: the shared traces (the longest cut to ``max_lines`` lines, the WEKA
    documents to their first requests) and canonical files written by ``save_canonical``."""
    from hybridstore.replay import generate, load_weka, save_canonical

    seeds: list[Seed] = []
    weka = sorted((TRACES / "weka").glob("*.json.zst")) if (TRACES / "weka").is_dir() else []
    for f in (weka or sorted(SAMPLES.glob("*.json.zst")))[:8]:
        doc = json.loads(_read(f))
        head = doc["requests"][:6]
        doc["requests"] = head + [r for r in doc["requests"][6:] if
                                  r.get("type") == "subagent"][:1 - any(
                                      r.get("type") == "subagent" for r in head)]
        seeds.append(Seed(f.name, "weka", json.dumps(doc), ".json"))
    for f in sorted((TRACES / "mooncake").glob("*.jsonl.zst")):
        lines = _read(f).splitlines()[:max_lines]
        seeds.append(Seed(f.name, "mooncake", "\n".join(lines) + "\n", ".jsonl"))
    for f in sorted((TRACES / "tracelab").glob("*.jsonl")):
        lines = _read(f).splitlines()[:max_lines]
        seeds.append(Seed(f.name, "tracelab", "\n".join(lines) + "\n", ".jsonl"))
    seeds += _generated()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        traces = [generate("synthetic:agent?sessions=2&turns=3&new=300&block=16"),
                  generate("synthetic:rewind?sessions=2&turns=4&system=64&user=32&tool=64&"
                           "long=128&summary=32&block=16")]
        if weka:
            traces.append(load_weka(weka[:2], progress=False))
        for i, trace in enumerate(traces):
            out = Path(tmp) / f"c{i}.jsonl"
            save_canonical(trace, out)
            lines = out.read_text().splitlines()[:max_lines]
            seeds.append(Seed(f"canonical-{i}", "canonical", "\n".join(lines) + "\n", ".jsonl"))
    return seeds


def _generated() -> list[Seed]:
    """Small valid Mooncake and TraceLab files (ids chained, a partial last block, events)."""
    moon = [{"timestamp": 1000 * i, "input_length": 512 * (i % 3) + 100, "output_length": 20,
             "hash_ids": [*range(1 + i % 2, 1 + i % 2 + i % 3), 900 + i]} for i in range(8)]
    rounds = []
    for sid in ("s1", "s2"):
        for r in range(4):
            t = f"2025-01-01T00:0{r}:00Z"
            rounds.append({"session_id": sid, "round_index": r, "input_tokens_total": 500 * (r + 1),
                           "prefix_tokens": 500 * r, "newly_append_tokens": 500,
                           "output_tokens": 30, "model": "m" if r < 3 else "m2",
                           "timing_events": [{"event_type": "user_message", "timestamp": t,
                                              "content_chars": 40},
                                             {"event_type": "tool_result", "timestamp": t,
                                              "result_chars": 90}]})
    return [Seed("generated-mooncake", "mooncake",
                 "".join(json.dumps(r) + "\n" for r in moon), ".jsonl"),
            Seed("generated-tracelab", "tracelab",
                 "".join(json.dumps(r) + "\n" for r in rounds), ".jsonl")]


# -- mutations -------------------------------------------------------------------------------
JSON_EDGE = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 10**20, 200_000_000_000, -(10**20),
             1.5, -0.0, 1e308, "NaN", "", "0", "1e9", "x" * 50, "\ud800", [], {}, [1, 2], [[1]],
             {"a": 1}, [None], ["a"], [-1], [2**64], [1.5], "2025-01-01T00:00:00Z", "Z"]
TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1", b"99999999999999999999999", b"null",
          b"[]", b"{}", b"\"\"", b"true", b"\"\\ud800\"", b"\xff", b"\x00", b"\n", b",", b"]",
          b"}", b"{\"", b"0.0", b"-0", b"1e-999", b"[[[[[[[[[[", b"\"subagent\""]


def json_values() -> st.SearchStrategy[Any]:
    leaf = st.one_of(st.sampled_from(JSON_EDGE), st.integers(), st.floats(allow_nan=True),
                     st.text(max_size=6))
    return st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=4), inner,
                                                                      max_size=3)),
                        max_leaves=6)


def _paths(obj: Any, prefix: tuple[Any, ...] = (), out: list | None = None,
           limit: int = 400) -> list[tuple[Any, ...]]:
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    out.append(prefix)
    if isinstance(obj, dict):
        for k, v in obj.items():
            _paths(v, prefix + (k,), out, limit)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            _paths(v, prefix + (i,), out, limit)
    return out


def _edit(obj: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    if not path:
        return value if op == "set" else obj
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "wrap":
        parent[last] = [parent[last]]
    elif op == "dup" and isinstance(parent, list):
        parent.insert(last, json.loads(json.dumps(parent[last])))
    return obj


@st.composite
def json_mutant(draw: st.DrawFn, seed: Seed) -> bytes:
    """Structural edits: a field set to an edge value, deleted, wrapped or duplicated."""
    lines = seed.text.splitlines() if seed.suffix == ".jsonl" else [seed.text]
    docs = [json.loads(line) for line in lines if line.strip()]
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(docs) - 1))
        paths = _paths(docs[i])
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["set", "set", "set", "delete", "wrap", "dup"]))
        value = copy.deepcopy(draw(json_values())) if op == "set" else None   # never edit
        docs[i] = _edit(docs[i], path, op, value)                              # JSON_EDGE
    if seed.suffix == ".jsonl" and draw(st.booleans()):
        k = draw(st.integers(0, len(docs)))
        docs = docs[:k] + docs[k:][::-1]          # lines out of order
    sep = "\n"
    return (sep.join(json.dumps(d) for d in docs) + "\n").encode()


@st.composite
def byte_mutant(draw: st.DrawFn, raw: bytes) -> bytes:
    """Byte edits: flips, cuts, splices of JSON tokens, repeats."""
    data = bytearray(raw)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "truncate", "token", "repeat", "drop"]))
        at = rng.randrange(len(data) + 1)
        if op == "flip" and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == "cut":
            del data[at: at + rng.randrange(1, 64)]
        elif op == "truncate":
            del data[at:]
        elif op == "token":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif op == "repeat" and len(data) < 1 << 20:
            chunk = data[at: at + rng.randrange(1, 200)]
            data[at:at] = chunk * rng.randrange(1, 20)
        elif op == "drop":
            data = data[:at] + data[at + rng.randrange(1, 4):]
    return bytes(data)


@st.composite
def trace_case(draw: st.DrawFn, seeds: list[Seed]) -> tuple[str, str, bytes, dict[str, Any]]:
    """``(loader, file name, bytes, kwargs)`` of one fuzzed load."""
    seed = draw(st.sampled_from(seeds))
    how = draw(st.sampled_from(["json", "json", "bytes", "zst-bytes", "zst-json", "valid",
                                "garbage", "spec"]))
    if how == "spec":
        return ("load", _spec(draw), b"", {})
    if how == "garbage":
        raw = draw(st.binary(max_size=300))
    elif how == "valid":
        raw = seed.text.encode()
    elif how in ("json", "zst-json"):
        raw = draw(json_mutant(seed))
    else:
        raw = draw(byte_mutant(seed.text.encode()))
    name = f"{seed.fmt}{seed.suffix}"
    if seed.fmt == "weka" and draw(st.integers(0, 5)) == 0:
        name = "dir/" + name        # a directory: this document and a valid one
        raw = zstandard.ZstdCompressor(level=1).compress(raw)
        if how == "zst-bytes":
            raw = draw(byte_mutant(raw))
        name += ".zst"
    elif draw(st.integers(0, 9)) == 0:
        name += ".zst"                               # not zstd, but named so
    loader = draw(st.sampled_from(LOADERS))
    kwargs: dict[str, Any] = {}
    if loader == "load:fmt":
        loader = "load"
        name = f"{draw(st.sampled_from(['weka', 'mooncake', 'tracelab', 'canonical']))}:" + name
    elif loader in ("mooncake", "tracelab") and draw(st.booleans()):
        kwargs["block_size"] = draw(st.sampled_from([1, 16, 64, 512, 2**20]))
    return loader, name, raw, kwargs


def _spec(draw: st.DrawFn) -> str:
    gen = draw(st.sampled_from(["agent", "rewind", "nope", ""]))
    keys = ["sessions", "turns", "new", "out", "mutation", "seed", "block", "cut", "system", "gap",
            "user", "tool", "long", "summary", "marker", "keep", "rewind", "truncate", "compact",
            "model", "x"]
    small = {"sessions": "2", "turns": "3", "new": "100", "user": "16", "tool": "32",
             "long": "64", "summary": "16", "system": "32", "block": "16"}
    values = st.one_of(st.sampled_from(["0", "-1", "1", "2", "1e3", "nan", "inf", "-inf", "1.5", "",
                                        "0x10", "1e400", "9" * 30, "%00", "a&b", "=="]),
                       st.text(max_size=4))
    pairs = dict(small) if gen in ("agent", "rewind") else {}
    for k in draw(st.lists(st.sampled_from(keys), max_size=3)):
        pairs[k] = draw(values)
    if gen == "agent":
        for k in ("user", "tool", "long", "summary"):
            pairs.pop(k, None)
    query = "&".join(f"{k}={v}" for k, v in pairs.items())
    return f"synthetic:{gen}?{query}" if query or draw(st.booleans()) else f"synthetic:{gen}"


def _valid_weka() -> Path:
    weka = sorted((TRACES / "weka").glob("*.json.zst")) or sorted(SAMPLES.glob("*.json.zst"))
    return weka[0]


def trace_load_case(tally: Tally, sandbox: Sandbox, root: str,
                    case: tuple[str, str, bytes, dict[str, Any]]) -> None:
    """Write the fuzzed file, load it in the sandbox, record the outcome."""
    loader, name, raw, kwargs = case
    tally.case("traces")
    tally.calls["traces"] += 1
    if name.startswith("synthetic:"):
        path = name
    else:
        fmt, sep, fname = name.rpartition(":")
        os.makedirs(root, exist_ok=True)
        file = os.path.join(root, fname)
        if fname.startswith("dir/"):
            shutil.rmtree(os.path.dirname(file), ignore_errors=True)
            os.makedirs(os.path.dirname(file))
            shutil.copy(_valid_weka(), os.path.join(os.path.dirname(file), "valid.json.zst"))
        with open(file, "wb") as f:
            f.write(raw)
        path = f"{fmt}:{file}" if sep else file
        if fname.startswith("dir/"):
            path = path.rpartition("/")[0]
    example = (loader, name, kwargs, raw[:120])
    out = sandbox.run(loader, path, kwargs)
    call = f"{loader}({name.rpartition('.')[0] or name})" if not name.startswith("synthetic:") \
        else "load(synthetic)"
    if out[0] == "ok":
        tally.accepted["traces"] += 1
    elif out[0] == "typed":
        tally.typed[out[1]] += 1
    elif out[0] == "untyped":
        tally.defect("traces", call, out[1], out[2], example)
    elif out[0] == "hang":
        tally.defect("traces", call, "hang", f"no answer in {sandbox.timeout_s} s", example)
    else:
        tally.defect("traces", call, "sandbox died", f"exit code {out[1]}", example)
