"""A seeded SIGKILL harness: a store process killed at random points keeps every object
bit-exact, and every prompt it flushed (issue 13, "Harness and figures").

A *child* process opens a :class:`~hybridstore.HybridStore` over one disk directory and
puts prompts from a fixed universe (prompt ``j`` shares a prefix with prompt ``j // 2``),
evicts, flushes and journals each prompt it flushed; the *parent* kills it with SIGKILL
after a random delay (sometimes while it is still recovering), then reopens the directory
and checks:

* **bit-exact**: every prompt that matches loads exactly the bytes its pages and state
  were put with (they are a pure function of the tokens, so nothing needs recording);
* **kept**: under write-through with no disk eviction, every journaled (flushed) prompt
  resumes at its end.

Every tier policy is exercised, and in half of the runs the child also evicts from the
disk tier under a small disk budget, so extents are freed and reused while it is killed.

Run the full harness with ``python -m tests.reliability.crash --kills 200``; the test suite
runs a short form (``tests/reliability/test_crash.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

B = 16
PAGE = 2048
UNIVERSE = 64
POLICIES = ("write-through", "write-back", "partition", "asymmetric")


def prompt(j: int) -> np.ndarray:
    """Prompt ``j``: prompt ``j // 2``'s tokens, then 1-3 pages of its own."""
    own = np.random.default_rng(10_000 + j).integers(1, 50_000, B * (1 + j % 3), dtype=np.int64)
    return own if j == 0 else np.concatenate([prompt(j // 2), own])


def _rng(tokens: np.ndarray, tag: bytes) -> np.random.Generator:
    digest = hashlib.blake2b(tokens.astype("<i8").tobytes() + tag, digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def page_bytes(tokens: np.ndarray, block: int) -> np.ndarray:
    """The page of ``block``: a function of the tokens up to its end only."""
    return _rng(tokens[:(block + 1) * B], b"page").integers(0, 256, PAGE, dtype=np.uint8)


def state_bytes(tokens: np.ndarray) -> np.ndarray:
    return _rng(tokens, b"state").integers(0, 256, 640, dtype=np.uint8)


def put_prompt(store, tokens: np.ndarray) -> None:
    """Put every page of a prompt and its state at its end."""
    store.put_kv(tokens, [page_bytes(tokens, k) for k in range(len(tokens) // B)])
    store.put_state(tokens, state_bytes(tokens))


def loaded_exactly(tokens: np.ndarray, position: int, pages, state) -> bool:
    """Whether a load of a plan of ``tokens`` resuming at ``position`` returned exactly the
    bytes its pages and state were put with (``state`` None: a plan of pages only)."""
    return (all(np.array_equal(got, page_bytes(tokens, k)) for k, got in enumerate(pages))
            and (state is None or np.array_equal(state, state_bytes(tokens[:position]))))


@dataclass(frozen=True)
class Run:
    """One child run: its seed, tier policy and whether it evicts from the disk tier."""

    seed: int
    tier_policy: str
    disk_evict: bool

    def config(self, path: str):
        from hybridstore import StoreConfig

        # a disk object takes a 4 KiB slot: 128 slots force eviction and extent reuse
        return StoreConfig(block_size=B, host_bytes=96 * PAGE, disk_path=path,
                           disk_bytes=(128 if self.disk_evict else 4096) * 4096,
                           disk_segment_bytes=1 << 20, tier_policy=self.tier_policy)


def child(path: str, run: Run, journal: str) -> None:
    """Put prompts until killed; journal each prompt once a flush covered it."""
    from hybridstore import HybridStore

    rng = random.Random(run.seed)
    print("opening", flush=True)
    with HybridStore(run.config(path)) as store, open(journal, "a") as log:
        print("ready", flush=True)
        pending: list[int] = []
        while True:
            j = rng.randrange(UNIVERSE)
            put_prompt(store, prompt(j))
            pending.append(j)
            r = rng.random()
            if r < 0.1:
                store.evict(rng.randrange(1, 32) * PAGE, "host")
            elif r < 0.2 and run.disk_evict:
                store.evict(rng.randrange(1, 32) * PAGE, "disk")
            elif r < 0.4:
                store.flush()
                log.write("".join(f"{p}\n" for p in pending))
                log.flush()
                os.fsync(log.fileno())
                pending.clear()


def verify(path: str, run: Run, journal: str) -> dict[str, int]:
    """Reopen and check every prompt of the universe; returns counts."""
    from hybridstore import HybridStore

    flushed = {int(x) for x in Path(journal).read_text().split()} if os.path.exists(journal) \
        else set()
    kept_required = run.tier_policy == "write-through" and not run.disk_evict
    hits = 0
    with HybridStore(run.config(path)) as store:
        for j in range(UNIVERSE):
            tokens = prompt(j)
            plan = store.match(tokens)
            try:
                if kept_required and j in flushed:
                    assert plan.position == len(tokens), (j, plan.position, len(tokens))
                if plan.position:
                    pages, state = store.load(plan).result()
                    assert loaded_exactly(tokens, plan.position, pages, state), j
                    hits += 1
            finally:
                store.release(plan)
        assert store.index.check_refcounts()
    return {"hits": hits, "flushed": len(flushed)}


def harness(root: Path, kills: int, seed: int = 0, max_delay: float = 1.5) -> dict[str, int]:
    """``kills`` child runs killed with SIGKILL, each followed by a verification."""
    rng = random.Random(seed)
    totals = {"kills": 0, "killed_in_recovery": 0, "verified_hits": 0, "flushed_checked": 0}
    dirs: dict[Run, Path] = {}
    for i in range(kills):
        run = Run(seed=rng.randrange(1 << 30), tier_policy=POLICIES[i % len(POLICIES)],
                  disk_evict=bool((i // len(POLICIES)) % 2))
        key = Run(0, run.tier_policy, run.disk_evict)       # one directory per configuration
        path = dirs.setdefault(key, root / f"{run.tier_policy}-{int(run.disk_evict)}")
        journal = str(path) + ".journal"
        in_recovery = rng.random() < 0.15
        delay = rng.uniform(0.0, 0.05) if in_recovery else rng.uniform(0.05, max_delay)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.crash", "--child", str(path),
             json.dumps([run.seed, run.tier_policy, run.disk_evict]), journal],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])
        assert proc.stdout is not None
        # kill while it opens the store (recovery) or while it works
        phase = "opening" if in_recovery else "ready"
        while (line := proc.stdout.readline().decode().strip()) and line != phase:
            pass
        time.sleep(delay)
        if proc.poll() is not None:
            raise AssertionError(f"the child exited by itself: {proc.stderr.read().decode()[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        totals["kills"] += 1
        totals["killed_in_recovery"] += in_recovery
        got = verify(str(path), run, journal)
        totals["verified_hits"] += got["hits"]
        totals["flushed_checked"] += got["flushed"] if (run.tier_policy == "write-through"
                                                        and not run.disk_evict) else 0
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "RUN", "JOURNAL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        seed, policy, disk_evict = json.loads(args.child[1])
        child(args.child[0], Run(seed, policy, disk_evict), args.child[2])
        return 0
    import tempfile

    root = Path(args.dir or tempfile.mkdtemp(prefix="hs-crash-"))
    print(json.dumps(harness(root, args.kills, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
