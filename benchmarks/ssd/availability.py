"""What the SSD benchmark can measure here: kvikio, DALI, safetensors, CUDA, fio, the block device."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hybridstore.bench import odirect


def _libcuda_path() -> str | None:
    """Where ``libcuda.so.1`` was loaded from (after a successful load), if known."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                if "libcuda.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def kvikio_state() -> tuple[bool, str]:
    """(usable, reason or the libcuda it runs on)."""
    from hybridstore.backends import engines

    if not engines.libcuda_loadable():  # the engine's own test
        return False, ("no NVIDIA driver: libcuda.so.1 is not loadable, and kvikio needs it "
                       "even in its POSIX compat mode")
    if not engines.kvikio_importable():
        return False, "kvikio cannot be imported (pip install kvikio-cu12)"
    where = _libcuda_path() or "libcuda.so.1"
    devices = "a CUDA device" if engines.cuda_driver_usable() else "no usable CUDA device"
    return True, f"libcuda: {where} ({devices})"


def kvikio_direct_reads() -> bool:
    """Whether kvikio's compat reads use O_DIRECT (``auto_direct_io_read``)."""
    try:
        import kvikio.defaults

        return bool(kvikio.defaults.get("auto_direct_io_read"))
    except Exception:  # noqa: BLE001 - older kvikio: buffered
        return False


def dali_state() -> tuple[bool, str]:
    try:
        import nvidia.dali as dali  # noqa: F401
        from nvidia.dali import fn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means no DALI
        return False, f"DALI cannot be imported ({e}); pip install nvidia-dali-cuda120"
    return True, f"nvidia-dali {getattr(dali, '__version__', '?')}"


def importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False
    return True


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mod, attr in (("nvidia.dali", "__version__"), ("kvikio", "__version__"),
                      ("safetensors", "__version__")):
        try:
            m = __import__(mod, fromlist=["_"])
            out[mod] = getattr(m, attr, "?")
        except Exception:  # noqa: BLE001
            out[mod] = None
    fio = odirect.fio_path()
    out["fio"] = odirect.fio_version(fio) if fio else None
    return out


def block_device(path: str) -> dict[str, Any]:
    """The block device under ``path`` (sysfs), as far as Linux tells."""
    out: dict[str, Any] = {}
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sys_dir = os.path.realpath(f"/sys/dev/block/{dev}")
        out["dev"] = dev
        out["name"] = os.path.basename(sys_dir)
        queue = os.path.join(sys_dir, "queue")
        if not os.path.isdir(queue):
            queue = os.path.join(os.path.dirname(sys_dir), "queue")  # a partition
        for key in ("rotational", "scheduler", "max_sectors_kb", "nr_requests",
                    "logical_block_size"):
            with contextlib.suppress(OSError):
                with open(os.path.join(queue, key)) as fh:
                    out[key] = fh.read().strip()
        for key in ("device/model", "device/vendor"):
            for base in (sys_dir, os.path.dirname(sys_dir)):
                with contextlib.suppress(OSError):
                    with open(os.path.join(base, key)) as fh:
                        out[key.split("/")[-1]] = fh.read().strip()
                        break
    except OSError:
        pass
    return out
