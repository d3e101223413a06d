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
