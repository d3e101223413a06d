"""Timing rows of the SSD benchmark and the objects each object size writes and reads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridstore.bench.common import median, percentile
from hybridstore.objects import ObjectKind, object_key


@dataclass
class Row:
    path: str
    op: str
    cache: str
    object_bytes: int
    note: str = ""
    rep_gbps: dict[int, float] = field(default_factory=dict)
    op_seconds: list[float] = field(default_factory=list)
    objects_per_rep: int = 0
    cached_after_drop: float | None = None

    def add_rep(self, rep: int, seconds: list[float], nbytes: int) -> None:
        self.rep_gbps[rep] = nbytes / sum(seconds) / 1e9
        self.op_seconds.extend(seconds)
        self.objects_per_rep = len(seconds)

    def doc(self) -> dict[str, Any]:
        g = list(self.rep_gbps.values())
        out: dict[str, Any] = {
            "path": self.path, "op": self.op, "cache": self.cache,
            "object_bytes": self.object_bytes, "gbps": median(g),
            "gbps_p10": percentile(g, 10.0), "p50_ms": percentile(self.op_seconds, 50.0) * 1e3,
            "p99_ms": percentile(self.op_seconds, 99.0) * 1e3, "reps": len(g),
            "objects_per_rep": self.objects_per_rep,
        }
        if self.cached_after_drop is not None:
            out["page_cache_after_drop"] = self.cached_after_drop
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class ObjectSet:
    """``n`` objects of ``size`` bytes: names, keys, the source buffer, a target buffer."""

    size: int
    n: int
    dir: str
    src: np.ndarray
    out: np.ndarray

    def stamp(self, i: int, rep: int) -> np.ndarray:
        """The source buffer, made unique to object ``i`` of write repetition ``rep``."""
        head = min(16, self.size)
        self.src[:head] = np.frombuffer((i + (rep << 32)).to_bytes(8, "little") * 2,
                                        np.uint8)[:head]
        return self.src

    def file(self, i: int, ext: str) -> str:
        return os.path.join(self.dir, f"obj-{i:04d}.{ext}")

    def key(self, i: int, salt: int) -> bytes:
        return object_key(ObjectKind.STATE, (self.size * 1_000_003 + i * 131 + salt)
                          .to_bytes(16, "little"))


def npy_offset(path: str) -> int:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            np.lib.format.read_array_header_1_0(fh)
        else:
            np.lib.format.read_array_header_2_0(fh)
        return fh.tell()
