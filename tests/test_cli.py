"""The command line without an install extra: a typed error that names the extra, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridstore.errors import HybridStoreError, MissingExtraError


def _run_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    # A None entry in sys.modules makes `import module` raise ModuleNotFoundError, as on a
    # machine where the extra was not installed.
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from hybridstore.cli import main\n"
            f"sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("module, argv, extra", [
    ("zstandard", ("replay", "--policy", "lru"), "replay"),
    ("rich", ("bench", "core", "--quick"), "replay"),
    ("transformers", ("demo",), "hf"),
])
def test_a_missing_extra_names_itself(module, argv, extra, tmp_path):
    done = _run_without(module, *argv)
    assert done.returncode == 2, done.stderr
    assert f"hybridstore[{extra}]" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_extra_error_is_typed():
    exc = MissingExtraError.of(ModuleNotFoundError("No module named 'matplotlib.pyplot'",
                                                   name="matplotlib.pyplot"))
    assert isinstance(exc, HybridStoreError) and isinstance(exc, ImportError)
    assert exc.extra == "replay" and exc.name == "matplotlib"
    # A module no extra brings is not ours to explain.
    assert MissingExtraError.of(ModuleNotFoundError("x", name="numpy")) is None


@pytest.mark.parametrize("argv,says", [
    (["replay", "/no/such/trace.json"], "no such trace"),
    (["replay", "--policy", "nope"], "unknown preset"),
    (["replay", "--model", "nope"], "unknown model"),
    (["replay", "--scale", "0"], "--scale"),
    (["replay", "--gpu-gib", "nan"], "--gpu-gib"),
    (["replay", "--host-gib", "-1"], "--host-gib"),
    (["replay", "--max-requests", "-1"], "--max-requests"),
    (["replay", "--live-sessions", "0"], "--live-sessions"),
    (["replay", "--resume-hints", "-0.5"], "--resume-hints"),
    (["replay", "--json", "/no/such/dir/r.json"], "cannot write"),
    (["replay", "--plot", "."], "cannot write"),
    (["demo", "--scale", "-2"], "--scale"),
])
def test_bad_arguments_get_one_line_and_exit_2_before_any_work(argv, says, capsys):
    """Issue 13, item 8: tracebacks with exit 1, `--max-requests -1` exiting 0, and an
    unwritable --json failing only after the whole replay."""
    import time

    from hybridstore.cli import main

    t0 = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as e:              # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert says in err and "Traceback" not in err
    assert time.perf_counter() - t0 < 5        # checked before the traces load / the replay runs
