"""The remote tier on a real Mooncake master (started here on loopback)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridstore import HybridStore
from hybridstore.backends.base import Tier
from hybridstore.testing.tiers import TierConformance
from tests.backends import remote_peer as rp
from tests.backends.remote_master import Master, master_binary

ROOT = Path(__file__).resolve().parents[2]

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


# -- two stores, two processes, one master ----------------------------------------------
def peer(master: Master, prefix: str, secret: bytes) -> subprocess.Popen:
    """Start the peer store (tests/backends/remote_peer.py) and wait for its READY."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.backends.remote_peer",
                             master.url(prefix=prefix, **SMALL), secret.hex()],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = _readline(proc, 60)
    assert line.startswith("READY"), line
    assert int(line.split()[1]) == 7 + 2         # 7 pages (6 full, 1 partial), 2 states
    return proc


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    if not box:
        proc.kill()
        raise AssertionError(f"the peer store said nothing in {timeout} s")
    return box[0]


def finish(proc: subprocess.Popen) -> None:
    proc.stdin.write("done\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    assert proc.wait(60) == 0


def same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16  # type: ignore[attr-defined,union-attr]
                                                   else a, b.view(torch.uint8) if b.dtype == torch.bfloat16 else b))  # type: ignore[attr-defined,union-attr]


def test_prefix_put_by_one_process_is_loaded_bit_exact_by_another(master: Master) -> None:
    secret, prefix = os.urandom(32), f"x{os.getpid()}-{next(_prefixes)}"
    proc = peer(master, prefix, secret)
    try:
        with HybridStore(rp.config(master.url(prefix=prefix, **SMALL), secret)) as store:
            assert "remote" in store.tiers
            query = rp.TOKENS[:150]                   # the same conversation, continued
            assert store.present_pages(query) == 6    # full pages only: block 6 differs
            assert store.restorable(query) == [64, 100]
            plan = store.match(query)
            assert plan.position == 100 and len(plan.pages) == 7
            assert set(store.restore_cost(plan)) == {"remote"}
            pages, state = store.load(plan).result(timeout=30)
            store.release(plan)
            for k in range(6):
                assert same(pages[k], rp.page_of(k))
            assert same(pages[6][:, :, :100 - 96], rp.page_of(6)[:, :, :4])
            assert same(state, rp.state_of(100))
            stats = store.stats()
            assert stats["tiers"]["remote"]["foreign"] == 9 and stats["corrupt"] == 0
            assert stats["loaded_bytes"]["remote"] > 0
            # another secret keys the same tokens elsewhere: nothing matches
        other = rp.config(master.url(prefix=prefix, **SMALL), os.urandom(32))
        with HybridStore(other) as store:
            assert store.match(rp.TOKENS[:150]).position == 0
    finally:
        finish(proc)
