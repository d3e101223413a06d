"""A seeded fault harness: damage costs exactly the damaged objects, and the store serves
everything undamaged bit-exact (issue 13, "Harness and figures": faults).

Each round opens a :class:`~hybridstore.HybridStore` over a disk directory, puts prompts
(their pages and states are a pure function of their tokens: ``tests/reliability/crash.py``),
moves everything to the disk tier, injects one fault and then *settles*: it loads every
prompt (each load is either bit-exact or a typed error), forgets nothing else, and puts the
prompts that lost something again (an engine recomputes a miss), until every prompt loads
whole.  The objects that disappeared from the disk tier on the way (*lost*) must be exactly
the ones the fault damaged.  Faults:

=====================  ===============================================================
kind                   what is injected (``@running``: under the open store; ``@reopen``:
                       between a close and a reopen)
=====================  ===============================================================
``flip``               one byte flipped in the payload of 1-3 objects
``flip-padding``       one byte flipped in the slot padding of 1-3 objects (no loss)
``truncate``           a segment file cut at a random point (aligned or not)
``delete-segment``     a segment file unlinked (costs its objects at the next open)
``catalog-record``     1-2 catalog records damaged (garbage, version, cut, offsets,
                       lengths, segment, checksum, meta, a claim on another's slot)
``catalog-delete``     1-2 catalog records deleted
``catalog-info``       a layout or geometry record damaged (``@reopen``)
``eio-transient``      reads of 1-3 objects fail with EIO once or twice (no loss)
``eio-persistent``     reads of 1-3 objects fail until the range is written again
``short-read``         the POSIX engine's ``preadv`` returns short counts or an early
                       EOF, transiently or until rewritten (kvikio: the engine reports
                       a short read)
``write-eio``          writes fail with EIO / ENOSPC, fdatasync with EIO (nothing is
``write-enospc``       lost, nothing half stored: the objects stay where they were)
``fsync-eio``
``full-ext4``          a real full file system: a loop-mounted ext4 (and one whose
``full-ext4-nofalloc`` ``posix_fallocate`` is unsupported), a tmpfs of a few MiB, or an
``full-tmpfs``         explicit quota: ``disk_bytes`` far above the free space; every put
``full-quota``         succeeds, nothing half stored, a reopen is clean
=====================  ===============================================================

Loop and tmpfs mounts need root and ``/dev/loop-control``; without them those rounds are
skipped with the reason (``full-quota`` still runs).

Run ``python -m tests.reliability.faults --rounds 230 --seed 0 --json faults.json`` (ten
rounds of each kind; ``--engine kvikio`` for kvikio's compat mode, which needs
``libcuda.so.1``: ``tests/backends/fake_libcuda`` builds a stand-in); the test suite runs a
short form (``tests/reliability/test_faults.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from tests.reliability import injectors as inj
from tests.reliability.crash import (
    PAGE,
    POLICIES,
    B,
    loaded_exactly,
    prompt,
    put_prompt,
)

UNIVERSE = 256
"""Prompts of a damage round are drawn from ``prompt(0..UNIVERSE-1)``."""
FULL_UNIVERSE = 4096


@dataclass(frozen=True)
class Setup:
    """How much a round puts, and with which I/O engine.

    Attributes:
        fill: prompts put before a damage round's fault (40: a few hundred objects over
            two 1 MiB segments).
        full_puts: prompts put into a full file system (250: a few MiB of new objects,
            well past the free space left).
        full_free: bytes left free on a full file system (a filler file takes the rest),
            or the quota, drawn from this range.

        engine: the disk tier's ``disk_engine`` ("posix", or "kvikio" for its compat
            mode; kvikio needs ``libcuda.so.1``, the test suite's stand-in will do).
    """

    fill: int = 40
    full_puts: int = 250
    full_free: tuple[int, int] = (1 << 20, 5 << 19)
    engine: str = "posix"

DAMAGE = ("flip", "flip-padding", "truncate", "delete-segment", "catalog-record",
          "catalog-delete")
RUNNING_ONLY = ("eio-transient", "eio-persistent", "short-read", "write-eio", "write-enospc",
                "fsync-eio")
FULL = ("full-ext4", "full-ext4-nofalloc", "full-tmpfs", "full-quota")
KINDS = tuple([f"{k}@running" for k in DAMAGE + RUNNING_ONLY]
              + [f"{k}@reopen" for k in DAMAGE + ("catalog-info",)] + list(FULL))
"""Every round kind; rounds cycle through them."""


@dataclass
class Tally:
    """What the rounds did and found.

    ``checked`` counts objects loaded and compared bit-exact; ``lost`` and ``damaged`` count
    objects by round kind (they must be equal, object by object); ``typed`` the typed errors
    loads raised; ``disk_full`` the ENOSPC/EDQUOT a full round met (segments refused, writes
    refused, and under the quota every refused preallocation, the catalog's slack included).
    """

    rounds: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    damaged: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    checked: int = 0
    typed: Counter[str] = field(default_factory=Counter)
    disk_full: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)
    violations: Counter[str] = field(default_factory=Counter)

    def violate(self, kind: str, what: str) -> None:
        self.violations[f"{kind}: {what}"] += 1

    def compare(self, kind: str, lost: set[bytes], damaged: set[bytes], how: str = "") -> None:
        """Lost must be exactly the damaged objects (``how``: the fault's details)."""
        self.damaged[kind] += len(damaged)
        self.lost[kind] += len(lost)
        if lost - damaged:
            self.violate(kind, f"{len(lost - damaged)} undamaged objects lost {how}")
        if damaged - lost:
            self.violate(kind, f"{len(damaged - lost)} damaged objects kept {how}")

    def summary(self) -> dict[str, Any]:
        return {"rounds": sum(self.rounds.values()), "faults_injected": sum(self.faults.values()),
                "objects_damaged": sum(self.damaged.values()),
                "objects_lost": sum(self.lost.values()), "objects_checked_bit_exact": self.checked,
                "typed_errors": dict(self.typed), "disk_full_events": dict(self.disk_full),
                "by_kind": {k: {"rounds": self.rounds[k], "faults": self.faults[k],
                                "damaged": self.damaged[k], "lost": self.lost[k]}
                            for k in sorted(self.rounds)},
                "skipped": self.skipped,
                "violations": [f"{v} (x{n})" if n > 1 else v for v, n in self.violations.items()]}


def config(path: Path, policy: str, *, host_pages: int = 32, disk_bytes: int = 16 << 20,
           engine: str = "posix"):
    from hybridstore import StoreConfig

    # objects take 4 KiB slots on disk; host_pages of DRAM keep most of them on disk only
    return StoreConfig(block_size=B, host_bytes=host_pages * PAGE, disk_path=str(path),
                       disk_bytes=disk_bytes, disk_segment_bytes=1 << 20, tier_policy=policy,
                       disk_engine=engine)


def disk_keys(store: Any) -> set[bytes]:
    return {bytes(k) for k, _, _ in store.tiers["disk"].entries()}


def sweep(store: Any, js: Iterable[int], tally: Tally, kind: str) -> list[int]:
    """Load every prompt ``j`` of ``js``; returns those that did not load whole.

    Each load is bit-exact or a typed error (anything else is a violation)."""
    from hybridstore.errors import HybridStoreError

    short = []
    for j in dict.fromkeys(js):
        tokens = prompt(j)
        plan = store.match(tokens)
        try:
            if plan.position:
                try:
                    pages, state = store.load(plan).result()
                except HybridStoreError as e:
                    tally.typed[type(e).__name__] += 1
                    short.append(j)
                    continue
                except Exception as e:  # noqa: BLE001 - the harness reports it
                    tally.violate(kind, f"untyped {type(e).__name__} from load: {e}")
                    short.append(j)
                    continue
                if not loaded_exactly(tokens, plan.position, pages, state):
                    tally.violate(kind, f"wrong bytes loaded for prompt {j}")
                tally.checked += len(pages) + 1
            if plan.position < len(tokens):
                short.append(j)
        finally:
            store.release(plan)
    return short


def settle(store: Any, js: list[int], before: set[bytes], tally: Tally, kind: str, *,
           reput: bool = True, how: str = "") -> set[bytes]:
    """Sweep, put what was lost again, repeat until every prompt loads whole; returns the
    objects of ``before`` that left the disk tier on the way."""
    lost: set[bytes] = set()
    for _ in range(8):
        store.flush()
        store.evict(1 << 40, "host")              # every load reads the disk tier
        short = sweep(store, js, tally, kind)
        lost |= before - disk_keys(store)
        if not short or not reput:
            break
        for j in short:
            put_prompt(store, prompt(j))
    else:
        tally.violate(kind, f"{len(short)} prompts never loaded whole {how}")
    if not store.index.check_refcounts():
        tally.violate(kind, f"index refcounts are off {how}")
    return lost


def fill(store: Any, js: list[int]) -> None:
    for j in js:
        put_prompt(store, prompt(j))
    store.flush()
    store.evict(1 << 40, "host")


def reopen(cfg: Any, tally: Tally, kind: str) -> Any:
    from hybridstore import HybridStore

    try:
        return HybridStore(cfg)
    except Exception as e:
        tally.violate(kind, f"reopen failed: {type(e).__name__}: {e}")
        raise


# -- damage rounds --------------------------------------------------------------------
def inject_files(kind: str, path: Path, recs: inj.Records, rng: Random,
                 store: Any = None) -> inj.Fault:
    """A file or catalog fault (``store``: through the running store's catalog)."""
    fault = inj.Fault(kind)
    if kind in ("flip", "flip-padding"):
        fault.running = inj.flip(path, recs, rng, rng.randint(1, 3), kind == "flip-padding")
    elif kind == "truncate":
        fault.running = inj.truncate(path, recs, rng)
    elif kind == "delete-segment":     # the open file stays readable until the store closes
        seg = fault.detail["segment"] = inj.delete_segment(path, recs, rng)
        fault.reopen = {k for k, r in recs.items() if r.segment == seg}
    elif kind == "catalog-record":
        fault.reopen, ways = inj.damage_records(path, recs, rng, rng.randint(1, 2), store)
        fault.detail.update(ways)
    elif kind == "catalog-delete":
        fault.reopen = inj.delete_records(path, recs, rng, rng.randint(1, 2), store)
    elif kind == "catalog-info":
        name, fault.reopen = inj.damage_info(path, recs, rng)
        fault.detail[name] += 1
    if store is None:       # between runs, everything damaged is lost at the reopen
        fault.reopen |= fault.running
        fault.running = set()
    return fault


def inject_engine(kind: str, store: Any, recs: inj.Records, rng: Random,
                  stack: contextlib.ExitStack) -> inj.Fault:
    """An I/O fault in the disk tier's engine, removed when ``stack`` closes."""
    import errno

    tier = store.tiers["disk"]
    fault = inj.Fault(kind)
    engine = inj.FaultyEngine(tier)
    stack.callback(engine.remove)
    targets = rng.sample(sorted(recs), min(rng.randint(1, 3), len(recs)))
    if kind in ("eio-transient", "eio-persistent"):
        left = rng.randint(1, 2) if kind == "eio-transient" else None
        for key in targets:
            rec = recs[key]
            engine.faults.append(inj.EngineFault("read", rec.segment, rec.offset,
                                                 rec.offset + rec.length, left=left))
        if left is None:
            fault.running = set(targets)
    elif kind == "short-read":
        eof, left = rng.random() < 0.5, rng.choice([1, 2, None])
        ranges = [(recs[k].segment, recs[k].offset, recs[k].offset + recs[k].length)
                  for k in targets]
        if engine.name.startswith("posix"):       # the OS returns short counts
            stack.enter_context(inj.short_preadv(tier, ranges, eof=eof, left=left))
        else:                                       # the engine reports a short read
            eof = True
            engine.faults += [inj.EngineFault("read", *r, short=True, left=left) for r in ranges]
        fault.detail["eof" if eof else "partial"] += 1
        if eof and left is None:
            fault.running = set(targets)
    else:
        op, code = {"write-eio": ("write", errno.EIO), "write-enospc": ("write", errno.ENOSPC),
                    "fsync-eio": ("fsync", errno.EIO)}[kind]
        engine.faults.append(inj.EngineFault(op, -1, 0, 1 << 62, errno_=code,
                                             left=rng.randint(1, 6)))
    fault.detail["engine"] = 1
    return fault


def damage_round(root: Path, kind: str, rng: Random, tally: Tally, setup: Setup) -> None:
    """One damage round (see the module docstring)."""
    from hybridstore import HybridStore

    what, when = kind.split("@")
    path = root / f"{what}-{when}-{sum(tally.rounds.values())}"
    cfg = config(path, rng.choice(POLICIES), engine=setup.engine)
    js = rng.sample(range(UNIVERSE), setup.fill)
    store = HybridStore(cfg)
    try:
        fill(store, js)
        if when == "reopen":
            store.close()
            recs = inj.records(path)
            fault = inject_files(what, path, recs, rng)
            store = reopen(cfg, tally, kind)
            tally.compare(kind, settle(store, js, set(recs), tally, kind, how=fault.how()),
                          fault.reopen, fault.how())
        else:
            recs = inj.records(path, store)
            with contextlib.ExitStack() as stack:
                if what in RUNNING_ONLY:
                    fault = inject_engine(what, store, recs, rng, stack)
                    if what.startswith(("write", "fsync")):     # puts meet the failing writes
                        more = rng.sample(range(UNIVERSE), setup.fill // 2)
                        try:
                            fill(store, more)
                        except Exception as e:  # noqa: BLE001 - the harness reports it
                            tally.violate(kind, f"a put raised {type(e).__name__}: {e}")
                        js += more
                else:
                    fault = inject_files(what, path, recs, rng, store)
                lost = settle(store, js, set(recs), tally, kind, how=fault.how())
            tally.compare(kind, lost, fault.running, fault.how())
            store.close()
            recs = inj.records(path)
            if what == "delete-segment":
                fault.reopen = {k for k, r in recs.items() if r.segment == fault.detail["segment"]}
            store = reopen(cfg, tally, kind)
            tally.compare(kind + "/reopen",
                          settle(store, js, set(recs), tally, kind, how=fault.how()),
                          fault.reopen & set(recs), fault.how())
        tally.faults[kind] += 1
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


# -- full file systems ----------------------------------------------------------------
def full_round(root: Path, kind: str, rng: Random, tally: Tally, setup: Setup) -> None:
    """Fill a small real file system (or an explicit quota) with a store whose budget is
    far above it: every put succeeds, whatever is on disk loads bit-exact, and a reopen
    finds exactly what was there, with nothing half stored."""
    from hybridstore import HybridStore

    base = root / f"{kind}-{sum(tally.rounds.values())}"
    base.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        if kind == "full-quota":
            mnt = base / "q"
            mnt.mkdir()
            refused = stack.enter_context(inj.quota(mnt, rng.randrange(*setup.full_free)))
        else:
            reason = inj.mount_refusal()
            if reason is not None:
                tally.skipped[kind] = reason
                return
            fs = "tmpfs" if kind == "full-tmpfs" else "ext4"
            mnt = stack.enter_context(inj.mounted(base, fs, (4 if fs == "tmpfs" else 8) << 20))
            refused = Counter()
        if kind == "full-ext4-nofalloc":
            stack.enter_context(inj.no_fallocate())
        cfg = config(mnt / "hs", rng.choice(POLICIES), host_pages=64, disk_bytes=256 << 20,
                     engine=setup.engine)
        store = HybridStore(cfg)
        stack.callback(store.close)
        tier = store.tiers["disk"]
        engine = inj.FaultyEngine(tier)         # no faults: counts ENOSPC from the real engine
        full = Counter()
        _count_disk_full(tier, full)
        if kind != "full-quota":          # little room left for segments and catalog
            _filler(mnt, rng.randrange(*setup.full_free) + rng.randrange(64 << 10))
        js = []
        for _ in range(setup.full_puts):
            j = rng.randrange(FULL_UNIVERSE)
            try:
                put_prompt(store, prompt(j))
            except Exception as e:  # noqa: BLE001 - the harness reports it
                tally.violate(kind, f"a put raised {type(e).__name__}: {e}")
            js.append(j)
            if rng.random() < 0.1:
                store.flush()
        store.flush()
        store.evict(1 << 40, "host")              # spills (write-back) land before `before`
        store.flush()
        events = sum(full.values()) + sum(refused.values()) + engine.errors["ENOSPC"]
        tally.disk_full[kind] += events
        if not events:
            tally.violate(kind, "the file system never filled (no ENOSPC/EDQUOT)")
        before = disk_keys(store)
        tally.compare(kind, settle(store, js, before, tally, kind, reput=False), set())
        at_close = disk_keys(store)
        store.close()
        recs = inj.records(mnt / "hs")
        if set(recs) != at_close:
            tally.violate(kind, f"the catalog lists {len(recs)} objects, the tier held "
                                f"{len(at_close)}")
        store = reopen(cfg, tally, kind)
        stack.callback(store.close)
        dropped = store.tiers["disk"].stats()["recovery_dropped"]
        if dropped:
            tally.violate(kind, f"{dropped} catalog entries pointed at unwritten bytes")
        tally.compare(kind + "/reopen", settle(store, js, set(recs), tally, kind, reput=False),
                      set())
        tally.faults[kind] += 1


def _count_disk_full(tier: Any, full: Counter[str]) -> None:
    """Count the DiskFullErrors the tier's segment creation and growth raise."""
    from hybridstore.errors import DiskFullError

    alloc = tier._alloc
    create, grow = alloc._on_new_arena, alloc._on_grow_arena

    def on_new_arena(arena: int, nbytes: int) -> None:
        try:
            create(arena, nbytes)
        except DiskFullError:
            full["segment"] += 1
            raise

    def on_grow_arena(arena: int, limit: int, need: int, size: int) -> int:
        try:
            return int(grow(arena, limit, need, size))
        except DiskFullError:
            full["growth"] += 1
            raise

    alloc._on_new_arena = on_new_arena
    alloc._on_grow_arena = on_grow_arena


def _filler(mnt: Path, leave: int) -> None:
    """A file that leaves only ``leave`` bytes free."""
    n = inj.free_bytes(mnt) - leave
    if n > 0:
        with open(mnt / "filler", "wb") as fh:
            fh.truncate(0)
            fh.write(b"\0" * n)


# -- the harness ----------------------------------------------------------------------
ROUNDS: dict[str, Callable[[Path, str, Random, Tally, Setup], None]] = {
    kind: (full_round if kind in FULL else damage_round) for kind in KINDS}


def harness(root: Path, rounds: int, seed: int = 0, kinds: Iterable[str] = KINDS,
            setup: Setup = Setup(), progress: bool = False) -> Tally:
    """``rounds`` rounds cycling through ``kinds``; returns what they did and found."""
    kinds = list(kinds)
    rng = Random(seed)
    tally = Tally()
    order = [kinds[i % len(kinds)] for i in range(rounds)]
    if progress:
        from tqdm import tqdm

        order = tqdm(order, desc="fault rounds", unit="round")
    for kind in order:
        if kind in tally.skipped:
            continue
        try:
            ROUNDS[kind](root, kind, Random(rng.randrange(1 << 30)), tally, setup)
        except Exception as e:  # noqa: BLE001 - the harness reports it and goes on
            tally.violate(kind, f"round failed: {type(e).__name__}: {e}")
        tally.rounds[kind] += 1
    return tally


def table(summary: dict[str, Any]) -> str:
    rows = [f"{'kind':28} {'rounds':>6} {'faults':>6} {'damaged':>7} {'lost':>6}"]
    for kind, row in summary["by_kind"].items():
        rows.append(f"{kind:28} {row['rounds']:>6} {row['faults']:>6} {row['damaged']:>7} "
                    f"{row['lost']:>6}")
    rows.append(f"faults injected {summary['faults_injected']}, objects checked bit-exact "
                f"{summary['objects_checked_bit_exact']}, damaged {summary['objects_damaged']}, "
                f"lost {summary['objects_lost']}, typed errors {summary['typed_errors']}, "
                f"disk-full events {summary['disk_full_events']}, "
                f"violations {len(summary['violations'])}")
    for kind, reason in summary["skipped"].items():
        rows.append(f"skipped {kind}: {reason}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=len(KINDS) * 10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated round kinds")
    parser.add_argument("--engine", default="posix", choices=("posix", "kvikio"))
    parser.add_argument("--dir", default=None, help="scratch directory (a new temporary one)")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args()
    import logging

    logging.getLogger("hybridstore").setLevel(logging.ERROR)   # drops are expected here
    root = Path(args.dir or tempfile.mkdtemp(prefix="hs-faults-"))
    tally = harness(root, args.rounds, args.seed, args.kinds.split(","),
                    Setup(engine=args.engine), progress=True)
    summary = tally.summary()
    print(table(summary), file=sys.stderr)
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
