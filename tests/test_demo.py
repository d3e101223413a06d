"""``hybridstore demo`` on a shortened session: every turn resumes where it should."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from rich.console import Console  # noqa: E402

from hybridstore.demo import conversation, run_demo  # noqa: E402


def test_demo_session_resumes_every_mutation(tmp_path):
    rows = run_demo(disk_path=str(tmp_path / "ssd"), console=Console(file=open(tmp_path / "out.txt", "w")),
                    scale=0.25, width=128, layers=4)
    turns = conversation(scale=0.25)
    assert [r["prompt"] for r in rows] == [len(t.tokens) for t in turns]
    assert all(r["exact"] for r in rows)
    by = {r["turn"][0]: r for r in rows}
    assert by["1"]["reused"] == 0
    assert by["2"]["reused"] == by["1"]["prompt"]           # append: the previous request end
    assert by["3"]["reused"] == by["2"]["prompt"]
    # truncation inside the tool result: resumes past the tool result's start, before the cut
    tool_start = turns[1].anchors[2]
    cut = tool_start + len(turns[1].tokens[tool_start:]) * 2 // 3
    assert tool_start <= by["4"]["reused"] <= cut + 8
    # after the restart everything comes from the SSD tier
    assert by["5"]["reused"] == by["4"]["prompt"] and by["5"]["from_dram_KiB"] == 0 < by["5"]["from_ssd_KiB"]
    # rewind and edit: at least the system prompt (an anchor); compaction: exactly the system prompt
    system = turns[0].anchors[0]
    assert by["6"]["reused"] >= system and by["7"]["reused"] == system
    assert all(r["reused"] + r["recomputed"] == r["prompt"] for r in rows)
