"""Tenants: the namespace is enforced by the store, and what it writes is owner-only
(issue 13, item 3)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from hybridstore import HybridStore, NamespaceError, StoreConfig

B = 16
TOKENS = np.arange(4 * B, dtype=np.int64)


def _cfg(tmp_path, namespace: str, **kw) -> StoreConfig:
    return StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"),
                       disk_bytes=16 << 20, tier_policy="write-through", namespace=namespace, **kw)


def _fill(store: HybridStore) -> None:
    store.put_kv(TOKENS, [np.full(256, i, np.uint8) for i in range(4)])
    store.put_state(TOKENS, np.arange(64, dtype=np.uint8))
    store.flush()


def test_a_directory_opens_only_with_the_namespace_that_created_it(tmp_path):
    with HybridStore(_cfg(tmp_path, "tenant-a")) as a:
        _fill(a)
    with pytest.raises(NamespaceError, match="another namespace"):
        HybridStore(_cfg(tmp_path, "tenant-b"))
    # the refused open changed nothing: tenant a finds everything, and the directory can be
    # opened again (the refused store released its lock)
    with HybridStore(_cfg(tmp_path, "tenant-a")) as a:
        plan = a.match(TOKENS)
        assert plan.position == 4 * B
        pages, _ = a.load(plan).result()
        assert [int(p[0]) for p in pages] == [0, 1, 2, 3]
        a.release(plan)


def test_a_prompt_hashed_under_another_root_is_refused(tmp_path):
    with HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, namespace="a")) as a, \
            HybridStore(StoreConfig(block_size=B, host_bytes=1 << 20, namespace="b")) as b:
        a.put_kv(TOKENS, [np.full(256, i, np.uint8) for i in range(4)])
        a.put_state(TOKENS, np.arange(64, dtype=np.uint8))
        foreign = b.prefix(TOKENS)                 # b's (public) root
        for call in (lambda: a.match(foreign), lambda: a.present_pages(foreign),
                     lambda: a.put_kv(foreign, [np.zeros(256, np.uint8)] * 4)):
            with pytest.raises(NamespaceError):
                call()
        assert a.stats()["pages"] == 4


def test_files_and_directories_are_owner_only_even_under_umask_0(tmp_path):
    old = os.umask(0)
    try:
        with HybridStore(_cfg(tmp_path, "t")) as store:
            _fill(store)
    finally:
        os.umask(old)
    root = tmp_path / "hs"
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
            mode = stat.S_IMODE(os.stat(name).st_mode)
            assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
            seen += 1
    assert seen >= 5          # the directory, its lock, a segment, the catalog and its files


# -- the hashing secret (issue 13, item 2) -----------------------------------------------
def _hit(store: HybridStore) -> int:
    plan = store.match(TOKENS)
    try:
        return plan.position
    finally:
        store.release(plan)


def test_the_disk_tier_keeps_its_hash_secret_so_a_reopen_hits(tmp_path):
    from hybridstore.backends.catalog import Catalog
    from hybridstore.backends.disk.objects import CATALOG_DIR
    from hybridstore.store.facade import SECRET_INFO

    with HybridStore(_cfg(tmp_path, "t")) as store:
        _fill(store)
        keys = store.prefix(TOKENS).keys.copy()
    cat = Catalog(tmp_path / "hs" / CATALOG_DIR)
    try:
        secret = cat.get_info(SECRET_INFO)
    finally:
        cat.close()
    assert secret is not None and len(secret) == 32
    for name in os.listdir(tmp_path / "hs" / CATALOG_DIR):      # the secret's file is 0600
        assert stat.S_IMODE(os.stat(tmp_path / "hs" / CATALOG_DIR / name).st_mode) == 0o600
    with HybridStore(_cfg(tmp_path, "t")) as store:
        np.testing.assert_array_equal(store.prefix(TOKENS).keys, keys)
        assert _hit(store) == 4 * B
    # the same secret, given explicitly, opens it too; another one is refused
    with HybridStore(_cfg(tmp_path, "t", hash_secret=secret)) as store:
        assert _hit(store) == 4 * B
    with pytest.raises(NamespaceError, match="another hash secret"):
        HybridStore(_cfg(tmp_path, "t", hash_secret=bytes(32)))
    with HybridStore(_cfg(tmp_path, "t")) as store:             # the refusal changed nothing
        assert _hit(store) == 4 * B


def test_two_stores_key_the_same_prompt_differently(tmp_path):
    """Each directory draws its own secret: same namespace, same tokens, unrelated keys."""
    a_cfg = _cfg(tmp_path / "a", "t")
    b_cfg = _cfg(tmp_path / "b", "t")
    with HybridStore(a_cfg) as a, HybridStore(b_cfg) as b:
        ka, kb = a.prefix(TOKENS).keys, b.prefix(TOKENS).keys
        assert (ka != kb).all()
        with pytest.raises(NamespaceError):
            b.match(a.prefix(TOKENS))
    with HybridStore(StoreConfig(block_size=B, hash_secret=b"s" * 32)) as a, \
            HybridStore(StoreConfig(block_size=B, hash_secret=b"s" * 32)) as b:
        np.testing.assert_array_equal(a.prefix(TOKENS).keys, b.prefix(TOKENS).keys)


@pytest.mark.parametrize("damage", ["damaged", "missing"])
def test_a_lost_hash_secret_costs_the_objects_it_keyed_and_nothing_else(tmp_path, damage,
                                                                        caplog):
    from hybridstore.backends.catalog import Catalog
    from hybridstore.backends.disk.objects import CATALOG_DIR
    from hybridstore.store.facade import SECRET_INFO

    with HybridStore(_cfg(tmp_path, "t")) as store:
        _fill(store)
    cat = Catalog(tmp_path / "hs" / CATALOG_DIR)
    try:
        if damage == "damaged":
            cat.put_info(SECRET_INFO, b"\x00" * 3)
        else:
            from hybridstore.backends.catalog import _INFO_PREFIX
            cat._write(lambda txn: txn.delete(_INFO_PREFIX + SECRET_INFO.encode(), db=cat._meta))
    finally:
        cat.close()
    with HybridStore(_cfg(tmp_path, "t")) as store:             # opens; the objects are gone
        assert "hash secret record is " + damage in caplog.text
        assert store.tiers["disk"].stats()["objects"] == 0 and _hit(store) == 0
        _fill(store)                                            # and it works as new
        assert _hit(store) == 4 * B
    with HybridStore(_cfg(tmp_path, "t")) as store:
        assert _hit(store) == 4 * B
