"""What the store does with a ``remote`` tier that other stores share.

Two rules, both here so that the facade only calls them:

**What goes remote** (:meth:`RemoteSync.worth_sending`).  The remote tier follows the
tier policy like the disk tier below which it sits (``write-through``: every page as
it is put; ``write-back``: what the tier above evicts), with one restriction: a
checkpoint is sent only when every page it needs (its path from block 0 and one of
its cover pages) is remote already or on its way there.  A state without its pages
is useless to another store, and a page without a state is not: pages always go.

**What is found there** (:meth:`RemoteSync.sync`).  Before ``match`` and its kin the
store asks the pool which of the prompt's objects it holds past the pages the store
knows: the pages of the blocks after its held run (one ``batch_is_exist``), then the
checkpoints at every block end of the run so extended and at every position of the
first block past it, with that block's partial pages (a second one).  Objects found
are adopted: their headers are read (two ranged reads), their meta decoded as the
disk tier's is at reopen, and they join the index as held by ``remote``.  Objects
the remote tier dropped (gone from the pool, damaged, or the master down) are
forgotten first.  With the master down nothing is asked: the store serves what its
own tiers hold.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hybridstore.config import StoreConfig
from hybridstore.errors import CatalogError
from hybridstore.index import meta
from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import ROOT, Checkpoint
from hybridstore.layout import Layout
from hybridstore.objects import TIER_BITS, ObjectKey, ObjectKind, key_kind, object_key
from hybridstore.store.landing import take_layouts
from hybridstore.store.residency import Residency

log = logging.getLogger("hybridstore.store")

REMOTE = "remote"
MAX_PROBE = 4096
"""Keys asked about in one probe at most (a very long prompt asks about its first ones)."""


def open_remote(config: StoreConfig, secret: bytes, tenant: bytes,
                layouts: dict[ObjectKind, Layout]) -> Any:
    """The remote tier of ``config.remote``, its values sealed under ``secret`` and
    ``tenant`` (the store's namespace root), or ``None`` when its master cannot be
    reached now: the store then opens without it (logged), as an engine whose remote
    pool is down still serves from its own tiers.

    Raises:
        MissingExtraError: Mooncake (or, with ``remote_encrypt``, cryptography) is not
            installed (the config asks for it).
    """
    from hybridstore.backends.remote.tier import MooncakeTier
    from hybridstore.errors import ConfigError

    assert config.remote is not None
    if config.hash_secret is None:
        log.warning("the remote tier is used without hash_secret: this store keys and seals "
                    "its remote objects with its own secret, so no other store finds them; "
                    "give every store that shares the pool the same hash_secret")
    try:
        return MooncakeTier(config.remote, config.remote_bytes, h2d_gbps=config.h2d_gbps,
                            secret=secret, tenant=tenant, encrypt=config.remote_encrypt,
                            layouts=layouts)
    except ConfigError as e:
        log.warning("the remote tier is not used: %s", e)
        return None


class RemoteSync:
    """The remote rules of one store (see the module docstring).

    Args:
        residency: the store's record of who holds what.
        layouts: the store's layouts (a store that has put nothing takes the pool's).
        pending: the store's copies in flight, by ``(key, target tier)``.
    """

    def __init__(self, residency: Residency, layouts: dict[ObjectKind, Layout],
                 pending: dict[tuple[ObjectKey, str], Any]) -> None:
        self.res = residency
        self.tier: Any = residency.tiers[REMOTE]
        self.layouts = layouts
        self.pending = pending
        self.adopted = 0
        self.skipped_states = 0

    # -- what goes remote ---------------------------------------------------------------
    def worth_sending(self, okey: ObjectKey) -> bool:
        """Whether ``okey`` may be copied to the remote tier now."""
        if key_kind(okey) == ObjectKind.PAGE:
            return True
        index = self.res.index
        ck = index.checkpoint(okey[1:])
        ok = ck is not None and self._pages_remote(ck)
        if not ok:
            self.skipped_states += 1
        return ok

    def _pages_remote(self, ck: Checkpoint) -> bool:
        index = self.res.index
        ids = index._path(ck.base) if ck.base != ROOT else np.zeros(0, np.int64)
        if len(ids) and not self._remote(ids).all():
            return False
        covers = np.asarray(ck.covers, np.int64)
        return bool(len(covers) == 0 or self._remote(covers).any())

    def _remote(self, ids: np.ndarray) -> np.ndarray:
        """Per page node: remote already, or a copy there in flight."""
        index = self.res.index
        held = (index.page_columns(ids)["tiers"] & TIER_BITS[REMOTE]) != 0
        for i in np.flatnonzero(~held).tolist():
            okey = object_key(ObjectKind.PAGE, index.node_key(int(ids[i])))
            held[i] = (okey, REMOTE) in self.pending
        return held

    # -- what is found there ------------------------------------------------------------
    def sync(self, prompt: PrefixKeys) -> None:
        """Forget what the remote tier lost, then adopt the prompt's objects it holds
        (under the store lock; bounded: the tier's calls are)."""
        self.forget_lost()
        if not self.tier.available or prompt.nblocks == 0:
            return
        index = self.res.index
        held = index.held_run(prompt)
        pages = [object_key(ObjectKind.PAGE, prompt.block_key(k))
                 for k in range(held, min(prompt.nblocks, held + MAX_PROBE))]
        self._adopt(pages)
        run = index.held_run(prompt)
        B = prompt.block_size
        states: list[ObjectKey] = []
        partial: list[ObjectKey] = []
        for k in range(min(run, MAX_PROBE)):
            states.append(object_key(ObjectKind.STATE, prompt.block_key(k)))
        if run < prompt.nblocks and prompt.tokens is not None:
            for p in range(run * B + 1, prompt.block_end(run) + 1):
                key = prompt.key_at(p)
                if key is not None:
                    states.append(object_key(ObjectKind.STATE, key))
                    if p < prompt.block_end(run):
                        partial.append(object_key(ObjectKind.PAGE, key))
        states = [k for k in states if not self._known_state(k)]
        self._adopt(partial + states)
        self.forget_lost()

    def _known_state(self, okey: ObjectKey) -> bool:
        ck = self.res.index.checkpoint(okey[1:])
        return ck is not None and bool(ck.tiers & TIER_BITS[REMOTE])

    def _adopt(self, okeys: list[ObjectKey]) -> None:
        """Adopt those of ``okeys`` the pool holds (pages before states)."""
        if not okeys:
            return
        there = self.tier.exist_many(okeys)
        found = [k for k, ok in zip(okeys, there) if ok]
        if not found:
            return
        take_layouts(self.tier, self.layouts, {key_kind(k) for k in found},
                     lambda msg: self.tier.client.warn(f"the pool's {msg}"))
        states = []
        for okey, nbytes, blob in self.tier.adopt(found):
            kind = key_kind(okey)
            layout = self.layouts.get(kind)
            try:
                info = meta.decode(blob)
                if layout is None or layout.nbytes != nbytes:
                    raise CatalogError(f"{nbytes} bytes, not this store's {kind.name.lower()} "
                                       "layout")
                if isinstance(info, meta.PageMeta) != (kind == ObjectKind.PAGE):
                    raise CatalogError("its meta is of the other kind")
            except CatalogError as e:
                self.tier.client.warn(f"remote object {okey.hex()} ignored: {e}")
                self.tier.delete(okey)           # a foreign object: only forgotten here
                continue
            if isinstance(info, meta.PageMeta):
                self.res.index.restore_page(okey[1:], info.block, info.ntok, info.parent_key,
                                            REMOTE, nbytes)
                self.res.added(REMOTE, ObjectKind.PAGE, 1, self.tier.charge(nbytes))
                self.adopted += 1
            else:
                states.append((okey, nbytes, info))
        for okey, nbytes, state in states:
            self.res.index.restore_checkpoint(okey[1:], state.position, state.base_key,
                                              state.covers, REMOTE, nbytes)
            self.res.added(REMOTE, ObjectKind.STATE, 1, self.tier.charge(nbytes))
            self.adopted += 1

    def forget_lost(self) -> None:
        """Forget in the index every object the remote tier dropped."""
        index = self.res.index
        for okey in self.tier.take_lost():
            if key_kind(okey) == ObjectKind.PAGE:
                nid = index.find_node(okey[1:])
                n = index.page_info(nid)["nbytes"] if nid >= 0 else None
            else:
                ck = index.checkpoint(okey[1:])
                n = ck.nbytes if ck is not None else None
            if n is not None:
                self.res.forget(okey, REMOTE, n)
