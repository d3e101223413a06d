"""Trace replay: canonical traces, their loaders and generators, pseudo tokens.

Only light modules are re-exported here (numpy, xxhash, zstandard, tqdm).
"""

from __future__ import annotations

from hybridstore.replay.loaders import (
    load,
    load_canonical,
    load_mooncake,
    load_tracelab,
    load_weka,
    save_canonical,
    sniff_format,
)
from hybridstore.replay.synthetic import generate
from hybridstore.replay.tokens import request_tokens, session_tokens
from hybridstore.replay.trace import (
    MutationStats,
    Request,
    Session,
    Trace,
    TraceFormatError,
    merge,
)

__all__ = [
    "MutationStats",
    "Request",
    "Session",
    "Trace",
    "TraceFormatError",
    "generate",
    "load",
    "load_canonical",
    "load_mooncake",
    "load_tracelab",
    "load_weka",
    "merge",
    "request_tokens",
    "save_canonical",
    "session_tokens",
    "sniff_format",
]
