"""Builds the optional native extensions of ``hybridstore.native``.

All metadata lives in pyproject.toml.  The extensions are optional: when no C
compiler is available the build continues and the modules that use them
(``hybridstore.index.keys``, ``hybridstore.index.u64map``, ...) fall back to
their pure-Python (numpy) twins, which behave identically.
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build extensions, but never fail the install because of them."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the toolchain
            print(f"hybridstore: native extension skipped ({exc}); using the Python twin")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover - depends on the toolchain
            print(f"hybridstore: {ext.name} skipped ({exc}); using the Python twin")


setup(
    ext_modules=[
        Extension(
            "hybridstore.native._hashing",
            sources=["src/hybridstore/native/_hashing.c"],
            depends=["src/hybridstore/native/_buffers.h", "src/hybridstore/native/_tables.h"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
        Extension(
            "hybridstore.native._u64map",
            sources=["src/hybridstore/native/_u64map.c"],
            depends=["src/hybridstore/native/_buffers.h", "src/hybridstore/native/_tables.h"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
        Extension(
            "hybridstore.native._gather",
            sources=["src/hybridstore/native/_gather.c"],
            depends=["src/hybridstore/native/_buffers.h"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
        Extension(
            "hybridstore.native._keytable",
            sources=["src/hybridstore/native/_keytable.c"],
            depends=["src/hybridstore/native/_tables.h"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
        Extension(
            "hybridstore.native._trie",
            sources=["src/hybridstore/native/_trie.c"],
            depends=["src/hybridstore/native/_buffers.h"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
