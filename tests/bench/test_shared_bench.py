"""``hybridstore bench shared`` on a small synthetic agent trace, real processes."""

from __future__ import annotations

from pathlib import Path

from hybridstore.bench.shared import run_shared_bench


def test_a_shared_directory_serves_sessions_that_hop_processes(tmp_path: Path) -> None:
    """Round robin sends a session's next request to the other process: with a
    directory each it misses what its own earlier request stored, with one shared
    directory it hits; every page loaded across processes holds its block id."""
    doc = run_shared_bench(json_path=str(tmp_path / "s.json"), plot_path=str(tmp_path / "s.png"),
                           procs=(2,), routings=("round-robin",), budget_fraction=1.0,
                           trace_spec="synthetic:agent?sessions=3&turns=4",
                           page_bytes=4096, disk_dir=str(tmp_path))
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == {"shared", "separate"}
    assert all(r["wrong_pages"] == 0 and r["lost_plans"] == 0 for r in rows.values())
    assert rows["shared"]["token_hit"] > rows["separate"]["token_hit"]
    assert rows["shared"]["token_hit"] > 0.3
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "s.json").exists()
