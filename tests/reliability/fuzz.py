"""A hypothesis fuzz campaign over the public API, the engine-keyed API, StoreConfig and
every trace loader (issue 13, "Harness and figures").

Targets (share of ``--cases``):

* ``api`` (35%): one public call of a populated store (with disk tier) or of a closed
  one, one argument hostile or at an edge (``fuzz_api.api_calls``); a rejected call must
  leave ``stats()``, ``restorable``/``present_pages`` answers and loaded bytes unchanged;
* ``stateful`` (15%, counted in calls): ``fuzz_api.MixedCalls``, a hypothesis
  ``RuleBasedStateMachine`` mixing valid puts/matches/loads/releases with hostile calls on
  a fresh store, the same checks after every rejected call, every prompt bit-exact;
* ``engine`` (12%): ``engine_prefix`` with garbage keys, ``prefix=None`` resolution,
  length mismatches, puts and loads through engine keys;
* ``config`` (3%): ``StoreConfig`` with hostile fields, and the store it opens;
* ``traces`` (35%): mutated real and generated trace files (bytes, JSON, zstd) and
  ``synthetic:`` specs through every loader, in a memory- and time-limited sandbox.

Only errors deriving from :class:`~hybridstore.errors.HybridStoreError` are allowed;
anything else, a rejected call that changed something, wrong bytes, a hang or an
allocation past the sandbox limit is a defect.  Runs are reproducible from ``--seed``
(hypothesis ``@seed``, no example database)::

    python -m tests.reliability.fuzz --cases 100000 --seed 0 --json fuzz.json

The test suite runs a short form (``tests/reliability/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from tests.reliability.fuzz_api import CALLS_ON_CLOSED, MixedCalls, World, api_case, config_case, \
    engine_case
from tests.reliability.fuzz_tally import Tally
from tests.reliability.fuzz_traces import Sandbox, corpus, trace_case, trace_load_case

SHARES = {"api": 0.35, "stateful": 0.15, "engine": 0.12, "config": 0.03, "traces": 0.35}
STEPS = 25
"""Steps of one state-machine run."""


def _settings(n: int, strict: bool) -> settings:
    return settings(max_examples=max(1, n), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=strict,
                    phases=[Phase.generate, Phase.shrink] if strict else [Phase.generate],
                    stateful_step_count=STEPS)


def run_api(tally: Tally, world: World, n: int, seed_: int, strict: bool = False) -> None:
    names = sorted(world.calls)

    @seed(seed_)
    @_settings(n, strict)
    @given(data=st.data())
    def fuzz_api(data: st.DataObject) -> None:
        closed = data.draw(st.integers(0, 9), "closed?") == 0
        name = data.draw(st.sampled_from(CALLS_ON_CLOSED if closed else names), "call")
        value = data.draw(world.calls[name][1], name)
        api_case(tally, world, name, value, closed=closed,
                 check_bytes=tally.cases["api"] % 16 == 0)

    fuzz_api()


def run_engine(tally: Tally, world: World, n: int, seed_: int, strict: bool = False) -> None:
    @seed(seed_)
    @_settings(n, strict)
    @given(data=st.data())
    def fuzz_engine(data: st.DataObject) -> None:
        engine_case(tally, world, data)

    fuzz_engine()


def run_config(tally: Tally, root: str, n: int, seed_: int, strict: bool = False) -> None:
    @seed(seed_)
    @_settings(n, strict)
    @given(data=st.data())
    def fuzz_config(data: st.DataObject) -> None:
        config_case(tally, root, data)

    fuzz_config()


def run_stateful(tally: Tally, world: World | None, root: str, n_calls: int, seed_: int,
                 strict: bool = False) -> None:
    """About ``n_calls`` calls, in runs of up to :data:`STEPS` steps."""
    machine = type("Machine", (MixedCalls,), {"tally": tally, "root": root, "world": world})
    machine._hypothesis_internal_use_seed = seed_  # type: ignore[attr-defined]
    runs = max(1, n_calls // STEPS)             # a step makes 1 to 2 calls; some runs end early
    run_state_machine_as_test(machine, settings=_settings(runs, strict))


def run_traces(tally: Tally, root: str, n: int, seed_: int, strict: bool = False,
               sandbox: Sandbox | None = None) -> None:
    seeds = corpus()
    box = sandbox or Sandbox()
    try:
        @seed(seed_)
        @_settings(n, strict)
        @given(case=trace_case(seeds))
        def fuzz_traces(case: Any) -> None:
            trace_load_case(tally, box, root, case)

        fuzz_traces()
    finally:
        if sandbox is None:
            box.stop()


def campaign(cases: int, seed_: int = 0, *, progress: bool = True,
             only: list[str] | None = None) -> dict[str, Any]:
    """Run every target with its share of ``cases``; returns the JSON summary."""
    from tqdm import tqdm

    warnings.simplefilter("ignore")
    root = tempfile.mkdtemp(prefix="hs-fuzz-")
    bar = tqdm(total=cases, unit="case", disable=not progress, file=sys.stderr, smoothing=0.05)
    tally = Tally(tick=lambda: bar.update(1))
    world = World(root + "/world")
    seconds: dict[str, float] = {}
    runners: dict[str, Callable[[int, int], None]] = {
        "api": lambda n, s: run_api(tally, world, n, s),
        "engine": lambda n, s: run_engine(tally, world, n, s),
        "config": lambda n, s: run_config(tally, root, n, s),
        "stateful": lambda n, s: run_stateful(tally, world, root, n, s),
        "traces": lambda n, s: run_traces(tally, root + "/traces", n, s),
    }
    try:
        for i, (name, share) in enumerate(SHARES.items()):
            if only and name not in only:
                continue
            bar.set_description(name)
            start = time.perf_counter()
            try:
                runners[name](round(cases * share / (sum(SHARES[k] for k in only) if only else 1)),
                              seed_ * 100 + i)
            except Exception as e:  # noqa: BLE001 - a harness failure ends this target only
                tally.defect(name, "harness", f"harness {type(e).__name__}", str(e)[:300])
            seconds[name] = round(time.perf_counter() - start, 1)
    finally:
        bar.close()
        world.close()
        shutil.rmtree(root, ignore_errors=True)
    out = tally.summary()
    out.update(seed=seed_, requested_cases=cases, seconds=seconds,
               cases_per_second=round(out["total_cases"] / max(sum(seconds.values()), 1e-9), 1))
    return out


def print_table(doc: dict[str, Any]) -> None:
    print(f"{'target':<10} {'cases':>8} {'calls':>8} {'accepted':>9} {'seconds':>8}")
    for name in doc["cases"]:
        print(f"{name:<10} {doc['cases'][name]:>8} {doc['calls'].get(name, 0):>8} "
              f"{doc['accepted_calls'].get(name, 0):>9} {doc['seconds'].get(name, 0):>8}")
    print(f"{'total':<10} {doc['total_cases']:>8}   ({doc['cases_per_second']} cases/s)")
    print("typed errors: " + ", ".join(f"{k} {v}" for k, v in doc["typed_errors"].items()))
    print(f"defects: {doc['n_defects']}")
    for d in doc["defects"]:
        print(f"  {d['count']:>6} x {d['target']} {d['call']}: {d['kind']} -- {d['message'][:120]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument("--only", nargs="*", choices=sorted(SHARES), help="run these targets")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.cases < 1:
        parser.error("--cases must be >= 1")
    doc = campaign(args.cases, args.seed, progress=not args.no_progress, only=args.only)
    print(json.dumps(doc))
    print_table(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if doc["n_defects"] else 0


if __name__ == "__main__":
    sys.exit(main())
