"""The other store of the cross-process remote tests: ``python -m tests.backends.remote_peer
URL SECRET_HEX``.  It puts a conversation (pages and checkpoints, deterministic bytes),
flushes, prints ``READY``, then keeps its Mooncake segment (where the objects live)
until a line arrives on stdin."""

from __future__ import annotations

import sys

import numpy as np

from hybridstore import HybridStore, StoreConfig
from tests.store.test_api import page_of, state_of  # the same deterministic bytes

B = 16
TOKENS = np.random.default_rng(77).integers(0, 150_000, 200).astype(np.int64)
POSITIONS = (64, 100)          # a block end and a position inside block 6


def config(url: str, secret: bytes, **kw: object) -> StoreConfig:
    base: dict[str, object] = {"block_size": B, "host_bytes": 32 << 20, "remote": url,
                               "remote_bytes": 256 << 20, "hash_secret": secret,
                               "pin_host_memory": False}
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]


def put_conversation(store: HybridStore, length: int = 100) -> None:
    """Pages of blocks [0, length) and a checkpoint at each of POSITIONS."""
    prompt = store.prefix(TOKENS[:length])
    store.put_kv(prompt, [page_of(k) for k in range(prompt.nblocks)])
    for p in POSITIONS:
        if p <= length:
            assert store.put_state(TOKENS[:length], state_of(p), position=p)
    store.flush()


def main() -> None:
    url, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
    with HybridStore(config(url, secret)) as store:
        put_conversation(store)
        remote = store.stats()["tiers"]["remote"]
        print("READY", int(remote["objects"]), flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    main()
