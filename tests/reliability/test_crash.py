"""The SIGKILL harness, short form (``python -m tests.reliability.crash --kills 200`` is the
full run)."""

from __future__ import annotations

from tests.reliability.crash import POLICIES, harness


def test_killed_stores_keep_every_object_bit_exact_and_every_flushed_prompt(tmp_path):
    totals = harness(tmp_path, kills=2 * len(POLICIES), seed=1, max_delay=0.8)
    assert totals["kills"] == 8
    assert totals["verified_hits"] > 0          # the checks ran on real hits
