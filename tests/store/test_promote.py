"""HybridStore.promote: what an engine holds after loading a prefix from a lower tier is
copied up into its own cache (the fastest tier), pages and named checkpoints, nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.errors import UnknownTierError
from hybridstore.objects import TIER_BITS

B, PAGE, STATE = 16, 4096, 1 << 16


def store() -> HybridStore:
    return HybridStore(StoreConfig(block_size=B, tier_policy="write-through"),
                       tiers={"device": AccountingTier("device", 64 * PAGE + 4 * STATE, read_gbps=900),
                              "host": AccountingTier("host", 1 << 30, read_gbps=64)})


def held(s: HybridStore, prompt, tier: str) -> tuple[int, bool]:
    ids = s.index.known_ids(prompt)
    pages = int(((s.index.page_columns(ids, ("tiers",))["tiers"] & TIER_BITS[tier]) != 0).sum())
    ck = s.index.checkpoint(prompt.key_at(prompt.length))
    return pages, ck is not None and bool(ck.tiers & TIER_BITS[tier])


def test_promote_copies_what_the_device_lost_back_from_the_host():
    s = store()
    prompt = s.prefix(np.arange(10 * B))
    s.put_kv_sized(prompt, nbytes=PAGE)
    s.put_state_sized(prompt, nbytes=STATE)
    assert held(s, prompt, "device") == (10, True) and held(s, prompt, "host") == (10, True)
    s.evict(64 * PAGE + 4 * STATE, tier="device")
    assert held(s, prompt, "device") == (0, False) and held(s, prompt, "host") == (10, True)
    assert s.promote(prompt, positions=[prompt.length], sources=("host",)) == 11
    assert held(s, prompt, "device") == (10, True)
    assert s.promote(prompt, positions=[prompt.length]) == 0        # nothing left to copy
    other = s.prefix(np.arange(1000, 1000 + 4 * B))
    assert s.promote(other, positions=[7]) == 0                     # unknown prompt, no state


def test_promote_names_its_tiers():
    s = store()
    prompt = s.prefix(np.arange(2 * B))
    with pytest.raises(UnknownTierError):
        s.promote(prompt, tier="disk")
    with pytest.raises(UnknownTierError):
        s.promote(prompt, sources=("nvme",))
