"""Held-out WEKA sessions: the default against every preset on sessions nothing was tuned on.

Issue 27 asks for the default preset to be best on traces it was not fitted to. The
project's WEKA sessions (``../shared/traces/weka``, 30 of them, and the 8 of those bundled
as the sample) come from kv-cache-tester (github.com/callanjfox/kv-cache-tester, commit
94f6046, ``traces/``, Apache-2.0), which holds 710 readable sessions. This draws groups
of its *other* sessions, the same size as the development set, and replays them::

    git clone https://github.com/callanjfox/kv-cache-tester
    python -m benchmarks.heldout kv-cache-tester/traces OUT --run

``OUT/h1 ... OUT/hN`` are the groups (links to the source files) and ``OUT/groups.json``
their sessions; ``--run`` then writes, per group and pools, the sweep of every preset and
the exact bound (the CLI's ``hybridstore replay GROUP --discipline sequential --sweep
5%,10%,20% --pools P --policy ...`` and the same with ``--headroom``) into ``OUT/results``
and the table of :mod:`benchmarks.preset_table` (``summary.json``, ``summary.png``).

A source session is left out when its bytes equal a session of an ``--exclude``
directory (decompressed; by default the development sessions and the bundled sample),
whatever its file name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridstore.errors import ConfigError

PRESETS = ("unlimited", "vllm-marconi", "sglang-hicache", "sglang-extra", "marconi",
           "flashstates", "histate", "hybridstore")
"""The presets of docs/replay.md's issue-27 table (``unlimited`` is the reference)."""
BUDGETS = "5%,10%,20%"
POOLS = ("unified", "split")
SUFFIXES = (".json", ".json.zst")


def _bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.name.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
    return raw


def _digest(path: Path) -> str:
    return hashlib.sha256(_bytes(path)).hexdigest()


def _sessions(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory of WEKA session documents")
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIXES))


def draw_groups(source: Path, exclude: Sequence[Path], *, groups: int, size: int,
                seed: int) -> list[list[Path]]:
    """``groups`` disjoint groups of ``size`` sessions of ``source`` not in ``exclude``.

    The sessions left (sorted by file name) are shuffled with ``random.Random(seed)`` and
    cut into groups in order, so a seed always draws the same groups from the same source.

    Raises:
        ConfigError: a directory is missing, or fewer sessions are left than the groups need.
    """
    if groups < 1 or size < 1:
        raise ConfigError(f"groups and size must be at least 1, got {groups} and {size}")
    known = {_digest(p) for d in exclude for p in _sessions(d)}
    left = [p for p in _sessions(source) if _digest(p) not in known]
    if len(left) < groups * size:
        raise ConfigError(f"{source} has {len(left)} sessions outside the excluded ones; "
                          f"{groups} groups of {size} need {groups * size}")
    random.Random(seed).shuffle(left)
    return [left[g * size:(g + 1) * size] for g in range(groups)]


def write_groups(drawn: list[list[Path]], out: Path) -> list[Path]:
    """``out/h1 ...``: a directory of links per group, and ``out/groups.json``."""
    dirs = []
    for g, members in enumerate(drawn, 1):
        d = out / f"h{g}"
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for p in members:
            (d / p.name).symlink_to(p.resolve())
        dirs.append(d)
    (out / "groups.json").write_text(json.dumps(
        {d.name: [p.name for p in members] for d, members in zip(dirs, drawn)}, indent=1))
    return dirs


def run(dirs: Sequence[Path], results: Path) -> None:
    """Every preset's sweep and the exact bound for each group and pools, then the table."""
    from tqdm import tqdm

    from benchmarks import preset_table

    results.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "hybridstore", "replay"]
    jobs = []
    for d in dirs:
        for pools in POOLS:
            common = [str(d), "--discipline", "sequential", "--sweep", BUDGETS, "--pools", pools,
                      "--no-progress"]
            jobs.append(base + common + ["--policy", ",".join(PRESETS), "--json",
                                         str(results / f"{d.name}-{pools}-all.json")])
            jobs.append(base + common + ["--headroom", "--json",
                                         str(results / f"bound-{d.name}-{pools}.json")])
    for cmd in tqdm(jobs, desc="held-out replays", unit="run"):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    preset_table.main([str(results)])


def main(argv: Sequence[str] | None = None) -> int:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog="python -m benchmarks.heldout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="kv-cache-tester's traces/ folder")
    parser.add_argument("out", type=Path, help="where the groups (and results) go")
    parser.add_argument("--exclude", type=Path, action="append", default=None,
                        help="a directory of sessions to leave out (repeatable; default: "
                             "../shared/traces/weka and the bundled sample)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--size", type=int, default=30, help="sessions per group")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--run", action="store_true",
                        help="replay every group (docs/replay.md's issue-27 table)")
    args = parser.parse_args(argv)
    exclude = args.exclude if args.exclude is not None else [
        p for p in (here.parent / "shared" / "traces" / "weka",
                    here / "src" / "hybridstore" / "replay" / "samples" / "weka") if p.is_dir()]
    try:
        drawn = draw_groups(args.source, exclude, groups=args.groups, size=args.size,
                            seed=args.seed)
    except ConfigError as e:
        raise SystemExit(f"heldout: {e}") from None
    dirs = write_groups(drawn, args.out)
    for d, members in zip(dirs, drawn):
        print(f"{d}: {len(members)} sessions")
    if args.run:
        run(dirs, args.out / "results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
