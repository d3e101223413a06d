"""The fault harness, short form (``python -m tests.reliability.faults --rounds 400`` is the
full run): one small round of every fault kind; damage costs exactly the damaged objects
and everything else loads bit-exact."""

from __future__ import annotations

import logging

import pytest

from tests.reliability import injectors
from tests.reliability.faults import DAMAGE, FULL, KINDS, RUNNING_ONLY, Setup, harness

SMALL = Setup(fill=10, full_puts=60, full_free=(1 << 20, 5 << 18))


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="hybridstore")   # every drop logs a warning


def _check(tally, kinds) -> None:
    assert not tally.violations, tally.summary()["violations"]
    for kind in kinds:
        assert tally.faults[kind] == 1, kind


def test_damage_while_running_costs_exactly_the_damaged_objects(tmp_path):
    kinds = [f"{k}@running" for k in DAMAGE + RUNNING_ONLY]
    tally = harness(tmp_path, len(kinds), seed=5, kinds=kinds, setup=SMALL)
    _check(tally, kinds)
    assert tally.checked > 0
    assert tally.lost["flip@running"] == tally.damaged["flip@running"] > 0
    assert tally.lost["eio-transient@running"] == 0                 # retried, never lost
    assert tally.typed["CorruptObjectError"] > 0                    # the loads that met damage


def test_damage_between_runs_costs_exactly_the_damaged_objects(tmp_path):
    kinds = [f"{k}@reopen" for k in DAMAGE + ("catalog-info",)]
    tally = harness(tmp_path, len(kinds), seed=6, kinds=kinds, setup=SMALL)
    _check(tally, kinds)
    assert sum(tally.lost.values()) == sum(tally.damaged.values()) > 0


def test_a_full_file_system_is_a_full_tier(tmp_path):
    """Loop ext4 (with and without fallocate) and tmpfs where this machine can mount them;
    an explicit quota everywhere."""
    reason = injectors.mount_refusal()
    tally = harness(tmp_path, len(FULL), seed=7, kinds=FULL, setup=SMALL)
    ran = FULL if reason is None else ("full-quota",)
    _check(tally, ran)
    assert all(tally.disk_full[kind] > 0 for kind in ran)           # they really filled up
    if reason is not None:
        assert set(tally.skipped) == set(FULL) - {"full-quota"}
        pytest.skip(f"loop/tmpfs rounds skipped: {reason} (the quota round ran)")


def test_every_kind_is_named_once():
    assert len(set(KINDS)) == len(KINDS)
