"""Store configuration: one frozen dataclass, validated on construction.

Environment variables are read in exactly one place, :meth:`StoreConfig.from_env`:

=================================  =========================  ==================
variable                           field                      example
=================================  =========================  ==================
``HYBRIDSTORE_BLOCK_SIZE``         ``block_size``             ``16``
``HYBRIDSTORE_NAMESPACE``          ``namespace``              ``tenant-a``
``HYBRIDSTORE_HOST_BYTES``         ``host_bytes``             ``8GiB``
``HYBRIDSTORE_DISK_PATH``          ``disk_path``              ``/nvme/hs``
``HYBRIDSTORE_DISK_BYTES``         ``disk_bytes``             ``512GiB``
``HYBRIDSTORE_DEVICE_BYTES``       ``device_bytes``           ``4GiB``
``HYBRIDSTORE_POLICY``             ``policy``                 ``lru``
``HYBRIDSTORE_TIER_POLICY``        ``tier_policy``            ``write-through``
``HYBRIDSTORE_DISK_ENGINE``        ``disk_engine``            ``auto``
``HYBRIDSTORE_DISK_SHARED``        ``disk_shared``            ``1``
``HYBRIDSTORE_IO_THREADS``         ``io_threads``             ``8``
``HYBRIDSTORE_IO_CHUNK_BYTES``     ``io_chunk_bytes``         ``8MiB``
``HYBRIDSTORE_HASH_SECRET``        ``hash_secret``            (64 hex digits)
``KVIKIO_AUTO_DIRECT_IO_READ``,    ``kvikio_keep``            (set: kvikio's own)
``KVIKIO_TASK_SIZE``
=================================  =========================  ==================

kvikio reads its ``KVIKIO_*`` variables itself; ``from_env`` only notes which
of the settings the kvikio engine tunes the user gave kvikio that way, so the
engine leaves those alone (``kvikio_keep``).  One process-wide switch is not
store configuration and is read at import by ``hybridstore._native``, as
py-lmdb reads ``LMDB_FORCE_CFFI``: `HYBRIDSTORE_FORCE_TWINS=1` runs the Python
twins of the compiled extensions.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridstore.errors import ConfigError
from hybridstore.units import TRUE_WORDS, parse_bytes

DISK_ENGINES = ("auto", "kvikio", "posix")
KVIKIO_TUNED = frozenset({"auto_direct_io_read", "task_size"})
"""The kvikio settings the kvikio engine tunes (``backends/engines/kvikio.py``)."""
TIER_POLICY_NAMES = ("write-through", "write-back", "partition", "asymmetric")

_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "block_size": (int,), "namespace": (str, bytes), "host_bytes": (int,), "disk_bytes": (int,),
    "device_bytes": (int,), "policy": (str,), "checkpoint_policy": (str,), "tier_policy": (str,),
    "disk_engine": (str,), "disk_segment_bytes": (int, type(None)), "io_threads": (int,),
    "io_chunk_bytes": (int,),
    "pin_host_memory": (bool,), "h2d_gbps": (int, float), "ssd_gbps": (int, float),
    "verify_checksums": (bool,), "remote_bytes": (int,), "disk_shared": (bool,),
    "remote_encrypt": (bool,)}
"""The type of each scalar field (``disk_path``, ``kvikio_keep``, ``hash_secret`` and
``remote`` are checked apart)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Everything a :class:`~hybridstore.HybridStore` needs to know.

    Attributes:
        block_size: tokens per KV page (the engine's page size).
        namespace: tenant salt mixed into every prefix hash; stores with
            different namespaces never share keys.
        host_bytes: hard budget of the pinned-DRAM pool.
        disk_path: directory of the SSD tier (created if missing); ``None``
            disables the disk tier.
        disk_bytes: hard budget of the SSD tier.
        device_bytes: budget of the GPU tier; 0 disables it (the engine owns
            GPU memory in most deployments).
        policy: eviction policy name (``"lru"``; ``hybridstore.policy.EVICTION_POLICIES``
            lists the rest).
        checkpoint_policy: which checkpoints the engine puts are kept
            (``"keep-all"``: every one).
        tier_policy: where objects live across DRAM and SSD:
            ``"write-through"`` (every object to disk as it is put, vLLM
            CPU/disk offloading), ``"write-back"`` (to disk when DRAM evicts
            it), ``"partition"`` (SGLang HiCache: write-through, half of each
            tier for states), ``"asymmetric"`` (HiState §3.1).
        disk_engine: ``"kvikio"`` (kvikio ``CuFile``: GDS, or its POSIX compat
            mode), ``"posix"`` (O_DIRECT + a thread pool), or ``"auto"``
            (kvikio when a CUDA driver is present, POSIX otherwise).
        disk_segment_bytes: size of one segment file of the disk tier; ``None``, the
            default: from ``disk_bytes`` (1/16 of it, a power of two in [4 MiB,
            256 MiB]).  A directory keeps the size it was created with; segment files
            grow as their objects need room.
        disk_shared: share ``disk_path`` with the other processes that open it with
            ``disk_shared=True`` (engine processes on one host: vLLM's scheduler
            and workers, SGLang's ranks, several replicas): each sees what the
            others made durable, ``disk_bytes`` bounds them together, and one at a
            time evicts (docs/design.md, "Several processes").  ``False``, the
            default: the directory is this store's alone (a second store gets
            ``DiskPathError``).
        io_threads: threads of the disk tier's I/O pool: reads and writes in flight
            at once (each one request, or one I/O striped over as many threads).
        io_chunk_bytes: the largest request the disk tier's POSIX engine issues (a
            multiple of 4096): a read or write of neighbouring objects (up to 8 MiB)
            is one request up to this size, else the fewest equal requests below it.
            Larger requests cost less CPU per byte; the kernel splits them into the
            device's own maximum.  The kvikio engine keeps its ``task_size``.
        pin_host_memory: page-lock the host pool through torch when a GPU is
            present.
        h2d_gbps, ssd_gbps: bandwidths used to *model* restore time (the
            HiState paper's 64 GB/s H2D and 5 GB/s SSD by default).
        verify_checksums: check every object read from disk.
        hash_secret: the secret (16 to 64 random bytes) that keys every token
            hash (``index/keys.py``).  ``None``, the default: the disk tier keeps
            its own, drawn on first use (in its 0600 catalog); a store without a
            disk tier draws one per process.  Give the same secret to stores
            that must find each other's objects through another medium (e.g. a
            remote tier shared across hosts); never log it.
        remote: a remote tier below the disk tier, shared by stores on any host:
            ``"mooncake://HOST:PORT"`` (a Mooncake Store master's RPC port, with
            optional ``?prefix=&protocol=&segment=&buffer=&staging=&timeout=&retry=``;
            docs/remote.md); ``None``, the default, disables it.  Stores that must
            find each other's objects there share ``namespace``, ``hash_secret``,
            ``block_size`` and the URL's ``prefix``.
        remote_bytes: this store's budget in the remote pool.
        remote_encrypt: encrypt what goes to the remote pool (AES-256-GCM under a key
            derived from the hash secret; the ``cryptography`` package, extra
            ``remote-encrypt``).  Every remote value is authenticated either way (an
            HMAC keyed by the hash secret and namespace): without encryption, anyone
            who reaches the pool can read the KV bytes, but not replace them.
        kvikio_keep: kvikio settings the kvikio engine leaves as kvikio has them
            (``"auto_direct_io_read"``, ``"task_size"``) instead of applying its
            own measured values (kvikio's earlier values come back when the last
            kvikio engine closes).
    """

    block_size: int = 16
    namespace: str = ""
    host_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_bytes: int = 64 << 30
    device_bytes: int = 0
    policy: str = "lru"
    checkpoint_policy: str = "keep-all"
    tier_policy: str = "write-through"
    disk_engine: str = "auto"
    disk_segment_bytes: int | None = None
    disk_shared: bool = False
    io_threads: int = 8
    io_chunk_bytes: int = 8 << 20     # = backends.engines.DEFAULT_CHUNK_BYTES
    pin_host_memory: bool = True
    h2d_gbps: float = 64.0
    ssd_gbps: float = 5.0
    verify_checksums: bool = True
    kvikio_keep: frozenset[str] = frozenset()
    hash_secret: bytes | None = dataclasses.field(default=None, repr=False)
    remote: str | None = None
    remote_bytes: int = 16 << 30
    remote_encrypt: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1 << 16:
            raise ConfigError(f"block_size must be an int in [1, 65536], got {self.block_size!r}")
        for name in ("host_bytes", "disk_bytes", "device_bytes", "remote_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int of bytes, got {value!r}")
        if self.disk_engine not in DISK_ENGINES:
            raise ConfigError(f"disk_engine must be one of {DISK_ENGINES}, got {self.disk_engine!r}")
        if self.tier_policy not in TIER_POLICY_NAMES:
            raise ConfigError(f"tier_policy must be one of {TIER_POLICY_NAMES}, got {self.tier_policy!r}")
        if self.disk_segment_bytes is not None and (
                not (1 << 20) <= self.disk_segment_bytes <= (1 << 40)
                or self.disk_segment_bytes % 4096):
            raise ConfigError("disk_segment_bytes must be a multiple of 4096 in [1 MiB, 1 TiB], "
                              f"got {self.disk_segment_bytes}")
        if not 1 <= self.io_threads <= 256:
            raise ConfigError(f"io_threads must be in [1, 256], got {self.io_threads}")
        if not 4096 <= self.io_chunk_bytes <= (1 << 30) or self.io_chunk_bytes % 4096:
            raise ConfigError("io_chunk_bytes must be a multiple of 4096 in [4 KiB, 1 GiB], "
                              f"got {self.io_chunk_bytes}")
        if not (0 < self.h2d_gbps < math.inf and 0 < self.ssd_gbps < math.inf):
            raise ConfigError(f"h2d_gbps and ssd_gbps must be positive and finite, got "
                              f"{self.h2d_gbps!r} and {self.ssd_gbps!r}")
        if not isinstance(self.kvikio_keep, frozenset) or not self.kvikio_keep <= KVIKIO_TUNED:
            raise ConfigError(f"kvikio_keep must be a frozenset of {sorted(KVIKIO_TUNED)}, "
                              f"got {self.kvikio_keep!r}")
        if self.hash_secret is not None and (not isinstance(self.hash_secret, bytes)
                                             or not 16 <= len(self.hash_secret) <= 64):
            raise ConfigError("hash_secret must be 16 to 64 random bytes (or None: the store "
                              "keeps its own), got "
                              + (f"{len(self.hash_secret)} bytes"
                                 if isinstance(self.hash_secret, bytes)
                                 else type(self.hash_secret).__name__))
        if self.remote is not None:
            from hybridstore.remote_url import parse_remote

            parse_remote(self.remote)          # ConfigError on a bad URL
        elif self.remote_encrypt:
            raise ConfigError("remote_encrypt=True applies to a remote tier: set remote= too "
                              "(or drop remote_encrypt)")
        if self.disk_path is not None and not isinstance(self.disk_path, (str, os.PathLike)):
            raise ConfigError(f"disk_path must be a path or None, got {self.disk_path!r}")
        if self.disk_path is not None and "\0" in os.fsdecode(self.disk_path):
            raise ConfigError(f"disk_path {self.disk_path!r} contains a NUL byte; no file system "
                              "accepts one: pass a plain directory path")

    def _check_types(self) -> None:
        """Each field of its declared type (a bool is not an int), before any range check."""
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                raise ConfigError(f"{name} must be {' or '.join(t.__name__ for t in types)}, "
                                  f"got {type(value).__name__} {value!r:.40}")

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> StoreConfig:
        """Build a config from ``HYBRIDSTORE_*`` variables (see the module table)."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(f"HYBRIDSTORE_{field.name.upper()}")
            if raw is None or field.name == "kvikio_keep":
                continue
            if field.name == "hash_secret":
                try:
                    kwargs[field.name] = bytes.fromhex(raw)
                except ValueError:
                    raise ConfigError("HYBRIDSTORE_HASH_SECRET must be hex digits "
                                      "(e.g. from `openssl rand -hex 32`)") from None
            elif field.name.endswith("_bytes"):
                kwargs[field.name] = parse_bytes(raw)
            elif field.type in ("int", "float"):
                convert = int if field.type == "int" else float
                try:
                    kwargs[field.name] = convert(raw)
                except ValueError:
                    raise ConfigError(f"HYBRIDSTORE_{field.name.upper()}={raw!r} is not "
                                      f"{'an integer' if convert is int else 'a number'}") from None
            elif field.type in ("bool",):
                kwargs[field.name] = raw.strip().lower() in TRUE_WORDS
            else:
                kwargs[field.name] = raw
        kwargs["kvikio_keep"] = frozenset(name for name in KVIKIO_TUNED
                                          if f"KVIKIO_{name.upper()}" in env)
        kwargs.update(overrides)
        return cls(**kwargs)  # type: ignore[arg-type]
