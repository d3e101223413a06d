"""``hybridstore bench remote``: the remote tier next to the local disk tier, one run.

For a page (1.5 MiB: a 16-token page of a 7B-class model's KV across its layers) and a
state (8 MiB: one recurrent-state checkpoint), each repetition measures, in turn on the
same buffers:

* ``MooncakeTier`` (``backends/remote``) against a Mooncake master on loopback (one
  started here, or ``--master mooncake://HOST:PORT``): the process lends its own
  segment, so the bytes cross the transfer engine's TCP path on this host;
* ``DiskTier`` with the POSIX ``O_DIRECT`` engine in ``--dir`` (a put is durable:
  written, ``fdatasync``'ed, catalog committed; a get reads the device, not the page
  cache).

Per tier and size: **throughput** (a batch of ``put`` futures awaited, then a batch of
``get_into``, bytes verified) and **latency** (one object put and awaited, then read
back, repeated).  Medians and p90 over repetitions; ``vs_disk`` is the remote median
over the disk median of the same figure.  Prints a table and the JSON document.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hybridstore.backends.base import Tier
from hybridstore.bench.common import (
    aligned,
    emit,
    fmt_bytes,
    fs_type,
    machine_info,
    median,
    percentile,
    progress,
    stdout_console,
)
from hybridstore.objects import ObjectKind, object_key

__all__ = ["run_remote_bench"]

MIB = 1 << 20
SIZES = {"page": 3 * MIB // 2, "state": 8 * MIB}


def _key(i: int) -> Any:
    return object_key(ObjectKind.PAGE, i.to_bytes(16, "little"))


def _throughput(tier: Tier, datas: list[np.ndarray], out: np.ndarray,
                base: int) -> tuple[float, float]:
    """Seconds to put a batch (every future awaited), then to read it back with one
    ``read_many_into`` (the load path; every byte checked)."""
    n = datas[0].nbytes
    t0 = time.perf_counter()
    futs = [tier.put(_key(base + i), d, nbytes=n) for i, d in enumerate(datas)]
    for f in futs:
        f.result()
    t1 = time.perf_counter()
    slot = -(-n // 4096) * 4096
    tier.read_many_into([_key(base + i) for i in range(len(datas))], out,
                        [i * slot for i in range(len(datas))]).result()
    t2 = time.perf_counter()
    for i, d in enumerate(datas):
        if not np.array_equal(d, out[i * slot:i * slot + n]):
            raise AssertionError(f"{tier.name} tier returned other bytes")
    tier.delete_many([_key(base + i) for i in range(len(datas))])
    return t1 - t0, t2 - t1


def _latency(tier: Tier, data: np.ndarray, out: np.ndarray, key: Any) -> tuple[float, float]:
    """Seconds of one put (awaited) and one get of one object."""
    t0 = time.perf_counter()
    tier.put(key, data, nbytes=data.nbytes).result()
    t1 = time.perf_counter()
    tier.get_into(key, out).result()
    t2 = time.perf_counter()
    tier.delete(key)
    return t1 - t0, t2 - t1


def _row(tier: str, size_name: str, nbytes: int, op: str, batch: int,
         put_or_get: list[float], lat: list[float]) -> dict[str, Any]:
    gbps = [batch * nbytes / s / 1e9 for s in put_or_get]
    return {"tier": tier, "object": size_name, "object_bytes": nbytes, "op": op,
            "batch": batch, "gbps_median": median(gbps), "gbps_p90": percentile(gbps, 10.0),
            "latency_ms_median": median(lat) * 1e3, "latency_ms_p90": percentile(lat, 90.0) * 1e3,
            "reps": len(gbps)}


def run_remote_bench(json_path: str | None = None, disk_dir: str | None = None,
                     quick: bool = False, master: str | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table and the JSON document, return the document.

    Args:
        json_path: also write the JSON document here.
        disk_dir: directory for the disk tier (a fresh subdirectory, removed after).
        quick: 3 repetitions and smaller batches (about 20 s).
        master: a running master's URL; by default one is started on loopback.

    Raises:
        MissingExtraError: Mooncake is not installed.
    """
    from hybridstore.backends.disk import DiskTier
    from hybridstore.backends.remote.client import import_store
    from hybridstore.backends.remote.master import Master, master_binary
    from hybridstore.backends.remote.tier import MooncakeTier

    import_store()
    reps = 3 if quick else 7
    lat_reps = 5 if quick else 15
    batch = {"page": 8 if quick else 24, "state": 3 if quick else 8}
    root = tempfile.mkdtemp(prefix="hybridstore-bench-remote-", dir=disk_dir)
    started = None
    tiers: dict[str, Tier] = {}
    try:
        if master is None:
            binary = master_binary()
            assert binary is not None      # import_store() succeeded
            started = Master(binary, Path(root) / "master.log")
            master = started.url()
        sep = "&" if "?" in master else "?"
        url = f"{master}{sep}prefix=bench-{os.getpid()}&segment=512MiB&buffer=64MiB&staging=64MiB"
        working = max(batch[k] * n for k, n in SIZES.items()) + 64 * MIB
        tiers["remote"] = MooncakeTier(url, 2 * working)
        tiers["disk"] = DiskTier(os.path.join(root, "disk"), 4 * working, engine="posix")
        rng = np.random.default_rng(14)
        series: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
        total = len(SIZES) * (reps + 1 + lat_reps) * len(tiers)
        with progress("bench remote", total) as step:
            for size_name, nbytes in SIZES.items():
                k = batch[size_name]
                datas = [aligned(nbytes) for _ in range(k)]
                for d in datas:
                    d[:] = np.frombuffer(rng.bytes(nbytes), np.uint8)
                out = aligned(k * (-(-nbytes // 4096) * 4096))
                for r in range(reps + 1):                # repetition 0 warms up
                    order = list(tiers) if r % 2 else list(tiers)[::-1]
                    for name in order:
                        step(f"{size_name} {fmt_bytes(nbytes)} x{k} rep {r}/{reps}: {name}")
                        put_s, get_s = _throughput(tiers[name], datas, out, 1000 * r)
                        if r:
                            for op, s in (("put", put_s), ("get", get_s)):
                                series.setdefault((name, size_name, op), ([], []))[0].append(s)
                for r in range(lat_reps):
                    for name in (list(tiers) if r % 2 else list(tiers)[::-1]):
                        step(f"{size_name} latency {r}/{lat_reps}: {name}")
                        put_s, get_s = _latency(tiers[name], datas[0], out[:nbytes], _key(99_999))
                        for op, s in (("put", put_s), ("get", get_s)):
                            series.setdefault((name, size_name, op), ([], []))[1].append(s)
        rows = [_row(name, size_name, SIZES[size_name], op, batch[size_name], thr, lat)
                for (name, size_name, op), (thr, lat) in series.items()]
        by = {(r["tier"], r["object"], r["op"]): r for r in rows}
        for row in rows:
            if row["tier"] == "remote":
                disk = by[("disk", row["object"], row["op"])]
                row["gbps_vs_disk"] = row["gbps_median"] / disk["gbps_median"]
                row["latency_vs_disk"] = row["latency_ms_median"] / disk["latency_ms_median"]
        doc = {"bench": "remote", "machine": machine_info(),
               "config": {"reps": reps, "latency_reps": lat_reps, "batch": batch,
                          "sizes": SIZES, "master": "started on loopback" if started else master,
                          "protocol": tiers["remote"].spec.protocol,  # type: ignore[attr-defined]
                          "disk_engine": "posix (O_DIRECT)", "disk_fs": fs_type(root)},
               "rows": rows}
    finally:
        for tier in tiers.values():
            tier.close()
        if started is not None:
            started.stop()
        shutil.rmtree(root, ignore_errors=True)
    _table(rows)
    emit(doc, json_path=json_path)
    return doc


def _table(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="remote (Mooncake, loopback) vs disk (O_DIRECT), medians [p90]")
    for col in ("object", "op", "tier", "GB/s", "latency ms", "remote/disk GB/s",
                "remote/disk latency"):
        table.add_column(col, justify="right" if col not in ("object", "op", "tier") else "left")
    for r in sorted(rows, key=lambda r: (r["object_bytes"], r["op"], r["tier"])):
        table.add_row(f"{r['object']} {r['object_bytes'] / MIB:g} MiB", r["op"], r["tier"],
                      f"{r['gbps_median']:.2f} [{r['gbps_p90']:.2f}]",
                      f"{r['latency_ms_median']:.2f} [{r['latency_ms_p90']:.2f}]",
                      f"{r['gbps_vs_disk']:.2f}" if "gbps_vs_disk" in r else "",
                      f"{r['latency_vs_disk']:.2f}" if "latency_vs_disk" in r else "")
    stdout_console().print(table)
