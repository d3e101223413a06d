"""Tensor layouts: how a KV page or a checkpoint becomes one flat byte object.

A page is one tensor (or a dict of tensors, e.g. per layer); a checkpoint is a
``dict[str, tensor]`` of recurrent states.  Torch tensors of any dtype
(bfloat16 included) and numpy arrays are accepted.  Each entry is laid at a
256-byte aligned offset of the object, so restored views are aligned for any
dtype and for device copies.  What goes in comes out bit-exact, with the same
dtype, shape and kind (torch or numpy).

A store holds one layout for pages and one for checkpoints; an object whose
dtypes or shapes contradict it gets :class:`~hybridstore.errors.LayoutMismatchError`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hybridstore.errors import CatalogError, LayoutMismatchError
from hybridstore.objects import byte_view

ENTRY_ALIGN = 256
"""Each entry of an object starts at a multiple of this (aligned for any dtype and device copy)."""
_SINGLE = ""


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _torch():
    import torch

    return torch


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a layout: name, dtype, shape, place in the object."""

    name: str
    framework: str  # "torch" or "numpy"
    dtype: str      # "bfloat16" (torch) or a numpy dtype string ("<f4")
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _dtype_str(dtype: np.dtype) -> str:
    """A numpy dtype as a string that round-trips: ``dtype.str`` for plain dtypes, the
    JSON of its ``.npy`` descr for structured dtypes (``.str`` is ``|V8`` for
    those and loses the fields)."""
    if dtype.fields is None:
        return dtype.str
    return json.dumps(np.lib.format.dtype_to_descr(dtype))


def _tuples(descr: Any) -> Any:
    if isinstance(descr, list):
        return [tuple(_tuples(x) for x in field) if isinstance(field, list) else field
                for field in descr]
    return descr


def _dtype_of(text: str) -> np.dtype:
    """The inverse of :func:`_dtype_str`."""
    if text.startswith("["):
        return np.lib.format.descr_to_dtype(_tuples(json.loads(text)))
    return np.dtype(text)


def _spec_of(name: str, value: Any, offset: int) -> TensorSpec:
    if _is_torch(value):
        if value.device.type == "meta" or value.layout != _torch().strided:
            raise LayoutMismatchError(f"{name or 'value'} is a {value.layout} tensor on "
                                      f"{value.device}; pass a dense tensor with data")
        dtype = str(value.dtype).removeprefix("torch.")
        nbytes = value.numel() * value.element_size()
        return TensorSpec(name, "torch", dtype, tuple(value.shape), offset, nbytes)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise LayoutMismatchError(f"tensor {name!r} has dtype object; store numeric arrays only")
        return TensorSpec(name, "numpy", _dtype_str(value.dtype), tuple(value.shape), offset,
                          value.nbytes)
    raise LayoutMismatchError(
        f"{name or 'value'} is a {type(value).__name__}; pass a torch tensor or a numpy array "
        "(or a dict of them)")


@dataclass(frozen=True, slots=True)
class Layout:
    """The byte layout of one kind of object (pages, or checkpoints)."""

    specs: tuple[TensorSpec, ...]
    nbytes: int
    single: bool  # the value is one tensor, not a dict

    @classmethod
    def of(cls, value: Any) -> Layout:
        """The layout of ``value`` (a tensor/array, or a dict of them)."""
        items = _items(value)
        specs = []
        offset = 0
        for name, tensor in items:
            spec = _spec_of(name, tensor, offset)
            specs.append(spec)
            offset = -(-(offset + spec.nbytes) // ENTRY_ALIGN) * ENTRY_ALIGN
        if not specs:
            raise LayoutMismatchError("an empty dict cannot be stored; pass at least one tensor")
        total = specs[-1].offset + specs[-1].nbytes
        return cls(tuple(specs), total, not isinstance(value, Mapping))

    def check(self, value: Any, what: str) -> None:
        """Raise LayoutMismatchError unless ``value`` has exactly this layout."""
        other = Layout.of(value)
        if other == self:
            return
        if other.single != self.single or [s.name for s in other.specs] != [s.name for s in self.specs]:
            raise LayoutMismatchError(
                f"{what} has entries {[s.name for s in other.specs]} but this store holds "
                f"{[s.name for s in self.specs]}; use one layout per store (or another namespace/store)")
        for mine, theirs in zip(self.specs, other.specs):
            if mine != theirs:
                label = mine.name or what
                raise LayoutMismatchError(
                    f"{label}: got {theirs.framework} {theirs.dtype}{list(theirs.shape)}, but this "
                    f"store holds {mine.framework} {mine.dtype}{list(mine.shape)}; convert it, or open "
                    "a separate store for this model")

    # -- bytes ------------------------------------------------------------------------
    def pack_into(self, value: Any, out: np.ndarray) -> None:
        """Copy ``value``'s bytes into ``out`` (uint8, at least ``nbytes``)."""
        for spec, (_, tensor) in zip(self.specs, _items(value)):
            dst = out[spec.offset: spec.offset + spec.nbytes]
            if spec.framework == "torch":
                torch = _torch()
                src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                if src.is_cuda:
                    torch.from_numpy(dst).copy_(src)   # D2H into the (pinned) slot
                else:
                    # numpy's single-threaded memcpy: torch's intra-op threads only
                    # add jitter to a copy this size on a busy host.
                    dst[:] = src.numpy()
            else:
                dst[:] = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)

    def unpack(self, buf: np.ndarray) -> Any:
        """Tensors viewing ``buf`` (the caller gives up ``buf`` to them)."""
        out = {}
        for spec in self.specs:
            raw = buf[spec.offset: spec.offset + spec.nbytes]
            if spec.framework == "torch":
                torch = _torch()
                out[spec.name] = torch.from_numpy(raw).view(getattr(torch, spec.dtype)).reshape(spec.shape)
            else:
                out[spec.name] = raw.view(_dtype_of(spec.dtype)).reshape(spec.shape)
        return out[_SINGLE] if self.single else out

    def targets(self, into: Any) -> list[Target]:
        """Match one object's caller buffers to specs; raise LayoutMismatchError when they
        disagree.  Runs for every buffer of a load, so it compares dtype and shape
        directly and resolves each host buffer's byte view here, once, for :func:`copy_out`."""
        return self._match(into, None)

    def batch_targets(self, batch: Any, n: int) -> list[Target]:
        """Match a page-major batch to specs: each entry's buffer has ``>= n`` rows (row
        ``i`` receives object ``i``) of the entry's shape; ``Target.host`` is then the
        ``(rows, nbytes)`` uint8 view of a host buffer (``None`` on a GPU).

        Raises:
            LayoutMismatchError: names, dtypes, shapes or row counts disagree, or a
                buffer is not contiguous.
        """
        return self._match(batch, n)

    def rows_bytes(self, array: Any) -> np.ndarray:
        """The ``(rows, nbytes)`` uint8 view of a host array whose every row is one whole
        object of this layout (a layout of one tensor): checked once for all of its rows
        (:meth:`~hybridstore.HybridStore.load_rows`).

        Raises:
            LayoutMismatchError: the layout has several tensors, the rows' dtype or shape
                differ from it, the array is on a GPU, not contiguous, or read-only.
        """
        if not self.single or len(self.specs) != 1:
            raise LayoutMismatchError("rows of one array restore objects of one tensor; this "
                                      "layout has several: pass a buffer per object")
        if self.specs[0].offset or self.specs[0].nbytes != self.nbytes:
            raise LayoutMismatchError("this layout pads its tensor; rows of one array cannot "
                                      "hold its objects back to back")
        host = self._match(array, 0)[0].host
        if host is None:
            raise LayoutMismatchError("the array of rows is on a GPU; pass host memory")
        if not host.flags.writeable:
            raise LayoutMismatchError("the array of rows is read-only")
        return host

    def _match(self, buffers: Any, rows: int | None) -> list[Target]:
        items = _items(buffers)
        if len(items) != len(self.specs):
            raise LayoutMismatchError(f"buffers have {len(items)} entries, the layout {len(self.specs)}")
        what = "buffer" if rows is None else "batch buffer"
        pairs = []
        for spec, (name, tensor) in zip(self.specs, items):
            dtype, shape, contiguous = _facts(name, tensor, spec.offset)
            entry = shape if rows is None else shape[1:]
            if (name != spec.name or dtype != spec.dtype or entry != spec.shape
                    or (rows is not None and not shape)):
                raise LayoutMismatchError(
                    f"{what} {name or 'page'}: {dtype}{list(shape)} cannot receive "
                    f"{'' if rows is None else 'rows of '}{spec.dtype}{list(spec.shape)}; "
                    "allocate buffers of the stored layout"
                    + ("" if rows is None else ", (pages, *shape) for a batch"))
            if rows is not None and shape[0] < rows:
                raise LayoutMismatchError(f"{what} {name or 'pages'} has {shape[0]} rows; the "
                                          f"plan restores {rows}")
            if not contiguous:
                raise LayoutMismatchError(f"{what} {name or 'page'} must be contiguous")
            host = _host_bytes(tensor)
            if host is not None and rows is not None:
                host = host.reshape(shape[0], -1)
            pairs.append(Target(spec, tensor, host))
        return pairs

    # -- persistence ------------------------------------------------------------------
    def to_json(self) -> bytes:
        return json.dumps({"single": self.single, "nbytes": self.nbytes,
                           "specs": [[s.name, s.framework, s.dtype, list(s.shape), s.offset, s.nbytes]
                                     for s in self.specs]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Layout:
        """The layout recorded by :meth:`to_json`.

        Raises:
            CatalogError: the record is damaged.
        """
        try:
            doc = json.loads(raw)
            specs = tuple(TensorSpec(str(n), str(f), str(d), tuple(int(x) for x in sh), int(o),
                                     int(nb)) for n, f, d, sh, o, nb in doc["specs"])
            layout = cls(specs, int(doc["nbytes"]), bool(doc["single"]))
        except (ValueError, KeyError, TypeError, OverflowError) as e:   # JSONDecodeError too
            raise CatalogError(f"the stored tensor layout is damaged ({type(e).__name__}: {e})"
                               ) from e
        if layout.nbytes <= 0 or any(s.offset < 0 or s.offset + s.nbytes > layout.nbytes
                                     for s in specs):
            raise CatalogError("the stored tensor layout is damaged (its sizes do not add up)")
        return layout


def _items(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str) or not name:
                raise LayoutMismatchError(f"dict keys must be non-empty strings, got {name!r}")
        return sorted(value.items())
    return [(_SINGLE, value)]


def batch_rows(batch: Any) -> int:
    """Rows of a page-major batch (one tensor/array, or a dict of them, first dimension
    = pages); raises LayoutMismatchError when its entries disagree or one has no rows."""
    counts = set()
    for name, tensor in _items(batch):
        _, shape, _ = _facts(name, tensor, 0)
        if not shape:
            raise LayoutMismatchError(f"batch entry {name or 'pages'} is 0-d; a batch is "
                                      "(pages, *shape)")
        counts.add(shape[0])
    if len(counts) != 1:
        raise LayoutMismatchError(f"batch entries have different numbers of rows {sorted(counts)}; "
                                  "row i of every entry is page i")
    return counts.pop()


def batch_row(batch: Any, i: int) -> Any:
    """Page ``i`` of a page-major batch, as the per-page value it stands for."""
    if isinstance(batch, Mapping):
        return {name: tensor[i] for name, tensor in batch.items()}
    return batch[i]


def _facts(name: str, tensor: Any, offset: int) -> tuple[str, tuple[int, ...], bool]:
    """Dtype string, shape and C-contiguity of a caller buffer (raises for what is not one)."""
    if _is_torch(tensor):
        return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.is_contiguous()
    if isinstance(tensor, np.ndarray):
        return _dtype_str(tensor.dtype), tensor.shape, tensor.flags.c_contiguous
    _spec_of(name, tensor, offset)      # raises LayoutMismatchError: not a tensor
    raise AssertionError("unreachable")


def _host_bytes(tensor: Any) -> np.ndarray | None:
    """A contiguous host buffer as flat uint8 (no copy); None for a GPU tensor."""
    if _is_torch(tensor) and tensor.is_cuda:
        return None
    return byte_view(tensor)


class Target(NamedTuple):
    """A caller buffer matched to one entry of a layout (:meth:`Layout.targets`)."""

    spec: TensorSpec
    buffer: Any                 # the caller's tensor or array
    host: np.ndarray | None     # its bytes as a uint8 array (host buffers); None on a GPU


def copy_out(target: Target, src: np.ndarray) -> None:
    """Copy one entry's bytes from a host buffer into the caller's buffer."""
    spec = target.spec
    raw = src[spec.offset: spec.offset + spec.nbytes]
    if target.host is not None:
        target.host[:] = raw
        return
    torch = _torch()
    flat = target.buffer.view(-1).view(torch.uint8)
    with warnings.catch_warnings():  # the source view is read-only; torch only reads it
        warnings.simplefilter("ignore", UserWarning)
        flat.copy_(torch.from_numpy(raw), non_blocking=True)
