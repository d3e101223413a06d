"""Several processes on one disk tier directory, killed at random: the shared-mode campaign.

``python -m tests.reliability.shared --procs 4 --kills 60 --seed 0`` starts ``--procs``
worker processes on one directory (``DiskTier(shared=True)``), each putting, reading and
deleting objects of a common key space (an object's bytes are a function of its key, so
any reader can check any object), evicting under the eviction lease when the
directory's budget is full.  The parent SIGKILLs a random worker every few hundred
milliseconds and starts a new one in its place (which takes the dead slot back), until
``--kills`` kills.  Then it stops the survivors and checks, through a fresh exclusive
open of the directory:

* every read any worker made returned exactly the object's bytes, or a typed miss
  (workers append each violation to a file the moment they see it, so a kill loses none);
* every object the catalog keeps reads back bit-exact, none was dropped on reopen;
* no two records overlap an extent, and the recorded segments stay within the budget.

It prints a JSON summary (and a line per check).  ``tests/reliability/test_shared.py``
runs a short form in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
SIZES = (4096, 10_000, 65_536, 200_000, 1_500_000)   # the last is past a 1 MiB segment
KEYS = 600


def key_of(i: int) -> bytes:
    return bytes([1]) + i.to_bytes(16, "little")


def payload(i: int) -> np.ndarray:
    """The bytes of object ``i`` (any process computes the same)."""
    n = SIZES[i % len(SIZES)]
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def worker(path: str, seed: int, capacity: int, out: str, stop_after: float) -> None:
    """One process: random puts, reads, deletes; violations appended to ``out``."""
    from hybridstore.backends.disk import DiskTier
    from hybridstore.errors import CapacityError, CorruptObjectError

    rng = random.Random(seed)
    tier = DiskTier(path, capacity, engine="posix", segment_bytes=MiB, io_threads=2,
                    shared=True, sync_interval_s=0.05)
    print("ready", flush=True)
    stats = dict(puts=0, reads=0, misses=0, deletes=0, full=0, moves=0)

    def violation(what: str) -> None:
        with open(out, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "slot": tier.shared.slot, "what": what})
                     + "\n")

    stopping = False

    def on_term(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    deadline = time.monotonic() + stop_after
    known: list[int] = []
    steps = 0
    while not stopping and time.monotonic() < deadline:
        steps += 1
        if steps % 25 == 1:
            known = [int.from_bytes(k[1:], "little") for k, _, _ in tier.entries()]
            Path(f"{out}.{os.getpid()}").write_text(json.dumps(stats))
        op = rng.random()
        i = rng.randrange(KEYS)
        if op < 0.45:
            data = payload(i)
            try:
                tier.put(key_of(i), data, nbytes=data.size).result()
                stats["puts"] += 1
            except CapacityError:
                stats["full"] += 1
                if (tier.free_bytes >= tier.charge(data.size) and rng.random() < 0.5
                        and tier.relocate_window(data.size, lambda _: True)):
                    stats["moves"] += 1         # compacted its own segments instead
                    continue
                with tier.shared.evict_lease():
                    tier.sync()
                    victims = [k for k, _, _ in tier.entries()]
                    rng.shuffle(victims)
                    tier.delete_many(victims[:max(1, len(victims) // 4)])
        elif op < 0.9:
            if known and rng.random() < 0.8:      # mostly objects that exist: reads race
                i = rng.choice(known)              # the others' deletes and reuse
            k = key_of(i)
            try:
                got = tier.get(k)
            except KeyError:
                stats["misses"] += 1
                continue
            except CorruptObjectError as e:
                violation(f"read of object {i} failed its checksum: {e}")
                continue
            stats["reads"] += 1
            want = payload(i)
            if got.size != want.size or not np.array_equal(got, want):
                violation(f"read of object {i} returned other bytes")
        else:
            stats["deletes"] += 1
            tier.delete(key_of(i))
    tier.close()
    Path(f"{out}.{os.getpid()}").write_text(json.dumps(stats))
    print(json.dumps(stats))


def check(path: str, capacity: int) -> dict[str, Any]:
    """Open the directory alone and check every object, extent and the budget."""
    from hybridstore.backends.catalog import Catalog
    from hybridstore.backends.disk import CATALOG_DIR, DiskTier

    with DiskTier(path, capacity, engine="posix", segment_bytes=MiB) as tier:
        st = tier.stats()
        bad = 0
        n = 0
        for k, nbytes, _ in tier.entries():
            i = int.from_bytes(k[1:], "little")
            got = tier.get(k)
            n += 1
            bad += int(not np.array_equal(got, payload(i)))
        dropped = st["recovery_dropped"]
    cat = Catalog(os.path.join(path, CATALOG_DIR))
    try:
        records = sorted((r.segment, r.offset, r.offset + r.slot_length) for _, r in cat.items())
        segments = cat.segments()
    finally:
        cat.close()
    overlaps = sum(1 for a, b in zip(records, records[1:]) if a[0] == b[0] and b[1] < a[2])
    return {"objects": n, "wrong_bytes": bad, "dropped_on_reopen": dropped,
            "overlaps": overlaps, "segment_bytes": sum(segments.values()),
            "within_budget": sum(segments.values()) <= capacity}


def campaign(procs: int, kills: int, seed: int, capacity: int = 24 * MiB,
             interval_s: float = 0.4, workdir: str | None = None,
             progress: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    root = Path(workdir or tempfile.mkdtemp(prefix="hs-shared-"))
    path = str(root / "disk")
    out = str(root / "violations.jsonl")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, str(Path(src).parent), env.get("PYTHONPATH", "")])

    def start(n: int) -> subprocess.Popen[str]:
        code = (f"from tests.reliability.shared import worker; "
                f"worker({path!r}, {seed * 1000 + n}, {capacity}, {out!r}, 600)")
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()          # "ready": its slot is taken; the kill timer starts
        return proc

    started = 0
    live = []
    for _ in range(procs):
        live.append(start(started))
        started += 1
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=kills, desc="kills", unit="kill")
    died = []
    t0 = time.monotonic()
    for _ in range(kills):
        time.sleep(interval_s * (0.5 + rng.random()))
        victim = rng.randrange(len(live))
        proc = live[victim]
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.returncode not in (-signal.SIGKILL, 0):
            died.append((proc.returncode, proc.stderr.read()[-2000:] if proc.stderr else ""))
        live[victim] = start(started)
        started += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    time.sleep(interval_s)
    totals: dict[str, int] = {}
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    for proc in live:
        stdout, stderr = proc.communicate(timeout=120)
        if proc.returncode != 0:
            died.append((proc.returncode, stderr[-2000:]))
            continue
        for k, v in json.loads(stdout.strip().splitlines()[-1]).items():
            totals[k] = totals.get(k, 0) + v
    violations = Path(out).read_text().splitlines() if os.path.exists(out) else []
    every: dict[str, int] = {}           # every worker's last counts, killed ones' too
    for f in root.glob("violations.jsonl.*"):
        for k, v in json.loads(f.read_text() or "{}").items():
            every[k] = every.get(k, 0) + v
    summary = {"procs": procs, "kills": kills, "started": started, "seconds": round(time.monotonic() - t0, 1),
               "survivor_ops": totals, "all_ops": every, "violations": len(violations),
               "violation_samples": violations[:5], "crashed": [c for c, _ in died],
               "crash_samples": [e for _, e in died[:2]], **check(path, capacity)}
    summary["ok"] = (not violations and not died and summary["wrong_bytes"] == 0
                     and summary["overlaps"] == 0 and summary["within_budget"]
                     and summary["dropped_on_reopen"] == 0)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.4, help="mean seconds between kills")
    args = ap.parse_args(argv)
    summary = campaign(args.procs, args.kills, args.seed, interval_s=args.interval)
    print(json.dumps(summary, indent=2))
    for name in ("violations", "wrong_bytes", "overlaps", "dropped_on_reopen"):
        print(f"{name:>20}: {summary[name]}")
    print(f"{'ok':>20}: {summary['ok']}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
