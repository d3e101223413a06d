"""The import direction of ARCHITECTURE.md's layers, checked on the source with ``ast``.

Dependencies point down only::

    __main__ < cli < demo, bench < adapters, replay, testing < hybridstore/__init__
      < store < policy < index, backends, layout < config, objects, _native < errors, _cext

read from the top: a module may import its own package (``hybridstore.<group>``) and any
group of a *lower* row, never a group of its own row or above.  Beside the rows:

* only ``backends/`` imports kvikio (``benchmarks/``, outside the package, may too);
* only ``adapters/`` import engines (vllm, sglang, transformers; ``benchmarks/`` may too, and
  ``hybridstore.bench.engines``, the benchmark of the engines' storage interfaces);
* only ``hybridstore._native`` imports the compiled extensions (one native switch);
* ``store/`` imports no torch at all, ``index/``, ``policy/`` and the bottom row none at
  module level (device staging lives in ``backends/``);
* no module imports a private (``_x``) name or module of another package, and the library
  never imports the research benchmarks.

Every import counts: module level, inside functions, under ``TYPE_CHECKING`` and
``importlib.import_module("...")`` with a literal name.  The checks are functions of a
:class:`ModuleGraph`, so the negative tests at the bottom feed them a made-up graph and prove
that each one fails on a real violation.

"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hybridstore"

# Rows of ARCHITECTURE.md's picture, bottom first: a group imports only groups of lower rows.
# A group is the first name under ``hybridstore`` (a subpackage or a module); ``__init__`` is the
# package's own re-exports.  A new top-level module must be placed here before the test passes.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_cext"),
    ("units",),
    ("remote_url",),           # the remote tier's URL, which config validates
    ("config", "objects", "_native"),
    ("layout", "index", "backends"),
    ("policy",),
    ("store",),
    ("__init__",),
    ("adapters", "replay", "testing"),
    ("demo", "bench"),   # bench measures the library through the adapters and the replay
    ("cli",),
    ("__main__",),
)
OUTSIDE = ("benchmarks",)  # top-level packages of the repository beside src/hybridstore
ONLY_IMPORTED_BY: dict[str, tuple[str, ...]] = {
    # third-party top-level name -> the groups (or outside packages) that may import it
    "kvikio": ("backends", "benchmarks"),
    "vllm": ("adapters", "benchmarks", "hybridstore.bench.engines"),
    "sglang": ("adapters", "benchmarks", "hybridstore.bench.engines"),
    "transformers": ("adapters", "benchmarks"),
}
NATIVE_EXTENSIONS = ("hybridstore._cext",)  # where the compiled extensions live
NATIVE_SWITCH = "hybridstore._native"
NO_TORCH_ANYWHERE = ("store",)
NO_TORCH_AT_MODULE_LEVEL = ("store", "index", "policy", "errors", "config", "objects", "_native")


class Import(NamedTuple):
    importer: str  # dotted module name; a package is named by its __init__'s package name
    target: str  # dotted name imported: a module, or module.name for ``from m import name``
    line: int
    module_level: bool  # runs when the importer is imported (not in a function, not TYPE_CHECKING)


@dataclass
class ModuleGraph:
    imports: list[Import] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)
    packages: set[str] = field(default_factory=set)


class Violation(NamedTuple):
    rule: str
    imp: Import

    def __str__(self) -> str:
        return f"{self.imp.importer}:{self.imp.line} imports {self.imp.target} ({self.rule})"


# -- building the graph -------------------------------------------------------------------------

def _module_name(path: Path, base: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(base).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports_of(source: str, importer: str, is_package: bool) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(importer, a.name, node.lineno, top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node.module, node.level)
            found.extend(Import(importer, base if a.name == "*" else f"{base}.{a.name}", node.lineno, top)
                         for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):
            found.append(Import(importer, node.args[0].value, node.lineno, False))
        for child in ast.iter_child_nodes(node):
            visit(child, top)

    visit(ast.parse(source), True)
    return found


def build_graph(root: Path = ROOT) -> ModuleGraph:
    """The imports of ``src/hybridstore`` and of the top-level packages in ``OUTSIDE``."""
    files: list[tuple[Path, Path]] = [(p, root / "src") for p in (root / "src" / PACKAGE).rglob("*.py")]
    for name in OUTSIDE:
        if (root / name).is_dir():
            files += [(p, root) for p in (root / name).rglob("*.py")]
    graph = ModuleGraph()
    named = []
    for path, base in files:
        mod, is_package = _module_name(path, base)
        graph.modules.add(mod)
        if is_package:
            graph.packages.add(mod)
        named.append((path, mod, is_package))
    for path, mod, is_package in named:
        graph.imports += _imports_of(path.read_text(), mod, is_package)
    return graph


# -- the checks ---------------------------------------------------------------------------------

def group_of(name: str, graph: ModuleGraph) -> str:
    """``hybridstore.index.trie`` -> ``index``; ``hybridstore`` and ``hybridstore.HybridStore``
    (a name the package re-exports) -> ``__init__``."""
    parts = name.split(".")
    if len(parts) > 1 and ".".join(parts[:2]) in graph.modules | graph.packages:
        return parts[1]
    return "__init__"


def _row(group: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    return next((i for i, row in enumerate(layers) if group in row), None)


def _first_party(module: str) -> bool:
    return module.split(".")[0] in (PACKAGE, *OUTSIDE)


def layer_violations(graph: ModuleGraph, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[Violation]:
    out = []
    for imp in graph.imports:
        if imp.importer.split(".")[0] != PACKAGE:
            continue
        top = imp.target.split(".")[0]
        if top in OUTSIDE:
            out.append(Violation("the library never imports the research benchmarks", imp))
            continue
        if top != PACKAGE:
            continue
        src, dst = group_of(imp.importer, graph), group_of(imp.target, graph)
        if src == dst:
            continue
        src_row, dst_row = _row(src, layers), _row(dst, layers)
        if src_row is None or dst_row is None:
            unknown = src if src_row is None else dst
            out.append(Violation(f"'{unknown}' is in no row of LAYERS: place it there", imp))
        elif dst_row >= src_row:
            how = "its own row" if dst_row == src_row else "a higher row"
            out.append(Violation(f"{src} imports {dst}, {how}", imp))
    return out


def _allowed(importer: str, allowed: tuple[str, ...], graph: ModuleGraph) -> bool:
    top = importer.split(".")[0]
    return ((top == PACKAGE and group_of(importer, graph) in allowed) or top in allowed
            or any("." in a and (importer == a or importer.startswith(a + ".")) for a in allowed))


def only_imported_by_violations(graph: ModuleGraph,
                                rules: dict[str, tuple[str, ...]] = ONLY_IMPORTED_BY) -> list[Violation]:
    out = []
    for imp in graph.imports:
        top = imp.target.split(".")[0]
        if top in rules and not _allowed(imp.importer, rules[top], graph):
            out.append(Violation(f"only {', '.join(rules[top])} may import {top}", imp))
    return out


def native_switch_violations(graph: ModuleGraph) -> list[Violation]:
    out = []
    for imp in graph.imports:
        hits = any(imp.target == ext or imp.target.startswith(ext + ".") for ext in NATIVE_EXTENSIONS)
        inside = any(imp.importer == ext or imp.importer.startswith(ext + ".") for ext in NATIVE_EXTENSIONS)
        if hits and not inside and imp.importer != NATIVE_SWITCH:
            out.append(Violation(f"only {NATIVE_SWITCH} imports the compiled extensions", imp))
    return out


def torch_violations(graph: ModuleGraph) -> list[Violation]:
    out = []
    for imp in graph.imports:
        if imp.target.split(".")[0] != "torch" or imp.importer.split(".")[0] != PACKAGE:
            continue
        group = group_of(imp.importer, graph)
        if group in NO_TORCH_ANYWHERE:
            out.append(Violation(f"no torch import in {group}/ (device staging lives in backends/)", imp))
        elif group in NO_TORCH_AT_MODULE_LEVEL and imp.module_level:
            out.append(Violation(f"no torch import at module level in {group}", imp))
    return out


def _private_scope(target: str, graph: ModuleGraph) -> str | None:
    """The package a private name in ``target`` belongs to, or None when nothing is private."""
    parts = target.split(".")
    for i in range(1, len(parts)):
        name = parts[i]
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            owner = ".".join(parts[:i])
            return owner if owner in graph.packages else ".".join(parts[: i - 1])
    return None


def private_violations(graph: ModuleGraph) -> list[Violation]:
    out = []
    for imp in graph.imports:
        if not _first_party(imp.target):
            continue
        scope = _private_scope(imp.target, graph)
        if scope is not None and not (imp.importer == scope or imp.importer.startswith(scope + ".")):
            out.append(Violation(f"a private name of {scope} used outside it", imp))
    return out


def _check(violations: list[Violation]) -> None:
    assert not violations, "import direction broken:\n" + "\n".join(map(str, violations))


@pytest.fixture(scope="module")
def graph() -> ModuleGraph:
    return build_graph()


def test_the_graph_sees_the_package(graph):
    assert "hybridstore.config" in graph.modules and "hybridstore.index" in graph.packages
    assert any(i.target == "hybridstore.errors.ConfigError" for i in graph.imports
               if i.importer == "hybridstore.config")


def test_layers_point_down(graph):
    _check(layer_violations(graph))


def test_only_backends_import_kvikio_and_only_adapters_import_engines(graph):
    _check(only_imported_by_violations(graph))


def test_one_native_switch(graph):
    _check(native_switch_violations(graph))


def test_no_torch_in_store_nor_at_module_level_in_index_policy_and_the_bottom(graph):
    _check(torch_violations(graph))


def test_no_private_names_of_another_package(graph):
    _check(private_violations(graph))


# -- the checks fail on a real violation (a made-up graph) --------------------------------------

def fake_graph(edges: dict[str, list[tuple[str, bool]]], packages: Iterable[str] = (),
               modules: Iterable[str] = ()) -> ModuleGraph:
    graph = ModuleGraph(modules=set(modules), packages=set(packages))
    for importer, targets in edges.items():
        graph.modules.add(importer)
        graph.imports += [Import(importer, t, n + 1, top) for n, (t, top) in enumerate(targets)]
    return graph


CLEAN = {
    "hybridstore.errors": [],
    "hybridstore.objects": [("hybridstore.errors.HybridStoreError", True), ("numpy", True)],
    "hybridstore._native": [("hybridstore._cext.hashing", True)],
    "hybridstore.index.keys": [("hybridstore._native", True), ("hybridstore.objects.ObjectKey", True),
                               ("hybridstore.index._helpers", True)],
    "hybridstore.backends.engines.kvikio": [("kvikio", False), ("torch", True)],
    "hybridstore.policy.lru": [("hybridstore.index.trie.HybridIndex", True), ("torch", False)],
    "hybridstore.store.facade": [("hybridstore.policy.lru", True), ("hybridstore.backends", True),
                                 ("hybridstore.store.residency._Row", True)],
    "hybridstore.adapters.transformers": [("transformers", False), ("torch", True),
                                          ("hybridstore.store", True)],
    "hybridstore.cli": [("hybridstore.replay.sim", False), ("hybridstore.bench.core", False)],
    "benchmarks.peers": [("vllm.v1.core.block_pool", False), ("hybridstore.bench.common", True)],
}
PACKAGES = ("hybridstore", "hybridstore.index", "hybridstore.store", "hybridstore._cext",
            "benchmarks", "hybridstore.backends", "hybridstore.backends.engines", "hybridstore.policy",
            "hybridstore.adapters", "hybridstore.replay", "hybridstore.bench")
MODULES = ("hybridstore.config", "hybridstore.errors", "hybridstore.demo", "hybridstore.objects")


def test_a_clean_fake_graph_passes_every_check():
    g = fake_graph(CLEAN, PACKAGES, MODULES)
    assert layer_violations(g) == []
    assert only_imported_by_violations(g) == []
    assert native_switch_violations(g) == []
    assert torch_violations(g) == []
    assert private_violations(g) == []


@pytest.mark.parametrize(("importer", "target", "top", "check"), [
    # upwards and sideways
    ("hybridstore.index.meta", "hybridstore.backends.base.ObjectKind", True, layer_violations),
    ("hybridstore.backends.disk", "hybridstore.index.keys", False, layer_violations),
    ("hybridstore.policy.lru", "hybridstore.store.facade", False, layer_violations),
    ("hybridstore.objects", "hybridstore.config", True, layer_violations),
    ("hybridstore.errors", "hybridstore.objects", True, layer_violations),
    ("hybridstore.replay.sim", "hybridstore.bench.core", False, layer_violations),
    ("hybridstore.store.facade", "hybridstore.adapters.transformers", False, layer_violations),
    ("hybridstore.store.facade", "hybridstore", True, layer_violations),
    ("hybridstore.newthing", "hybridstore.errors", True, layer_violations),
    ("hybridstore.bench.core", "benchmarks.ssd", False, layer_violations),
    # third-party fences
    ("hybridstore.bench.core", "kvikio.defaults", False, only_imported_by_violations),
    ("hybridstore.store.loader", "kvikio", False, only_imported_by_violations),
    ("hybridstore.replay.data", "transformers", False, only_imported_by_violations),
    ("hybridstore.bench.peers", "sglang.srt.mem_cache.radix_cache", False, only_imported_by_violations),
    ("hybridstore.demo", "vllm", False, only_imported_by_violations),
    # the native switch
    ("hybridstore.index.keys", "hybridstore._cext.hashing", True, native_switch_violations),
    ("hybridstore.index.keys", "hybridstore._cext.hashing", False, native_switch_violations),
    # torch
    ("hybridstore.store.loader", "torch", False, torch_violations),
    ("hybridstore.index.trie", "torch", True, torch_violations),
    ("hybridstore.policy.units", "torch.cuda", True, torch_violations),
    ("hybridstore.objects", "torch", True, torch_violations),
    # privates
    ("hybridstore.bench.ssd", "hybridstore.backends.engines._libcuda_loadable", False, private_violations),
    ("benchmarks.ssd", "hybridstore.bench.core._aligned", True, private_violations),
    ("hybridstore.store.facade", "hybridstore.index._helpers", True, private_violations),
    ("hybridstore.policy.lru", "hybridstore.store.residency._Row", True, private_violations),
])
def test_each_check_fails_on_a_real_violation(importer, target, top, check):
    edges = {k: list(v) for k, v in CLEAN.items()}
    edges.setdefault(importer, []).append((target, top))
    found = check(fake_graph(edges, PACKAGES, MODULES))
    assert [(v.imp.importer, v.imp.target) for v in found] == [(importer, target)]


def test_the_ast_reader_finds_every_kind_of_import():
    source = (
        "from __future__ import annotations\n"
        "import torch\n"
        "from typing import TYPE_CHECKING\n"
        "from . import _sibling\n"
        "from ..index.trie import HybridIndex\n"
        "if TYPE_CHECKING:\n"
        "    from hybridstore.store import HybridStore\n"
        "def f():\n"
        "    import kvikio.defaults\n"
        "    return importlib.import_module('vllm.utils.hashing')\n"
        "class C:\n"
        "    import numpy\n"
    )
    found = _imports_of(source, "hybridstore.policy.lru", False)
    got = {(i.target, i.module_level) for i in found}
    assert got == {("__future__.annotations", True), ("torch", True),
                   ("typing.TYPE_CHECKING", True), ("hybridstore.policy._sibling", True),
                   ("hybridstore.index.trie.HybridIndex", True), ("hybridstore.store.HybridStore", False),
                   ("kvikio.defaults", False), ("vllm.utils.hashing", False), ("numpy", True)}
