"""TEST FIXTURE ONLY: build a stand-in ``libcuda.so.1`` for kvikio's compat path.

kvikio's native library dlopens the NVIDIA driver (``libcuda.so.1``) even for
host-memory I/O in POSIX compat mode.  On CPU-only test machines
:func:`build_fake_libcuda` compiles ``fake_libcuda.c`` (a few dozen stub
driver functions: no devices, every pointer is host memory) with gcc into a
temporary directory.  Tests put that directory on ``LD_LIBRARY_PATH`` of a
*subprocess* only; the stand-in is never loaded by the main test process and
never shipped with the package.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.c")

ENV_FLAG = "HYBRIDSTORE_TEST_FAKE_LIBCUDA"
"""Set to ``"1"`` in the subprocess that runs with the stand-in driver."""

MODE_VAR = "FAKE_LIBCUDA_MODE"
"""``"nodevice"`` (default: cuInit ok, 0 devices) or ``"uninit"`` (cuInit fails)."""


def gcc() -> str | None:
    """Path of gcc, or ``None`` when it is missing."""
    return shutil.which("gcc")


def build_fake_libcuda(out_dir: Path) -> Path:
    """Compile the stand-in into ``out_dir/libcuda.so.1``; returns ``out_dir``.

    Raises:
        RuntimeError: gcc is missing or the build failed.
    """
    compiler = gcc()
    if compiler is None:
        raise RuntimeError("gcc is missing; cannot build the stand-in libcuda.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "libcuda.so.1"
    proc = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(target),
                           str(SOURCE)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building the stand-in libcuda.so.1 failed:\n{proc.stderr}")
    return out_dir
