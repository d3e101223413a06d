"""The bytes of SGLang's host pools as hybridstore objects.

A KV page is stored as the bytes of ``host_pool.get_data_page(slot, flat=True)``
(the page's K half then its V half for MHA pools, the one latent for MLA), so
the legacy page calls (flat page tensors) and the zero-copy v1 calls (host
slots) read and write the same objects.  Where the host layout keeps each half
of a page contiguous (``page_first``, ``page_first_direct``, ``page_head``:
``pool_host/mha.py``) the adapter hands the store views into the pool's
``kv_buffer`` -- the store copies straight between its tiers and the pool --
and falls back to ``get_data_page`` / ``set_from_flat_data_page`` copies
otherwise (``layer_first``).  The flat byte order depends on the host layout,
so the layout is part of the store's namespace (:func:`layout_tag`).

A Mamba state is the ``MambaPoolHost`` slot bytes (``pool_host/mamba.py``:
every Mamba layer's temporal state, then each conv state, then registered side
states), read with ``get_data_page`` and written back with
``set_from_flat_data_page``; one state is one object.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch

PageViews = dict[str, torch.Tensor]
"""One stored page: ``{"k", "v"}`` uint8 halves (or ``{"kv"}``: the whole page)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class KVPages:
    """Reads and writes whole KV pages of one SGLang KV host pool.

    Args:
        pool: the KV host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``,
            ...): ``page_size``, ``get_data_page``, ``set_from_flat_data_page``,
            ``get_dummy_flat_data_page`` and, for zero copy, ``kv_buffer``.

    Attributes:
        mode: ``"halves"`` (K and V halves each a contiguous view of
            ``kv_buffer``), ``"whole"`` (the page is one contiguous view) or
            ``"copy"`` (through ``get_data_page`` / ``set_from_flat_data_page``).
        nbytes: bytes of one page.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        flat = pool.get_data_page(0, flat=True)
        self.dtype = flat.dtype
        self.nbytes = flat.numel() * flat.element_size()
        self.mode = self._mode()
        self.names: tuple[str, ...] = ("kv",) if self.mode == "whole" else ("k", "v")

    def _mode(self) -> str:
        buf = getattr(self.pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            return "copy"
        page = self.pool.get_data_page(0, flat=False)
        if page.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            return "copy"     # not a view of the pool: writes into it would be lost
        if page.is_contiguous():
            return "whole"
        if page.dim() > 1 and page.shape[0] == 2 and page[0].is_contiguous() and page[1].is_contiguous():
            return "halves"
        return "copy"

    # -- from flat pages (the legacy calls) ----------------------------------------------
    def split(self, flat: torch.Tensor) -> PageViews:
        """A flat page (``get_data_page(flat=True)``, any dtype) as stored entries (views)."""
        raw = _bytes(flat.contiguous())
        if len(self.names) == 1:
            return {"kv": raw}
        half = raw.numel() // 2
        return {"k": raw[:half], "v": raw[half:]}

    # -- host slots (the v1 calls) ------------------------------------------------------
    def views(self, slot: int) -> PageViews | None:
        """Writable views of the page at token slot ``slot`` (``None`` in ``"copy"`` mode)."""
        if self.mode == "copy":
            return None
        page = self.pool.get_data_page(slot, flat=False)
        if self.mode == "whole":
            return {"kv": _bytes(page)}
        return {"k": _bytes(page[0]), "v": _bytes(page[1])}

    def run_views(self, slots: list[int]) -> PageViews | None:
        """One page-major batch (``(len(slots), nbytes/2)`` uint8 views of the K and V
        halves) when ``slots`` are consecutive pages of a ``page_first*`` / ``page_head``
        pool; ``None`` otherwise.  The store then moves a whole run with one copy per
        half instead of two per page (``put_kv_batch``, ``load(into=(batch, None))``)."""
        layout, ps, n = getattr(self.pool, "layout", None), self.page_size, len(slots)
        if self.mode != "halves" or n < 2 or any(b - a != ps for a, b in pairwise(slots)):
            return None
        if layout == "page_first":
            rows = slice(slots[0], slots[0] + n * ps)            # token-major
        elif layout in ("page_first_direct", "page_head"):
            rows = slice(slots[0] // ps, slots[0] // ps + n)     # page-major
        else:
            return None
        buf = self.pool.kv_buffer
        halves = {"k": buf[0, rows], "v": buf[1, rows]}
        if not all(h.is_contiguous() and h.numel() * h.element_size() == n * self.nbytes // 2
                   for h in halves.values()):
            return None
        return {name: h.reshape(n, -1).view(torch.uint8) for name, h in halves.items()}

    def read(self, slot: int) -> PageViews:
        """The page at ``slot`` to store: views, or a copy in ``"copy"`` mode."""
        views = self.views(slot)
        return views if views is not None else self.split(self.pool.get_data_page(slot, flat=True))

    def targets(self, slot: int) -> tuple[PageViews, torch.Tensor | None]:
        """Where a load of the page at ``slot`` goes: ``(entries, scratch)``; ``scratch`` is
        not None in ``"copy"`` mode and must then go through :meth:`commit`."""
        views = self.views(slot)
        if views is not None:
            return views, None
        scratch = torch.empty(self.nbytes, dtype=torch.uint8)
        return self.split(scratch), scratch

    def commit(self, slot: int, scratch: torch.Tensor) -> None:
        """Write a loaded ``"copy"``-mode page into the pool."""
        self.pool.set_from_flat_data_page(slot, scratch.view(self.dtype))


def state_bytes(pool: Any, slot: int) -> torch.Tensor:
    """The bytes of one ``MambaPoolHost`` slot (a copy, uint8)."""
    return _bytes(pool.get_data_page(slot, flat=True).contiguous())


def layout_tag(kv_pool: Any, state_pool: Any | None) -> str:
    """What fixes the stored bytes' meaning: pool classes, layouts, dtypes, sizes."""
    tag = (f"{type(kv_pool).__name__}:{getattr(kv_pool, 'layout', '?')}:"
           f"{str(getattr(kv_pool, 'dtype', '?')).removeprefix('torch.')}:ps{kv_pool.page_size}:"
           f"{getattr(kv_pool, 'size_per_token', '?')}")
    if state_pool is not None:
        tag += (f"+{type(state_pool).__name__}:{getattr(state_pool, 'layout', '?')}:"
                f"{getattr(state_pool, 'size_per_token', '?')}")
    return tag
