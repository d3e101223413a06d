"""hybridstore._native: the one switch between the C extensions and their twins."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridstore import _native
from hybridstore.backends import gather as G
from hybridstore.backends import keytable
from hybridstore.index import keys as K
from hybridstore.index import u64map
from hybridstore.index.trie import HybridIndex
from tests import twins

REPO_SRC = Path(__file__).resolve().parents[1] / "src"


def test_available_names_exactly_the_built_extensions() -> None:
    built = _native.available()
    assert list(built) == list(_native.NAMES)
    for name, ok in built.items():
        assert ok == (importlib.util.find_spec(f"hybridstore._cext.{name}") is not None), name


def test_use_twins_runs_the_twins_and_restores_the_extensions() -> None:
    start = {name: getattr(_native, name) for name in _native.NAMES}
    assert _native.in_use() == {name: m is not None for name, m in start.items()}
    with _native.use_twins():
        assert all(getattr(_native, name) is None for name in _native.NAMES)
        assert not any(_native.in_use().values())
        assert type(u64map.U64Map()) is u64map.PyU64Map
        assert type(keytable.KeyTable(17)) is keytable.PyKeyTable
        assert HybridIndex(4, K.HashKey.generate(4).root(""))._ids.__class__ is u64map.PyU64Map
    assert {name: getattr(_native, name) for name in _native.NAMES} == start


def test_use_twins_false_selects_the_built_extensions_and_nests() -> None:
    start = _native.in_use()
    with _native.use_twins():
        with _native.use_twins(False):
            assert _native.in_use() == _native.available()
            for name, ok in _native.available().items():
                if ok:
                    module = getattr(_native, name)
                    assert module.__name__ == f"hybridstore._cext.{name}"
        assert not any(_native.in_use().values())
    assert _native.in_use() == start


def test_use_twins_only_switches_the_names_given_and_restores_on_error() -> None:
    start = _native.in_use()
    with pytest.raises(RuntimeError), _native.use_twins(only=["trie"]):
        assert _native.trie is None
        assert _native.in_use() == {**start, "trie": False}
        raise RuntimeError
    assert _native.in_use() == start
    with pytest.raises(ValueError, match="unknown"), _native.use_twins(only=["hashin"]):
        pass


@twins.needs_native("hashing")
def test_the_compiled_functions_really_stop_being_called(monkeypatch) -> None:
    """Inside use_twins() no call reaches the extensions; after it they are called again."""
    calls: list[str] = []
    for name in ("hashing", "gather"):
        module = twins.extension(name)
        for fn in ("chain_tokens", "gather"):
            if hasattr(module, fn):
                real = getattr(module, fn)
                monkeypatch.setattr(module, fn,
                                    lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))

    def work() -> None:
        key = K.HashKey.generate(2)
        K.chain_hash_tokens([1, 2, 3, 4, 5], 2, key.root(""), key)
        dst = np.zeros((1, 4), np.uint8)
        one = np.zeros(1, np.int64)
        G.gather_rows([np.arange(8, dtype=np.uint8)], one, one, one, 0, 4, dst)

    with _native.use_twins(False):
        work()
    assert calls == ["chain_tokens", "gather"]
    calls.clear()
    with _native.use_twins():
        work()
    assert calls == []


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_SRC), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120, env=env)


def test_force_twins_env_runs_every_twin() -> None:
    proc = _run("from hybridstore import _native as N; "
                "print(any(N.in_use().values()), N.available() == "
                "{n: __import__('importlib.util').util.find_spec('hybridstore._cext.' + n) "
                "is not None for n in N.NAMES})", HYBRIDSTORE_FORCE_TWINS="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_a_missing_extension_warns_once_and_its_twin_runs() -> None:
    code = """
import sys, warnings
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == 'hybridstore._cext.hashing':
            raise ImportError('not built (test)')
sys.meta_path.insert(0, Blocker())
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    from hybridstore import _native
    import hybridstore.index.keys as K
    import hybridstore.index.trie, hybridstore.backends.keytable, hybridstore.backends.gather
    key = K.HashKey.generate(2)
    K.chain_hash_tokens([1, 2, 3], 2, key.root(''), key)
mine = [str(w.message) for w in seen if 'hybridstore' in str(w.message)]
print(len(mine), _native.available()['hashing'], _native.hashing is None)
print(mine[0] if mine else '')
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    counts, message = proc.stdout.splitlines()
    assert counts.split() == ["1", "False", "True"]
    assert "hashing" in message and "twin" in message


def test_require_native_fails_instead_of_skipping(monkeypatch) -> None:
    monkeypatch.setattr(_native, "available", lambda: {n: n != "trie" for n in _native.NAMES})
    monkeypatch.setattr(twins, "REQUIRE_NATIVE", False)
    with pytest.raises(pytest.skip.Exception):
        twins.require_native("trie")
    monkeypatch.setattr(twins, "REQUIRE_NATIVE", True)
    with pytest.raises(pytest.fail.Exception, match="HYBRIDSTORE_REQUIRE_NATIVE"):
        twins.require_native("trie")
    twins.require_native("hashing")                  # built: neither


def test_store_stats_say_which_extensions_run() -> None:
    from hybridstore import HybridStore, StoreConfig

    with HybridStore(StoreConfig(block_size=4, host_bytes=1 << 20)) as store:
        assert store.stats()["native"] == _native.in_use()
        with _native.use_twins():
            assert store.stats()["native"] == dict.fromkeys(_native.NAMES, False)
