"""Helpers shared by the benchmarks: statistics, timing, machine facts, JSON, progress."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hybridstore import _native
from hybridstore.objects import aligned_empty

__all__ = ["aligned", "emit", "fmt_bytes", "fs_type", "json_safe", "machine_info", "median", "no_gc",
           "o_direct_works", "percentile", "progress", "stdout_console", "timed"]

KIB = 1 << 10
MIB = 1 << 20


def median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off while timing (as ``timeit`` does)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes, with the cyclic GC off."""
    with no_gc():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def json_safe(x: Any) -> Any:
    """JSON-safe: NaN/inf become None (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def emit(doc: dict[str, Any], *, json_path: str | None, echo_json: bool = True,
         plot_path: str | None = None, plot: Callable[[dict[str, Any], str], None] | None = None) -> None:
    """Write a benchmark's JSON document to stdout and ``json_path``, and its plot."""
    import json
    import sys

    text = json.dumps(doc, indent=2)
    if echo_json:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(text + "\n")
    if plot_path and plot is not None:
        plot(doc, plot_path)


def machine_info() -> dict[str, Any]:
    """CPU, memory, versions and the hashing backend of this run."""
    import torch

    import hybridstore

    cpu_model = None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem = None
    used = _native.in_use()
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "cpu_model": cpu_model,
            "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "hybridstore": hybridstore.__version__,
            "cuda_available": bool(torch.cuda.is_available()),
            "torch_threads": torch.get_num_threads(),
            "hash_backend": "native" if used["hashing"] else "python",
            "native_hashing": _native.available()["hashing"], "native": used}


def stdout_console() -> Any:
    """A rich console for the report; 160 columns when piped (tables stay readable)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


@contextlib.contextmanager
def progress(name: str, total: int) -> Iterator[Callable[[str], None]]:
    """A transient rich progress bar on stderr; yields ``step(description)``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(name, total=total)

        def step(what: str) -> None:
            bar.update(task, advance=1, description=what)

        yield step


# ---------------------------------------------------------------------------------
# files and buffers (bench core and the SSD benchmark)
# ---------------------------------------------------------------------------------
def aligned(nbytes: int, fill: int | None = None) -> np.ndarray:
    """A 4 KiB aligned uint8 array (O_DIRECT reads/writes land in place), touched once."""
    out = aligned_empty(nbytes)
    out.fill(0 if fill is None else fill)  # fault the pages in before any timing
    return out


def o_direct_works(directory: str) -> bool:
    """Whether the file system of ``directory`` accepts ``O_DIRECT`` opens."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, path = tempfile.mkstemp(dir=directory, prefix=".odirect-probe-")
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        os.unlink(path)


def fs_type(path: str) -> str | None:
    """File system type of ``path`` from /proc/mounts (Linux), else None."""
    try:
        best, fstype = "", None
        real = os.path.realpath(path)
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1]
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
        return fstype
    except OSError:
        return None
