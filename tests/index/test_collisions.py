"""Crafted key collisions (issue 13, item 2): with the secret they are easy, without it they fail.

The attack: the lane sums are linear, so anyone who knows a store's multipliers finds two
different blocks with the same key by lattice reduction (a short integer vector ``d`` with
``sum d[i] * ra[i] = sum d[i] * rb[i] = 0 (mod p)``; the blocks are ``base`` and ``base + d``).
The test runs that attack for real under an attacker's own secret, checks that it works
there (so the search is not a straw man), and then that the pair it found means nothing to
a store keyed by another secret: different keys, no hit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridstore import HybridStore, StoreConfig
from hybridstore.index import keys as K

B = 16
BASE = 1 << 31


def _reduce(basis: list[list[int]]) -> list[list[int]]:
    """LLL-reduce linearly independent integer rows (Cohen, Algorithm 2.6.7: integral LLL,
    delta = 3/4).  Exact integer arithmetic; fine for a few dozen dimensions."""
    b = [list(row) for row in basis]
    n = len(b)
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))
    d = [1] + [0] * n               # d[i]: Gram determinant of the first i rows
    lam = [[0] * n for _ in range(n)]

    def red(k: int, l: int) -> None:
        if 2 * abs(lam[k][l]) > d[l + 1]:
            q = (2 * lam[k][l] + d[l + 1]) // (2 * d[l + 1])
            b[k] = [x - q * y for x, y in zip(b[k], b[l])]
            lam[k][l] -= q * d[l + 1]
            for i in range(l):
                lam[k][i] -= q * lam[l][i]

    def swap(k: int, kmax: int) -> None:
        b[k], b[k - 1] = b[k - 1], b[k]
        for j in range(k - 1):
            lam[k][j], lam[k - 1][j] = lam[k - 1][j], lam[k][j]
        la = lam[k][k - 1]
        bb = (d[k - 1] * d[k + 1] + la * la) // d[k]
        for i in range(k + 1, kmax + 1):
            t = lam[i][k]
            lam[i][k] = (d[k + 1] * lam[i][k - 1] - la * t) // d[k]
            lam[i][k - 1] = (bb * t + la * lam[i][k]) // d[k + 1]
        d[k] = bb

    d[1] = dot(b[0], b[0])
    k, kmax = 1, 0
    while k < n:
        if k > kmax:
            kmax = k
            for j in range(k + 1):
                u = dot(b[k], b[j])
                for i in range(j):
                    u = (d[i + 1] * u - lam[k][i] * lam[j][i]) // d[i]
                if j < k:
                    lam[k][j] = u
                else:
                    d[k + 1] = u
        while True:
            red(k, k - 1)
            if 4 * d[k + 1] * d[k - 1] < 3 * d[k] * d[k] - 4 * lam[k][k - 1] ** 2:
                swap(k, kmax)
                k = max(1, k - 1)
                continue
            for l in range(k - 2, -1, -1):
                red(k, l)
            k += 1
            break
    return b


def crafted_collision(key: K.HashKey, n: int) -> tuple[list[int], list[int]]:
    """Two different ``n``-token blocks with equal lane sums under ``key`` (which the
    attacker must know: it reads the multipliers off ``key.table``)."""
    tab = key.table.astype(object)
    ra = [int(tab[1, i]) << 32 | int(tab[0, i]) for i in range(n)]
    rb = [int(tab[3, i]) << 32 | int(tab[2, i]) for i in range(n)]
    p, w = K.PRIME, 1 << 64
    rows = [[int(i == j) for j in range(n)] + [w * ra[i], w * rb[i]] for i in range(n)]
    rows += [[0] * n + [w * p, 0], [0] * n + [0, w * p]]
    for row in _reduce(rows):
        diff = row[:n]
        if row[n:] == [0, 0] and any(diff) and max(map(abs, diff)) < BASE:
            return [BASE] * n, [BASE + x for x in diff]
    raise AssertionError("lattice reduction found no short collision")


@pytest.mark.parametrize("attempt", range(3))
def test_a_collision_crafted_under_one_secret_is_no_collision_under_another(attempt: int) -> None:
    attacker = K.HashKey(os.urandom(32), B)
    x, y = crafted_collision(attacker, B)
    assert x != y
    root = attacker.root("")
    np.testing.assert_array_equal(K.chain_hash_tokens(x, B, root, attacker),   # the attack is real
                                  K.chain_hash_tokens(y, B, root, attacker))
    # The pair is a collision of the attacker's key only.
    victim = K.HashKey(os.urandom(32), B)
    vroot = victim.root("")
    kx, ky = K.chain_hash_tokens(x, B, vroot, victim), K.chain_hash_tokens(y, B, vroot, victim)
    assert (kx != ky).all()
    # Every inner key differs too (checkpoints inside the block).
    ix, iy = K.block_prefix_keys(x, vroot, victim), K.block_prefix_keys(y, vroot, victim)
    first = next(i for i in range(B) if x[i] != y[i])
    assert (ix[first:] != iy[first:]).all()


def test_a_store_serves_no_prompt_for_a_crafted_twin(tmp_path) -> None:
    """The attacker's colliding pair, sent to a store with its own secret: no hit."""
    attacker = K.HashKey(os.urandom(32), B)
    x, y = crafted_collision(attacker, B)
    cfg = StoreConfig(block_size=B, host_bytes=1 << 20, disk_path=str(tmp_path / "hs"))
    with HybridStore(cfg) as store:
        store.put_kv(x, np.arange(64, dtype=np.uint8))
        store.put_state(x, np.ones(8, np.uint8))
        plan = store.match(x)
        assert plan.position == B
        store.release(plan)
        plan = store.match(y)
        assert plan.position == 0 and store.present_pages(y) == 0
        store.release(plan)


def test_with_the_secret_the_same_search_succeeds_so_the_secret_is_the_guard() -> None:
    secret = os.urandom(32)
    x, y = crafted_collision(K.HashKey(secret, B), B)
    with HybridStore(StoreConfig(block_size=B, hash_secret=secret)) as store:
        store.put_kv(x, np.arange(64, dtype=np.uint8))
        assert store.present_pages(y) == 1
