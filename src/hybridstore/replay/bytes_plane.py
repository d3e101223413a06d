"""Data-mode replay: real bytes through the pinned pool and the disk tier, timed restores.

The replay loop (``replay/sim.py``) is the same as in accounting mode; only its
objects differ (the caller passes :func:`data_planes` as ``replay``'s ``plane_for``).  :class:`DataObjects` builds the store over real tiers
(``replay/datatiers.py``): the pinned pool (:class:`HostPool`) as the DRAM
tier, the disk tier (:class:`DiskTier`, O_DIRECT or kvikio) in a fresh
directory, and, for presets with a GPU budget, a second RAM pool standing in
for GPU memory (there may be no GPU; restores from it are modeled free, as in
accounting mode, and cost a zero-copy view).  Then:

* **puts** carry buffers of the (scaled) page and checkpoint sizes, filled with
  a pattern derived from the object's key (:func:`pattern`: a fixed random
  block XOR a 64-bit seed from the key; one vectorised pass per request);
* **every hit** is restored with ``store.load(plan, skip_tiers=("device",))`` (what the GPU tier holds is resident) and its wall
  time is recorded next to the modeled restore of the same bytes; the
  checkpoint and up to :data:`VERIFY_PAGES` pages of every restore are compared
  with the pattern, and a mismatch raises :class:`CorruptObjectError`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridstore.backends.base import Tier
from hybridstore.errors import ConfigError, CorruptObjectError
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import ResumePlan
from hybridstore.objects import TIER_BITS, ObjectKind
from hybridstore.replay.datatiers import BudgetedPool, WriteBehindDisk, physical_bytes
from hybridstore.replay.planes import ObjectPlane, SizedObjects, TierBudget
from hybridstore.replay.systems import Preset
from hybridstore.store import HybridStore

DATA_SCALE = 128.0
"""Default ``--scale`` of data mode: Qwen3.5-9B pages of 16 KiB and checkpoints of
390 KB, HiState's 45/96/150 GiB budgets as 0.35/0.75/1.2 GiB."""

DATA_POLICIES = "unlimited,vllm-disk,histate"
"""Default presets of data mode: each moves every page it keeps through DRAM and SSD, so a
preset costs ~20-45 s on the bundled sample on a 2-core machine (``unlimited`` has no
budget and runs in accounting mode, as the reference)."""

VERIFY_PAGES = 4
"""Pages of every restore compared with their pattern (evenly spaced, first and last included)."""

PATTERN_WORDS = 1 << 16
"""64-bit words of the random block patterns repeat (512 KiB; longer objects step the seed)."""

_BASE = np.random.default_rng(0x6879627269640).integers(0, 1 << 64, PATTERN_WORDS, dtype=np.uint64)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_KIND_TAG = {ObjectKind.PAGE: np.uint64(0x50), ObjectKind.STATE: np.uint64(0x53 << 56)}


def _seeds(kind: ObjectKind, keys: np.ndarray) -> np.ndarray:
    """One 64-bit seed per ``(n, 2)`` uint64 key rows ``[lo, hi]``."""
    with np.errstate(over="ignore"):
        return keys[:, 0] ^ (keys[:, 1] * _GOLDEN) ^ _KIND_TAG[kind]


def _key_rows(key16: bytes) -> np.ndarray:
    return np.frombuffer(key16, dtype="<u8").reshape(1, 2).astype(np.uint64)


def _fill(out: np.ndarray, seeds: np.ndarray) -> None:
    """Fill ``(n, words)`` uint64 rows with the pattern of each row's seed."""
    words = out.shape[1]
    with np.errstate(over="ignore"):
        for chunk, start in enumerate(range(0, words, PATTERN_WORDS)):
            stop = min(words, start + PATTERN_WORDS)
            np.bitwise_xor(_BASE[None, : stop - start], (seeds + _GOLDEN * np.uint64(chunk))[:, None],
                           out=out[:, start:stop])


def patterns(kind: ObjectKind, keys: np.ndarray, nbytes: int,
             scratch: np.ndarray | None = None) -> np.ndarray:
    """``(n, nbytes)`` uint8 rows: the content of objects of ``kind`` with key rows ``keys``.

    ``scratch``: a uint64 buffer to fill instead of a new one, if large enough.
    """
    words = -(-nbytes // 8)
    n = len(keys)
    if scratch is not None and scratch.size >= n * words:
        out = scratch[: n * words].reshape(n, words)
    else:
        out = np.empty((n, words), dtype=np.uint64)
    _fill(out, _seeds(kind, keys))
    return out.view(np.uint8)[:, :nbytes]


def pattern(kind: ObjectKind, key16: bytes, nbytes: int) -> np.ndarray:
    """The content of the object of ``kind`` with 16-byte key ``key16`` (``nbytes`` uint8)."""
    return patterns(kind, _key_rows(key16), nbytes)[0]


class DataObjects:
    """The data-mode objects of one preset's run (see the module docstring).

    Args:
        data_dir: parent of the disk tier's directory (a fresh temporary one
            is made inside it and removed by :meth:`close`); None: the
            system's temp dir.
        label: prefix of that directory's name (the preset).
    """

    def __init__(self, data_dir: str | None, *, label: str = "replay") -> None:
        self._parent = data_dir
        self._label = label
        self._dir: str | None = None
        self._disk: WriteBehindDisk | None = None
        self._timed = 0
        self._objects = 0
        self._seconds = 0.0
        self._verified = {"objects": 0, "bytes": 0}
        self._scratch = np.empty(0, dtype=np.uint64)   # page contents, reused across puts
        self._batch = np.empty((0, 0), dtype=np.uint8)  # restore target (page-major), reused
        self._page_bytes = 0
        self._state_buf = np.empty(0, dtype=np.uint8)

    # -- tiers ------------------------------------------------------------------------
    def open_tiers(self, budgets: Sequence[TierBudget]) -> dict[str, Tier]:
        if self._parent is not None and any(b.name == "disk" for b in budgets):
            os.makedirs(self._parent, exist_ok=True)
        _check_fits(budgets, self._parent)
        tiers: dict[str, Tier] = {}
        try:
            for b in budgets:
                if b.name == "disk":
                    self._dir = tempfile.mkdtemp(prefix=f"hybridstore-{self._label}-",
                                                 dir=self._parent)
                    self._disk = WriteBehindDisk(self._dir, b.capacity_bytes, read_gbps=b.read_gbps)
                    tiers["disk"] = self._disk
                else:
                    tiers[b.name] = BudgetedPool(b.name, b.capacity_bytes, read_gbps=b.read_gbps)
        except BaseException:
            for tier in tiers.values():
                tier.close()
            self.close()
            raise
        return tiers

    # -- puts -------------------------------------------------------------------------
    def put_pages(self, store: HybridStore, prompt: PrefixKeys, first_block: int, nbytes: int) -> None:
        if first_block >= prompt.nblocks:
            return
        self._page_bytes = nbytes
        need = (prompt.nblocks - first_block) * -(-nbytes // 8)
        if self._scratch.size < need:   # grown, then reused: no page faults per request
            self._scratch = np.empty(max(need, 2 * self._scratch.size), dtype=np.uint64)
        rows = patterns(ObjectKind.PAGE, prompt.keys[first_block:], nbytes, self._scratch)
        store.put_kv_batch(prompt, np.ascontiguousarray(rows))   # copied into the pool a run at a time

    def put_state(self, store: HybridStore, prompt: PrefixKeys, position: int, nbytes: int) -> None:
        key = prompt.key_at(position)
        assert key is not None
        store.put_state(prompt, pattern(ObjectKind.STATE, key, nbytes), position=position)
        if self._state_buf.size != nbytes:
            self._state_buf = np.empty(nbytes, dtype=np.uint8)

    # -- restores ---------------------------------------------------------------------
    def restore(self, store: HybridStore, plan: ResumePlan) -> float:
        """``store.load(plan)`` into a page-major batch (what an engine restores into: its
        staging buffer, not new tensors), timed; then a sample of its bytes is checked."""
        n = len(plan.pages)
        if self._batch.shape[0] < n or self._batch.shape[1] != self._page_bytes:
            self._batch = np.empty((max(n, 2 * self._batch.shape[0]), self._page_bytes), np.uint8)
        # what the GPU tier holds is resident: an engine reads only what must move
        resident = (store.index.page_columns(plan.pages)["tiers"] & TIER_BITS["device"]) != 0
        t0 = time.perf_counter()
        _, state = store.load(plan, into=(self._batch, self._state_buf),
                              skip_tiers=("device",)).result()
        seconds = time.perf_counter() - t0
        self._timed += 1
        self._seconds += seconds
        keys = plan.page_keys
        moved = np.flatnonzero(~resident).tolist()
        self._objects += len(moved) + (state is not None)
        m = len(moved)
        picks = sorted({moved[round(i * (m - 1) / (VERIFY_PAGES - 1))] for i in range(VERIFY_PAGES)}) if m else []
        for i in picks:
            self._verify(ObjectKind.PAGE, keys[i], self._batch[i])
        if state is not None:
            self._verify(ObjectKind.STATE, plan.state_key, state)
        return seconds

    def _verify(self, kind: ObjectKind, key16: bytes, got: Any) -> None:
        data = np.asarray(got).reshape(-1).view(np.uint8)
        want = pattern(kind, key16, data.size)
        if not np.array_equal(data, want):
            bad = int(np.flatnonzero(data != want)[0])
            raise CorruptObjectError(
                f"data-mode replay: the {kind.name.lower()} {key16.hex()} came back with other "
                f"bytes than were put (first difference at byte {bad} of {data.size}); the "
                "store or a tier returned wrong data", key=bytes((int(kind),)) + key16)
        self._verified["objects"] += 1
        self._verified["bytes"] += data.size

    # -- end of run -------------------------------------------------------------------
    def finish(self, store: HybridStore) -> dict[str, Any]:
        """What moved: bytes put and read per tier, disk files, checks, allocator refusals."""
        if self._disk is not None:
            self._disk.apply_deletes()
            self._disk.wait_writes()
        stats = store.stats()
        tiers = stats["tiers"]
        out: dict[str, Any] = {
            "restores_timed": self._timed, "restore_wall_s": self._seconds,
            "objects_loaded": self._objects,
            "bytes_read": dict(stats["loaded_bytes"]),
            "bytes_put": {name: int(t.get("bytes_in", t.get("bytes_written", 0)))
                          for name, t in tiers.items()},
            "verified_objects": self._verified["objects"], "verified_bytes": self._verified["bytes"],
            "physical_refusals": int(sum(t.get("physical_refusals", 0) for t in tiers.values())),
            "ram_mapped_bytes": int(sum(t.get("committed_bytes", 0) for n, t in tiers.items()
                                        if n != "disk")),
        }
        if self._disk is not None and self._dir is not None:
            d = tiers["disk"]
            files = [e for e in os.scandir(self._dir) if e.name.endswith(".dat")]
            out["disk"] = {"path": self._dir, "engine": d["engine"],
                           "objects": sum(1 for _ in self._disk.entries()),
                           "bytes_written": int(d["bytes_written"]), "bytes_read": int(d["bytes_read"]),
                           "segment_files": len(files),
                           "file_bytes": int(sum(e.stat().st_blocks * 512 for e in files))}
        return out

    def close(self) -> None:
        """Remove the disk tier's directory (the store has closed its tiers)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def data_planes(data_dir: str | None) -> Callable[[Preset], ObjectPlane]:
    """Data mode's planes: bytes for every preset with a budget, sizes for ``unlimited`` ones.

    A preset without a budget (``unlimited``) has no tier sizes for real bytes
    to fill; it runs in accounting mode, as the reference.

    Args:
        data_dir: parent of each run's disk-tier directory (:class:`DataObjects`).
    """
    def plane_for(p: Preset) -> ObjectPlane:
        if p.unlimited:
            return SizedObjects()
        return DataObjects(data_dir, label=p.name)

    return plane_for


def _check_fits(budgets: Sequence[TierBudget], data_dir: str | None) -> None:
    """Refuse budgets whose real bytes cannot fit this machine's memory or disk."""
    ram = sum(physical_bytes(b.capacity_bytes) for b in budgets if b.name != "disk")
    disk = sum(physical_bytes(b.capacity_bytes) for b in budgets if b.name == "disk")
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if ram > total_ram // 2:
        raise ConfigError(f"data mode would map {ram / 2**30:.1f} GiB of pools on a machine with "
                          f"{total_ram / 2**30:.1f} GiB of memory; raise --scale or lower the budgets")
    if disk:
        free = shutil.disk_usage(data_dir or tempfile.gettempdir()).free
        if disk > free // 2:
            raise ConfigError(f"data mode's disk tier may take {disk / 2**30:.1f} GiB and "
                              f"{data_dir or tempfile.gettempdir()} has {free / 2**30:.1f} GiB free; "
                              "raise --scale, lower --disk-gib or pass another --data-dir")
