"""The accounting tier: the conformance suite (sizes only) plus its timing model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybridstore.backends.accounting import AccountingTier
from hybridstore.errors import CapacityError, ConfigError
from hybridstore.testing.tiers import TierConformance, key_of


class TestAccountingTier(TierConformance):
    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> AccountingTier:
        return AccountingTier("host", capacity_bytes, read_gbps=64.0)


class TestAlignedAccountingTier(TierConformance):
    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> AccountingTier:
        return AccountingTier("disk", capacity_bytes, read_gbps=5.0, alignment=4096)


def test_sizes_and_timings() -> None:
    tier = AccountingTier("disk", 1 << 20, read_gbps=5.0, write_gbps=2.5, alignment=4096)
    assert tier.name == "disk" and not tier.stores_bytes
    tier.put(key_of(1), None, nbytes=5000).result()
    assert tier.used_bytes == 8192 and tier.get_into(key_of(1), None).result() == 5000
    assert tier.read_seconds(5 * 10**9) == pytest.approx(1.0)
    assert tier.write_seconds(5 * 10**9) == pytest.approx(2.0)
    stats = tier.stats()
    assert stats["read_seconds"] == pytest.approx(5000 / 5e9)
    assert stats["write_seconds"] == pytest.approx(5000 / 2.5e9)
    with pytest.raises(CapacityError, match="disk"):
        tier.put(key_of(2), None, nbytes=(1 << 20) - 4096)


def test_millions_of_ops_are_cheap() -> None:
    tier = AccountingTier("host", 1 << 40, read_gbps=64.0)
    keys = [key_of(i) for i in range(1000)]
    start = time.perf_counter()
    for _ in range(100):
        for key in keys:
            tier.put(key, None, nbytes=1 << 20)
            tier.get_into(key, None)
    per_op = (time.perf_counter() - start) / 200_000
    assert per_op < 20e-6, f"{per_op * 1e6:.1f} us per op"


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        AccountingTier("host", 1 << 20, read_gbps=0)
    with pytest.raises(ConfigError):
        AccountingTier("host", -1, read_gbps=1.0)
