"""The remote tier on a real Mooncake master (started here on loopback)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridstore import HybridStore, HybridStoreError
from hybridstore.backends.base import Tier
from hybridstore.backends.remote.master import Lender, Master, master_binary
from hybridstore.objects import TIER_BITS
from hybridstore.testing.tiers import TierConformance
from tests.backends import remote_peer as rp

ROOT = Path(__file__).resolve().parents[2]

BINARY = master_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="Mooncake is not installed (pip install "
    "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")

SMALL = {"segment": "64MiB", "buffer": "32MiB", "staging": "16MiB", "timeout": 10, "retry": 1}
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
    from hybridstore.remote_url import parse_remote

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
def peer(master: Master, prefix: str, secret: bytes, **options: object) -> subprocess.Popen:
    """Start the peer store (tests/backends/remote_peer.py) and wait for its READY."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.backends.remote_peer",
                             master.url(prefix=prefix, **{**SMALL, **options}), secret.hex()],
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


def test_prefix_put_by_one_process_is_loaded_bit_exact_by_another(tmp_path: Path) -> None:
    """The writer lends no memory (``segment=0``): its objects live in a ``mooncake_client``
    lender and outlive it; the reader opens only after the writer has exited."""
    assert BINARY is not None
    secret, prefix = os.urandom(32), f"x{os.getpid()}-{next(_prefixes)}"
    master = Master(BINARY, tmp_path / "master.log")  # its own: the lender leaves with the test
    lender = Lender(master, tmp_path / "lender.log")
    try:
        finish(peer(master, prefix, secret, segment=0))
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
        lender.stop()
        master.stop()


def test_a_state_goes_remote_only_with_its_pages(master: Master) -> None:
    url = master.url(prefix=f"s{os.getpid()}-{next(_prefixes)}", **SMALL)
    with HybridStore(rp.config(url, os.urandom(32))) as store:
        assert store.put_state(rp.TOKENS[:100], rp.state_of(100), position=100)
        store.flush()
        remote = store.stats()["tiers"]["remote"]
        assert remote["objects"] == 0 and store._remote.skipped_states == 1  # type: ignore[union-attr]
        rp.put_conversation(store)                 # pages first, then the states
        remote = store.stats()["tiers"]["remote"]
        # the pages and the state at 64 went; the one at 100 was declined at its put
        # (held already, it is not put again)
        assert remote["objects"] == 7 + 1 and remote["failed"] == 0
        prompt = store.prefix(rp.TOKENS[:100])
        tiers = {p: store.index.checkpoint(prompt.key_at(p)).tiers for p in (64, 100)}  # type: ignore[union-attr]
        assert tiers == {64: TIER_BITS["host"] | TIER_BITS["remote"], 100: TIER_BITS["host"]}


def test_damaged_or_foreign_values_are_misses(master: Master, client: object) -> None:
    from hybridstore.backends.remote import frame
    from hybridstore.errors import CorruptObjectError
    from hybridstore.testing.tiers import blob, key_of

    tier = tier_on(master, 8 << 20, client)
    try:
        for i in range(3):
            tier.put(key_of(i), blob(5000, i), nbytes=5000, meta=b"m").result()
        store = tier.client.store  # type: ignore[attr-defined]
        prefix = tier.spec.prefix  # type: ignore[attr-defined]
        value = np.frombuffer(store.get(frame.object_name(prefix, key_of(0))), np.uint8).copy()
        value[-1] ^= 1                                                  # one payload bit
        store.remove(frame.object_name(prefix, key_of(0)), True)
        assert store.put(frame.object_name(prefix, key_of(0)), value.tobytes()) == 0
        good = store.get(frame.object_name(prefix, key_of(2)))          # another key's value
        store.remove(frame.object_name(prefix, key_of(1)), True)
        assert store.put(frame.object_name(prefix, key_of(1)), good) == 0
        for i in (0, 1):
            with pytest.raises(CorruptObjectError):
                tier.get(key_of(i))
            assert not tier.contains(key_of(i))
        assert sorted(tier.take_lost()) == [key_of(0), key_of(1)]  # type: ignore[attr-defined]
        assert np.array_equal(tier.get(key_of(2)), blob(5000, 2))
        assert tier.used_bytes == tier.charge(5000)
        assert tier.adopt([key_of(1)]) == []      # its header names another key  # type: ignore[attr-defined]
    finally:
        tier.close()


def test_master_unreachable_at_open(caplog: pytest.LogCaptureFixture) -> None:
    from hybridstore.backends.remote.master import free_port

    url = f"mooncake://127.0.0.1:{free_port()}?timeout=2"
    with caplog.at_level("WARNING", logger="hybridstore"):
        started = time.monotonic()
        with HybridStore(rp.config(url, os.urandom(32))) as store:
            assert "remote" not in store.tiers        # opens without it
            rp.put_conversation(store)
            plan = store.match(rp.TOKENS[:150])
            assert plan.position == 100
            store.release(plan)
        assert time.monotonic() - started < 10
    assert "remote tier is not used" in caplog.text and "unreachable" in caplog.text


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridstore.backends.remote.tier import MooncakeTier
    from hybridstore.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "mooncake.store", None)   # import fails
    with pytest.raises(MissingExtraError, match="pip install mooncake-transfer-engine-non-cuda"):
        MooncakeTier("mooncake://127.0.0.1:1", 1 << 20)


def test_bad_urls_are_config_errors() -> None:
    from hybridstore import ConfigError, StoreConfig

    for url in ("redis://h:1", "mooncake://h", "mooncake://h:1/x", "mooncake://h:1?bogus=1",
                "mooncake://h:1?segment=lots", "mooncake://h:1?timeout=0"):
        with pytest.raises(ConfigError):
            StoreConfig(remote=url)
    spec = StoreConfig(remote="mooncake://h:9?segment=1GiB&prefix=a").remote
    from hybridstore.backends.remote import parse_remote

    parsed = parse_remote(spec)  # type: ignore[arg-type]
    assert parsed.segment_bytes == 1 << 30 and parsed.prefix == "a" and parsed.master == "h:9"


def test_master_killed_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Objects only the pool held become misses with a logged reason; every call returns
    within the bound; the store keeps serving what its own tiers hold."""
    assert BINARY is not None
    own = Master(BINARY, tmp_path / "master.log")
    url = own.url(prefix="k", **SMALL)
    secret = os.urandom(32)
    writer = HybridStore(rp.config(url, secret))
    reader = HybridStore(rp.config(url, secret))
    try:
        rp.put_conversation(writer)
        plan = reader.match(rp.TOKENS[:150])
        assert plan.position == 100 and set(reader.restore_cost(plan)) == {"remote"}
        mine = rp.TOKENS[::-1][:32].copy()
        reader.put_kv(mine, [rp.page_of(90), rp.page_of(91)])            # the reader's own
        own.kill()
        with caplog.at_level("WARNING", logger="hybridstore"):
            started = time.monotonic()
            with pytest.raises(HybridStoreError):        # typed: BackendIOError
                reader.load(plan).result(timeout=30)
            reader.release(plan)
            again = reader.match(rp.TOKENS[:150])        # a miss now
            assert again.position == 0 and reader.present_pages(rp.TOKENS[:150]) == 0
            reader.release(again)
            assert reader.present_pages(mine) == 2         # its own tiers still serve
            own_plan = reader.match_pages(mine)
            pages, _ = reader.load(own_plan).result(timeout=30)
            reader.release(own_plan)
            assert same(pages[1], rp.page_of(91))
            reader.put_kv(rp.TOKENS[:64], [rp.page_of(k) for k in range(4)])   # no raise
            reader.flush()
            assert reader.present_pages(rp.TOKENS[:150]) == 4
            elapsed = time.monotonic() - started
        assert elapsed < 15, elapsed         # measured: well under a second
        assert "unreachable" in caplog.text
        stats = reader.stats()["tiers"]["remote"]
        assert stats["down_events"] >= 1 and stats["objects"] == 0 and not stats["available"]
    finally:
        started = time.monotonic()
        reader.close()
        writer.close()
        assert time.monotonic() - started < 15     # measured: about 2 s (the writer)
        own.stop()


# -- issue 26: sealed values, per-tenant layouts, bounded open, lost records, exit -----
def test_a_forged_value_is_a_miss_never_loaded(master: Master) -> None:
    """A client of the master without the secret (here: a tier of another tenant on the
    same prefix, which lists the victim's names as the master's HTTP does) replaces a
    page with framed, forged bytes: the victim's load is a miss, never those bytes."""
    from hybridstore.backends.remote import MooncakeTier
    from hybridstore.objects import ObjectKind, object_key

    url = master.url(prefix=f"f{os.getpid()}-{next(_prefixes)}", **SMALL)
    secret = os.urandom(32)
    with HybridStore(rp.config(url, secret)) as writer, \
            HybridStore(rp.config(url, secret)) as reader:
        rp.put_conversation(writer)
        plan = reader.match(rp.TOKENS[:64])
        assert plan.position == 64 and set(reader.restore_cost(plan)) == {"remote"}
        victim = reader.tiers["remote"]
        okey = object_key(ObjectKind.PAGE, reader.prefix(rp.TOKENS[:64]).block_key(1))
        entry = victim._objects[okey]  # type: ignore[attr-defined]
        forged = np.full(entry.nbytes, 0x41, np.uint8)
        attacker = MooncakeTier(url, 64 << 20, client=victim.client)  # type: ignore[attr-defined]
        try:
            victim.client.store.remove(f"{victim.spec.prefix}/{okey.hex()}", True)  # type: ignore[attr-defined]
            attacker.put(okey, forged, nbytes=entry.nbytes, meta=entry.meta).result()
        finally:
            attacker.close()
        try:
            pages, _ = reader.load(plan).result(timeout=30)
        except HybridStoreError:
            pages = None                                 # a miss: fine
        reader.release(plan)
        if pages is not None:
            assert same(pages[1], rp.page_of(1)), "the victim loaded forged bytes"
        stats = reader.stats()["tiers"]["remote"]
        assert stats["unauthentic"] == 1 and stats["corrupt"] == 1
        assert reader.present_pages(rp.TOKENS[:64]) == 1   # the forged page is forgotten


def test_another_tenants_layout_never_reinterprets_pages(master: Master) -> None:
    """Tenant B (another secret, the same prefix) records an int16 page layout of the
    same size after tenant A's bf16 one: a fresh store of A still loads A's pages as
    bf16, bit-exact."""
    url = master.url(prefix=f"l{os.getpid()}-{next(_prefixes)}", **SMALL)
    a, b = os.urandom(32), os.urandom(32)
    with HybridStore(rp.config(url, a)) as writer_a, HybridStore(rp.config(url, b)) as writer_b:
        rp.put_conversation(writer_a)
        other = rp.TOKENS[::-1][:64].copy()
        writer_b.put_kv(other, [rp.page_of(50 + k).view(torch.int16) for k in range(4)])
        writer_b.flush()
        with HybridStore(rp.config(url, a)) as reader:
            plan = reader.match_pages(rp.TOKENS[:64])
            assert len(plan.pages) == 4
            pages, _ = reader.load(plan).result(timeout=30)
            reader.release(plan)
            assert all(p.dtype == torch.bfloat16 for p in pages)
            assert all(same(pages[k], rp.page_of(k)) for k in range(4))


def test_a_value_of_another_layout_is_not_adopted(master: Master, client: object) -> None:
    """Two models under one tenant: a value names the layout it was written with, and a
    tier whose store has another layout of that kind never adopts it."""
    from hybridstore.layout import Layout
    from hybridstore.objects import ObjectKind
    from hybridstore.testing.tiers import key_of

    from hybridstore.backends.remote import MooncakeTier

    url = master.url(prefix=f"m{os.getpid()}-{next(_prefixes)}", **SMALL)
    secret = os.urandom(32)
    page = rp.page_of(0)
    bf16 = {ObjectKind.PAGE: Layout.of(page)}
    i16 = {ObjectKind.PAGE: Layout.of(page.view(torch.int16))}
    tiers = [MooncakeTier(url, 16 << 20, client=client, secret=secret,  # type: ignore[arg-type]
                          tenant=b"t" * 16, layouts=lay) for lay in (bf16, i16, bf16)]
    try:
        data = page.view(torch.uint8).numpy().ravel()
        tiers[0].put(key_of(7), data, nbytes=data.nbytes, meta=b"m").result()
        assert tiers[1].adopt([key_of(7)]) == []
        assert tiers[1].stats()["other_layout"] == 1
        assert [k for k, _, _ in tiers[2].adopt([key_of(7)])] == [key_of(7)]
        assert np.array_equal(tiers[2].get(key_of(7)), data)
    finally:
        for t in tiers:
            t.close()


def test_encrypted_values_round_trip_and_hide_the_payload(master: Master,
                                                          client: object) -> None:
    from hybridstore.backends.remote import MooncakeTier, frame
    from hybridstore.testing.tiers import blob, key_of

    url = master.url(prefix=f"c{os.getpid()}-{next(_prefixes)}", **SMALL)
    secret = os.urandom(32)
    tier = MooncakeTier(url, 16 << 20, client=client, secret=secret,  # type: ignore[arg-type]
                        encrypt=True)
    plain = MooncakeTier(url, 16 << 20, client=client, secret=secret)  # type: ignore[arg-type]
    try:
        data = blob(100_000, 3)
        tier.put(key_of(1), data, nbytes=data.nbytes, meta=b"m").result()
        raw = client.store.get(frame.object_name(tier.spec.prefix, key_of(1)))  # type: ignore[attr-defined]
        assert data.tobytes()[:4096] not in raw
        assert np.array_equal(tier.get(key_of(1)), data)
        assert [k for k, _, _ in plain.adopt([key_of(1)])] == [key_of(1)]   # one key
        assert np.array_equal(plain.get(key_of(1)), data)
    finally:
        tier.close()
        plain.close()


def test_encryption_without_cryptography_names_the_extra(
        master: Master, client: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridstore import ConfigError, StoreConfig
    from hybridstore.backends.remote import MooncakeTier
    from hybridstore.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(MissingExtraError, match=r"hybridstore\[remote-encrypt\]"):
        MooncakeTier(master.url(**SMALL), 1 << 20, client=client, encrypt=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="set remote"):
        StoreConfig(remote_encrypt=True)


SILENT_OPEN = """
import os, sys, time
from hybridstore import HybridStore
from tests.backends import remote_peer as rp
started = time.monotonic()
with HybridStore(rp.config(sys.argv[1], os.urandom(32))) as store:
    print("remote" in store.tiers, round(time.monotonic() - started, 1), flush=True)
"""


def test_open_against_a_port_that_never_answers_is_bounded(tmp_path: Path) -> None:
    """The port accepts connections and never answers: the store opens without the remote
    tier within the URL's timeout, saying why (before, Mooncake's setup held the GIL and
    retried for minutes)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    url = f"mooncake://127.0.0.1:{server.getsockname()[1]}?timeout=2&segment=16MiB&buffer=16MiB"
    try:
        proc = subprocess.Popen([sys.executable, "-c", SILENT_OPEN, url], cwd=ROOT,
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("opening a store against a silent port hung") from None
    finally:
        server.close()
        for s in held:
            s.close()
    assert proc.returncode == 0, err[-2000:]
    found, seconds = out.split()
    assert found == "False" and float(seconds) < 10, out
    assert "did not answer an RPC within 2 s" in err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_layout_records_lost_in_a_master_restart_are_written_back(tmp_path: Path) -> None:
    """The master restarts (every object and record gone); the store that was open puts
    again and writes its layout records back, so a fresh store matches what it put."""
    assert BINARY is not None
    own = Master(BINARY, tmp_path / "master.log")
    url = own.url(prefix="r", **SMALL)
    secret = os.urandom(32)
    try:
        with HybridStore(rp.config(url, secret)) as writer:
            rp.put_conversation(writer)
            own.restart()
            deadline = time.monotonic() + 60
            for attempt in itertools.count():       # until the client is back and puts land
                tokens = np.random.default_rng(attempt).integers(0, 150_000, 64)
                puts = writer.stats()["tiers"]["remote"]["puts"]
                writer.put_kv(tokens, [rp.page_of(20 + k) for k in range(4)])
                writer.flush()
                if writer.stats()["tiers"]["remote"]["puts"] == puts + 4:   # all 4 landed
                    break
                assert time.monotonic() < deadline, "the writer never reached the new master"
                time.sleep(1)
            time.sleep(2.1)                    # past REPUBLISH_S, then one more put checks
            writer.put_kv(rp.TOKENS[::-1][:80].copy(), [rp.page_of(40)])
            writer.flush()
            with HybridStore(rp.config(url, secret)) as reader:
                plan = reader.match_pages(tokens)
                assert len(plan.pages) == 4 and set(reader.restore_cost(plan)) == {"remote"}
                pages, _ = reader.load(plan).result(timeout=30)
                reader.release(plan)
                assert all(same(pages[k], rp.page_of(20 + k)) for k in range(4))
    finally:
        own.stop()


EXIT_AFTER_LOSS = """
import os, sys, time
from pathlib import Path
from hybridstore import HybridStore
from hybridstore.backends.remote.master import Master, master_binary
from tests.backends import remote_peer as rp
master = Master(master_binary(), Path(sys.argv[1]))
url = master.url(prefix="x", segment="64MiB", buffer="32MiB", staging="16MiB", timeout=10, retry=1)
store = HybridStore(rp.config(url, os.urandom(32)))
rp.put_conversation(store)
master.kill()
if sys.argv[2] == "use":
    store.match(rp.TOKENS[::-1][:64].copy())      # finds the master gone
elif sys.argv[2] == "close":
    store.close()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("how", ["open", "use", "close"])
def test_exit_after_the_master_died_is_clean(tmp_path: Path, how: str) -> None:
    """The master dies while the store is open; the process exits 0 (before: with the
    store left open it hung for good at exit, its destructor waiting on a thread that
    could no longer start)."""
    proc = subprocess.Popen([sys.executable, "-c", EXIT_AFTER_LOSS, str(tmp_path / "m.log"),
                             how], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the process did not exit ({how})") from None
    assert "exiting" in out
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
