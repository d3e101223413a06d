"""The remote tier on a real Mooncake master (started here on loopback)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hybridstore.backends.base import Tier
from hybridstore.testing.tiers import TierConformance, blob, key_of
from tests.backends.remote_master import Master, master_binary

BINARY = master_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="Mooncake is not installed (pip install "
    "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")

SMALL = {"segment": "64MiB", "buffer": "32MiB", "staging": "16MiB", "timeout": 3, "retry": 1}
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    assert BINARY is not None
    m = Master(BINARY, tmp_path_factory.mktemp("mooncake") / "master.log")
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(master: Master) -> Iterator[object]:
    """One client of the master shared by the conformance tiers (a client's close takes 2 s)."""
    from hybridstore.backends.remote.client import MooncakeClient
    from hybridstore.backends.remote.url import parse_remote

    c = MooncakeClient(parse_remote(master.url(**SMALL)))
    yield c
    c.close()


def tier_on(master: Master, capacity: int, client: object = None, **options: object) -> Tier:
    """A tier with a prefix of its own (so it starts empty)."""
    from hybridstore.backends.remote import MooncakeTier

    prefix = f"t{next(_prefixes)}-{np.random.default_rng().integers(1 << 40)}"
    return MooncakeTier(master.url(prefix=prefix, **{**SMALL, **options}), capacity,
                        client=client)  # type: ignore[arg-type]


class TestMooncakeTier(TierConformance):
    @pytest.fixture(autouse=True)
    def _master(self, master: Master, client: object) -> None:
        self.master, self.client = master, client

    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        return tier_on(self.master, capacity_bytes, self.client)
