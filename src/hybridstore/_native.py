"""The one place that chooses between hybridstore's C extensions and their twins.

Every compiled module has a pure-Python (numpy) twin beside its public API that
computes the same results bit for bit; the C only makes it faster.  This module
imports the five extensions of :mod:`hybridstore._cext` (built by ``setup.py``
from ``native/`` in the repository, whose README describes them) and holds, as
module attributes, the one each user calls now:

============  ======================================  ===========================
attribute     used by                                 twin
============  ======================================  ===========================
``hashing``   :mod:`hybridstore.index.keys`           the numpy chain in keys.py
``u64map``    :mod:`hybridstore.index.u64map`         ``PyU64Map``
``keytable``  :mod:`hybridstore.backends.keytable`    ``PyKeyTable``
``trie``      :mod:`hybridstore.index.trie`           ``HybridIndex._*_py``
``gather``    :mod:`hybridstore.backends.gather`      the numpy loops in gather.py
============  ======================================  ===========================

An attribute is the extension module, or ``None`` when the twin is in use.
Users read it where they call it (``ext = _native.hashing``), one module
attribute lookup, so a switch takes effect at once and costs the hot paths
nothing more.  The table types are chosen when one is made: an existing
``U64Map`` or ``KeyTable`` keeps its implementation.

The twins are used

* for an extension that is not built (no C compiler at install time): a
  ``RuntimeWarning`` says so once, at the first import;
* for all five when ``HYBRIDSTORE_FORCE_TWINS=1`` is set in the environment
  (read once, here);
* inside :func:`use_twins` (tests and benchmarks).

Building: ``python setup.py build_ext --inplace`` or any pip install compiles
them; ``HYBRIDSTORE_REQUIRE_NATIVE=1`` at build time makes a failed build an
error instead of a warning.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = ["FORCE_TWINS_ENV", "NAMES", "available", "in_use", "use_twins"]

NAMES = ("hashing", "u64map", "keytable", "trie", "gather")
"""The extensions, as named in :mod:`hybridstore._cext` and as attributes here."""

FORCE_TWINS_ENV = "HYBRIDSTORE_FORCE_TWINS"
"""Set to ``1`` to run every twin instead of the compiled extensions."""


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"hybridstore._cext.{name}")
    except ImportError:  # pragma: no cover - depends on the build
        return None


_BUILT: dict[str, ModuleType | None] = {name: _load(name) for name in NAMES}

hashing: ModuleType | None = None
u64map: ModuleType | None = None
keytable: ModuleType | None = None
trie: ModuleType | None = None
gather: ModuleType | None = None


def _select(twins: bool, names: Iterable[str] = NAMES) -> None:
    g = globals()
    for name in names:
        g[name] = None if twins else _BUILT[name]


def available() -> dict[str, bool]:
    """Which extensions are built (importable), by name.

    Returns:
        ``{"hashing": True, "u64map": True, ...}``, one entry per name of
        :data:`NAMES`; ``False`` where only the twin exists.
    """
    return {name: module is not None for name, module in _BUILT.items()}


def in_use() -> dict[str, bool]:
    """Which extensions the library calls now, by name (``False``: the twin).

    Differs from :func:`available` under ``HYBRIDSTORE_FORCE_TWINS=1`` and
    inside :func:`use_twins`.
    """
    g = globals()
    return {name: g[name] is not None for name in NAMES}


@contextmanager
def use_twins(enabled: bool = True, *, only: Iterable[str] | None = None) -> Iterator[None]:
    """Run the pure-Python twins (or, with ``enabled=False``, the built extensions).

    The previous choice comes back when the block exits, also on an error.
    Nested blocks restore their own previous choice.  Not thread-safe: a
    switch is seen by every thread (meant for tests and benchmarks)::

        with _native.use_twins():
            keys = chain_hash_tokens(tokens, 16, root, key)   # the numpy twin

    Args:
        enabled: ``True`` selects the twins; ``False`` selects the built
            extensions (also under ``HYBRIDSTORE_FORCE_TWINS=1``), the twin
            where one is not built.
        only: the names (of :data:`NAMES`) to switch; all by default.

    Raises:
        ValueError: ``only`` names an unknown extension.
    """
    names = NAMES if only is None else tuple(only)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown native extension(s) {unknown}; expected names of {NAMES}")
    g = globals()
    previous = {name: g[name] for name in NAMES}
    _select(enabled, names)
    try:
        yield
    finally:
        g.update(previous)


_select(os.environ.get(FORCE_TWINS_ENV, "") == "1")

_MISSING = [name for name, module in _BUILT.items() if module is None]
if _MISSING:  # pragma: no cover - depends on the build
    warnings.warn(
        f"hybridstore: the C extension(s) {', '.join(_MISSING)} are not built; using their "
        f"pure-Python twins (same results, slower). Build them with a C compiler: "
        f"`pip install .` or `python setup.py build_ext --inplace`.",
        RuntimeWarning, stacklevel=2)
