"""Fault injectors of the fault harness (``tests/reliability/faults.py``).

Each injector damages one thing and says exactly which objects it damaged, so that the
harness can check that the store loses those and nothing else:

* :class:`FaultyEngine` wraps the I/O engine a :class:`~hybridstore.backends.disk.DiskTier`
  uses: reads, writes or ``fdatasync`` touching chosen ranges fail (``EIO``, short reads,
  ``ENOSPC``), a given number of times (transient) or until the range is written again
  (persistent: a bad sector the drive remaps on the next write);
* :func:`short_preadv` makes the POSIX engine's ``preadv`` calls return short counts (a
  partial read it must continue, or an early end of file);
* :func:`flip`, :func:`truncate`, :func:`delete_segment` damage segment files;
* :func:`damage_records`, :func:`delete_records`, :func:`damage_info` damage the lmdb
  catalog (through the running store's handle, or the closed directory's);
* :func:`mounted` mounts a small loop ext4 or a tmpfs where the machine allows it
  (:func:`mount_refusal` says why not), :func:`quota` imposes an explicit byte quota on
  segment preallocation otherwise, :func:`no_fallocate` makes ``posix_fallocate``
  unsupported (a file system without it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from hybridstore.backends.catalog import Catalog, CatalogRecord
from hybridstore.backends.disk import CATALOG_DIR, segment_name
from hybridstore.backends.engines import round_up
from hybridstore.errors import BackendIOError

Records = dict[bytes, CatalogRecord]


# -- engine faults --------------------------------------------------------------------
@dataclass
class EngineFault:
    """Operations ``op`` ("read", "write", "fsync") on ``[start, end)`` of ``segment``
    (-1: any) fail with ``errno_`` (``short``: a read that moved half its bytes), ``left``
    more times (``None``: until the range is written again)."""

    op: str
    segment: int
    start: int
    end: int
    errno_: int = errno.EIO
    short: bool = False
    left: int | None = 1
    hits: int = 0

    def error(self, offset: int, nbytes: int) -> BackendIOError:
        if self.short:
            return BackendIOError(f"injected short {self.op} of {nbytes} bytes at offset {offset}",
                                  offset=offset, expected=nbytes, got=nbytes // 2)
        cause = OSError(self.errno_, os.strerror(self.errno_))
        err = BackendIOError(f"injected {self.op} of {nbytes} bytes at offset {offset} failed: "
                             f"{cause.strerror}", offset=offset, expected=nbytes, got=0)
        err.__cause__ = cause
        return err


class FaultyEngine:
    """A disk tier's engine with :class:`EngineFault` s injected (installed on the tier)."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.inner = tier._engine
        self.faults: list[EngineFault] = []
        self.errors: Counter[str] = Counter()
        """Errors the real engine raised through this wrapper, by errno name."""
        self._lock = threading.Lock()
        tier._engine = self

    def remove(self) -> None:
        """Give the tier its engine back."""
        self.tier._engine = self.inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _segment(self, file: Any) -> int | None:
        for seg, handle in list(self.tier._files.items()):
            if handle is file:
                return int(seg)
        return None

    def _check(self, op: str, file: Any, nbytes: int, offset: int) -> None:
        seg = self._segment(file)
        with self._lock:
            if op == "write":      # a written range is remapped: its read faults heal
                self.faults = [f for f in self.faults if not (
                    f.op == "read" and f.left is None and f.segment == seg
                    and offset <= f.start and f.end <= offset + nbytes)]
            hits = [f for f in self.faults
                    if f.op == op and f.left != 0 and f.segment in (seg, -1)
                    and (op == "fsync" or (offset < f.end and f.start < offset + nbytes))]
            for f in hits:        # one failed I/O counts for every bad range it touched
                if f.left is not None:
                    f.left -= 1
                f.hits += 1
        if hits:
            raise hits[0].error(offset, nbytes)

    def _count(self, call: Callable[[], Any]) -> Any:
        """Run an engine call, counting the errors it raises by errno (ENOSPC, EIO, ...)."""
        try:
            return call()
        except BackendIOError as e:
            cause = e.__cause__
            self.errors[errno.errorcode.get(getattr(cause, "errno", None) or 0, "other")] += 1
            raise

    def read(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        self._check("read", file, nbytes, offset)
        return int(self._count(lambda: self.inner.read(file, buf, nbytes, offset)))

    def pread(self, file: Any, buf: Any, nbytes: int, offset: int) -> Any:
        self._check("read", file, nbytes, offset)
        return self.inner.pread(file, buf, nbytes, offset)

    def pread_stream(self, file: Any, buf: Any, nbytes: int, offset: int,
                     piece_bytes: int | None = None) -> Any:
        self._check("read", file, nbytes, offset)
        return self.inner.pread_stream(file, buf, nbytes, offset, piece_bytes)

    def write(self, file: Any, buf: Any, nbytes: int, offset: int) -> int:
        self._check("write", file, nbytes, offset)
        return int(self._count(lambda: self.inner.write(file, buf, nbytes, offset)))

    def pwrite(self, file: Any, buf: Any, nbytes: int, offset: int) -> Any:
        self._check("write", file, nbytes, offset)
        return self.inner.pwrite(file, buf, nbytes, offset)

    def fsync(self, file: Any) -> None:
        self._check("fsync", file, 0, 0)
        self.inner.fsync(file)


@contextlib.contextmanager
def short_preadv(tier: Any, ranges: list[tuple[int, int, int]], *, eof: bool,
                 left: int | None) -> Iterator[Counter[str]]:
    """The POSIX engine's ``preadv`` on any ``(segment, start, end)`` of ``ranges`` returns
    half of what was asked (``eof``: nothing, an early end of file), ``left`` times per
    range (``None``: until the range is written again).  Yields a counter of the short
    reads made."""
    from hybridstore.backends.engines import posix

    real = os.preadv
    made: Counter[str] = Counter()
    remaining = [left] * len(ranges)

    def touched(fd: int, offset: int, n: int, whole: bool) -> list[int]:
        """The ranges an I/O touches (``whole``: covers)."""
        out = []
        for i, (segment, start, end) in enumerate(ranges):
            handle = tier._files.get(segment)
            if handle is None or getattr(handle, "fd", None) != fd:
                continue
            if (offset <= start and end <= offset + n) if whole else (
                    offset < end and start < offset + n):
                out.append(i)
        return out

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        want = sum(len(b) for b in buffers)
        hit = [i for i in touched(fd, offset, want, whole=False) if remaining[i] != 0]
        if hit and want > 1:
            for i in hit:          # one short read counts for every range it touched
                if remaining[i] is not None:
                    remaining[i] -= 1
            made["eof" if eof else "partial"] += 1
            if eof:
                return 0
            half = round_up(want // 2) if want > 8192 else want // 2
            return real(fd, [buffers[0][:half]], offset)
        return real(fd, buffers, offset)

    def pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        for i in touched(fd, offset, sum(len(b) for b in buffers), whole=True):
            remaining[i] = 0                  # rewritten: the range reads back whole again
        return os.pwritev(fd, buffers, offset)

    class _Os:
        def __getattr__(self, name: str) -> Any:
            return {"preadv": preadv, "pwritev": pwritev}.get(name) or getattr(os, name)

    saved = posix.os
    posix.os = _Os()  # type: ignore[assignment]
    try:
        yield made
    finally:
        posix.os = saved


# -- file damage ----------------------------------------------------------------------
def records(path: Path, store: Any = None) -> Records:
    """Every catalog record of a disk directory (through the running store, or opened)."""
    damaged: list[tuple[bytes, str]] = []     # records that no longer decode are left out
    if store is not None:
        return dict(store.tiers["disk"].catalog.items(damaged))
    cat = Catalog(path / CATALOG_DIR)
    try:
        return dict(cat.items(damaged))
    finally:
        cat.close()


def flip(path: Path, recs: Records, rng: Random, n: int, padding: bool) -> set[bytes]:
    """Flip one byte in each of ``n`` objects' payloads (``padding``: in their slot padding
    instead, which no checksum covers and no load returns); returns the objects damaged."""
    keys = rng.sample(sorted(recs), min(n, len(recs)))
    damaged = set()
    for key in keys:
        rec = recs[key]
        if padding:
            room = round_up(rec.length) - rec.length
            if not room:
                continue
            at = rec.offset + rec.length + rng.randrange(room)
        else:
            at = rec.offset + rng.randrange(rec.length)
            damaged.add(key)
        with open(path / segment_name(rec.segment), "r+b") as fh:
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ rng.randrange(1, 256)]))
    return damaged


def truncate(path: Path, recs: Records, rng: Random) -> set[bytes]:
    """Cut a segment file at a random point (4 KiB aligned or not) at or before its last
    object's end; returns the objects whose payload lost bytes."""
    seg = rng.choice(sorted({r.segment for r in recs.values()}))
    mine = {k: r for k, r in recs.items() if r.segment == seg}
    end = max(r.offset + r.length for r in mine.values())
    at = rng.randrange(end + 1)
    if rng.random() < 0.5:
        at -= at % 4096
    os.truncate(path / segment_name(seg), at)
    return {k for k, r in mine.items() if r.offset + r.length > at}


def delete_segment(path: Path, recs: Records, rng: Random) -> int:
    """Unlink a segment file that holds objects; returns its id."""
    seg = rng.choice(sorted({r.segment for r in recs.values()}))
    os.unlink(path / segment_name(seg))
    return seg


RECORD_DAMAGE = ("garbage", "version", "cut", "offset-past-end", "misaligned", "length",
                 "no-segment", "checksum", "meta", "overlap")


def _damaged_record(kind: str, rec: CatalogRecord, other: CatalogRecord, rng: Random) -> bytes:
    raw = rec.pack()
    if kind == "garbage":
        return rng.randbytes(rng.randrange(0, 64))
    if kind == "version":
        return bytes([rng.choice([0, 2, 7, 255])]) + raw[1:]
    if kind == "cut":
        return raw[:rng.randrange(0, 40)]
    fields: dict[str, Any] = {"segment": rec.segment, "offset": rec.offset,
                              "length": rec.length, "slot_length": rec.slot_length,
                              "checksum": rec.checksum, "meta": rec.meta}
    if kind == "offset-past-end":
        fields["offset"] = rng.choice([1 << 40, 1 << 62, 2**64 - 4096])
    elif kind == "misaligned":
        fields["offset"] = rec.offset + rng.randrange(1, 4096)
    elif kind == "length":
        fields["length"] = rng.choice([0, rec.slot_length + 1, 2**63, rec.length - 1])
    elif kind == "no-segment":
        fields["segment"] = 900_000 + rng.randrange(1000)
    elif kind == "checksum":
        fields["checksum"] = rec.checksum ^ (1 << rng.randrange(64))
    elif kind == "meta":
        fields["meta"] = rng.choice([b"", rng.randbytes(rng.randrange(1, 40)),
                                     rec.meta[:rng.randrange(len(rec.meta))]])
    elif kind == "overlap":          # claims another object's slot
        fields.update(segment=other.segment, offset=other.offset, slot_length=other.slot_length,
                      length=min(rec.length, other.slot_length))
    return CatalogRecord(**fields).pack()


def _catalog_write(path: Path, store: Any, body: Callable[[Catalog, Any], None]) -> None:
    if store is not None:
        cat = store.tiers["disk"].catalog
        cat._write(lambda txn: body(cat, txn))
        return
    cat = Catalog(path / CATALOG_DIR)
    try:
        cat._write(lambda txn: body(cat, txn))
    finally:
        cat.close()


def damage_records(path: Path, recs: Records, rng: Random, n: int,
                   store: Any = None) -> tuple[set[bytes], Counter[str]]:
    """Damage ``n`` catalog records, each in one of :data:`RECORD_DAMAGE`'s ways; returns
    the objects damaged and the ways used."""
    keys = rng.sample(sorted(recs), min(n, len(recs)))
    ways: Counter[str] = Counter()
    raws = {}
    for key in keys:
        way = rng.choice(RECORD_DAMAGE)
        others = [k for k in recs if k != key]
        other = recs[rng.choice(others)] if others else recs[key]
        raws[key] = _damaged_record(way, recs[key], other, rng)
        ways[way] += 1

    def body(cat: Catalog, txn: Any) -> None:
        for key, raw in raws.items():
            txn.put(key, raw, db=cat._objects)

    _catalog_write(path, store, body)
    return set(keys), ways


def delete_records(path: Path, recs: Records, rng: Random, n: int,
                   store: Any = None) -> set[bytes]:
    """Delete ``n`` catalog records; returns their keys."""
    keys = rng.sample(sorted(recs), min(n, len(recs)))

    def body(cat: Catalog, txn: Any) -> None:
        for key in keys:
            txn.delete(key, db=cat._objects)

    _catalog_write(path, store, body)
    return set(keys)


INFO_DAMAGE = ("layout.page", "layout.state", "disk.geometry")


def damage_info(path: Path, recs: Records, rng: Random) -> tuple[str, set[bytes]]:
    """Damage one info blob of a closed directory; returns its name and the objects it
    costs (a layout: every object of its kind; the geometry: none, it is recomputed)."""
    from hybridstore.objects import ObjectKind, key_kind

    name = rng.choice(INFO_DAMAGE)
    raw = rng.choice([b"", b"{", rng.randbytes(rng.randrange(1, 24))])

    def body(cat: Catalog, txn: Any) -> None:
        txn.put(b"info:" + name.encode(), raw, db=cat._meta)

    _catalog_write(path, None, body)
    if name == "disk.geometry":
        return name, set()
    kind = ObjectKind.PAGE if name == "layout.page" else ObjectKind.STATE
    return name, {k for k in recs if key_kind(k) == kind}


# -- full file systems ----------------------------------------------------------------
_REFUSAL: list[str | None] = []


def mount_refusal() -> str | None:
    """Why this machine cannot mount a loop ext4 and a tmpfs (``None``: it can; checked
    once, by mounting a tiny image)."""
    if _REFUSAL:
        return _REFUSAL[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "not root"
    elif not os.path.exists("/dev/loop-control"):
        reason = "no /dev/loop-control"
    elif not (shutil.which("mkfs.ext4") and shutil.which("mount") and shutil.which("umount")):
        reason = "mkfs.ext4/mount/umount not installed"
    else:
        with tempfile.TemporaryDirectory(prefix="hs-mount-") as tmp:
            try:
                with mounted(Path(tmp), "ext4", 2 << 20):
                    pass
            except (OSError, subprocess.SubprocessError) as e:
                reason = f"a loop mount failed: {e}"
    _REFUSAL.append(reason)
    return reason


@contextlib.contextmanager
def mounted(root: Path, fs: str, nbytes: int) -> Iterator[Path]:
    """A fresh file system of ``nbytes`` at ``root/mnt`` (``fs``: "ext4" on a loop device
    or "tmpfs"); unmounted after."""
    mnt = root / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    if fs == "ext4":
        image = root / "fs.img"
        with open(image, "wb") as fh:
            fh.truncate(nbytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True,
                       capture_output=True, timeout=60)
        cmd = ["mount", "-o", "loop", str(image), str(mnt)]
    else:
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(mnt)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True, timeout=60)
        if fs == "ext4":
            (root / "fs.img").unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _used(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


@contextlib.contextmanager
def quota(path: Path, limit: int) -> Iterator[Counter[str]]:
    """An explicit quota: preallocating a segment under ``path`` past ``limit`` bytes in
    use fails with ``EDQUOT`` (for machines that cannot mount a small file system)."""
    real = os.posix_fallocate
    refused: Counter[str] = Counter()

    def posix_fallocate(fd: int, offset: int, nbytes: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(str(path)):
            have = os.fstat(fd).st_blocks * 512
            if _used(path) - have + offset + nbytes > limit:
                refused["EDQUOT"] += 1
                raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real(fd, offset, nbytes)

    os.posix_fallocate = posix_fallocate
    try:
        yield refused
    finally:
        os.posix_fallocate = real


@contextlib.contextmanager
def no_fallocate() -> Iterator[None]:
    """``posix_fallocate`` is unsupported (``EOPNOTSUPP``), as on a file system without it."""
    real = os.posix_fallocate

    def refuse(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    os.posix_fallocate = refuse
    try:
        yield
    finally:
        os.posix_fallocate = real


@dataclass
class Fault:
    """What one injection did: its kind and the objects it damaged (while the store ran,
    and at its reopen)."""

    kind: str
    running: set[bytes] = field(default_factory=set)
    reopen: set[bytes] = field(default_factory=set)
    detail: Counter[str] = field(default_factory=Counter)

    def how(self) -> str:
        """The fault's details, for a report."""
        return "(" + ", ".join(sorted(self.detail)) + ")" if self.detail else ""
