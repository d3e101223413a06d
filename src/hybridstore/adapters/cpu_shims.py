"""Import SGLang's cache modules on a CPU-only machine (for tests and benchmarks).

Not needed inside a running SGLang server: there SGLang has imported itself with
its real dependencies before it loads :mod:`hybridstore.adapters.sglang`.

On a machine with a CPU-only torch two things stand in SGLang's way, neither of
them used by its cache code:

* ``sglang/__init__.py`` (the frontend language) pulls in the whole serving
  stack; :func:`import_sglang` registers the ``sglang`` package without running
  it (the submodules import normally).
* ``triton`` (``sglang/srt/utils/common.py`` imports it at module level) and
  ``torchvision`` (``sglang/srt/multimodal/internvl_utils.py`` via
  ``sglang/srt/configs``; its wheel is CUDA-built and fails to import over a CPU
  torch) are served, when not installed, by SGLang's own stub
  ``sglang._platform_stubs._MockModule`` -- what SGLang itself installs where
  Triton is missing -- while the given modules import.

Example::

    from hybridstore.adapters.cpu_shims import import_sglang

    mods = import_sglang(["sglang.srt.mem_cache.unified_radix_cache"])
    UnifiedRadixCache = mods["sglang.srt.mem_cache.unified_radix_cache"].UnifiedRadixCache
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from collections.abc import Iterable
from typing import Any

from hybridstore.errors import MissingExtraError

__all__ = ["SGLANG_CACHE_MODULES", "STUBBED_MODULES", "import_sglang", "stubbed_modules"]

SGLANG_CACHE_MODULES = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.unified_cache.components.base",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.configs.mamba_utils",
    "sglang.srt.environ",
    "sglang.srt.mem_cache.storage.backend_factory",
    # imported lazily by the assembler and the controller (they need the stubs too)
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
)
"""SGLang 0.5.23's radix cache, pools, HiCache controller and their configuration: what
the tests' engine harness and ``python -m benchmarks calibrate`` build a real
``UnifiedRadixCache`` from, on CPU."""

STUBBED_MODULES = ("triton", "torchvision")
"""Top-level modules served by SGLang's stub while :func:`import_sglang` imports, if absent."""

_MARK = "_hybridstore_stubbed"   # attribute of the registered ``sglang`` package: what was stubbed


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves SGLang's ``_MockModule`` for ``triton.*`` / ``torchvision.*`` while installed."""

    def __init__(self, names: tuple[str, ...], stubs: types.ModuleType) -> None:
        self.names = names
        self.stubs = stubs

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = self.stubs._MockModule(spec.name)
        if spec.name == "triton":   # what SGLang's install_platform_stubs() sets on its Triton
            mod.__version__ = "3.0.0"
            mod.cdiv = self.stubs._cdiv
            mod.next_power_of_2 = self.stubs._next_power_of_2
            mod.Config = self.stubs._Config
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _register_without_init(package: str) -> None:
    """Make ``package`` importable as a package without running its ``__init__``."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(f"{package} is not installed (pip install --no-deps {package})",
                                name=package)
    mod = types.ModuleType(package)
    mod.__path__ = list(spec.submodule_search_locations)
    mod.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    sys.modules[package] = mod


def _settle_probes() -> None:
    """Let torch and transformers record "no triton" / "no torchvision" before a stub exists."""
    import torch._dynamo  # noqa: F401
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()
    torch_triton.has_triton()
    try:
        import transformers.utils.import_utils as tiu

        tiu.is_torchvision_available()
    except ImportError:
        pass


class _QuietImports:
    """Silence import-time warnings and log lines (platform notices) for a moment."""

    def __enter__(self) -> None:
        self.level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: object) -> None:
        self.warnings.__exit__(None, None, None)
        logging.disable(self.level)


def import_sglang(module_names: Iterable[str]) -> dict[str, types.ModuleType]:
    """Import SGLang modules with the CPU shims active; returns them by name.

    For CPU-only machines: tests and benchmarks.  Modules already imported are
    returned as they are.  The stubs are removed again after the import (a
    stub never shadows a real ``triton`` installed later).

    Raises:
        MissingExtraError: SGLang is not installed.
        ImportError: a module on the import path is missing (the message names it).
    """
    names = list(module_names)
    missing_mods = [n for n in names if n not in sys.modules]
    if missing_mods:
        _settle_probes()
        _register_without_init("sglang")
        stubs = importlib.import_module("sglang._platform_stubs")
        absent = tuple(n for n in STUBBED_MODULES if importlib.util.find_spec(n) is None)
        finder = _StubFinder(absent, stubs)
        sys.meta_path.insert(0, finder)
        try:
            with _QuietImports():
                for name in missing_mods:
                    importlib.import_module(name)
        finally:
            sys.meta_path.remove(finder)
            for name in [m for m in sys.modules if m.split(".")[0] in absent]:
                del sys.modules[name]
        done = set(sys.modules["sglang"].__dict__.get(_MARK, ()))
        sys.modules["sglang"].__dict__[_MARK] = sorted(done | set(absent))
    return {name: sys.modules[name] for name in names}


def stubbed_modules() -> list[str]:
    """The modules :func:`import_sglang` has stood in for in this process (empty when none)."""
    pkg = sys.modules.get("sglang")
    return list(pkg.__dict__.get(_MARK, ())) if pkg is not None else []
