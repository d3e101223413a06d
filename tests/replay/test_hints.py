"""An orchestrator's announcements in the replay (``ReplayConfig.resume_hints``, ``hybridstore
replay --resume-hints SIGMA``): each session's next request announced to the store when a
request has been served (``HybridStore.expect(..., in_s=)``), its time exact or off by a
log-normal factor, and a session's end. A what-if of what such hints are worth
(docs/replay.md), on the bundled sample."""

from __future__ import annotations

import math

import pytest

from hybridstore.errors import ConfigError
from hybridstore.replay.loaders import load
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import ReplayConfig, announce_next, replay_policy


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def expect(self, prompt, *, in_s):
        self.calls.append(in_s)
        return 0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_bad_hint_errors_are_config_errors(bad):
    with pytest.raises(ConfigError, match="resume_hints"):
        ReplayConfig(resume_hints=bad)


def test_the_announced_times_are_exact_noisy_per_request_or_the_end():
    session = load(str(weka_sample())).sessions[0]
    last = len(session.requests) - 1
    rec = _Recorder()
    announce_next(rec, None, ReplayConfig(), session, 0, lambda nxt: 12.0)  # off: nothing said
    assert rec.calls == []
    exact = ReplayConfig(resume_hints=0.0)
    announce_next(rec, None, exact, session, 0, lambda nxt: 12.0)
    announce_next(rec, None, exact, session, last, lambda nxt: 12.0)
    assert rec.calls == [12.0, math.inf]
    rec.calls.clear()
    noisy = ReplayConfig(resume_hints=1.0)
    for _ in range(2):          # the same request gets the same error (every preset sees it)
        announce_next(rec, None, noisy, session, 0, lambda nxt: 12.0)
    announce_next(rec, None, noisy, session, 1, lambda nxt: 12.0)
    assert rec.calls[0] == rec.calls[1] != 12.0 and rec.calls[2] != rec.calls[0]
    assert all(0 < x < math.inf for x in rec.calls)


def test_exact_announcements_keep_more_than_the_prediction():
    """The sample at 10 % with split pools: 0.817 predicted, 0.844 with exact times (and
    the sessions' ends), 0.840 with times off by a factor exp(N(0, 0.5))."""
    trace = load(str(weka_sample()))
    hit = {h: replay_policy(trace, "hybridstore",
                            ReplayConfig(discipline="sequential", pools="split", budget=0.1,
                                         resume_hints=h), progress=False
                            ).summary()["token_hit_rate"]
           for h in (None, 0.0)}
    assert hit[0.0] > hit[None] + 0.005, hit
