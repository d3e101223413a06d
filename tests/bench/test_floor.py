"""``bench/engines/floor.py``: the load floor reads and checks every byte of its file."""

from __future__ import annotations

import pytest

from hybridstore.bench.engines import floor
from hybridstore.errors import ConfigError


def test_the_floor_reads_every_run_and_checks_every_chunk(tmp_path, monkeypatch) -> None:
    seen: list[bytes] = []
    real = floor.checksum
    monkeypatch.setattr(floor, "checksum", lambda buf: seen.append(bytes(buf[:16])) or real(buf))
    out = floor.load_floor(str(tmp_path / "f.dat"), (6 << 20) + 4096, run_bytes=2 << 20,
                           chunk_bytes=512 << 10, passes=2)
    assert out["bytes"] == 6 << 20             # whole runs only
    assert out["chunks_checked"] == 12 and len(seen) == 2 * 12   # every chunk, every pass
    # make_test_file stamps each 8 MiB block's offset in its first 8 bytes: the first
    # chunk read is the file's first, so the reads landed in the buffer that was hashed
    assert seen[0][:8] == (0).to_bytes(8, "little")
    assert out["read_cpu_ms_per_mib"] >= 0 and out["checked_cpu_ms_per_mib"] > 0
    assert out["read_gbps"] > 0
    assert not (tmp_path / "f.dat").exists()


@pytest.mark.parametrize("run, chunk, total", [(3 << 20, 2 << 20, 8 << 20),
                                               ((1 << 20) + 512, 512, 8 << 20),
                                               (2 << 20, 1 << 20, 1 << 20)])
def test_runs_that_do_not_hold_whole_chunks_are_a_config_error(tmp_path, run, chunk, total):
    with pytest.raises(ConfigError):
        floor.load_floor(str(tmp_path / "f.dat"), total, run_bytes=run, chunk_bytes=chunk)
