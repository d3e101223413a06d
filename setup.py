"""Builds the native extensions of hybridstore from ``native/`` (see native/README.md).

All metadata lives in pyproject.toml.  The C sources sit at the repository root
(``native/src``, shared headers in ``native/include/hybridstore``) and compile into
the private package ``hybridstore._cext``; ``hybridstore._native`` is the one module
that imports them.

A failed C build does not fail the install by default: the extension is left out
with a warning naming it, and hybridstore uses its pure-Python (numpy) twin, which
computes the same results.  Set the build-time environment variable
``HYBRIDSTORE_REQUIRE_NATIVE=1`` to make any failed extension fail the build
instead (CI does, so that a green run means the C was built and tested)::

    HYBRIDSTORE_REQUIRE_NATIVE=1 pip install -e .
"""

from __future__ import annotations

import os
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE_NATIVE = os.environ.get("HYBRIDSTORE_REQUIRE_NATIVE", "") == "1"

_INCLUDE = "native/include"
_BUFFERS = f"{_INCLUDE}/hybridstore/buffers.h"
_TABLES = f"{_INCLUDE}/hybridstore/tables.h"


class NativeBuildExt(build_ext):
    """Build the extensions; a failure warns (or fails, with HYBRIDSTORE_REQUIRE_NATIVE=1)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the toolchain
            if REQUIRE_NATIVE:
                raise
            _skipped("the native extensions", exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover - depends on the toolchain
            if REQUIRE_NATIVE:
                raise
            _skipped(ext.name, exc)


def _skipped(what: str, exc: BaseException) -> None:
    # pip shows a build's output only with -v; hybridstore._native warns again
    # at the first import, which every user sees.
    warnings.warn(f"hybridstore: {what} not built ({exc}); hybridstore will use the "
                  f"pure-Python twin instead (same results, slower). Set "
                  f"HYBRIDSTORE_REQUIRE_NATIVE=1 to make this an error.",
                  RuntimeWarning, stacklevel=2)


def _extension(name: str, depends: list[str]) -> Extension:
    return Extension(
        f"hybridstore._cext.{name}",
        sources=[f"native/src/{name}.c"],
        include_dirs=[_INCLUDE],
        depends=depends,
        extra_compile_args=["-O3", "-std=c11"],
    )


setup(
    ext_modules=[
        _extension("hashing", [_BUFFERS, _TABLES]),
        _extension("u64map", [_BUFFERS, _TABLES]),
        _extension("gather", [_BUFFERS]),
        _extension("keytable", [_TABLES]),
        _extension("trie", [_BUFFERS]),
    ],
    cmdclass={"build_ext": NativeBuildExt},
)
