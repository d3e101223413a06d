"""The ways of writing and reading the objects that the SSD benchmark compares.

One class per path: the disk tier (:class:`TierPath`), and one file per object
read by numpy, torch, safetensors or DALI (:class:`FilePath` and its
subclasses), cold (page cache dropped before each read) or warm.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.ssd.rows import ObjectSet, npy_offset
from hybridstore.backends.engines import fsync_path
from hybridstore.bench import odirect


class ObjectPath:
    """One way of writing/reading the objects; ``read_one`` is what gets timed."""

    name = "path"
    cache = "warm"
    op = "read"
    note = ""

    def start_rep(self, objs: ObjectSet, rep: int) -> None:
        """Untimed set-up before a repetition's reads."""

    def before_one(self, objs: ObjectSet, i: int) -> None:
        """Untimed set-up before one read (dropping the page cache)."""

    def read_one(self, objs: ObjectSet, i: int) -> None:
        raise NotImplementedError

    def end_rep(self, objs: ObjectSet) -> None:
        """Untimed clean-up after a repetition (and a byte check)."""


class TierPath(ObjectPath):
    """A DiskTier: put() per object (durable), get_into() into an aligned buffer."""

    def __init__(self, tier: Any, name: str, cache: str, note: str,
                 drop_segments: bool = False) -> None:
        self.tier = tier
        self.name = name
        self.cache = cache
        self.note = note
        self.keys: dict[int, bytes] = {}
        self._drop = drop_segments

    def write_one(self, objs: ObjectSet, i: int, rep: int) -> float:
        key = objs.key(i, rep)
        src = objs.stamp(i, rep)
        t0 = time.perf_counter()
        self.tier.put(key, src, nbytes=objs.size).result()
        dt = time.perf_counter() - t0
        old = self.keys.get(i)
        if old is not None and old != key:
            self.tier.delete(old)
        self.keys[i] = key
        return dt

    def before_one(self, objs: ObjectSet, i: int) -> None:
        if self._drop:  # kvikio compat reads through the page cache
            for name in os.listdir(self.tier.path):
                if name.startswith("seg-"):
                    odirect.drop_page_cache(os.path.join(self.tier.path, name))

    def read_one(self, objs: ObjectSet, i: int) -> None:
        self.tier.get_into(self.keys[i], objs.out).result()

    def clear(self) -> None:
        for key in self.keys.values():
            self.tier.delete(key)
        self.keys.clear()


def _durable_write(path: str | os.PathLike[str], dump: Callable[[Any], None]) -> float:
    """Seconds to serialise into ``path`` with ``dump(file)`` and fsync it (a durable write)."""
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        dump(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


class FilePath(ObjectPath):
    """A file-per-object reader: cold (pages dropped before each op) or warm."""

    ext = "npy"

    def __init__(self, cold: bool) -> None:
        self.cache = "cold-dropped" if cold else "warm"
        self.cold = cold
        self.cached_after_drop: float | None = None

    def start_rep(self, objs: ObjectSet, rep: int) -> None:
        if not self.cold:  # warm: every file in the page cache
            for i in range(objs.n):
                with open(objs.file(i, self.ext), "rb") as fh:
                    while fh.read(16 << 20):
                        pass

    def before_one(self, objs: ObjectSet, i: int) -> None:
        if self.cold:
            path = objs.file(i, self.ext)
            odirect.drop_page_cache(path)
            if i == 0:
                frac = odirect.cached_fraction(path)
                if frac is not None:
                    self.cached_after_drop = max(self.cached_after_drop or 0.0, frac)


class NumpyPath(FilePath):
    name = "numpy.fromfile"
    ext = "npy"
    note = "np.fromfile(.npy, uint8, offset=header); write: np.save + fsync"

    def __init__(self, cold: bool) -> None:
        super().__init__(cold)
        self._offset = 128

    def start_rep(self, objs: ObjectSet, rep: int) -> None:
        self._offset = npy_offset(objs.file(0, "npy"))
        super().start_rep(objs, rep)

    def read_one(self, objs: ObjectSet, i: int) -> None:
        a = np.fromfile(objs.file(i, "npy"), dtype=np.uint8, offset=self._offset)
        if a.size != objs.size:
            raise RuntimeError(f"numpy.fromfile read {a.size} of {objs.size} bytes")

    @staticmethod
    def write_one(objs: ObjectSet, i: int, rep: int) -> float:
        src = objs.stamp(i, rep)
        return _durable_write(objs.file(i, "npy"), lambda fh: np.save(fh, src))


class TorchPath(FilePath):
    name = "torch.load"
    ext = "pt"
    note = "torch.load(weights_only=True) of a uint8 tensor; write: torch.save + fsync"

    def read_one(self, objs: ObjectSet, i: int) -> None:
        import torch

        t = torch.load(objs.file(i, "pt"), weights_only=True)
        if t.numel() != objs.size:
            raise RuntimeError("torch.load returned the wrong size")

    @staticmethod
    def write_one(objs: ObjectSet, i: int, rep: int) -> float:
        import torch

        t = torch.from_numpy(objs.stamp(i, rep))
        return _durable_write(objs.file(i, "pt"), lambda fh: torch.save(t, fh))


class SafetensorsPath(FilePath):
    name = "safetensors"
    ext = "safetensors"
    note = ("safetensors.torch.load_file (lazy mmap: one byte of every 4 KiB page is read, so "
            "the bytes are in memory); write: save_file + fsync")

    def read_one(self, objs: ObjectSet, i: int) -> None:
        from safetensors.torch import load_file

        x = load_file(objs.file(i, "safetensors"))["x"]
        if x.numel() != objs.size:
            raise RuntimeError("safetensors returned the wrong size")
        int(x[::4096].sum())  # load_file maps the file lazily: fault every page in

    @staticmethod
    def write_one(objs: ObjectSet, i: int, rep: int) -> float:
        import torch
        from safetensors.torch import save_file

        t = torch.from_numpy(objs.stamp(i, rep))
        path = objs.file(i, "safetensors")
        t0 = time.perf_counter()
        save_file({"x": t}, path)
        fsync_path(path)
        return time.perf_counter() - t0


class DaliPath(FilePath):
    """``fn.readers.numpy`` over the ``.npy`` files, batch size 1, one pipeline per repetition.

    A fresh pipeline per repetition (built untimed): DALI's loader reads one
    sample ahead, so a pipeline kept across repetitions would read the next
    repetition's first object while other paths are being timed.
    """

    ext = "npy"

    def __init__(self, mode: str, threads: int) -> None:
        super().__init__(cold=mode != "warm")
        self.mode = mode  # "odirect" | "warm" | "gpu"
        self.name = "dali-numpy-gpu" if mode == "gpu" else "dali-numpy-cpu"
        self.cache = "cold-odirect" if mode == "odirect" else (
            "cold-gds" if mode == "gpu" else "warm")
        self.threads = threads
        self.note = {"odirect": "CPU reader, dont_use_mmap=True, use_o_direct=True",
                     "warm": "CPU reader, mmap (default), files in the page cache",
                     "gpu": "GPU reader (cuFile / GDS)"}[mode]
        self._pipe: Any = None

    def start_rep(self, objs: ObjectSet, rep: int) -> None:
        if self.mode == "warm":
            super().start_rep(objs, rep)
        from nvidia.dali import fn, pipeline_def

        files = [os.path.basename(objs.file(i, "npy")) for i in range(objs.n)]
        mode = self.mode

        @pipeline_def(batch_size=1, num_threads=self.threads,
                      device_id=0 if mode == "gpu" else None, prefetch_queue_depth=1,
                      exec_pipelined=False, exec_async=False)
        def pipe() -> Any:
            if mode == "gpu":
                return fn.readers.numpy(device="gpu", file_root=objs.dir, files=files)
            if mode == "odirect":
                return fn.readers.numpy(file_root=objs.dir, files=files, dont_use_mmap=True,
                                        use_o_direct=True)
            return fn.readers.numpy(file_root=objs.dir, files=files)

        self._pipe = pipe()
        self._pipe.build()

    def before_one(self, objs: ObjectSet, i: int) -> None:
        if self.mode == "gpu":  # GDS may still go through the page cache in compat mode
            super().before_one(objs, i)

    def read_one(self, objs: ObjectSet, i: int) -> None:
        (out,) = self._pipe.run()
        if self.mode == "gpu":
            import torch

            torch.cuda.synchronize()
        del out

    def end_rep(self, objs: ObjectSet) -> None:
        self._pipe = None
        gc.collect()
