"""Hypothesis strategies of hostile and edge values for the fuzz campaign
(``tests/reliability/fuzz.py``): wrong types, numpy and torch arrays of every dtype and
shape (structured, object, bool, float, 0-d, N-d, strided, big-endian, read-only), huge and
negative ints, NaN, str/bytes, None, nested lists, iterators."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

NP_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
             "float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8", "<U3",
             "S4", "V4", "datetime64[s]", "timedelta64[ms]", "object",
             [("a", "<i4"), ("b", "<f2")], [("x", "u1", (3,)), ("y", ">u8")]]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]

INTS = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([-1, -(2**31), 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                     2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(),
)
FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.5, 1.0, 16.0, 1e300,
                                    -1e-300]),
                   st.floats())


@st.composite
def np_scalars(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["int8", "uint8", "int32", "uint32", "int64", "uint64",
                                  "float16", "float32", "float64", "bool", "complex64"]))
    value = draw(st.one_of(st.integers(-(2**65), 2**65), FLOATS, st.booleans()))
    try:
        with np.errstate(all="ignore"):
            return np.array(value).astype(dtype)[()]
    except (OverflowError, ValueError, TypeError):
        return np.dtype(dtype).type(0)


@st.composite
def np_arrays(draw: st.DrawFn, dtypes: list[Any] | None = None,
              max_side: int = 6) -> np.ndarray:
    """A numpy array of any dtype/shape, maybe strided, big-endian, Fortran or read-only."""
    dtype = np.dtype(draw(st.sampled_from(dtypes or NP_DTYPES)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim)))
    if int(np.prod(shape)) * dtype.itemsize > 1 << 16:     # at most 64 KiB: one long side
        shape = (draw(st.integers(0, max_side)),)
    n = int(np.prod(shape)) if shape else 1
    if dtype == np.dtype(object):
        arr = np.empty(shape, object)
        items = draw(st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()),
                              min_size=1, max_size=8))
        arr.reshape(-1)[:] = (items * n)[:n]
    else:
        pattern = np.frombuffer(draw(st.binary(min_size=1, max_size=64)), np.uint8)
        arr = np.resize(pattern, n * dtype.itemsize).view(dtype).reshape(shape)
    how = draw(st.sampled_from(["plain", "plain", "fortran", "strided", "reversed", "readonly"]))
    if how == "fortran":
        arr = np.asfortranarray(arr)
    elif how == "strided" and arr.ndim:
        arr = np.repeat(arr, 2, axis=0)[::2]
    elif how == "reversed" and arr.ndim:
        arr = arr[::-1]
    elif how == "readonly":
        arr.setflags(write=False)
    return arr


@st.composite
def tensors(draw: st.DrawFn, dtypes: list[Any] | None = None, max_side: int = 6) -> torch.Tensor:
    """A torch tensor of any dtype/shape, maybe non-contiguous, grad-tracking, sparse or meta."""
    dtype = draw(st.sampled_from(dtypes or TORCH_DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim)))
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    t = torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)[: n * size]
    t = t.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    how = draw(st.sampled_from(["plain", "plain", "transposed", "strided", "grad", "sparse",
                                "meta"]))
    if how == "transposed" and t.ndim >= 2:
        t = t.transpose(0, 1)
    elif how == "strided" and t.ndim:
        t = t.repeat_interleave(2, dim=0)[::2] if n else t
    elif how == "grad" and t.is_floating_point() and dtype != torch.float8_e4m3fn:
        t = t.clone().requires_grad_(True)
    elif how == "sparse" and t.ndim and dtype in (torch.float32, torch.int64):
        t = t.to_sparse()
    elif how == "meta":
        t = torch.empty(shape, dtype=dtype, device="meta")
    return t


class _Weird:
    """An object whose every dunder misbehaves (len, iter, index, int)."""

    def __len__(self) -> int:
        raise RuntimeError("len of a weird object")

    def __iter__(self) -> Any:
        raise RuntimeError("iter of a weird object")

    def __index__(self) -> int:
        raise RuntimeError("index of a weird object")


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.complex_numbers(),
                     st.text(max_size=8), st.binary(max_size=8), np_scalars(),
                     st.sampled_from([b"", "", "\0", "0" * 64, "zz" * 32, Ellipsis, slice(1, 2),
                                      range(0), range(3), object(), _Weird(), int, np.int64,
                                      torch.float32, bytearray(b"ab"), memoryview(b"xyz"),
                                      ValueError("x"), frozenset({1})]))


def hostile(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any value: scalars, arrays, tensors, and nested lists/tuples/dicts/iterators of them."""
    leaves = st.one_of(scalars(), np_arrays(), tensors())
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.lists(inner, max_size=4).map(tuple),
            st.dictionaries(st.one_of(st.text(max_size=4), st.integers(), st.none()), inner,
                            max_size=3),
            st.lists(inner, max_size=4).map(iter),
            st.lists(st.integers(), max_size=3).map(set)),
        max_leaves=max_leaves)


def token_like(max_len: int = 80) -> st.SearchStrategy[Any]:
    """Token sequences near and past the edge: ids at 0 / 2**32 - 1 / 2**32, every dtype."""
    ids = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 60),
                    st.sampled_from([-1, 2**32, 2**64, 0, 2**32 - 1]))
    as_list = st.lists(ids, max_size=max_len)
    return st.one_of(
        as_list,
        as_list.map(tuple),
        st.lists(st.integers(0, 60), max_size=max_len).map(np.array),
        st.tuples(st.lists(st.integers(0, 255), max_size=max_len),
                  st.sampled_from(["int8", "uint8", "int32", "uint32", "int64", "uint64",
                                   "float32", "float64", "bool", "int16", ">i8"]))
        .map(lambda t: np.array(t[0]).astype(t[1])),
        st.tuples(st.lists(st.integers(0, 127), max_size=max_len),
                  st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32,
                                   torch.bool, torch.int8]))
        .map(lambda t: torch.tensor(t[0], dtype=t[1])),
        st.lists(st.integers(0, 60), min_size=1, max_size=max_len).map(
            lambda x: np.array(x).reshape(1, -1)),
        st.lists(st.one_of(ids, FLOATS, st.text(max_size=2)), max_size=8),
    )
