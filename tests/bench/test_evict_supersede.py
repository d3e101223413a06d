"""The research benchmarks ``benchmarks.evict`` and ``benchmarks.supersede`` on tiny inputs."""

from __future__ import annotations

from benchmarks import evict, supersede
from hybridstore.replay import systems


def test_evict_rates_every_policy_against_histate():
    rows = evict.run([256], ["histate", "hybridstore"], reps=1)
    assert [r["policy"] for r in rows] == ["histate", "hybridstore"]
    assert all(r["pages_per_s"] > 0 for r in rows)
    assert rows[0]["ratio_to_histate"] == 1.0


def test_supersede_runs_each_value_and_puts_the_preset_back():
    before = systems.PRESETS["hybridstore"]
    rows = supersede.run("synthetic:agent?sessions=3&turns=4&new=2048&out=128", [0.0, 0.25],
                         [0.1], "unified")
    assert [(r["supersede"], r["budget"]) for r in rows] == [(0.0, 0.1), (0.25, 0.1)]
    assert all(0.0 <= r["token_hit_rate"] <= 1.0 for r in rows)
    assert systems.PRESETS["hybridstore"] is before
