"""One-page puts of unrelated prompts whose bytes are copied outside the store lock.

:meth:`~hybridstore.HybridStore.put_kv_many` (vLLM's tiering manager: a job of
chunks, each keyed by its own hash) runs in three steps: under the store lock
the pages already held are touched and slots for the new ones are reserved in
the fastest tier (:func:`stage`); without the lock the bytes are copied into
the slots (several jobs copy at once, and lookups and loads are not held up by
the copies); under the lock again the slots are committed, indexed and written
through to the slower tiers as one batch (:func:`commit`).

A reserved slot is invisible until it is committed: nothing reads or evicts it
meanwhile.  Keys reserved by one call and not yet committed are skipped by the
others (:attr:`Staging.keys`): the first call stores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from hybridstore.errors import CapacityError
from hybridstore.index.meta import encode_page
from hybridstore.index.prefix import PrefixKeys
from hybridstore.objects import ObjectKey, ObjectKind, object_key
from hybridstore.store.landing import Landing


@dataclass
class Staged:
    """The new pages of one call: which prompt each is, its key and its reserved slot."""

    tier: str
    nbytes: int
    index: list[int] = field(default_factory=list)        # into the call's prompts
    keys: list[ObjectKey] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)


class Staging:
    """Keys reserved by calls in progress (one per store; the set is the landing's
    :attr:`~hybridstore.store.landing.Landing.reserved`, which the other puts skip)."""

    def __init__(self, keys: set[ObjectKey] | None = None) -> None:
        self.keys: set[ObjectKey] = set() if keys is None else keys


def stage(landing: Landing, staging: Staging, prompts: Sequence[PrefixKeys],
          nbytes: int) -> Staged:
    """Under the store lock: touch the held last pages of ``prompts``, reserve slots for
    the others (runs of at most an eighth of the tier, room made for each run)."""
    res, room = landing.res, landing.evictor
    name = res.chain[0]
    tier = res.tiers[name]
    out = Staged(name, nbytes)
    new: list[int] = []
    keys: list[ObjectKey] = []
    for i, prompt in enumerate(prompts):
        first = prompt.nblocks - 1
        okey = object_key(ObjectKind.PAGE, prompt.block_key(first))
        if res.index.held_tiers(prompt, first, first + 1)[0] != 0:
            res.index.add_pages(prompt, first, first + 1, None, nbytes)     # touched
        elif okey not in staging.keys:
            staging.keys.add(okey)
            new.append(i)
            keys.append(okey)
    charge = tier.charge(nbytes)
    run = max(1, min(len(keys), tier.capacity_bytes // 8 // max(charge, 1)))
    c = 0
    try:
        while c < len(keys):
            d = min(c + run, len(keys))
            part = keys[c:d]
            try:
                room.make_room(name, charge * len(part), ObjectKind.PAGE)
                arenas, which, offsets = room.retry(name, nbytes * len(part),
                                                    partial(tier.stage_many, part, nbytes))
            except CapacityError:
                if len(part) == 1:
                    raise
                run = 1            # room only one by one
                continue
            out.index += new[c:d]
            out.keys += part
            out.slots += [arenas[w][o:o + nbytes] for w, o in zip(which.tolist(), offsets.tolist())]
            c = d
    except BaseException:
        abort(landing, staging, out)
        staging.keys.difference_update(keys[c:])
        raise
    return out


def abort(landing: Landing, staging: Staging, staged: Staged) -> None:
    """Give back the slots of a call that failed (under the store lock)."""
    landing.res.tiers[staged.tier].abort_many(staged.keys)
    staging.keys.difference_update(staged.keys)


def commit(landing: Landing, staging: Staging, staged: Staged,
           prompts: Sequence[PrefixKeys]) -> int:
    """Under the store lock: make the filled slots visible, index them and write them
    through as one batch.  Returns the pages stored."""
    res = landing.res
    keys, name, nbytes = staged.keys, staged.tier, staged.nbytes
    try:
        if not keys:
            return 0
        landing.commit(name, keys, nbytes)
    finally:
        staging.keys.difference_update(keys)
    res.added(name, ObjectKind.PAGE, len(keys), res.tiers[name].charge(nbytes) * len(keys))
    B = res.block_size
    metas = []
    for i in staged.index:
        prompt = prompts[i]
        k = prompt.nblocks - 1
        res.index.add_pages(prompt, k, k + 1, name, nbytes)
        metas.append(encode_page(k, prompt.block_end(k) - k * B, prompt.key_before(k)))
    if res.writes_through(ObjectKind.PAGE):
        for dst in res.chain[1:]:
            landing.copies.write_through_many(keys, ObjectKind.PAGE, nbytes, metas, name, dst)
    return len(keys)
