"""``python -m benchmarks ssd``: the disk tier against the device limit and other loaders.

What is measured, in order, all on the file system of ``--dir``:

1. **Device limit.**  O_DIRECT sequential and random reads and writes at
   several block sizes and queue depths on a test file: with fio (``libaio``,
   ``direct=1``, one stonewalled job per cell) when ``fio`` is on ``PATH``, else
   with an O_DIRECT thread pool of our own (:mod:`hybridstore.bench.odirect`).
   ``read_gbps``/``write_gbps`` are the best cells.
2. **Object paths.**  For each object size (4 KiB to 256 MiB, including a
   Qwen3.5-9B recurrent-state checkpoint of 50 MB and one of its 576-token KV
   blocks), ``n`` objects are written, then read back one at a time through:

   ============================  ==============================================
   path                          how
   ============================  ==============================================
   ``hybridstore-posix``         :class:`~hybridstore.backends.disk.DiskTier`
                                 with the POSIX engine: ``put(...).result()``
                                 (durable) and ``get_into(key, out).result()``
                                 (O_DIRECT, checksum verified)
   ``hybridstore-kvikio-*``      the same tier on kvikio (compat or GDS), where
                                 a CUDA driver exists
   ``dali-numpy-cpu``            ``nvidia.dali.fn.readers.numpy`` on the CPU
                                 (``use_o_direct`` cold; mmap warm), one
                                 ``.npy`` per object, batch size 1
   ``dali-numpy-gpu``            the same reader on a GPU (GDS), where present
   ``torch.load``                ``torch.save``/``torch.load`` of a uint8 tensor
   ``safetensors``               ``safetensors.torch`` ``save_file``/``load_file``
   ``numpy.fromfile``            ``np.save`` / ``np.fromfile`` of the ``.npy``
   ============================  ==============================================

   Cache states: ``cold-odirect`` (O_DIRECT: the page cache is bypassed),
   ``cold-dropped`` (buffered reader; the file's pages were evicted with
   ``posix_fadvise(DONTNEED)`` before each op, checked with ``mincore``),
   ``warm`` (buffered reader, file in the page cache).  Writes are durable
   (fsync'ed) for every path.
3. **Host pool.**  Copies into and out of the pinned DRAM pool
   (:class:`~hybridstore.backends.host.HostPool` ``put``/``get_into``) against
   ``numpy.copyto``; on a GPU also H2D/D2H between the pool and the device
   against torch pinned tensors.

Every repetition runs every path once, in a rotated order, and first
``device-ref``: our O_DIRECT pool at the best read cell (block size, queue
depth) reading the very extents of these objects in the disk tier's segment
files, so each path's throughput is compared with the device *in the same
repetition, on the same blocks* (``vs_device_now``) as well as with the
device limit (``vs_device_limit``) and with hybridstore (``vs_hybridstore``).
The virtual disk this was developed on swings between ~1.3 and ~3 GB/s
within minutes, so the in-run ratios are the ones to compare.  GB/s is bytes of the objects over the
summed wall time of their ops (1e9 bytes/s), median over repetitions;
``p50_ms``/``p99_ms`` are per op, over all repetitions.

Modules, in the order the benchmark runs them: ``sizes`` (object sizes),
``hybridstore.bench.device`` (the device limit), ``paths`` (one class per way of reading and
writing), ``runs`` (one object size through every path; ``rows`` holds the
timings), ``host`` (the host pool), ``report`` (ratios, table, plot) and
``run`` (:func:`run_ssd_bench`); ``availability`` says what can run here.
"""

from __future__ import annotations

from benchmarks.ssd.run import run_ssd_bench
from benchmarks.ssd.sizes import (
    CKPT_BYTES,
    FULL_SIZES,
    KV_BLOCK_BYTES,
    OURS,
    QUICK_SIZES,
    parse_sizes,
    size_label,
)

__all__ = ["CKPT_BYTES", "FULL_SIZES", "KV_BLOCK_BYTES", "OURS", "QUICK_SIZES", "parse_sizes",
           "run_ssd_bench", "size_label"]
