"""``python -m benchmarks.heldout``: groups of sessions that leave out the development ones,
by content, drawn the same way for the same seed, and replayable as WEKA directories."""

from __future__ import annotations

import json
import shutil

import pytest
import zstandard

from benchmarks.heldout import draw_groups, main, write_groups
from hybridstore.errors import ConfigError
from hybridstore.replay.loaders import load
from hybridstore.replay.samples import weka_sample


@pytest.fixture()
def source(tmp_path):
    """The bundled sample's 8 sessions as kv-cache-tester ships them (plain JSON), and an
    exclusion directory holding 2 of them compressed, one under another name."""
    src, dev = tmp_path / "traces", tmp_path / "dev"
    src.mkdir()
    dev.mkdir()
    files = sorted(weka_sample().glob("*.json.zst"))
    assert len(files) == 8
    for f in files:
        raw = zstandard.ZstdDecompressor().stream_reader(f.read_bytes()).read()
        (src / f.name.removesuffix(".zst")).write_bytes(raw)
    shutil.copy(files[0], dev / files[0].name)
    shutil.copy(files[1], dev / "renamed.json.zst")
    return src, dev, [f.name.removesuffix(".zst") for f in files]


def test_groups_leave_out_the_excluded_sessions_by_content(source):
    src, dev, names = source
    drawn = draw_groups(src, [dev], groups=2, size=3, seed=27)
    chosen = [p.name for g in drawn for p in g]
    assert len(chosen) == len(set(chosen)) == 6
    assert set(chosen) == set(names[2:])          # the renamed copy is recognised too
    again = draw_groups(src, [dev], groups=2, size=3, seed=27)
    assert [[p.name for p in g] for g in again] == [[p.name for p in g] for g in drawn]
    other = draw_groups(src, [dev], groups=2, size=3, seed=28)
    assert [[p.name for p in g] for g in other] != [[p.name for p in g] for g in drawn]


def test_too_few_sessions_or_a_missing_source_is_a_config_error(source, tmp_path):
    src, dev, _ = source
    with pytest.raises(ConfigError, match="6 sessions outside"):
        draw_groups(src, [dev], groups=2, size=4, seed=0)
    with pytest.raises(ConfigError, match="not a directory"):
        draw_groups(tmp_path / "nowhere", [dev], groups=1, size=1, seed=0)
    with pytest.raises(SystemExit, match="heldout: "):
        main([str(src), str(tmp_path / "out"), "--exclude", str(dev), "--groups", "3",
              "--size", "3"])


def test_written_groups_replay_as_weka_directories(source, tmp_path):
    src, dev, _ = source
    drawn = draw_groups(src, [dev], groups=2, size=3, seed=27)
    dirs = write_groups(drawn, tmp_path / "out")
    assert [d.name for d in dirs] == ["h1", "h2"]
    assert json.loads((tmp_path / "out" / "groups.json").read_text()) == {
        d.name: [p.name for p in g] for d, g in zip(dirs, drawn)}
    trace = load(str(dirs[0]))      # sub-agents are sessions "FILE/agent_N" of their file
    assert {s.id.split("/")[0] for s in trace.sessions} == {
        p.name.removesuffix(".json") for p in drawn[0]}
    write_groups(drawn[::-1], tmp_path / "out")     # a redraw replaces the links
    assert sorted(p.name for p in dirs[0].iterdir()) == sorted(p.name for p in drawn[1])
