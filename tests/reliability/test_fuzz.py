"""The fuzz campaign, short form (``python -m tests.reliability.fuzz --cases 100000`` is the
full run): hostile calls of the public and engine-keyed API, StoreConfig, a stateful
machine and fuzzed trace files raise only typed errors and a rejected call changes nothing.
A defect fails the test with the example hypothesis shrank it to."""

from __future__ import annotations

import warnings

import pytest

from tests.reliability import fuzz
from tests.reliability.fuzz_api import World
from tests.reliability.fuzz_tally import Tally
from tests.reliability.fuzz_traces import Sandbox


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(str(tmp_path_factory.mktemp("world")))
    yield w
    w.close()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _clean(tally: Tally, target: str, at_least: int) -> None:
    assert tally.cases[target] >= at_least
    assert not tally.defects, tally.defects
    assert tally.typed, "no call was rejected: the hostile values did not reach the checks"


def test_public_api_calls(world):
    tally = Tally(strict=True)
    fuzz.run_api(tally, world, 600, seed_=1, strict=True)
    _clean(tally, "api", 600)
    assert tally.accepted["api"] > 20          # valid edge values went through too


def test_engine_keyed_api(world):
    tally = Tally(strict=True)
    fuzz.run_engine(tally, world, 300, seed_=2, strict=True)
    _clean(tally, "engine", 300)


def test_store_config(tmp_path):
    tally = Tally(strict=True)
    fuzz.run_config(tally, str(tmp_path), 100, seed_=3, strict=True)
    _clean(tally, "config", 100)


def test_stateful_mixed_valid_and_invalid_calls(world, tmp_path):
    tally = Tally(strict=True)
    fuzz.run_stateful(tally, world, str(tmp_path), 400, seed_=4, strict=True)
    _clean(tally, "stateful", 150)
    assert tally.accepted["stateful"] > 20     # valid puts, matches and loads were checked


def test_trace_loaders(tmp_path):
    tally = Tally(strict=True)
    box = Sandbox()
    try:
        fuzz.run_traces(tally, str(tmp_path), 400, seed_=5, strict=True, sandbox=box)
    finally:
        box.stop()
    _clean(tally, "traces", 400)
    assert tally.accepted["traces"] > 0 and tally.typed["TraceFormatError"] > 50


def test_the_sandbox_reports_allocations_past_its_limit_and_hangs(tmp_path):
    """The loader target's own detectors: a load that needs more address space than the
    sandbox allows is reported (not survived by luck), and so is one that does not answer."""
    from tests.reliability.fuzz_traces import _valid_weka

    tight = Sandbox(headroom=1 << 16)
    try:
        out = tight.run("weka", str(_valid_weka()), {})
    finally:
        tight.stop()
    assert out[0] in ("untyped", "died") and (out[0] == "died" or "MemoryError" in out[1]), out
    slow = Sandbox(timeout_s=1e-4)
    try:
        assert slow.run("load", "synthetic:agent?sessions=4&turns=4", {}) == ("hang",)
    finally:
        slow.stop()
    ok = Sandbox()
    try:
        assert ok.run("weka", str(_valid_weka()), {})[0] == "ok"
    finally:
        ok.stop()
