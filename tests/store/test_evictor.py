"""The evictor alone: its safety rules over two accounting tiers, without a HybridStore.

Objects are put straight into the index and the tiers (what the put path does), then
the :class:`Evictor` is asked for room; the tests read what left which tier.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore.backends.accounting import AccountingTier
from hybridstore.errors import CapacityError, ObjectTooLargeError
from hybridstore.index import keys as hashing
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import HybridIndex
from hybridstore.objects import TIER_BITS, KeyBatch, ObjectKind, object_key
from hybridstore.policy import eviction_policy
from hybridstore.policy.base import Victim
from hybridstore.policy.tiering import tier_policy
from hybridstore.store.copies import TierCopies
from hybridstore.store.evictor import Evictor
from hybridstore.store.residency import Residency

B = 4          # tokens per block
PAGE = 100     # bytes of a page
STATE = 300    # bytes of a checkpoint
HOST, DISK = TIER_BITS["host"], TIER_BITS["disk"]


class Rig:
    """Index + two accounting tiers + residency, copies and an evictor over them."""

    def __init__(self, *, tiering: str = "write-through", policy: str = "lru",
                 host: int = 4000, disk: int = 8000) -> None:
        self.key = hashing.HashKey.generate(B)
        self.root = self.key.root("evictor")
        self.index = HybridIndex(B, self.root)
        self.tiers = {"host": AccountingTier("host", host, read_gbps=64),
                      "disk": AccountingTier("disk", disk, read_gbps=5)}
        self.res = Residency(self.index, self.tiers, tier_policy(tiering), B)
        self.copies = TierCopies(self.res)
        self.evictor = Evictor(self.res, self.copies, eviction_policy(policy))
        assert self.copies.room is self.evictor

    def prompt(self, first_token: int, nblocks: int) -> PrefixKeys:
        tokens = np.arange(first_token, first_token + nblocks * B, dtype=np.int64)
        return PrefixKeys.from_tokens(tokens, block_size=B, root=self.root,
                                      hash_key=self.key)

    def put(self, prompt: PrefixKeys, *, state: bool = True, tier: str = "host") -> None:
        """The pages of every block of ``prompt`` and a checkpoint at its end, in ``tier``."""
        t = self.tiers[tier]
        keys = KeyBatch.of(ObjectKind.PAGE, prompt.keys.astype("<u8", copy=False).tobytes())
        t.put_many(keys, None, nbytes=PAGE)
        self.res.added(tier, ObjectKind.PAGE, len(keys), t.charge(PAGE) * len(keys))
        self.index.add_pages(prompt, 0, prompt.nblocks, tier, PAGE)
        if state:
            key16 = prompt.key_at(prompt.length)
            t.put(object_key(ObjectKind.STATE, key16), None, nbytes=STATE).result()
            self.res.added(tier, ObjectKind.STATE, 1, t.charge(STATE))
            self.index.add_checkpoint(prompt, prompt.length, tier, STATE)

    def page_mask(self, prompt: PrefixKeys, block: int) -> int:
        nid = self.index.find_node(prompt.key_before(block + 1))
        return self.index.page_tiers(nid) if nid >= 0 else 0

    def state_mask(self, prompt: PrefixKeys) -> int:
        ck = self.index.checkpoint(prompt.key_at(prompt.length))
        return 0 if ck is None else ck.tiers

    def consistent(self) -> None:
        """The tiers hold exactly what residency counts, and refcounts add up."""
        assert self.index.check_refcounts()
        for name, tier in self.tiers.items():
            held = sum(n for _, n, _ in tier.entries())
            assert held == sum(self.res.kind_bytes[name].values()) == tier.used_bytes
            assert len(list(tier.entries())) == self.res.objects[name]


def test_lru_evicts_the_least_recently_used_request_first():
    rig = Rig()
    a, b, c = rig.prompt(0, 3), rig.prompt(1000, 3), rig.prompt(2000, 3)
    for p in (a, b, c):
        rig.put(p)
    rig.index.release(rig.index.match(a))          # a is used again: b is now the oldest
    used = rig.tiers["host"].used_bytes
    freed = rig.evictor.evict("host", 3 * PAGE + STATE)
    assert freed >= 3 * PAGE + STATE and rig.tiers["host"].used_bytes == used - freed
    assert rig.state_mask(b) == 0 and all(rig.page_mask(b, k) == 0 for k in range(3))
    assert rig.state_mask(a) == HOST and rig.state_mask(c) == HOST
    assert rig.evictor.evictions == 4                # three pages and one checkpoint
    rig.consistent()


def test_pinned_objects_stay_until_released():
    rig = Rig()
    a, b = rig.prompt(0, 4), rig.prompt(1000, 4)
    rig.put(a)
    rig.put(b)
    plan = rig.index.match(a)
    assert plan.position == a.length
    freed = rig.evictor.evict("host", 10**9)           # everything it may
    assert freed == 4 * PAGE + STATE                  # all of b, none of a
    assert rig.state_mask(a) == HOST and all(rig.page_mask(a, k) == HOST for k in range(4))
    assert rig.state_mask(b) == 0
    with pytest.raises(CapacityError, match="pinned"):
        rig.evictor.make_room("host", rig.tiers["host"].capacity_bytes)
    rig.index.release(plan)
    rig.evictor.make_room("host", rig.tiers["host"].capacity_bytes)
    assert rig.tiers["host"].used_bytes == 0
    rig.consistent()


def test_a_page_a_checkpoint_needs_stays_until_the_checkpoint_goes():
    rig = Rig()                                  # lru is dependency-aware; nothing spills
    a = rig.prompt(0, 3)
    rig.put(a)
    nid = rig.index.find_node(a.key_before(2))
    assert rig.evictor.evict_one(Victim(ObjectKind.PAGE, nid), "host") == 0
    assert rig.page_mask(a, 1) == HOST             # its only copy, needed: kept
    ck = rig.index.checkpoint(a.key_at(a.length))
    assert rig.evictor.evict_one(Victim(ObjectKind.STATE, ck.key), "host") == STATE
    assert rig.evictor.evict_one(Victim(ObjectKind.PAGE, nid), "host") == PAGE
    assert rig.page_mask(a, 1) == 0
    rig.consistent()


def test_evicting_a_checkpoint_takes_the_pages_only_it_needed():
    rig = Rig()
    a, b = rig.prompt(0, 3), rig.prompt(1000, 3)
    rig.put(a)
    rig.put(b)
    # a's pages are offered by no ranking while its checkpoint needs them; once the
    # checkpoint goes, the pages only it needed follow at once (before b is touched)
    freed = rig.evictor.evict("host", STATE + 3 * PAGE)
    assert freed == STATE + 3 * PAGE and rig.evictor.evictions == 4
    assert rig.state_mask(a) == 0 and all(rig.page_mask(a, k) == 0 for k in range(3))
    assert rig.state_mask(b) == HOST and all(rig.page_mask(b, k) == HOST for k in range(3))
    rig.consistent()


def test_a_plain_lru_drops_needed_pages_too():
    rig = Rig(policy="lru-vllm")               # not dependency-aware
    a = rig.prompt(0, 3)
    rig.put(a)
    nid = rig.index.find_node(a.key_before(1))
    assert rig.evictor.evict_one(Victim(ObjectKind.PAGE, nid), "host") == PAGE
    assert rig.page_mask(a, 0) == 0
    rig.consistent()


def test_write_back_spills_the_last_copy_to_the_tier_below():
    rig = Rig(tiering="write-back")
    a, b = rig.prompt(0, 3), rig.prompt(1000, 3)
    rig.put(a)
    rig.put(b)
    rig.index.release(rig.index.match(b))          # a is the oldest
    rig.evictor.evict("host", 3 * PAGE + STATE)
    assert rig.state_mask(a) == DISK and all(rig.page_mask(a, k) == DISK for k in range(3))
    assert rig.tiers["disk"].contains(object_key(ObjectKind.STATE, a.key_at(a.length)))
    assert rig.state_mask(b) == HOST
    assert rig.res.kind_bytes["disk"][ObjectKind.PAGE] == 3 * PAGE
    assert rig.res.kind_bytes["disk"][ObjectKind.STATE] == STATE
    rig.consistent()


def test_a_full_tier_below_drops_what_may_be_dropped():
    rig = Rig(tiering="write-back", disk=PAGE + STATE + PAGE + PAGE // 2)
    a, b = rig.prompt(0, 2), rig.prompt(1000, 1)
    rig.put(a)
    rig.put(b, tier="disk")                        # 400 of the disk's 550 bytes, then pinned
    plan = rig.index.match(b)
    assert plan.position == b.length
    ck = rig.index.checkpoint(a.key_at(a.length))
    # no room below for the spill (b is pinned there): a checkpoint may always be dropped
    assert rig.evictor.evict_one(Victim(ObjectKind.STATE, ck.key), "host") == STATE
    assert rig.state_mask(a) == 0 and rig.tiers["disk"].used_bytes == PAGE + STATE
    # a's first page fits below: spilled, not dropped
    nid0, nid1 = (rig.index.find_node(a.key_before(k + 1)) for k in range(2))
    assert rig.evictor.evict_one(Victim(ObjectKind.PAGE, nid0), "host") == PAGE
    assert rig.page_mask(a, 0) == DISK
    # the second needs room below: the disk evicts what it may (a's first page, not b's)
    assert rig.evictor.evict_one(Victim(ObjectKind.PAGE, nid1), "host") == PAGE
    assert rig.page_mask(a, 1) == DISK and rig.page_mask(a, 0) == 0
    assert rig.state_mask(b) == DISK and rig.page_mask(b, 0) == DISK
    rig.index.release(plan)
    rig.consistent()


def test_an_object_whose_copy_is_in_flight_stays():
    rig = Rig()
    a = rig.prompt(0, 2)
    rig.put(a)
    okey = object_key(ObjectKind.STATE, a.key_at(a.length))
    rig.copies.inflight[okey] += 1
    ck = rig.index.checkpoint(okey[1:])
    assert rig.evictor.evict_one(Victim(ObjectKind.STATE, ck.key), "host") == 0
    del rig.copies.inflight[okey]
    assert rig.evictor.evict_one(Victim(ObjectKind.STATE, ck.key), "host") == STATE
    rig.consistent()


def test_make_room_frees_slack_and_refuses_what_can_never_fit():
    rig = Rig(host=4000)
    for i in range(8):
        rig.put(rig.prompt(1000 * i, 1))                  # 8 x (100 + 300) = 3200 bytes
    rig.evictor.make_room("host", 1000)
    room = rig.tiers["host"].free_bytes
    assert room >= 1000 and room >= 1000 + 4000 // 32 - 400   # the need plus some slack
    with pytest.raises(ObjectTooLargeError):
        rig.evictor.make_room("host", 4001)
    rig.consistent()
