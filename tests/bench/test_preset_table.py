"""``python -m benchmarks.preset_table``: every cell the default against the best other preset
and the exact bound, from the sweep and headroom documents as the CLI writes them."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.preset_table import _cells, table


def _sweep(path: Path, rows: list[tuple[float, str, float]]) -> None:
    path.write_text(json.dumps({"rows": [{"budget": b, "policy": p, "token_hit_rate": h}
                                         for b, p, h in rows]}))


def test_cells_pick_the_best_other_and_the_share_of_the_bound(tmp_path):
    (tmp_path / "bound-t-split.json").write_text(json.dumps(
        {"rows": [{"budget": 0.1, "bound": 0.8}, {"budget": 0.2, "bound": 0.9}]}))
    _sweep(tmp_path / "t-split-others.json", [(0.1, "unlimited", 0.95), (0.1, "a", 0.7),
                                              (0.1, "b", 0.75), (0.2, "a", 0.85)])
    _sweep(tmp_path / "t-split-hybridstore.json", [(0.1, "hybridstore", 0.72),
                                                   (0.2, "hybridstore", 0.88)])
    _sweep(tmp_path / "u-split-others.json", [(0.1, "a", 0.1)])   # no bound: not a cell
    cells = _cells(tmp_path)
    assert [(c["budget"], c["best_other"]) for c in cells] == [(0.1, "b"), (0.2, "a")]
    assert cells[0]["default_share"] == 0.72 / 0.8 and cells[0]["best_other_hit"] == 0.75
    text = table(cells)
    assert "0.720 (90.0%) / 0.750 `b` / 0.800" in text      # below the best other: not bold
    assert "**0.880** (97.8%) / 0.850 `a` / 0.900" in text  # at least the best other: bold


def test_a_run_kept_as_before_is_not_read(tmp_path):
    (tmp_path / "bound-t-unified.json").write_text(json.dumps(
        {"rows": [{"budget": 0.1, "bound": 0.8}, {"budget": 0.2, "bound": 0.9}]}))
    _sweep(tmp_path / "t-unified-hybridstore-before.json", [(0.1, "hybridstore", 0.9),
                                                            (0.2, "hybridstore", 0.5)])
    _sweep(tmp_path / "t-unified-hybridstore.json", [(0.1, "hybridstore", 0.7)])
    cells = _cells(tmp_path)
    assert [(c["budget"], c["default"]) for c in cells] == [(0.1, 0.7)]
